"""The signals part of triage alone: each numeric divergence rule, the word signals of every backend, exit status and failure evidence.

Thresholds are read from the failure-signals table, never copied, so a table change moves the tests
with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune_mcp.triage.classify import classify_text
from finetune_mcp.triage.parse import Metric, parse_line, parse_text, wrap_width
from finetune_mcp.triage.signals import compiled, exit_fields, find, load_signal_table, number_hits

LOGS = Path(__file__).parent / "fixtures" / "logs"
RULES = load_signal_table().records
KEYS = compiled().keys  # the metric keys the classifier reads with


def _ids(metrics) -> list[str]:
    return [h.id for h in number_hits(metrics, compiled())]


def _losses(values, **extra) -> list[Metric]:
    return [Metric(i + 1, f"line {i + 1}", step=i + 1, loss=v, **extra) for i, v in enumerate(values)]


def test_nonfinite_loss_and_grad_norm():
    assert _ids(_losses([2.0, float("nan")])) == ["nonfinite-loss"]
    assert _ids(_losses([2.0, float("inf")])) == ["nonfinite-loss"]
    assert _ids([Metric(1, "x", loss=1.0, grad_norm=float("nan"))]) == ["nonfinite-grad-norm"]
    assert "nonfinite-loss" in _ids([Metric(1, "x", eval_loss=float("nan"))])


def test_loss_zero_with_nan_grad_norm():
    ids = _ids([Metric(i, "x", loss=0.0, grad_norm=float("nan")) for i in range(1, 3)])
    assert "loss-zero-grad-nan" in ids and "nonfinite-grad-norm" in ids


def test_rise_by_a_factor_after_the_minimum():
    k, n = RULES.rise_factor, RULES.rise_min_history
    base = [3.0, 2.0, 1.0] + [1.1] * (n - 2)
    assert "loss-rise" in _ids(_losses(base + [k * 1.0 * 1.01]))
    assert "loss-rise" not in _ids(_losses(base + [k * 1.0 * 0.95]))
    # Too little history before the minimum: a start, not a rise.
    assert "loss-rise" not in _ids(_losses([1.0] + [k * 2] * 1))
    # A converged run's tiny loss wobbling up is not a rise: it does not climb back toward the start.
    first = 2.0
    low = first * RULES.rise_back_to / (k * 4)
    assert "loss-rise" not in _ids(_losses([first, 1.0, 0.5] + [low] * n + [low * k * 1.5]))


def test_spike_against_the_rolling_median():
    k, n = RULES.spike_factor, RULES.spike_recover_logs
    high = 1.8 * k * 1.1
    # A spike that lasts spike_recover_logs logs counts, and so does one the log ends on (nothing shows it recovered).
    hits = number_hits(_losses([2.0, 1.9, 1.8, 1.7] + [high] * (n + 1)), compiled())
    spike = next(h for h in hits if h.id == "loss-spike")
    assert spike.lines[0] == (5, "line 5")
    assert "loss-spike" in _ids(_losses([2.0, 1.9, 1.8, 1.7, high]))
    # One bad batch: back under spike_recover_factor x the median within spike_recover_logs logs.
    back = 1.75 * RULES.spike_recover_factor * 0.9
    assert "loss-spike" not in _ids(_losses([2.0, 1.9, 1.8, 1.7, high] + [high] * (n - 1) + [back, 1.6]))
    assert "loss-spike" in _ids(_losses([2.0, 1.9, 1.8, 1.7, high] + [high] * n + [back, 1.6]))
    assert "loss-spike" not in _ids(_losses([2.0, 1.9, 1.8, 1.7, 1.8 * k * 0.9]))
    assert "loss-spike" not in _ids(_losses([40.0, 2.0, 1.9]))  # a high first loss is a start
    # A curve that came back from spikes before (a PPO value loss after large returns) ending on a smaller one:
    # more of the same. Ending on a higher one than it ever came back from still counts.
    base = [6.0, 7.0, 6.5, 5.8, 6.3]
    noisy = base + [1253.6] + base + [1061.7] + base
    assert "loss-spike" not in _ids(_losses(noisy + [187.3]))
    assert "loss-spike" in _ids(_losses(noisy + [6500.0]))
    assert "loss-spike" in _ids(_losses(base * 2 + [187.3]))
    # A loss printed to four decimals near zero (a GRPO actor loss): a ratio of noise is no spike.
    tiny = RULES.spike_abs_min / (k * 2)
    assert "loss-spike" not in _ids(_losses([tiny / 10] * 4 + [tiny]))


def test_loss_scale_collapsing_to_its_floor():
    floor = RULES.loss_scale_floor
    cut = [Metric(1, "x", loss_scale=floor, scale_cut=True)]
    assert _ids(cut) == ["loss-scale-collapse"]
    # A logged scale that fell to the floor counts; one that merely sits at 1 (bf16 Megatron) does not.
    fell = [Metric(1, "a", loss_scale=65536.0), Metric(2, "b", loss_scale=floor / 2)]
    assert _ids(fell) == ["loss-scale-collapse"]
    assert _ids([Metric(i, "a", loss_scale=1.0) for i in range(1, 6)]) == []
    # Cuts from a huge initial scale (the scaler settling) stay above the floor.
    assert _ids([Metric(i, "a", loss_scale=2.0 ** (32 - i), scale_cut=True) for i in range(1, 8)]) == []


def test_flat_and_zero_losses_and_grad_explosion():
    assert _ids(_losses([1.25] * RULES.flat_identical_run)) == ["flat-loss"]
    assert _ids(_losses([1.25] * (RULES.flat_identical_run - 1))) == []
    assert _ids(_losses([6.0] + [0.0] * RULES.zero_loss_run)) == ["flat-loss"]
    assert _ids([Metric(1, "x", loss=1.0, grad_norm=RULES.grad_norm_max)]) == ["grad-norm-explosion"]


@pytest.mark.parametrize("line, signal", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "cuda-oom"),
    ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 124.00 MiB.", "backend-oom"),
    ("RuntimeError: MPS backend out of memory (MPS allocated: 9.48 GiB, other allocations: 480.00 KiB, max allowed: 9.47 GiB).", "backend-oom"),
    ("RESOURCE_EXHAUSTED: Attempting to reserve 6.48G at the bottom of memory.", "backend-oom"),
    ("libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command buffer execution failed: "
     "Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)", "backend-oom"),
    ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY]", "unified-memory-exhausted"),
    ("(raylet) node_manager.cc:3277: 2 Workers (tasks / actors) killed due to memory pressure (OOM)", "kernel-oom-killer"),
    ("subprocess.CalledProcessError: Command '['python3']' died with <Signals.SIGKILL: 9>.", "sigkill-in-log"),
    ("slurmstepd: error: *** JOB 4523781 ON della-i23g1 CANCELLED AT 2026-02-06T10:15:37 DUE to SIGNAL Terminated ***", "slurm-cancelled"),
    ("NaN detected after softmax", "nonfinite-printout"),
    ("/bin/sh: 1: torchrun: not found", "tool-failure"),
    ("scripts/dft_train.sh: line 15: data.max_length=2048: command not found", "tool-failure"),
    ("nvcc fatal   : Unsupported gpu architecture 'compute_90'", "tool-failure"),
    ("ERROR: No matching distribution found for torch==2.1.0", "tool-failure"),
    ("make[2]: *** [CMakeFiles/lenet.dir/main.cpp.o] Error 1", "tool-failure"),
    ("FATAL:   while loading overlay images: failed to open overlay image /scratch/thesis/overlay_img2", "tool-failure"),
    ("Could not override 'trainer.lambda_max'.", "tool-failure"),
    ("RuntimeError: Function 'MulBackward0' returned nan values in its 0th output.", "nonfinite-printout"),
    ("deepspeed.ops.op_builder.builder.MissingCUDAException: CUDA_HOME does not exist, unable to compile CUDA op(s)", "cuda-toolkit-missing"),
    ("RuntimeError: Error building extension 'fused_adam'", "extension-build-failed"),
    ("ImportError: cannot import name 'SFTConfig' from 'trl'", "python-import-error"),
    ("Warning: Failed to set CUDA device 0: Unexpected error from cudaGetDeviceCount(). Error 803: system has unsupported "
     "display driver / cuda driver combination", "driver-too-old"),
    ("[[2.307283878326416, 35.845733642578125, 1.4034062829000125e+29, nan, nan, nan, nan, nan, nan], [nan, nan]]",
     "nonfinite-printout"),
    # Hydra's instantiate() wraps the ImportError into its own message (d12z-010); torch.utils.cpp_extension's own words.
    ("[2022-04-30 13:26:28,984][hydra.utils][ERROR] - Error instantiating model_ssg.PointNet2SemSegSSG : No module named "
     "'pointnet2_ops'", "python-import-error"),
    ("Error instantiating model_ssg.PointNet2SemSegSSG : CUDA_HOME environment variable is not set. Please set it to your "
     "CUDA install root.", "cuda-toolkit-missing"),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "cuda-oom"),
    ("OSError: [WinError 1455] The paging file is too small for this operation to complete. Error loading "
     "\"C:\\env\\lib\\site-packages\\torch\\lib\\cudnn_cnn_infer64_8.dll\" or one of its dependencies.", "cpu-allocator-oom"),
    ("torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with signal SIGKILL", "sigkill-in-log"),
    ("Batch 1183: Invalid loss, terminating training", "nonfinite-loss"),  # keras.callbacks.TerminateOnNaN
    ("WARNING:root:NaN or Inf found in input tensor.", "tensorboard-nonfinite"),  # tensorboardX's x2num.check_nan
    ("TERM_MEMLIMIT: job killed after reaching LSF memory usage limit.", "slurm-memory-limit-kill"),  # LSF job report
    ("ModuleNotFoundError: No module named 'flash_attn'", "stack-module-missing"),
    ("TERM_RUNLIMIT: job killed after reaching LSF run time limit.", "slurm-time-limit"),
    ("tensorflow.python.framework.errors_impl.InternalError: Failed copying input tensor from /job:localhost/replica:0/"
     "task:0/device:CPU:0 to /job:localhost/replica:0/task:0/device:GPU:0 in order to run _EagerConst: Dst tensor is not "
     "initialized.", "backend-oom"),
    ("RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be clipped. "
     "To disable this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`",
     "nonfinite-loss"),
    ("WARNING: non-finite loss, ending training  tensor([nan, nan], device='cuda:0')", "nonfinite-loss"),
    ("ValueError: The parameter loc has invalid values", "nonfinite-printout"),  # torch.distributions before 1.8
    # Seventh round: wordings a helper copied from the libraries' and schedulers' own sources (each cited in the table).
    ("Status:   Failed\nReason:   Evicted\nMessage:  The node was low on resource: memory. Threshold quantity: 100Mi",
     "kernel-oom-killer"),  # kubelet's eviction message
    ("slurmstepd: error: StepId=4242424.0 exceeded virtual memory limit (137438953472 > 103079215104), being killed",
     "slurm-memory-limit-kill"),
    ("Job 4242424 exceeded memory limit (68719476736>64424509440), cancelling it", "slurm-memory-limit-kill"),
    ("=>> PBS: job killed: mem 59756048kb exceeded limit 20971520kb", "slurm-memory-limit-kill"),  # OpenPBS pbs_mom
    ('job 4242424 exceeds job hard limit "h_vmem" of queue "gpu.q@node017" (17179869184.00000 > limit:17179869184.00000) '
     "- sending SIGKILL", "slurm-memory-limit-kill"),  # Grid Engine execd
    ("Job has gone over cgroup memory limit of 16384 megabytes. Last measured usage: 16401 megabytes.",
     "slurm-memory-limit-kill"),  # HTCondor starter
    ("=>> PBS: job killed: walltime 86415 exceeded limit 86400", "slurm-time-limit"),
    ("job 4242424.1 exceeded hard wallclock time - initiate terminate method", "slurm-time-limit"),
    ("Requeued SLURM job: 123456", "slurm-cancelled"),  # Lightning's auto-requeue on the scheduler's signal
    ("[rank: 0] Received SIGTERM: 15", "slurm-cancelled"),
    ("The node was low on resource: ephemeral-storage. Threshold quantity: 10Gi, available: 2Gi.", "disk-full"),
    ("NCCL WARN socketProgress: Connection closed by remote peer gpu-node-018<45678>", "nccl-error"),
    ("ncclRemoteError: remote process exited or there was a network error", "nccl-error"),
    ("FloatingPointError: Fatal error: gradients are inconsistent between workers. Try --ddp-backend=legacy_ddp.",
     "nccl-error"),  # fairseq's check across workers: the distributed setup, not the numbers
    ("One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for "
     "remainder of ranks for more than 60 seconds.", "nccl-timeout"),  # Horovod's stall inspector
    ("Attempted to use bitsandbytes native library functionality but it's not available.", "bitsandbytes-setup"),
    ("RuntimeError: No executable batch size found, reached zero.", "backend-oom"),  # accelerate's batch-size finder
    ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`", "backend-oom"),
    ("Invalid nan value encountered in the output of a jax.jit function. Calling the de-optimized version.",
     "nonfinite-printout"),  # jax_debug_nans
    ("Divergence threshold reached: val_loss = 12.5 > 10.0. Signaling Trainer to stop.", "nonfinite-printout"),
    ("UserWarning: found inf in observations, found nan in rewards.", "nonfinite-printout"),  # SB3's VecCheckNan
    ("found Inf in local grad norm for bucket #2 in backward pass before data-parallel communication collective",
     "nonfinite-printout"),  # Megatron-core
    ("Unexpected result 11.73 on rank 5 at iteration #40211 invokation #1 (message='Spiky loss')", "nonfinite-printout"),
    ("Checking c : Tensor had Inf values", "nonfinite-printout"),  # tf.debugging.check_numerics
    ("`Trainer.fit` stopped: No training batches.", "empty-training-data"),
    ("There seems to be not a single sample in your epoch_iterator, stopping training at step 0!", "empty-training-data"),
    ("NVRM: Xid (PCI:0000:06:00): 79, GPU has fallen off the bus.", "gpu-hardware-fault"),  # NVIDIA's Xid catalogue
    ("KL divergence for Module default_policy is non-finite, this will likely destabilize your model",
     "nonfinite-printout"),  # RLlib
    ("The local object store is full of objects that are still in scope and cannot be evicted.", "backend-oom"),  # Ray
    ("RuntimeError: Invalid buffer size: 12.28 GB", "backend-oom"),  # MPSAllocator: one buffer past the device's largest
    ("I0703 17:12:48.364184 30876 solver.cpp:204]     Train net output #2: loss3/loss3 = 87.3365 (* 1 = 87.3365 loss)",
     "nonfinite-loss"),  # Caffe's softmax loss clamped at -ln(FLT_MIN)
])
def test_word_signals_of_every_backend(line, signal):
    # Wordings from the libraries' own sources (caching allocator, MPS allocator, XLA, MLX, NVRM, Ray,
    # subprocess, DeepSpeed's op builder, torch.utils.cpp_extension, Python's import system).
    assert signal in [h.id for h in find(line + "\n").hits]


def _wordings():
    import yaml

    for i, w in enumerate(yaml.safe_load((LOGS.parent / "triage-wordings.yaml").read_text())):
        yield pytest.param(w, id=f"{i:03d}-{w['class']}")


@pytest.mark.parametrize("w", list(_wordings()))
def test_stock_wordings_from_the_libraries_sources(w):
    # Each message alone, as the last line of a log: it reads its class (or, where the table says why, the class
    # this project's definitions give it).
    assert classify_text(w["text"] + "\n").failure_class == w.get("reads", w["class"]), (w["source"], w.get("why"))


def test_exit_status_and_failure_evidence():
    assert exit_fields({"returncode": -9}) == (-9, 9, None)
    assert exit_fields({"signal": "SIGKILL", "stopped_by": "stop_run"}) == (None, 9, "stop_run")
    f = find((LOGS / "env-setup-keyerror-text-column-sft.log").read_text())
    assert f.failed and f.exception and "KeyError" in f.exception[1]
    cut = find('Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n')
    assert cut.failed and cut.traceback_cut  # an excerpt that stops inside the traceback
    healthy = find((LOGS / "none-healthy-trl-sft-llama2-loss-decreasing.log").read_text())
    assert not healthy.failed and not healthy.hits and len(healthy.metrics) == 11
    assert not find("Traceback (most recent call last):\nValueError: handled\n", exit_info={"returncode": 0}).failed
    # LSF's job report (bsub's mail, or the .out file): a job that ended on a non-zero exit failed.
    assert find("Subject: Job 23442268: <train_seg_model> in cluster <dcc> Exited\nExited with exit code 1.\n").failed
    assert not find("Subject: Job 1: <train> in cluster <dcc> Done\nSuccessfully completed.\n").failed
    # Look-alikes: Python logging's FATAL level and a message that quotes an override are no failure of the tool.
    assert "tool-failure" not in [h.id for h in find("FATAL:root:checkpoint dir missing, creating it\nWe could not override defaults here\n").hits]


def test_failure_lines_without_a_known_cause_still_fail_the_run():
    # srun's abort notice, and an exception whose class name does not end in Error, named by its module path.
    for last in ("srun: Job step aborted: Waiting up to 32 seconds for job step to finish.",
                 "huggingface_hub.errors.OfflineModeIsEnabled: Cannot reach https://huggingface.co/api/models/gpt2: "
                 "offline mode is enabled.",
                 "ERROR [05/01 12:00:00 d2.engine.train_loop]: Exception during training:"):  # detectron2's logger
        assert find(last + "\n").failed, last
    assert not find("transformers.modeling_utils: loading weights file model.safetensors\n").failed


def test_exit_statuses_as_the_tools_around_a_job_print_them():
    records = "".join(f"Epoch 1 Step {i * 10} loss {2.5 - 0.01 * i:.4f}\n" for i in range(5))
    for last in ("State: FAILED (exit code 1)",  # Slurm's seff
                 "Command exited with non-zero status 1",  # GNU time
                 "    Exit Code:    1",  # kubectl describe pod
                 "Error: exit status 1",  # Go's os/exec
                 "./run.sh: line 3: 12345 Terminated              python train.py",  # bash's job report
                 "Hangup",
                 "*** Error in `python': double free or corruption (!prev): 0x0000000001b8e010 ***"):  # glibc
        assert find(records + last + "\n").failed, last
    assert "slurm-time-limit" in [h.id for h in find(records + "State: TIMEOUT (exit code 0)\n").hits]
    assert not find(records + "State: COMPLETED (exit code 0)\n").failed


def test_a_pattern_with_a_case_insensitive_group_is_not_filtered_by_its_literals():
    import re

    from finetune_mcp.triage.signals import required_literals
    assert required_literals(re.compile(r"(?i:\bexit code:\s+[1-9])")) is None
    assert required_literals(re.compile(r"abc(?i:xyz)def")) == [["abc"], ["def"]]


def test_a_loggers_error_level_line_the_log_ends_on_is_a_failure():
    # The level is a prefix the cleaned text drops, so these are matched on the raw line (failure_levels).
    records = "".join(f"Epoch 1 Step {i * 10} loss {2.5 - 0.01 * i:.4f}\n" for i in range(30))
    for last in ("2024-01-01 10:00:00 ERROR trainer: training failed: dataset shard 3 unreadable",
                 "2024-01-01 10:00:00,120 - trainer - ERROR - shard 3 unreadable",  # python logging's default format
                 "ERROR:root:shard 3 unreadable",
                 "2024-01-01 10:00:00.120 | ERROR    | train:main:41 - shard 3 unreadable",  # loguru
                 "\x1b[31m[ERROR]\x1b[0m shard 3 unreadable",
                 "2024-01-01 10:00:00 CRITICAL shard 3 unreadable",
                 "F1207 12:00:00.123456  4321 solver.cpp:94] Check failed: status == CUBLAS_STATUS_SUCCESS",  # glog FATAL
                 "train.py: error: unrecognized arguments: --lora_rnk 8"):  # argparse, exit status 2
        f = find(records + last + "\n")
        assert f.failed and f.markers[-1][1] == last, last
        assert classify_text(records + last + "\n").failure_class != "none", last
    # Behind another logger's prefix (a collector's INFO before the program's ERROR), with or without its colours.
    stacked = "2025-04-25 12:51:19,625 - finetune - ERROR - 加载模型失败: No package metadata was found for bitsandbytes"
    for outer in ("2024-05-01 12:00:07,123 - root - INFO - ", "^[[32m", "\x1b[32m"):
        assert find(records + outer + stacked + "\n").failed, outer
    # Look-alikes: wandb's retries put no delimiter after the level, and a run that logs on past an ERROR went on.
    assert not find(records + "wandb: ERROR Error while calling W&B API: context deadline exceeded\n").failed
    assert not find("2024-01-01 10:00:00 ERROR loader: retrying shard 3\n" + records).failed
    assert not find(records + "I1207 12:00:00.123456  4321 solver.cpp:94] Iteration 300, loss = 2.2\n").failed


# --- issue 32: any named metric, loss scales, text as logs are, big logs streamed ------------------


def _named(key: str, values, **extra) -> list[Metric]:
    return [Metric(i + 1, f"line {i + 1}", step=i + 1, named={key: v}, **extra) for i, v in enumerate(values)]


def test_nonfinite_in_any_named_loss_or_grad_norm():
    assert _ids(_named("loss:loss b", [1.0, float("inf")])) == ["nonfinite-loss"]
    assert _ids(_named("kl:actor kl", [0.01, float("nan")])) == ["nonfinite-loss"]
    assert _ids(_named("grad_norm:model grad norm", [3.0, float("nan")])) == ["nonfinite-grad-norm"]
    hit = next(h for h in number_hits(_named("loss:value loss", [0.5, float("nan")]), compiled()) if h.id == "nonfinite-loss")
    assert hit.lines == [(2, "line 2")] and "value loss" in hit.detail


def test_spike_and_rise_in_a_named_loss_series():
    k = RULES.spike_factor
    assert "loss-spike" in _ids(_named("loss:value loss", [2.0, 1.9, 1.8, 1.7, 1.8 * k * 1.1]))
    assert "loss-spike" not in _ids(_named("loss:value loss", [2.0, 1.9, 1.8, 1.7, 1.8 * k * 0.9]))
    rise = [3.0, 2.0, 1.0] + [1.1] * RULES.rise_min_history + [RULES.rise_factor * 1.01]
    assert "loss-rise" in _ids(_named("loss:actor pg loss", rise))


def test_a_signed_objective_of_an_rl_trainer_has_no_spike_or_rise():
    # SB3's policy-gradient loss hovers around 0 on both sides: 1e-6 to 1e-3 is no rise, whatever the ratio.
    values = [-0.001, 0.000001, -0.0008, 0.00001] * 6 + [0.002] * 3

    def ids(vals, rl):
        ms = _named("loss:policy gradient loss", vals)
        for m in ms:
            m.rl = rl
        return _ids(ms)
    assert ids(values, rl=True) == []
    assert "loss-rise" in ids([abs(v) for v in values], rl=True)  # a loss that never went below 0 is read
    assert "loss-rise" in ids(values, rl=False)  # outside RL the positive values of a named loss are read as before


def test_a_reinforcement_learning_loss_must_rise_further():
    # Beside a reward, a loss follows the returns: rl_rise_factor, not rise_factor, makes a rise.
    def curve(top, rl):
        ms = _losses([3.0, 2.0, 1.0] + [1.1] * RULES.rise_min_history + [top])
        for m in ms:
            m.rl = rl
        return _ids(ms)
    between = (RULES.rise_factor + RULES.rl_rise_factor) / 2
    assert "loss-rise" in curve(between, rl=False) and "loss-rise" not in curve(between, rl=True)
    assert "loss-rise" in curve(RULES.rl_rise_factor * 1.1, rl=True)


def test_a_policy_or_value_loss_marks_a_record_as_reinforcement_learning_without_a_reward():
    # A PPO loop printing `ploss=... vloss=...` beside its reward as `r=` (a key no rule reads): the value loss follows
    # the returns, so rl_rise_factor applies (dev batch 19's self-play curriculum: vloss 9.6 -> 50.8, healthy).
    vloss = [60.0, 30.0, 12.0, 9.6, 11.0, 10.5, 12.0, 50.8]
    rl = "".join(f"  [{i:4d}] ep={i * 10}  r= {10 + i:5.1f} ploss=-0.0083 vloss= {v:6.1f} ent=1.143\n"
                 for i, v in enumerate(vloss))
    assert "loss-rise" not in classify_text(rl).signals
    assert "loss-rise" in classify_text(rl.replace(" ploss=-0.0083 vloss=", " loss=")).signals


def test_loss_scale_halving_step_after_step_once_settled():
    n, settled = RULES.scale_halving_run, RULES.scale_settled_logs
    held = [65536.0] * (settled + 1)
    halving = held + [65536.0 / 2 ** (i + 1) for i in range(n)]
    scales = [Metric(i + 1, f"line {i + 1}", loss_scale=v) for i, v in enumerate(halving)]
    hit = next(h for h in number_hits(scales, compiled()) if h.id == "loss-scale-halving")
    assert [ln for ln, _ in hit.lines] == list(range(len(held) + 1, len(halving) + 1))
    # Under any name, with no "overflow" line anywhere.
    assert "loss-scale-halving" in [h.id for h in find("".join(f"iter {i} | lm loss: 2.0 | grad_scale: {v:g}\n" for i, v in enumerate(halving))).hits]
    # One halving short, or the scaler's search down from its initial scale right after start: not a failure.
    assert "loss-scale-halving" not in _ids(scales[:-1])
    start = [Metric(i + 1, "x", loss_scale=2.0 ** (16 - i)) for i in range(6)] + [Metric(7, "x", loss_scale=1024.0)] * 3
    assert "loss-scale-halving" not in _ids(start)


@pytest.mark.parametrize("name", ["oom-killer-bare-killed-after-preprocessing.log", "oom-cpu-allocator-lmflow.log",
                                  "oom-nccl-timeout-after-rank-oom-swift.log", "env-setup-keyerror-text-column-sft.log",
                                  "divergence-dreamer-pytorch-named-losses-nan-table.log"])
@pytest.mark.parametrize("prefix", ["\x1b[2m\x1b[36m(RayWorker pid=4331, ip=10.0.0.1)\x1b[0m ", "^[[36m(pid=77)^[[0m ",
                                    "[rank3]: ", "10.0.0.1: ", "2024-05-03 18:47:25,368 ", "[33m(raylet)[0m "])
def test_escapes_and_prefixes_do_not_hide_a_signal(name, prefix):
    # The same real log as a launcher, a colour logger or a paste would print it: the verdict must not move,
    # and the evidence stays the printed line, verbatim.
    text = (LOGS / name).read_text(encoding="utf-8")
    plain = find(text)
    dressed_text = "".join(prefix + ln + "\r\n" for ln in text.split("\n")[:-1])
    dressed = find(dressed_text)
    assert sorted(h.id for h in dressed.hits) == sorted(h.id for h in plain.hits)
    assert bool(dressed.exception) == bool(plain.exception) and dressed.failed == plain.failed
    lines = dressed_text.split("\r\n")
    for h in dressed.hits:
        for n, t in h.lines:
            assert lines[n - 1] == t


@pytest.mark.parametrize("name", ["oom-nccl-timeout-after-rank-oom-swift.log", "none-healthy-torchtune-lora-multinode.log",
                                  "divergence-dreamer-pytorch-named-losses-nan-table.log", "none-healthy-ray-train-result-table.log",
                                  "none--b17mb-002.log", "environment--b27zh-007.log", "none--dev12y-014.log",
                                  "none--dev32yp-005.log", "none--dev32yq-002.log"])
@pytest.mark.parametrize("encoding", ["utf-8", "utf-16"])  # utf-16: as PowerShell's `python train.py > log` writes it
def test_a_big_log_streamed_reads_as_the_whole_text_does(tmp_path, monkeypatch, name, encoding):
    import finetune_mcp.triage.signals as S

    text = (LOGS / name).read_text(encoding="utf-8")
    path = tmp_path / name
    path.write_text(text, encoding=encoding)
    whole = find(text)
    monkeypatch.setattr(S, "WHOLE_BYTES", 0)
    monkeypatch.setattr(S, "CHUNK_BYTES", 97)  # many chunks, cut mid-line
    streamed = S.find_file(path)
    assert {h.id: h.lines for h in streamed.hits} == {h.id: h.lines for h in whole.hits}
    assert (streamed.exception, streamed.traceback_cut, streamed.markers) == (whole.exception, whole.traceback_cut, whole.markers)
    assert streamed.summary["records"] == len(whole.metrics)


def test_a_big_logs_logger_error_lines_are_read_in_its_last_whole_bytes(tmp_path, monkeypatch):
    import finetune_mcp.triage.signals as S

    records = "".join(f"Epoch 1 Step {i * 10} loss {2.5 - 0.0001 * i:.4f}\n" for i in range(400))
    path = tmp_path / "big.log"
    monkeypatch.setattr(S, "WHOLE_BYTES", 2000)
    monkeypatch.setattr(S, "CHUNK_BYTES", 500)
    path.write_text(records + "2024-01-01 10:00:00 ERROR trainer: shard 3 unreadable\n")
    assert S.find_file(path).failed  # the log ends on it
    # Scanning every chunk of a 100 MB log for level words costs 4 %; one 8 MB before the end was logged past.
    path.write_text("2024-01-01 10:00:00 ERROR loader: retrying shard 3\n" + records)
    assert not S.find_file(path).failed and not S.find_file(path).markers


def test_a_loggers_error_line_the_program_printed_well_past_is_not_how_the_log_ends(tmp_path, monkeypatch):
    # A Colab session (dev batch 19, rc-001) trains, then its serving experiment logs ngrok's ERROR lines and goes on:
    # it answers requests and zips its checkpoints, printing no record. went_on_lines lines after a logger's error line
    # (every failure line a level line, no traceback) is the program going on; fewer, or a traceback, still fail.
    import finetune_mcp.triage.signals as S

    err = ('ERROR:pyngrok.process.ngrok:t=2024-12-16T12:52:10+0000 lvl=eror msg="session closing" '
           'err="authentication failed: Usage of ngrok requires a verified account and authtoken."\n')
    after = "".join(f"  adding: results/checkpoint-{i}/optimizer.pt (deflated 8%)\n" for i in range(RULES.went_on_lines))
    went = find(err + after)
    assert not went.failed and classify_text(err + after).failure_class == "none"
    assert "went on past the error" in classify_text(err + after).reason
    short = err + after[: after.index("\n", len(after) // 2) + 1]
    assert find(short).failed and classify_text(short).failure_class == "environment"
    tb = 'Traceback (most recent call last):\n  File "serve.py", line 9, in <module>\nRuntimeError: tunnel closed\n'
    assert find(tb + after).failed  # a traceback ends the program whatever is printed after it (another process)
    path = tmp_path / "session.log"
    path.write_text("warm-up line\n" * 50 + err + after)
    monkeypatch.setattr(S, "WHOLE_BYTES", len(err + after) + 100)  # streamed, the error line within the last WHOLE_BYTES
    monkeypatch.setattr(S, "CHUNK_BYTES", 97)
    streamed = S.find_file(path)
    assert (streamed.level_only, streamed.lines_after, streamed.failed) == (True, RULES.went_on_lines, False)


def test_a_best_so_far_sentinel_is_no_nan_loss_but_a_nan_beside_it_is():
    # icefall prints best_train_loss: inf before any loss exists (dev case none-healthy-icefall-params-best-loss-inf).
    assert "nonfinite-loss" not in [h.id for h in find("{'best_train_loss': inf, 'best_valid_loss': inf, 'log_interval': 50}\n").hits]
    assert "nonfinite-loss" in [h.id for h in find("best_train_loss: inf | train loss: nan\n").hits]
    # The word patterns of the signal stay patterns (an `unless` list never swallows them).
    for line in ("RuntimeError:  > Detected NaN loss - Loss: nan", "Loss became infinite or NaN at iteration=3!", "step 3 loss is nan"):
        assert "nonfinite-loss" in [h.id for h in find(line + "\n").hits], line


# --- issue 32: rules that keep a failure from reading none, and the look-alikes they must leave alone ---------


def _find_ids(text: str) -> set[str]:
    return {h.id for h in find(text).hits}


def test_nan_in_any_metric_counts_but_not_in_a_mean_over_nothing_yet():
    # A GAN's one-letter losses in a tqdm postfix, a world model's table: whatever the name.
    assert "nonfinite-metric" in _find_ids("Epoch 41/250: 100%|███| 9375/9375 [07:11<00:00, DR=713, DF=nan, G=nan, LR=0.0001]\n")
    assert "nonfinite-metric" in _find_ids("G: nan | MSG: nan | VG: 0.00 | D: nan\n")
    # Every word of the ignore list is one whose NaN is a mean over nothing (or a count, a timer), not the numbers.
    for word in RULES.nonfinite_ignore:
        assert "nonfinite-metric" not in _find_ids(f"step 3 | {word}: nan | loss: 0.5\n"), word
    # A loss the table names is nonfinite-loss's, never counted twice.
    assert _find_ids("step 3 loss: nan\n") >= {"nonfinite-loss"} and "nonfinite-metric" not in _find_ids("step 3 loss: nan\n")


def test_a_loss_past_the_magnitude_limit_either_sign():
    lim = RULES.loss_abs_max
    assert "loss-magnitude" in _ids(_losses([2.0, 1.9, -lim * 10]))
    assert "loss-magnitude" in _ids([Metric(1, "x", named={"loss:value loss": lim})])
    assert "loss-magnitude" not in _ids(_losses([lim / 10, lim / 20]))


def test_a_loss_that_only_counts_up_by_whole_steps_is_an_index_read_as_a_loss():
    # Retired blind 24 xb-012 before its format was read: `Loss on train for epoch 100: 0.998` gave the loss 1, 2 ... 100.
    # Any reader that takes an epoch or step number for the value makes such a series; no curve rule reads it.
    window = RULES.rise_window
    assert "loss-rise" not in _ids(_losses([float(e) for e in range(1, 101)]))
    assert "loss-rise" not in _ids(_losses([float(e) for e in range(10, 1010, 10)]))
    assert "loss-rise" in _ids(_losses([float(e) for e in range(1, 101)] + [102.0]))  # one uneven step: a curve again
    assert "loss-rise" in _ids(_losses([float(e) for e in range(1, window)]))  # fewer than rise_window values: a curve
    text = "".join(f"Loss of epoch {e}: {1 + (e % 3) / 100}\n" for e in range(1, 60))
    assert classify_text(text).failure_class == "none"


def test_a_loss_that_starts_past_the_limit_and_falls_far_is_on_a_scale_of_its_own():
    # Retired blind 24 xc-022: a beta-VAE's summed loss on raw data starts at 2.9e8 and ends near 1e4.
    lim, fall = RULES.loss_abs_max, RULES.huge_fall_factor
    start = lim * 2.93
    assert "loss-magnitude" not in _ids(_losses([start, start / 2, start / 50, start / fall]))
    assert "loss-magnitude" in _ids(_losses([start, start / 2, start / 50, start / fall * 2]))  # fell, but not far enough
    assert "loss-magnitude" in _ids(_losses([start, start / fall, start * 1.5, start / fall]))  # past where it started
    assert "loss-magnitude" in _ids(_losses([2.0, start, start / fall]))  # it did not start there
    assert "loss-magnitude" not in _ids([Metric(i, "x", named={"kl:kl": v}) for i, v in enumerate([start, start / fall], 1)])


def test_kl_blowup_after_small_kls_only():
    small, big = RULES.kl_max / RULES.kl_rise_factor, RULES.kl_max
    ms = [Metric(i + 1, "x", named={"kl:approx kl": v}) for i, v in enumerate([small, small / 2, big * 4])]
    assert "kl-blowup" in _ids(ms)
    # A KL that was never small (a run whose KL sits high from the start) is no blow-up by this rule.
    assert "kl-blowup" not in _ids([Metric(i + 1, "x", named={"kl:kl": v}) for i, v in enumerate([big, big * 2, big * 4])])


def test_gan_losses_trading_places_are_the_game_but_their_nan_is_not():
    rising = [0.001 * (RULES.rise_factor * 3) ** min(i, 3) for i in range(8)]
    assert "loss-rise" in _ids([Metric(i + 1, "x", named={"loss:value loss": v}) for i, v in enumerate(rising)])
    for key in ("loss:g loss", "loss:d loss", "loss:generator loss"):
        assert not {"loss-rise", "loss-spike"} & set(_ids([Metric(i + 1, "x", named={key: v}) for i, v in enumerate(rising)])), key
    assert "nonfinite-loss" in _ids([Metric(1, "x", named={"loss:g loss": 0.3}), Metric(2, "x", named={"loss:g loss": float("nan")})])


def test_the_curve_rules_are_records_rules_of_the_table():
    # classify reads a divergence that rests only on these as the curve's shape (a job that died saving the model).
    from typing import get_args

    from finetune_mcp.skilltables import CURVE_RULES, RecordsRule

    table_rules = {s.records_rule for s in load_signal_table().signals if s.records_rule}
    assert CURVE_RULES <= set(get_args(RecordsRule)) and CURVE_RULES <= table_rules


def test_a_gan_whose_discriminator_went_to_zero_while_its_generator_climbed():
    # "D loss goes to 0: failure mode" (ganhacks #10): the discriminator's loss falls from about 0.5 to under
    # game_d_zero while the generator's loss climbs game_g_rise times; each side alone is the game.
    w, zero, rise = RULES.game_window, RULES.game_d_zero, RULES.game_g_rise

    def game(d_values, g_values):
        return [Metric(i + 1, "x", named={"loss:d loss": d, "loss:g loss": g}) for i, (d, g) in enumerate(zip(d_values, g_values))]

    d_won = [0.5] * w + [zero / 3] * w
    g_up = [2.0] * w + [2.0 * rise * 1.5] * w
    assert "discriminator-won" in _ids(game(d_won, g_up))
    assert "discriminator-won" not in _ids(game(d_won, [2.0] * w + [2.0 * rise * 0.8] * w))  # the generator held on
    assert "discriminator-won" not in _ids(game([zero * 2] * w + [zero / 3] * w, g_up))  # D near 0 from its start
    assert "discriminator-won" not in _ids(game(d_won, g_up)[: 2 * w - 1])  # too few values to judge a window
    # A WGAN critic's loss goes negative: a value near 0 there is no win.
    assert "discriminator-won" not in _ids(game([0.5] * w + [-zero / 3, zero / 3] * (w // 2), g_up))
    # A restart (the epoch went back) judges the finished run's game as it stood.
    ended = [Metric(i + 1, "x", epoch=float(1 + i), named=m.named) for i, m in enumerate(game(d_won, g_up))]
    again = [Metric(100 + i, "x", epoch=1.0, named={"loss:d loss": 0.5, "loss:g loss": 2.0}) for i in range(3)]
    assert "discriminator-won" in _ids(ended + again)


def test_nan_in_a_key_value_tables_row_counts_unless_its_key_is_a_mean_over_nothing_yet():
    # OpenAI Baselines' and Stable-Baselines' logger prints `| key | value |` rows (retired blind batch 15, b15hb-004:
    # a DDPG whose observation normaliser went NaN); its episode means are NaN until an episode ends.
    assert "nonfinite-metric" in _find_ids("| obs_rms_mean            | nan       |\n| train/loss_critic       | 6.27e+03  |\n")
    for key in ("ep_rewmean", "eplenmean", "rollout/ep_rew_mean"):
        assert "nonfinite-metric" not in _find_ids(f"| {key}         | nan           |\n"), key
    # A value printed finite after it, in the same kind of row, was a transient.
    rows = "| value_loss | nan |\n" + "| value_loss | 0.5 |\n" * RULES.nonfinite_recovered_logs
    assert "nonfinite-metric" not in _find_ids(rows)
    # darknet's per-scale line says it averaged over no object: its NaNs are means over nothing.
    assert "nonfinite-metric" not in _find_ids("Region 82 Avg IOU: -nan, Class: -nan, Obj: -nan, No Obj: 0.000004, .5R: -nan, .75R: -nan,  count: 0\n")
    assert "nonfinite-metric" in _find_ids("Region 82 Avg IOU: 0.71, Class: 0.9, Obj: 0.5, No Obj: 0.004, .5R: -nan, .75R: 0.5,  count: 3\n")


def test_a_zero_loss_beside_a_moving_reward_is_a_policy_gradient_not_a_stuck_run():
    # A GRPO loss is 0 when every completion of a group scores alike; a DQN logs 0 until its replay memory fills
    # (retired blind b15hc-003, b17ma-008). A reward stuck at one value, or a grad norm of exactly 0, is learning nothing.
    n = RULES.zero_loss_run + 2
    moving = [Metric(i + 1, "x", step=i + 1, loss=0.0, reward=float(i % 2)) for i in range(n)]
    assert "flat-loss" not in _ids(moving)
    assert "flat-loss" in _ids([Metric(i + 1, "x", step=i + 1, loss=0.0, reward=0.0) for i in range(n)])
    assert "flat-loss" in _ids([Metric(i + 1, "x", step=i + 1, loss=0.0, grad_norm=0.0, reward=float(i % 2)) for i in range(n)])
    assert parse_line(Metric(1, "x"), KEYS, "[Step 9/50] loss=-0.0000 reward_avg=0.000 avg_resp_len=405.5").reward == 0.0


def test_an_end_of_training_summary_whose_mean_loss_is_exactly_zero():
    # transformers' Trainer logs 0 for a step whose forward went NaN under fp16 (a T5): a run whose every step did
    # reports training_loss=0.0 (retired blind b16jb-007). A resume past the last step trains nothing in no time.
    done = "{'train_runtime': 314.0037, 'train_samples_per_second': 11.79, 'train_steps_per_second': 1.481, 'train_loss': 0.0, 'epoch': 3.0}\n"
    assert "flat-loss" in _find_ids(done)
    assert "flat-loss" not in _find_ids(done.replace("314.0037", "0.0123"))
    assert "flat-loss" not in _find_ids(done.replace("'train_loss': 0.0", "'train_loss': 0.4128"))


def test_a_record_line_printed_again_to_the_letter_is_read_once():
    # Two writers on one file repeat its lines (retired blind b16ja-003): a record line printed again to the letter, its
    # epoch or step included, is a copy, so the recurring window of losses is not the weights standing still. Lines that
    # name no epoch or step are still read each time (a stuck loss repeats its values).
    losses = [0.6806, 0.6688, 0.5647, 0.5493, 0.4926, 0.4217]
    lines = [f"[2026-05-02 08:08:{30 + i:02d}] [Trainer] Epoch {110 + 10 * i:>7}  |  Loss: {v}" for i, v in enumerate(losses)]
    text = "\n".join(lines + lines + ["[2026-05-02 08:09:00] [Trainer] Epoch     170  |  Loss: 0.3361"]) + "\n"
    assert "flat-loss" not in _find_ids(text)
    bare = [f"loss {v}" for v in losses]
    assert "flat-loss" in _find_ids("\n".join(bare * 3) + "\n")


def test_an_interrupt_before_the_trainer_reports_its_end_was_outlived():
    # A notebook stops a generate() cell by hand, then trains to the end (retired blind b16jb-006): the stop is not how
    # the session ends.
    stop = 'Traceback (most recent call last):\n  File "<ipython-input-3>", line 1, in <module>\nKeyboardInterrupt: \n'
    done = "TrainOutput(global_step=68, training_loss=2.402301283443675, metrics={'train_runtime': 2040.023, 'epoch': 1.0})\n"
    assert classify_text(stop + done).healthy_or_unrecognised == "healthy"
    assert classify_text(done + stop).healthy_or_unrecognised == "stopped"


def test_a_reinforcement_learning_loss_that_grows_with_its_returns():
    # A DQN's TD loss grows with the returns it predicts (retired blind b17ma-008: 0.1 -> 5-8 while the episode reward
    # climbs 1 -> 100-300): no rise, no spike. The same loss beside a reward that did not grow still rises.
    w = RULES.rise_window
    grew = [Metric(i + 1, "x", step=i + 1, named={"loss:td loss": 0.1 if i < w else 8.0}, reward=1.0 if i < w else 200.0,
                   rl=True) for i in range(3 * w)]
    assert not {"loss-rise", "loss-spike"} & set(_ids(grew))
    flat_reward = [Metric(i + 1, "x", step=i + 1, named={"loss:td loss": 0.1 if i < w else 8.0}, reward=1.0, rl=True)
                   for i in range(3 * w)]
    assert {"loss-rise", "loss-spike"} & set(_ids(flat_reward))


def test_slurms_cgroup_clean_up_after_the_jobs_last_line_is_no_failure():
    # slurmstepd failing to move a finished step out of its cgroup v2 (retired blind b17mb-002, a YOLOv8 run that ended).
    done = "Results saved to runs/detect/train64\n"
    cleanup = ("slurmstepd: error: common_file_write_uint32s: write pid 7193 to /sys/fs/cgroup/cgroup.procs failed: Device or resource busy\n"
               "slurmstepd: error: Unable to move pid 7193 to init root cgroup /sys/fs/cgroup\n")
    assert not find(done + cleanup).failed
    assert find(done + "slurmstepd: error: *** JOB 14112198 ON gpu-91 CANCELLED AT 2020-12-09T05:28:17 ***\n").failed


def test_a_failure_before_powershells_next_command_header_belongs_to_an_earlier_command():
    # One PowerShell capture of two commands (retired blind b19qe-004): an evaluation script's TypeError, then the
    # training run, each command's output opened by PowerShell's NativeCommandError header.
    def header(cmd):
        return (f"python : 2025-12-26 20:26:23,982 - __main__ - INFO - \nAt line:1 char:1\n+ python {cmd} ...\n"
                "    + CategoryInfo          : NotSpecified: (2025-12-26 20:2...ain__ - INFO - :String) [], RemoteException\n"
                "    + FullyQualifiedErrorId : NativeCommandError\n \n")
    crash = ('Traceback (most recent call last):\n  File "integrate_advanced.py", line 354, in <module>\n'
             "TypeError: TimeBasedStrategy.__init__() got an unexpected keyword argument 'off_peak_price'\n")
    trained = "2025-12-26 20:27:15,186 - __main__ - INFO - TRAINING COMPLETE\n"
    assert not find(header("integrate_advanced.py") + crash + header("train_advanced.py") + trained).failed
    assert find(header("integrate_advanced.py") + crash + trained).failed
    assert find(header("train_advanced.py") + trained + crash).failed


def test_a_loss_print_that_repeats_while_the_q_estimate_climbs_is_no_flat_loss():
    # PyTorch's Mario DQN tutorial logs means over the last 100 episodes rounded to 3 decimals (dev batch 21, va-003):
    # `Mean Loss` repeats for episodes while `Mean Q Value`, the network's own output, keeps moving.
    lines = [f"Episode {769 + i} - Step {287632 + 400 * i} - Epsilon 1 - Mean Reward {5068.9 - i:.3f} - Mean Length 4 - "
             f"Mean Loss 3.233 - Mean Q Value {4435.121 + i:.3f} - Time Delta 9.502" for i in range(9)]
    assert "flat-loss" not in _find_ids("\n".join(lines) + "\n")
    still = [line.replace(line[line.index("Mean Q Value"):line.index(" - Time")], "Mean Q Value 4435.121") for line in lines]
    assert "flat-loss" in _find_ids("\n".join(still) + "\n")


def test_out_of_memory_words_and_the_advice_that_only_mentions_them():
    assert "out-of-memory-words" in _find_ids("ERROR: Out of GPU memory while running the step\n")
    assert "out-of-memory-words" in _find_ids("worker 3: OOM\n")
    for advice in ("Reduce the batch size to avoid OOM errors.", "This may run out of memory on small GPUs.",
                   "Allocator (GPU_0_bfc) ran out of memory trying to allocate 2.59GiB. The caller indicates that this is not a failure"):
        assert "out-of-memory-words" not in _find_ids(advice + "\n"), advice


def test_keyboardinterrupt_counts_only_as_the_exception_line():
    assert "user-interrupt" in _find_ids("Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\nKeyboardInterrupt\n")
    # Jupyter shows library source in its tracebacks: a comment naming KeyboardInterrupt is no Ctrl-C.
    assert "user-interrupt" not in _find_ids("    724 # TODO: treat KeyboardInterrupt as BaseException (delete the code below) in v1.7\n")


def test_a_traceback_cut_inside_a_step_reads_oom_weakly_and_one_cut_in_setup_environment():
    from finetune_mcp.triage import classify_text

    head = 'Traceback (most recent call last):\n  File "train.py", line 10, in <module>\n    main()\n'
    in_step = head + '  File "/x/torch/optim/optimizer.py", line 487, in wrapper\n    out = func(*args, **kwargs)\n' \
                     '  File "/x/accelerate/optimizer.py", line 178, in step\n    self.optimizer.step(closure)\n'
    in_setup = head + '  File "/x/transformers/modeling_utils.py", line 3000, in from_pretrained\n    config = cls.config_class.from_pretrained(\n'
    r = classify_text(in_step)
    assert (r.failure_class, r.signals[0]) == ("oom", "cut-in-step-compute") and r.confidence < 0.5
    assert "weakly" in r.reason
    assert classify_text(in_setup).failure_class == "environment"


def test_a_printout_of_settings_is_no_measurement():
    # DeepSpeed prints its config twice at start: a dotted listing and the JSON it was given. "loss_scale": 0
    # means dynamic scaling, "steps_per_print": inf means never; an options dump's inf is an unbounded limit.
    config = ("[2025-02-20 20:25:29,321] [INFO] [config.py:1000:print]   loss_scale ................... 1.0\n"
              "[2025-02-20 20:25:29,322] [INFO] [config.py:1000:print]   steps_per_print .............. inf\n"
              '    "fp16": {\n        "enabled": true, \n        "loss_scale": 0, \n        "loss_scale_window": 1000, \n'
              '        "min_loss_scale": 1\n    }, \n    "steps_per_print": inf, \n'
              "               max_dataset_size: inf                           \t[default: inf]\n"
              "patience: inf\n")
    assert _find_ids(config) == set()
    # The same values as measurements beside a step still count.
    assert "nonfinite-metric" in _find_ids("step 40 | G_adv: inf | D_real: 0.31\n")
    logged = "".join(f"iter {i} | loss_scale: {s} | loss: 2.1\n" for i, s in enumerate([65536.0, 1.0, 0.5, 0.25], 1))
    assert "loss-scale-collapse" in _find_ids(logged)


def test_a_nan_that_recovers_is_a_transient_but_one_that_stays_is_not():
    n = RULES.nonfinite_recovered_logs
    first = "Epoch 1/200 train_eps_loss=0.536957 val_mae=inf val_rmse=inf tf=0.00 lr=0.001\n"
    later = "".join(f"Epoch {e}/200 train_eps_loss=0.41 val_mae={1.0 / e:.4f} val_rmse={2.0 / e:.4f} lr=0.001\n" for e in range(2, 2 + n))
    assert "nonfinite-metric" not in _find_ids(first + later)
    short = "".join(later.splitlines(keepends=True)[: n - 1])
    assert "nonfinite-metric" in _find_ids(first + short)  # fewer finite prints than the table asks: not yet recovered
    assert "nonfinite-metric" in _find_ids(later + first)  # NaN last: nothing recovered


def _keras_epochs(losses, val=None) -> str:
    """model.fit's output as Keras 2 prints it: an `Epoch i/n` line, then the epoch's last batch line."""
    out = []
    for i, v in enumerate(losses, 1):
        out.append(f"Epoch {i}/{len(losses)}")
        out.append(f"211/211 [==============================] - 3s 16ms/step - loss: {v} - accuracy: 0.{i:02d}"
                   + (f" - val_loss: {val[i - 1]}" if val else ""))
    return "\n".join(out) + "\n"


def test_nan_grad_norms_of_skipped_fp16_steps_are_set_aside_in_any_format_but_a_nan_loss_never():
    n, nan = RULES.nonfinite_recovered_logs, float("nan")
    norms = [1.2, nan, 0.8, 1.1, nan, 0.9, 1.0, nan] * n
    dicts = "".join(f"{{'loss': {1.0 - 0.01 * i:.4f}, 'grad_norm': {g}, 'learning_rate': 2e-05, 'epoch': {i / 100:.2f}}}\n"
                    for i, g in enumerate(norms))
    f = find(dicts)
    assert "nonfinite-grad-norm" not in {h.id for h in f.hits} and [h.id for h in f.transient] == ["nonfinite-grad-norm"]
    c = classify_text(dicts)
    assert c.failure_class == "none" and c.runner_up.failure_class == "divergence"  # never silent: named and shown
    assert any("'grad_norm': nan" in text for _, text in c.evidence) and "skipped" in c.reason
    # Read from records alone (a log history saved as CSV, dev10o-006), the set-aside NaN lines are shown the same way.
    csv = "step,loss,grad_norm\n" + "".join(f"{i},{1.0 - 0.01 * i:.4f},{g}\n" for i, g in enumerate(norms, 1))
    c = classify_text(csv)
    assert c.failure_class == "none" and c.runner_up.failure_class == "divergence"
    assert any(",nan" in text for _, text in c.evidence) and "skipped" in c.reason
    # Megatron's own count of NaN iterations is no record: it keeps the hit.
    assert "nonfinite-grad-norm" in _find_ids(dicts + "number of nan iterations: 3\n")
    # Keras' `loss: inf` for the epochs whose running mean took an overflowed batch, finite after (d12y-012): a
    # NaN/inf loss is never set aside, whatever follows.
    keras = "".join(f"Epoch {e}/9\n211/211 [======] - 3s 16ms/step - loss: {'inf' if e < 4 else 1.2 - 0.1 * e:.4} - accuracy: 0.{e}\n"
                    for e in range(1, 10))
    assert "nonfinite-loss" in _find_ids(keras) and classify_text(keras).failure_class == "divergence"


def test_an_epoch_index_before_a_key_is_not_part_of_its_name():
    # MXNet's Speedometer (d12z-008): an epoch-end summary of a metric it had just reset prints nan; the same key
    # printed finite by the batches after it recovered, whatever the epoch index printed in front.
    n = RULES.nonfinite_recovered_logs
    text = "Epoch[0] Train-SmoothL1=nan\n" + "".join(
        f"Epoch[1] Batch [{100 * b}]\tSpeed: 35.68 samples/sec\tTrain-SmoothL1={1.6 - 0.1 * b:.6f}\n" for b in range(1, n + 1))
    assert "nonfinite-metric" not in _find_ids(text)
    # one more epoch-end nan is the same reset again (the key flickers); nan on every batch after it is not
    assert "nonfinite-metric" not in _find_ids(text + "Epoch[2] Train-SmoothL1=nan\n")
    stays = "".join(f"Epoch[2] Batch [{100 * b}]\tSpeed: 35.68 samples/sec\tTrain-SmoothL1=nan\n" for b in range(1, n + 1))
    assert "nonfinite-metric" in _find_ids(text + "Epoch[2] Train-SmoothL1=nan\n" + stays)


def test_torchvisions_image_extension_warning_is_the_weakest_evidence_never_none():
    warn = ("/env/lib/python3.10/site-packages/torchvision/io/image.py:13: UserWarning: Failed to load image Python "
            "extension: '/env/lib/python3.10/site-packages/torchvision/image.so: undefined symbol: _ZN3c1017RegisterOp'"
            "If you don't plan on using image functionality from `torchvision.io`, you can ignore this warning.\n")
    alone = classify_text(warn)
    assert alone.failure_class == "environment" and alone.signals == ["torchvision-image-extension"]  # not abi-mismatch
    nan = "RuntimeError: Function 'SigmoidBackward0' returned nan values in its 0th output.\n"
    assert classify_text(warn + nan).failure_class == "divergence"  # outranked by anything else (dev11t-002)
    steps = "".join(f"epoch 1 step {i} loss {2.3 - i * 0.01:.3f}\n" for i in range(1, RULES.went_on_records + 1))
    assert classify_text(warn + steps).failure_class == "none"  # a run that trained past it


def test_an_exception_python_reports_as_ignored_did_not_end_the_run():
    # sys.unraisablehook: an error in a finaliser at exit is printed and ignored; the exit status is unaffected.
    steps = "".join(f"{{'loss': {2.0 - i * 0.01:.4f}, 'epoch': {i / 100:.2f}}}\n" for i in range(1, 6))
    ignored = ("Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f2c>\n"
               "Traceback (most recent call last):\n  File \"/x/dataloader.py\", line 1478, in __del__\n"
               "    self._shutdown_workers()\nAttributeError: '_MultiProcessingDataLoaderIter' object has no attribute '_shutdown'\n")
    r = classify_text(steps + ignored)
    assert r.failure_class == "none" and "ignored" in r.reason and r.runner_up.failure_class == "environment"
    crash = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\nKeyError: 'labels'\n"
    assert classify_text(steps + ignored + crash).failure_class == "environment"  # a traceback of its own still fails


def test_tensorflows_cudart_probe_on_a_machine_without_a_gpu_is_a_warning():
    probe = ("2021-01-01 12:00:00.1: W tensorflow/stream_executor/platform/default/dso_loader.cc:64] Could not load dynamic "
             "library 'libcudart.so.11.0'; dlerror: libcudart.so.11.0: cannot open shared object file: No such file or directory\n")
    epochs = "".join(f"Epoch {e}/3\n100/100 [====] - 2s 20ms/step - loss: {1.0 - e * 0.1:.4f}\n" for e in (1, 2, 3))
    assert classify_text(probe + epochs).failure_class == "none"
    assert "cuda-runtime-missing" in _find_ids("ImportError: libcudart.so.12: cannot open shared object file: No such file or directory\n")


def test_an_error_before_the_trainers_end_of_training_line_did_not_stop_the_run():
    # d13db-004: a notebook's early cell fails to import triton; later cells train to the end (Unsloth's notebooks
    # print "N seconds used for training." after trainer.train() returns) and save the adapter.
    early = ("Traceback (most recent call last):\n  File \"<ipython-input-3>\", line 1, in <module>\n"
             "ModuleNotFoundError: No module named 'triton'\n")
    done = "477.878 seconds used for training.\n7.96 minutes used for training.\n"
    r = classify_text(early + "Unsloth - 2x faster free finetuning | Num GPUs = 1\n" + done)
    assert r.failure_class == "none" and "end-of-training line" in r.reason
    assert classify_text(early + done).runner_up.failure_class == "environment"  # never silent: the error is named
    # An error after it still ends the run (a crash while saving); and without it, the import error is the verdict.
    assert classify_text(done + early).failure_class == "environment"
    assert classify_text(early + "Unsloth - 2x faster free finetuning | Num GPUs = 1\n").failure_class == "environment"
    # HF Trainer's and Lightning's own words on success.
    for line in ("Training completed. Do not forget to share your model on huggingface.co/models =)",
                 "`Trainer.fit` stopped: `max_epochs=3` reached."):
        assert classify_text(early + line + "\n").failure_class == "none", line


def test_a_models_advice_to_install_an_optional_kernel_is_no_missing_package():
    # Phi-3's modeling code (d13da-001) warns and falls back to eager attention.
    line = ("WARNING:transformers_modules.microsoft.Phi-3.5-mini-instruct.modeling_phi3:`flash-attention` package not found, "
            "consider installing for better performance: No module named 'flash_attn'.\n")
    assert "stack-module-missing" not in _find_ids(line)


def test_a_stop_followed_by_an_error_of_its_own_is_not_how_the_log_ends():
    stop = "Traceback (most recent call last):\n  File \"prep.py\", line 3, in <module>\nKeyboardInterrupt\n"
    assert classify_text(stop).failure_class == "none"
    # d13db-010: a slow preprocessing cell stopped by hand, the notebook prints on, then the training cell fails.
    later = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
             "ValueError: Unable to create tensor, you should probably activate padding with 'padding=True'\n")
    between = "".join(f"Map: {i}0%|###| {i}/10 [00:0{i}<00:00]\n" for i in range(RULES.stop_echo_lines + 1))
    assert classify_text(stop + between + later).failure_class == "environment"
    # Right after the Ctrl-C, the same error is an echo (DataLoader workers and shutdown hooks were interrupted too).
    assert classify_text(stop + later).failure_class == "none"
    # So is torchrun reporting the child the Ctrl-C stopped (dev10p-004), however late.
    echo = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    assert classify_text(stop + between + echo).failure_class == "none"


def test_a_loop_that_skips_nan_batches_is_not_a_nan_loss():
    # dev8e-016: a custom loop's own guard ("[WARNING] NaN loss detected! Skipping batch.") while the loss falls.
    steps = "".join(f"step {i} loss {3.0 - i * 0.02:.3f}\n" for i in range(1, RULES.went_on_records + 3))
    assert classify_text("[WARNING] NaN loss detected! Skipping batch.\n" + steps).failure_class == "none"


def test_an_undefined_evaluation_score_is_no_divergence():
    # sklearn returns nan for kappa / AUC / a correlation when a fold holds one class (UndefinedMetricWarning).
    for key in ("kappa", "auc", "mcc", "pearson", "spearman"):
        assert "nonfinite-metric" not in _find_ids(f"accuracy: 1.0000\n{key}: nan\n"), key


def test_a_kill_glued_to_a_progress_bar():
    bar = "".join(f" 98%|█████████▊| {i}/8192 [25:15<00:22,  5.79it/s]\r" for i in range(8060, 8080))
    assert "sigkill-in-log" in _find_ids(bar + " 99%|█████████▊| 8080/8192 [25:19<00:26,  4.29it/s]Killed\n")
    assert "sigkill-in-log" not in _find_ids("Killed processes are restarted by the supervisor (see docs)\n")


def test_a_gan_amp_scaler_per_network_is_a_loss_scale():
    lines = "".join(f"[TRAIN] E000 I{i:05d} | scale_g={s} | scale_d={s} | loss: G=4.19 D=2.24\n"
                    for i, s in zip(range(0, 700, 100), [32768.0, 32768.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert "loss-scale-collapse" in _find_ids(lines)


def test_no_nan_found_and_a_list_of_possible_causes_are_no_evidence():
    assert "nonfinite-printout" not in _find_ids("sanity check: no NaN detected in the batch\n")
    ray = ("(raylet) A worker died or was killed while executing a task by an unexpected system error. Worker exit type: "
           "SYSTEM_ERROR Some common causes include: (1) the process was killed by the OOM killer due to high memory usage, "
           "(2) ray stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.\n")
    assert "out-of-memory-words" not in _find_ids(ray)
    assert "out-of-memory-words" in _find_ids("(raylet) worker 3 was killed by the OOM killer\n")


def test_a_run_that_went_on_after_a_traceback_did_not_die_there():
    n = RULES.went_on_records
    tb = ("Traceback (most recent call last):\n  File \"/x/torch/_dynamo/convert_frame.py\", line 1, in f\n"
          "SystemError: PY_SSIZE_T_CLEAN macro must be defined for '#' formats\n")
    steps = "".join(f"step:{i}/20000 train_loss:{0.05 - i * 1e-4:.6f} train_time:{i * 4452}ms\n" for i in range(1, n + 1))
    assert not find(tb + steps).failed  # n records after it: caught, the run went on
    assert find(tb + steps[: steps.index(f"step:{n}/")]).failed  # one fewer: it may have killed the run
    assert find(steps + tb).failed  # the last thing the run printed
    # Read none, but never silently: the error lines are named as evidence and the runner-up says what they suggest.
    from finetune_mcp.triage import classify_text

    r = classify_text(tb + steps)
    assert r.failure_class == "none" and "line 3" in r.reason and r.runner_up.failure_class == "environment"
    assert (3, "SystemError: PY_SSIZE_T_CLEAN macro must be defined for '#' formats") in r.evidence


def test_a_signal_the_run_trained_past_is_set_aside_but_named():
    from finetune_mcp.triage import classify_text

    n = RULES.went_on_records
    steps = "".join(f"epoch 1 step {i} loss {2.3 - i * 0.01:.3f}\n" for i in range(1, n + 1))
    early = "nvidia-smi: command not found\n"
    r = classify_text(early + steps)
    assert r.failure_class == "none" and "tool-failure (last at line 1)" in r.reason
    assert classify_text(early + steps.rsplit("epoch", 1)[0]).failure_class == "environment"  # one record fewer
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
    assert classify_text(steps + oom).failure_class == "oom"  # what the run ended on is never set aside
    # A NaN the run went on past is still a divergence: numbers that went wrong stay wrong.
    assert classify_text("epoch 1 step 0 loss nan\n" + steps).failure_class == "divergence"


def test_a_nan_grad_norm_the_run_logged_finite_ones_after_was_a_skipped_step():
    n = RULES.nonfinite_recovered_logs
    recs = [Metric(1, "a", step=100, loss=1.91, grad_norm=float("nan"))]
    recs += [Metric(i + 2, "b", step=200 + i, loss=0.9, grad_norm=3.9) for i in range(n)]
    assert "nonfinite-grad-norm" not in _ids(recs)  # fp16 loss scaling skipped the step; the loss stayed finite
    assert "nonfinite-grad-norm" in _ids(recs[:n])  # fewer finite ones after it: not yet
    assert "nonfinite-grad-norm" in _ids(recs + [Metric(n + 2, "c", step=900, loss=float("nan"), grad_norm=3.9)])


def test_grad_norms_nan_every_few_steps_to_the_end_while_the_loss_falls_were_skipped_steps():
    # An fp16 run's HF log history (dev10o-006): the norm is NaN at one log in three, the last one included.
    n, nan = RULES.nonfinite_recovered_logs, float("nan")
    norms = [1.2, nan, 0.8, 1.1, nan, 0.9, 1.0, nan] * n
    recs = [Metric(i + 1, f"l{i}", step=10 * i, loss=1.0 - 0.01 * i, grad_norm=g) for i, g in enumerate(norms)]
    assert "nonfinite-grad-norm" not in _ids(recs)
    # NaN at the last n logs in a row: the scaler skips every step now (or the norm broke for good).
    tail = [Metric(len(recs) + j + 1, "t", step=900 + j, loss=0.5, grad_norm=nan) for j in range(n)]
    assert "nonfinite-grad-norm" in _ids(recs + tail)
    # Never a finite norm after the first NaN: nothing was skipped and recovered.
    assert "nonfinite-grad-norm" in _ids(recs[:1] + [Metric(90 + j, "t", step=90 + j, loss=0.5, grad_norm=nan) for j in range(2 * n)])


def test_a_loss_that_only_looks_flat():
    n = RULES.flat_identical_run
    moving = [Metric(i, "x", step=i, loss=0.0, grad_norm=0.2 + i / 100) for i in range(1, n + 2)]
    assert "flat-loss" not in _ids(moving)  # GRPO logs loss 0.0 while its grad norm moves: the policy learns
    stuck = [Metric(i, "x", step=i, loss=0.0, grad_norm=0.0) for i in range(1, n + 2)]
    assert "flat-loss" in _ids(stuck)
    assert "flat-loss" in _ids([Metric(i, "x", step=i, loss=6.90776) for i in range(1, n + 2)])  # ln(1000), to 6 digits
    assert "flat-loss" not in _ids([Metric(i, "x", step=i, loss=4.3) for i in range(1, n + 2)])  # HF's rounded print


def test_a_second_run_appended_to_the_log_starts_the_curve_rules_over():
    def run(losses):
        return [Metric(0, "x", loss=v, epoch=round(0.1 * (i + 1), 2)) for i, v in enumerate(losses)]

    first = run([2.0, 1.0, 0.4, 0.1, 0.02, 0.01, 0.012, 0.011])
    second = run([2.1, 1.2, 0.5])  # the relaunch starts where every run starts
    ms = [Metric(i + 1, f"line {i + 1}", loss=m.loss, epoch=m.epoch) for i, m in enumerate(first + second)]
    assert not {"loss-rise", "loss-spike"} & set(_ids(ms))
    # Without the epoch going back, the same numbers are a run that came apart.
    flat = [Metric(i + 1, f"line {i + 1}", loss=m.loss, epoch=1.0 + i / 10) for i, m in enumerate(first + second)]
    assert {"loss-rise", "loss-spike"} & set(_ids(flat))


def test_a_flat_loss_beside_a_loss_that_moves_or_at_a_converged_floor_is_not_stuck():
    n = RULES.flat_identical_run
    # One term pinned while the other loss of the same line falls: the weights move.
    pinned = [Metric(i, "x", step=i, loss=0.0144, named={"loss:train l1 loss": 0.80 - i / 1000}) for i in range(1, n + 2)]
    assert "flat-loss" not in _ids(pinned)
    both = [Metric(i, "x", step=i, loss=0.0144, named={"loss:train l1 loss": 0.8015}) for i in range(1, n + 2)]
    assert "flat-loss" in _ids(both)
    # A training loss printed to four decimals reaches 0.0000 while the validation loss beside it keeps moving
    # (an overfitting classifier): the print rounds, the weights move. With the validation loss still too: stuck.
    curve = [(0.0144, 0.5636), (0.0010, 0.6650), (0.0001, 0.7100)] + [(0.0, 0.7264 + i / 400) for i in range(n + 3)]
    rounded = parse_text("\n".join(f"Epoch {e}/60: train loss {a:.4f}, val loss {b:.4f}" for e, (a, b) in enumerate(curve, 20)), KEYS)
    assert "flat-loss" not in _ids(rounded)
    frozen = parse_text("\n".join(f"Epoch {e}/60: train loss {a:.4f}, val loss 0.7264" for e, (a, _) in enumerate(curve, 20)), KEYS)
    assert "flat-loss" in _ids(frozen)
    # Flat at the run's lowest after falling more than flat_converged_factor x: converged.
    fell = [0.167, 0.09, 0.05, 0.03, 0.02] + [0.0138] * (n + 1)
    assert RULES.flat_converged_factor and fell[0] >= RULES.flat_converged_factor * fell[-1]
    assert "flat-loss" not in _ids(_losses(fell))
    # Flat where it started (it never learned), or above where it had been (it came apart to a constant): stuck.
    assert "flat-loss" in _ids(_losses([0.0138] * (n + 1)))
    assert "flat-loss" in _ids(_losses([0.167, 0.09, 0.05, 0.03] + [0.0693] * (n + 1)))


def test_a_loss_that_never_moved_from_its_first_log_is_stuck():
    n, band = RULES.flat_still_logs, RULES.flat_still_band
    assert n and band
    # Caffe pinned at ln 1000 (6.90776), printed beside the solver's smoothed average: never five identical in a row.
    pinned = [6.91161, 6.91161] + [6.90501, 6.90776, 6.90635, 6.90776, 6.90681, 6.90776, 6.90704, 6.90776] * n
    assert max(pinned) - min(pinned) <= band * min(pinned)
    assert _ids(_losses(pinned[:n])) == ["flat-loss"]
    assert _ids(_losses(pinned[:n - 1])) == []  # too short to tell
    # A GPT-2 run's first ten logs at uniform over its vocabulary, falling: learning slowly, not stuck.
    start = [10.826 - 0.0049 * i for i in range(n)]
    assert _ids(_losses(start)) == []
    # The same band, but lower at the end than anywhere in the first half: progress, however slow.
    creeping = [2.4330 - 0.0004 * i for i in range(n)]
    assert max(creeping) - min(creeping) <= band * min(creeping)
    assert _ids(_losses(creeping)) == []
    # A plateau the run leaves (a loss-plateau study: 2.43 for twenty logs, then 0.01) moved.
    plateau = [round(2.4311 + 0.0001 * ((i * 37) % 23 - 11), 4) for i in range(20)] + [1.2, 0.3, 0.05, 0.012]
    assert _ids(_losses(plateau)) == []
    # An earlier run appended to the log that never moved still counts (its curve closes at the restart), unless the
    # log's last run learned (flat_superseded_fall): the stuck run was abandoned for one that trained.
    appended = [Metric(i + 1, "x", epoch=1.0 + i, loss=v) for i, v in enumerate(pinned[:n])]
    appended += [Metric(n + i + 1, "x", epoch=1.0 + i, loss=v) for i, v in enumerate([2.0, 1.95, 1.9, 1.92, 1.88])]
    assert "flat-loss" in _ids(appended)
    relaunched = appended[:n] + [Metric(n + i + 1, "x", epoch=1.0 + i, loss=v) for i, v in enumerate([2.0, 1.5, 1.1, 0.9, 0.8])]
    assert "flat-loss" not in _ids(relaunched)


def test_a_run_that_ends_at_ln_k_is_a_uniform_guess():
    n, near = RULES.chance_logs, RULES.chance_near
    assert n and near
    # A Keras multi-label model whose loss sat at ln 2 (AUC 0.500) after 0.7117.
    pinned = [0.7117, 0.69325, 0.69324, 0.69325, 0.69323, 0.69320, 0.69321, 0.69317][-(n + 2):]
    assert _ids(_losses(pinned)) == ["flat-loss"]
    assert _ids(_losses([2.41, 2.3031, 2.3019, 2.3027, 2.3024, 2.3022][-(n + 1):])) == ["flat-loss"]  # ln 10
    # Passing through chance on the way down is learning; so is a plateau at no ln k, or past chance_classes.
    assert _ids(_losses([0.7117, 0.6932, 0.6931, 0.6930, 0.6932, 0.6931, 0.52, 0.31])) == []
    assert _ids(_losses([3.2, 2.9, 2.4921, 2.4911, 2.4928, 2.4917, 2.4922, 2.4919])) == []
    k = RULES.chance_classes + 1
    import math
    assert _ids(_losses([8.0] + [round(math.log(k), 4) + 0.0001 * (i % 3) for i in range(n)])) == []


def test_a_nan_loss_on_the_epoch_0_row_is_a_mean_over_no_steps():
    # A metrics CSV written after evaluating the untrained model: train_loss/train_acc have no samples yet.
    head = "epoch,lr,train_loss,train_acc,test_loss,test_acc\n0,0.2,nan,nan,2.4937,0.1008\n"
    rows = "".join(f"{e},0.2,{2.15 / e:.4f},{0.2 + e / 100:.3f},{1.7 / e:.4f},{0.36 + e / 100:.3f}\n" for e in range(1, 8))
    assert _ids(parse_text(head + rows, KEYS)) == []
    # The same NaN with too few finite losses after it, or another NaN later, or at epoch 1: a NaN loss.
    short = "".join(rows.splitlines(keepends=True)[:RULES.nonfinite_recovered_logs - 1])
    assert "nonfinite-loss" in _ids(parse_text(head + short, KEYS))
    assert "nonfinite-loss" in _ids(parse_text(head + rows + "8,0.2,nan,0.3,1.1,0.4\n", KEYS))
    assert "nonfinite-loss" in _ids(parse_text(head.replace("\n0,", "\n1,") + rows.replace("1,0.2,", "2,0.2,", 1), KEYS))


def test_one_step_printed_twice_is_no_replay_and_a_spike_the_run_learned_away_from_is_no_divergence():
    # Keras draws the last batch's bar with its ETA and again with its time per step: the same (epoch, step, loss).
    # (Read as a replay, the run restarted at each such pair: from 0.0166 through a partial 0.0043 to 0.0228, a rise.)
    lines = []
    for e, (bar, v) in enumerate([(66, 10.41), (66, 2.1), (66, 0.31), (66, 0.05), (66, 0.0166), (63, 0.0043), (66, 0.0228)], start=1):
        end = 0.0114 if bar == 63 else v
        lines += [f"Epoch {e}/7", f"{bar}/66 [======] - ETA: 0s - loss: {v:.4f} - acc: 0.99",
                  f"66/66 [======] - 1s 19ms/step - loss: {end:.4f} - acc: 0.99 - val_loss: 0.01 - val_acc: 0.99"]
    assert _ids(parse_text("\n".join(lines), KEYS)) == []
    # Fell from 10.41 to 0.0003, spiked to 18.9 and ended at 0.07: 270x its floor, 0.7 % of its start.
    vals = [10.41, 3.1, 0.9, 0.2, 0.05] + [0.0003 + 0.000001 * ((i * 37) % 23) for i in range(25)]
    vals += [18.87, 11.4, 2.1, 0.6] + [0.07 + 0.0001 * ((i * 37) % 23) for i in range(25)]
    assert vals[-1] <= RULES.spike_settled_below * vals[0]
    assert "loss-spike" not in _ids(_losses(vals))
    # Ending at half its start, the same spike counts.
    assert "loss-spike" in _ids(_losses(vals[:-25] + [5.2 + 0.001 * ((i * 37) % 23) for i in range(25)]))


def test_a_long_curve_that_ends_above_its_start_by_rise_abs_rose_whatever_the_ratio():
    import random
    n, gap, noise = RULES.rise_smooth_after, RULES.rise_abs, random.Random(7)
    assert gap
    # A nanoGPT sweep arm: 4.73 at initialisation, 7.3 for the rest of the run (1.5x, a perplexity 12x higher).
    worse = [4.73, 5.24, 6.28, 7.32, 7.87] + [round(7.30 + noise.uniform(-0.1, 0.1), 4) for i in range(n)]
    assert worse[-1] < RULES.rise_factor * min(worse)
    assert _ids(_losses(worse)) == ["loss-rise"]
    # The same level, but a short excerpt: one bad stretch is no held level.
    assert _ids(_losses(worse[:RULES.rise_smooth_after // 2])) == []
    # Ending above its start but less than rise_abs above its lowest (a loss term switched on after warm-up).
    switched = [round(2.14 + noise.uniform(-0.05, 0.05), 4) for i in range(n)]
    switched += [round(2.14 + gap * 0.9 + noise.uniform(-0.05, 0.05), 4) for i in range(n)]
    assert _ids(_losses(switched)) == []
    # A loss that starts where no cross-entropy does is on another scale: an RL trader's MSE 62 -> 46 -> 67 is noise.
    mse = [round(v * 10, 3) for v in worse]
    assert mse[0] > RULES.rise_abs_first_max and mse[-1] < RULES.rise_factor * min(mse)
    assert _ids(_losses(mse)) == []
    # A reinforcement-learning trainer's loss follows its returns: rl_rise_factor only.
    assert "loss-rise" not in _ids([Metric(i + 1, "x", step=i + 1, loss=v, rl=True) for i, v in enumerate(worse)])


def test_a_relaunchs_first_loss_before_its_epoch_bar_belongs_to_the_new_run():
    # GANomaly appended to one nohup.out: the new run's first record prints before the bar that names epoch 1.
    first = [Metric(i + 1, "x", epoch=float(i + 1), loss=2.0 / (i + 1), named={"loss:l con": 0.3 / (i + 1)}) for i in range(50)]
    relaunch = [Metric(60, "x", loss=17.59, named={"loss:l con": 0.3345})]
    second = [Metric(61 + i, "x", epoch=float(i + 2), loss=11.77 / (i + 1), named={"loss:l con": 0.219 / (i + 1)}) for i in range(20)]
    assert _ids(first + relaunch + second) == []
    # Without the bar after it, the same record is the old run's last: a rise.
    assert "loss-rise" in _ids(first + relaunch)
    # BasicSR's l_pix and a paper's L_total are losses; l_rate is not.
    from finetune_mcp.triage.parse import key_kind
    assert key_kind("l_pix") == key_kind("L_total") == "loss" and key_kind("l_rate") is None


def test_a_bare_kill_after_the_loss_went_nan_for_good_is_the_divergence_it_ended():
    nan_from = RULES.nonfinite_recovered_logs
    steps = "".join(f"step:{s}/20000 train_loss:{3.1 - s / 1000:.4f}\n" for s in range(50, 1200, 50))
    nans = "".join(f"step:{s}/20000 train_loss:nan\n" for s in range(1200, 1200 + 50 * nan_from, 50))
    kill = ("E0328 20:09:39.233000 858 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: -9) "
            "local_rank: 3 (pid: 929) of binary: /usr/local/bin/python\n")
    r = classify_text(steps + nans + kill)
    assert r.failure_class == "divergence" and "sigkill-in-log" in r.signals
    assert r.metrics["loss_nonfinite_at_end"] == nan_from
    # A NaN the run logged finite losses after, or too short a NaN run, leaves the kill the verdict.
    back = "".join(f"step:{s}/20000 train_loss:2.9\n" for s in range(1400, 1600, 50))
    assert classify_text(steps + nans + back + kill).failure_class == "oom"
    assert classify_text(steps + nans.split("\n")[0] + "\n" + kill).failure_class == ("oom" if nan_from > 1 else "divergence")
    # An allocator's own error beside the kill is memory, whatever the numbers.
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert classify_text(steps + nans + oom + kill).failure_class == "oom"


def test_a_key_after_a_closed_bracket_and_a_one_letter_loss():
    line = "[ep 0 step   180 t=    345s vram= 5904MB] L=0.2934  D=0.2827  PSNR= 5.49  R=0.8200 bpp"
    assert parse_text(line, KEYS)[0].named == {"loss:l": 0.2934}
    # The index head is still read off first: `Epoch[1] done. Loss: 0.512` is the loss.
    assert parse_text("2026-06-15 20:54:08 transreid.train INFO: Epoch[1] done. Loss: 0.512 (Base: 0.5), Lr: 1e-4", KEYS)[0].loss == 0.512


def test_lines_end_without_every_carriage_return_python_on_windows_wrote():
    from finetune_mcp.triage.parse import split_lines
    assert split_lines("a\r\r\nb\r\nc\rd\n") == ["a", "b", "c\rd"]


def test_a_later_notebook_cells_error_after_training_finished_is_not_the_trainings_if_the_notebook_went_on():
    bars = "".join(f"Epoch {e}/5\n536/536 [==============================] - 2s 4ms/step - loss: {0.6 - e / 20:.4f} - "
                   f"accuracy: 0.85 - val_loss: 0.37 - val_accuracy: 0.84\n" for e in range(1, 6))
    cell = ("\x1b[0;31mKeyError\x1b[0m                                  Traceback (most recent call last)\n"
            "\x1b[0;32m<ipython-input-9-95de25879312>\x1b[0m in \x1b[0;36m<module>\x1b[0;34m\x1b[0m\n"
            "\x1b[0;32m----> 1\x1b[0;31m \x1b[0mplt\x1b[0m\x1b[0;34m.\x1b[0m\x1b[0mplot\x1b[0m\x1b[0;34m(\x1b[0m\x1b[0mhistory\x1b[0m\x1b[0;34m[\x1b[0m\x1b[0;34m'acc'\x1b[0m\x1b[0;34m]\x1b[0m\x1b[0;34m)\x1b[0m\n"
            "\n\x1b[0;31mKeyError\x1b[0m: 'acc'\n")
    # the cells after it ran (an evaluation, a confusion matrix): the notebook went on past the plot's error
    went = "<Figure size 432x288 with 1 Axes>\n63/63 [==============================] - 0s 1ms/step\n[[1517   78]\n [ 161  244]]\n"
    r = classify_text(bars + cell + went)
    assert r.failure_class == "none" and r.runner_up.failure_class == "environment"
    assert any("536/536" in t for _, t in r.evidence) and any("KeyError" in t for _, t in r.evidence)
    # ipykernel 6 names the cell's code by a file, IPython 8 by `Cell In[12]`.
    for frame in ("/tmp/ipykernel_451042/622961601.py in <module>", "Cell In[12], line 1"):
        framed = cell.replace("\x1b[0;32m<ipython-input-9-95de25879312>\x1b[0m", frame)
        assert classify_text(bars + framed + went).failure_class == "none"
    # srun --label's task number before every line (the cleaner keeps it before a number: `0: 536/536 [====`).
    labelled = "".join(f"0: {line}\n" for line in (bars + cell + went).splitlines())
    assert classify_text(labelled).failure_class == "none"
    # a notebook that ends on that error: its last step failed (environment, healthy training the runner-up)
    r = classify_text(bars + cell)
    assert r.failure_class == "environment" and r.runner_up.failure_class == "none"
    # The same error from a script, or in a cell while the last epoch had not finished, is a failure.
    script = 'Traceback (most recent call last):\n  File "train.py", line 40, in <module>\n    plt.plot(history["acc"])\nKeyError: \'acc\'\n'
    assert classify_text(bars + script).failure_class == "environment"
    cut = bars.rsplit("536/536", 1)[0]
    assert classify_text(cut + cell).failure_class == "environment"


def test_a_window_recurring_at_the_same_steps_is_a_replay_at_later_steps_stuck_weights():
    w = RULES.flat_repeat_window
    vals = [0.8082, 0.6930, 0.7121, 0.6987, 0.6850][:w]
    replay = [Metric(i + 1, "x", step=50 * (i % w + 1), loss=v) for i, v in enumerate(vals + vals)]
    assert "flat-loss" not in _ids(replay)  # the relaunch printed the same steps' losses again (same seed)
    stuck = [Metric(i + 1, "x", step=50 * (i + 1), loss=v) for i, v in enumerate(vals + vals)]
    assert "flat-loss" in _ids(stuck)


def test_wandb_run_summary_is_no_record():
    summary = "wandb: Run summary:\nwandb:     train l1 loss 0.78153\nwandb:        train_loss 0.01375\nwandb: \n"
    steps = "".join(f"Epoch [{i}/650], Train Loss: {0.2 - i / 100:.4f}\n" for i in range(1, 8))
    assert summary_records(summary + steps) == 7
    assert summary_records("wandb: setting up run 246sz0mq\n" + steps) == 7


def summary_records(text: str) -> int:
    from finetune_mcp.triage.parse import parse_text

    return sum(1 for m in parse_text(text, KEYS) if m.loss is not None)


def test_a_kl_term_past_the_magnitude_limit_is_broken_numbers():
    lim = RULES.loss_abs_max
    assert "loss-magnitude" in _ids([Metric(i, "x", named={"kl:kl loss": v}) for i, v in enumerate([13.0, 4e9, lim * 3e7], 1)])
    assert "loss-magnitude" not in _ids([Metric(i, "x", named={"kl:kl loss": v}) for i, v in enumerate([13.0, 40.0, 25.0], 1)])


def test_the_end_of_one_train_call_or_a_replay_starts_the_curve_over():
    sft = [Metric(i, "x", loss=v, epoch=i / 2) for i, v in enumerate([2.4, 1.6, 1.0, 0.7, 0.5, 0.4, 0.38], 1)]
    summary = parse_line(Metric(8, ""), KEYS, "{'train_runtime': 861.4, 'train_loss': 0.79, 'epoch': 8.33}")
    assert (summary.run_end, summary.loss, summary.epoch) == (861.4, 0.79, 8.33)
    ipo = [Metric(9 + i, "x", loss=v, epoch=5.0 * (i + 1)) for i, v in enumerate([24.6, 24.5, 24.3, 24.1, 23.9])]
    assert not {"loss-rise", "loss-spike"} & set(_ids(sft + [summary] + ipo))  # SFT, then an IPO stage
    assert {"loss-rise", "loss-spike"} & set(_ids(sft + ipo))  # without the summary: one run that came apart
    nan_summary = parse_line(Metric(8, ""), KEYS, "{'train_runtime': 9.0, 'train_loss': nan}")
    assert "nonfinite-loss" in _ids(sft + [nan_summary])
    # The same losses at the same steps printed again (a notebook cell run twice): a replay, not a rise.
    pre = [6.4668, 5.7228, 2.6397, 1.9819]
    once = [Metric(i + 1, "x", step=20 * (i + 1), loss=v) for i, v in enumerate(pre)]
    twice = once + [Metric(5 + i, "x", step=20 * (i + 1), loss=v) for i, v in enumerate(pre)]
    assert not {"loss-rise", "loss-spike"} & set(_ids(twice))
    # Each epoch repeating the last one's per-step losses is stuck weights: still flat-loss.
    w = RULES.flat_repeat_window
    per_epoch = [0.9741, 1.3742, 1.2390, 0.9670, 1.0386, 1.1681][:w]
    stuck = [Metric(e * w + s + 1, "x", step=s, epoch=e + 1, loss=v) for e in range(2) for s, v in enumerate(per_epoch)]
    assert "flat-loss" in _ids(stuck)


def test_losses_under_two_keys_are_two_curves():
    pre = [f"Pre-training iteration {20 * (i + 1)}/100, Loss: {v}" for i, v in enumerate([6.4668, 5.7228, 2.0397, 1.9819, 2.5954])]
    main = [f"Epoch {e}/10, Avg Loss: {v}, Time: 0.5m" for e, v in [(1, 51136.5554), (5, 26167.1351), (10, 23974.3964)]]
    ms = [parse_line(Metric(i, ""), KEYS, line) for i, line in enumerate(pre + main, 1)]
    assert not {"loss-rise", "loss-spike"} & set(_ids(ms))  # a per-iteration loss, then a per-epoch sum: each falls
    one_key = [parse_line(Metric(i, ""), KEYS, line.replace("Avg Loss", "Loss")) for i, line in enumerate(pre + main, 1)]
    assert {"loss-rise", "loss-spike"} <= set(_ids(one_key))  # the same numbers under one key: a run that blew up
    # The whole pre-training printed twice (two processes into one file): a replay at the same counted steps.
    assert "flat-loss" not in _ids([parse_line(Metric(i, ""), KEYS, line) for i, line in enumerate(pre + pre, 1)])


def test_a_run_resumed_after_an_interrupt_is_read_from_its_own_start():
    plateau = [f"Step {s} -- Train loss: {0.012 - (s - 860) * 1e-5:.6f}, Train Acc: 1.0" for s in range(860, 884)]
    resumed = [f"Step {883 + i} -- Train loss: {v}, Train Acc: 0.6" for i, v in enumerate([2.6767020225524902, 1.62, 1.557, 1.577, 1.397, 1.167, 1.006, 0.98, 0.91, 0.83, 0.7, 0.56, 0.4, 0.3])]
    dropped = ("wandb: WARNING (User provided step: 883 is less than current step: 884. Dropping entry: "
               "{'train_loss': 2.6767020225524902, 'train_acc': 0.5537109375})")

    def ids(lines):
        return _ids(parse_text("\n".join(lines), KEYS))

    assert "loss-spike" in ids(plateau + resumed)  # one curve: the jump from 0.012 to 2.68 did not come back in time
    assert "loss-spike" not in ids(plateau + ["\x1b[0;31mKeyboardInterrupt\x1b[0m: "] + resumed + [dropped])
    assert "loss-spike" in ids(plateau + ["KeyboardInterrupt: "] + resumed + ["Step 897 -- Train loss: 25.0"])  # its own spike counts


def test_a_new_runs_kl_is_read_from_its_own_start():
    first = [Metric(i, "x", epoch=1 + i / 10, named={"kl:kl loss": v}) for i, v in enumerate([1584.9, 40.0, 2.0, 0.034], 1)]
    second = [Metric(5 + i, "x", epoch=0.1 * (i + 1), named={"kl:kl loss": v}) for i, v in enumerate([1584.9, 900.0])]
    assert "kl-blowup" not in _ids(first + second)
    same_run = [Metric(5 + i, "x", epoch=2 + i, named={"kl:kl loss": v}) for i, v in enumerate([1584.9, 900.0])]
    assert "kl-blowup" in _ids(first + same_run)


def test_a_noisy_per_batch_curve_must_hold_its_rise():
    n = RULES.rise_smooth_after * 2
    noise = [0.03, 0.48, 0.05, 0.2, 0.023, 0.09, 0.37, 0.06, 0.12]
    values = [0.3] + [noise[i % len(noise)] for i in range(n)]
    values[n // 2: n // 2 + 9] = [0.02, 0.025, 0.03, 0.02, 0.03, 0.025, 0.028, 0.022, 0.03]  # one lucky stretch
    values[-4:] = [0.47, 0.45, 0.48, 0.46]  # a few bad batches at the end lift one median, not all of the last
    assert "loss-rise" not in _ids(_losses(values))
    risen = values[: n // 2 + 9] + [0.5 + (i % 3) / 10 for i in range(3 * RULES.rise_window)]  # a level that held
    assert "loss-rise" in _ids(_losses(risen))


def test_an_exception_message_or_an_unbounded_score_is_no_nan_metric():
    assert "nonfinite-metric" not in _find_ids("Traceback (most recent call last):\n  File \"e.py\", line 3\nKeyError: nan\n")
    assert "nonfinite-metric" not in _find_ids("[Eval Summary] Epoch: 1, SDR: -4.3230, SIR: inf, SAR: -4.3230, PSNR: inf\n")
    assert "nonfinite-metric" in _find_ids("[Eval Summary] Epoch: 1, recon: nan\n")  # the run's numbers still count
    from finetune_mcp.triage import classify_text

    lookup = classify_text("Traceback (most recent call last):\n  File \"e.py\", line 3, in <module>\nKeyError: nan\n")
    assert (lookup.failure_class, lookup.signals) == ("environment", ["fallback-lookup"]), lookup  # a lookup, not numbers
    overflow = classify_text("Traceback (most recent call last):\n  File \"e.py\", line 3, in <module>\nFloatingPointError: nan\n")
    assert overflow.failure_class == "divergence"


def test_a_run_that_came_apart_before_its_end_of_training_summary_is_not_forgotten():
    summary = Metric(20, "{'train_runtime': 12.0, 'train_loss': 1.9, 'epoch': 3.0}", loss=1.9, epoch=3.0)
    rose = [Metric(i, "x", loss=v, epoch=i / 10) for i, v in enumerate([2.0, 1.0, 0.5, 0.3, 0.25, 1.6, 2.2, 2.5], 1)]
    assert "loss-rise" in _ids(rose + [summary])  # the run's own rise stands after its summary closed it
    n = RULES.flat_identical_run
    stuck = [Metric(i, "x", loss=6.90776, epoch=i / 10) for i in range(1, n + 2)]
    assert "flat-loss" in _ids(stuck + [summary])  # and a flat stretch it ended on
    kl = [Metric(i, "x", epoch=i / 10, named={"kl:approx kl": v}) for i, v in enumerate([0.01, 0.02, 3.5], 1)]
    assert "kl-blowup" in _ids(kl + [summary])  # a blow-up already seen keeps the KL it rose from


# --- what the retired blind batches 4-9 showed (2026-12-07) ------------------------------------------


def _tb(*frames_and_exception: str) -> str:
    steps = "".join(f"Epoch 1 Step {i} loss {2.5 - 0.01 * i:.4f}\n" for i in range(1, 12))
    return steps + "Traceback (most recent call last):\n" + "\n".join(frames_and_exception) + "\n"


def test_a_job_that_died_saving_the_model_reads_by_its_exception_with_the_curve_runner_up():
    # A run whose loss only jumped (a detection term from 0.001, as in environment--b13gd-005) and whose job then died in
    # torch.save: the save decides, by the exception's type, and the curve is the runner-up. The same curve before a
    # crash that is not a save keeps reading divergence, and so does a NaN loss before a save (a value, not a shape).
    losses = [0.0011, 0.0012, 0.0010, 0.0011, 0.0900, 0.0950, 0.0870, 0.0910, 0.0890, 0.0930, 0.0880, 0.0900]
    steps = "".join(f"Epoch 0 iter {i} loss {v}\n" for i, v in enumerate(losses))
    save = ('  File "main2.py", line 122, in train',
            "    torch.save(model.state_dict(), os.path.join(root, 'pkl/model.pth'))",
            '  File "/usr/lib/python3.10/site-packages/torch/serialization.py", line 627, in save',
            "    with _open_zipfile_writer(f) as opened_zipfile:",
            "RuntimeError: Parent directory /data/ai_data/pkl does not exist.")
    tb = "Traceback (most recent call last):\n"
    r = classify_text(steps + tb + "\n".join(save) + "\n")
    assert (r.failure_class, r.runner_up.failure_class) == ("environment", "divergence")
    assert "while saving the model" in r.reason and "loss-spike" in r.signals
    other = ('  File "main2.py", line 98, in train', "    evaluate(model, loader)",
             "RuntimeError: Parent directory /data/ai_data/pkl does not exist.")
    assert classify_text(steps + tb + "\n".join(other) + "\n").failure_class == "divergence"
    nan = steps.replace("loss 0.088\n", "loss nan\n")
    assert "loss nan" in nan
    assert classify_text(nan + tb + "\n".join(save) + "\n").failure_class == "divergence"


def test_the_fallback_reads_a_zero_division_by_where_it_happened_and_a_code_error_by_its_type():
    scaler = _tb('  File "train.py", line 90, in <module>', "    optimizer.step()",
                 '  File "/usr/lib/python3/site-packages/apex/fp16_utils/fp16_optimizer.py", line 38, in _check_overflow',
                 "    1. / scale)", "ZeroDivisionError: float division by zero")
    r = classify_text(scaler)
    assert (r.failure_class, r.signals[0]) == ("divergence", "fallback-scaler-zero-division")
    user = _tb('  File "kd.py", line 77, in compute_weights', "    w = 1 / (k - 1)", "ZeroDivisionError: float division by zero")
    assert (classify_text(user).failure_class, classify_text(user).signals[0]) == ("environment", "fallback-setup")
    numpy2 = _tb('  File "train.py", line 9, in <module>', "    train(1, 10, np.Inf)",
                 "AttributeError: `np.Inf` was removed in the NumPy 2.0 release. Use `np.inf` instead.")
    assert classify_text(numpy2).signals[0] == "fallback-code-error" and classify_text(numpy2).failure_class == "environment"
    exp = _tb('  File "trainer.py", line 270, in train_epoch', "    math.exp(report_loss / report_tgt_words),",
              "OverflowError: math range error")
    assert classify_text(exp).failure_class == "divergence"
    assert classify_text(_tb("OverflowError: Python int too large to convert to C long")).failure_class == "environment"
    # The finite-input checks, in the plural and spelled out: numpy's asarray_chkfinite (numpy/lib/_function_base_impl.py,
    # which scipy.linalg calls) and scikit-learn's _assert_all_finite (sklearn/utils/validation.py), met when a metric or
    # an SVD gets the model's NaN outputs.
    for last in ("ValueError: array must not contain infs or NaNs",
                 "ValueError: Input y_pred contains infinity or a value too large for dtype('float32')."):
        r = classify_text(_tb('  File "eval.py", line 40, in fid', "    covmean, _ = linalg.sqrtm(sigma1.dot(sigma2))", last))
        assert (r.failure_class, r.signals[0]) == ("divergence", "fallback-numbers"), last


@pytest.mark.parametrize("tail, cls", [
    ("./run.sh: line 9: 74849 Killed: 9               python3 caltech101nin.py", "oom"),  # a macOS shell's report
    ("zsh: killed     python train.py", "oom"),
    ("RuntimeError: Couldn't open shared file mapping: <torch_21444_2977766649_500>, error code: <1455>", "oom"),
    ("There are not enough slots available in the system to satisfy the 16", "environment"),
    ("nohup: failed to run command 'CUDA_VISIBLE_DEVICES=2,5,6,7': No such file or directory", "environment"),
    ("nohup: 无法运行命令'CUDA_VISIBLE_DEVICES=2,5,6,7': 没有那个文件或目录", "environment"),
    ("queue.pl: Error, unfinished job no longer exists, log is in sge.log", "environment"),
    ("^C", "none"),
])
def test_how_shells_schedulers_and_launchers_report_a_job_they_ended(tail, cls):
    steps = "".join(f"step {i} loss {2.5 - 0.01 * i:.4f}\n" for i in range(1, 6))
    r = classify_text(steps + tail + "\n")
    assert r.failure_class == cls
    if cls == "none":  # a terminal echoes Ctrl-C as ^C: stopped on purpose, not a healthy end
        assert r.healthy_or_unrecognised == "stopped"


def test_an_option_named_after_oom_in_a_usage_dump_is_no_out_of_memory():
    usage = ("usage: pretrain_gpt.py [-h] [--num-layers NUM_LAYERS]\n"
             "                       [--max-tokens-to-oom MAX_TOKENS_TO_OOM]\n"
             "pretrain_gpt.py: error: argument --tokenizer-type: invalid choice: 'Llama2Tokenizer'\n")
    r = classify_text(usage)
    assert r.failure_class == "environment" and "out-of-memory-words" not in r.signals
    assert classify_text("step 3 loss 2.1\nRuntimeError: OOM when allocating tensor\n").failure_class == "oom"


def test_numbers_printed_without_names_are_read_for_nan():
    gan = "".join(f"{i} [{v}, 0.5] {g}\n" for i, (v, g) in enumerate([(0.69, 0.71), (0.52, 1.3), (7.7e27, "inf")] + [("nan", "nan")] * 5))
    r = classify_text(gan + "KeyboardInterrupt\n")
    assert r.failure_class == "divergence" and "nonfinite-row" in r.signals  # an interrupt after NaN stops no divergence
    assert classify_text("1\n<Figure size 640x480 with 1 Axes>\nLearned weights are [nan nan]\n").failure_class == "divergence"
    healthy = "".join(f"{i} [{0.7 - i / 100:.3f}, 0.5] {0.7 + i / 100:.3f}\n" for i in range(8))
    assert classify_text(healthy).failure_class == "none"
    # pandas prints a missing value as NaN in a table row: no training number.
    assert "nonfinite-row" not in classify_text("   epoch  loss  val_loss\n0      1  0.52       NaN\n1      2  0.41      0.44\n").signals


def test_a_best_so_far_trackers_first_improvement_from_inf_is_no_nan_loss():
    steps = "".join(f"loss decreases: {a} -> {b}\n" for a, b in [("inf", 9.78), (9.63, 9.47), (9.47, 9.1), (9.1, 8.8)])
    assert classify_text(steps).failure_class == "none"
    assert classify_text("step 1 loss 9.78\nstep 2 loss inf\nstep 3 loss inf\n").failure_class == "divergence"


def test_a_zero_loss_beside_a_full_accuracy_or_a_signed_loss_at_its_floor_is_converged():
    n = RULES.zero_loss_run + 2
    fitted = "".join(f"LR: {0.000110 - i / 1e6:.6f}, Acc: {a}, Loss: {l}\n"
                     for i, (a, l) in enumerate([("62.5000", "0.9000"), ("93.7500", "0.2000")] + [("100.0000", "0.0000")] * n))
    assert "flat-loss" not in classify_text(fitted).signals
    empty = fitted.replace("Acc: 100.0000", "Acc: 0.0000")
    assert "flat-loss" in classify_text(empty).signals  # a zero loss at zero accuracy: nothing is trained
    nll = _losses([1.6582, 0.4, -0.9, -1.5, -1.8808, -1.8790] + [-1.8778] * (RULES.flat_identical_run + 1))
    assert "flat-loss" not in _ids(nll)  # converged: flat within flat_converged_near of its lowest, far below its start
    chance = _losses([10.69, 2.0, 0.6773, 0.70] + [0.6931] * (RULES.flat_identical_run + 1))
    assert "flat-loss" in _ids(chance)  # back at ln 2 above where it had been: stuck at chance


def test_a_plateaus_print_noise_recurring_is_no_replay_and_no_stuck_weights():
    rng = [0.1064, 0.1063, 0.1062, 0.1063, 0.1063, 0.1060, 0.1061, 0.1064, 0.1062, 0.1065]
    plateau = _losses([-0.0758, -0.0899] + rng * 20)
    assert "flat-loss" not in _ids(plateau)
    # Without an epoch, the same rounded loss at the same batch index of a later epoch is no relaunch: the step
    # did not go back, so the curve is not read from a new start there.
    batches = [Metric(i + 1, "x", step=50 * (i % 8 + 1), loss=v) for i, v in enumerate([1.66, 0.5, -0.9, -1.87, -1.8781, -1.8782, -1.8781, -1.8782]
                                                                                        + [-1.8781, -1.8782, -1.8781, -1.8781, -1.8782, -1.8781, -1.8782, -1.8782])]
    assert "flat-loss" not in _ids(batches)


def test_one_term_rising_while_the_total_falls_is_a_trade_off():
    total = [9.276, 6.961, 5.9, 5.1, 4.6, 4.3, 4.183, 4.0, 3.922]
    term = [0.05, 0.024, 0.04, 0.07, 0.09, 0.11, 0.14, 0.13, 0.138]
    both = [Metric(i, "x", step=i, loss=t, named={"loss:loss 1": d}) for i, (t, d) in enumerate(zip(total, term), 1)]
    assert "loss-rise" not in _ids(both)
    rising = [Metric(i, "x", step=i, loss=3.9 + i / 100, named={"loss:loss 1": d}) for i, d in enumerate(term, 1)]
    assert "loss-rise" in _ids(rising)  # the total did not fall: the term's rise is the run's


def test_a_loss_scale_that_grows_back_above_the_floor_was_a_transient():
    floor = RULES.loss_scale_floor
    back = [Metric(1, "a", loss_scale=128.0), Metric(2, "b", loss_scale=floor, scale_cut=True), Metric(3, "c", loss_scale=floor * 2)]
    assert "loss-scale-collapse" not in _ids(back)
    assert "loss-scale-collapse" in _ids(back + [Metric(4, "d", loss_scale=floor, scale_cut=True)])


def test_nan_in_an_indexed_metric_counts():
    # A DDPG agent's actions printed per actuator (dev, retired blind 22 ua-009): `Action [6]: -nan`.
    ends = "entering control step\nAction [6]: 12\nentering control step\nAction [6]: -nan\nentering control step\nAction [7]: -nan\n"
    assert "nonfinite-metric" in _find_ids(ends)
    assert "nonfinite-metric" not in _find_ids(ends.replace("-nan", "12"))


def _ppo_table(kls: list[float], ent: str = "-1.1") -> str:
    rows = []
    for i, kl in enumerate(kls, 2):
        rows.append("---------------------------------------\n| time/                   |           |\n"
                    f"|    iterations           | {i:<9} |\n| train/                  |           |\n"
                    f"|    approx_kl            | {kl:<9} |\n|    entropy_loss         | {ent:<9} |\n"
                    f"|    loss                 | {0.5 + i * 0.01:<9.3f} |\n|    n_updates            | {10 * i:<9} |\n"
                    "---------------------------------------")
    return "\n".join(rows) + "\n"


def test_a_ppo_update_that_moves_the_policy_by_tens_of_nats_is_a_blowup_even_first():
    # SB3 PPO at learning rate 0.2 (dev, retired blind 21 sb-008): the first update's approx_kl is 86, the policy collapses.
    assert "kl-blowup" in _find_ids(_ppo_table([86.03548, 0.0, 0.0, 0.0]))
    # The healthy PPO runs of the corpus stay under 1.7 (dev b21sb-020), and a KL with no small one before it is no blowup
    # below kl_first_max; a VAE's KL term (not PPO's sampled estimate) is no policy at all.
    assert "kl-blowup" not in _find_ids(_ppo_table([1.67, 0.9, 1.2, 0.8]))
    assert "kl-blowup" not in _find_ids("".join(f"epoch {i} recon_loss: 0.5 kl_loss: {40 + i}\n" for i in range(12)))


def test_a_scale_that_never_held_a_scalers_value_is_no_loss_scale():
    # PaddleOCR's config dump (dev, retired blind 21 sa-022): a backbone's `scale : 0.75` under `scale : 1./255.`;
    # PaddleClas' `scale_loss : 128.0` is another name than its transforms' `scale : 1.0/255.0` (sa-007).
    dump = "    scale_loss : 128.0\n" + "".join("        scale : 1.0/255.0\n        scale : 0.75\n" for _ in range(3))
    assert "loss-scale-collapse" not in _find_ids(dump)
    # A scaler's own values are powers of two, down to its floor (an excerpt may start below 1).
    assert "loss-scale-collapse" in _find_ids("".join(f"step {i} loss 2.3 scale: {v}\n" for i, v in enumerate([1024, 64, 0.5, 0.25, 0.125])))


def test_a_huge_grad_norm_among_the_scalers_skipped_steps_that_the_run_came_back_from_is_a_transient():
    # HF Trainer, Llama-3-8B SFT (dev, retired blind 22 ub-020): `inf` grad norms and one 1.67e18, then norms of 2-100
    # for 30 logs while the loss falls from 1.64 to 1.2.
    head = [f"{{'loss': 1.66, 'grad_norm': inf, 'learning_rate': 5e-06, 'epoch': 0.0{i}}}" for i in range(1, 4)]
    big = ["{'loss': 1.639, 'grad_norm': 1.6703731171149742e+18, 'learning_rate': 9.9e-06, 'epoch': 0.11}"]
    after = [f"{{'loss': {1.6 - i * 0.02:.4f}, 'grad_norm': {2 + i % 3}.5, 'learning_rate': 9e-06, 'epoch': {0.12 + i / 100:.2f}}}"
             for i in range(12)]
    assert "grad-norm-explosion" not in _find_ids("\n".join(head + big + after) + "\n")
    r = classify_text("\n".join(head + big + after) + "\n")
    assert r.failure_class == "none" and "grad-norm-explosion" in r.reason
    # Too few norms after it, or a loss that climbed past the one beside it: the explosion stands.
    assert "grad-norm-explosion" in _find_ids("\n".join(head + big + after[:5]) + "\n")
    worse = [a.replace("'loss': 1.", "'loss': 3.") for a in after]
    assert "grad-norm-explosion" in _find_ids("\n".join(head + big + worse) + "\n")


def test_an_error_level_glued_with_hyphens_is_a_failure_line():
    # `%(asctime)s -%(name)s-%(levelname)s-%(module)s:%(message)s` (dev, retired blind 22 ua-011, a Keras script).
    last = "2018-09-16 19:43:19,388 -keras_dpm-ERROR-transfer_learning:unsupported operand type(s) for //: 'str' and 'int'\n"
    assert classify_text("2018-09-16 17:42:36,365 -keras_dpm-INFO-transfer_learning:start\n" + last).failure_class == "environment"
    assert classify_text("2018-09-16 17:42:36,365 -keras_dpm-INFO-transfer_learning:start\n"
                         + last.replace("-ERROR-", "-INFO-")).failure_class == "none"


def test_a_loop_that_prints_each_runs_caught_error_failed_when_no_run_went_on():
    # An experiment loop whose every run failed on the API's balance (dev, retired blind 22 ua-015).
    runs = "".join(f"INFO:ours:|2024-08-23 21:53:27| Run {i} Error: account balance insufficient\n" for i in range(4))
    assert classify_text("INFO:ours:|2024-08-23 21:53:27| Experiment Start\n" + runs).failure_class == "environment"
    went = "".join(f"epoch {i} loss {2 - i / 10:.2f}\n" for i in range(12))
    assert classify_text(runs + went).failure_class == "none"


def test_a_training_bar_drawn_after_a_failed_optional_cell_went_on():
    # A Colab notebook (dev, retired blind 22 ua-022): a resume cell's FileNotFoundError, then the training cell's bar.
    err = ("FileNotFoundError                         Traceback (most recent call last)\n<ipython-input-13> in <cell line: 2>()\n"
           "FileNotFoundError: [Errno 2] No such file or directory: '/content/drive/MyDrive/w.pth'\n")
    bar = "Epoch 0:   5%|▍         | {n}/1441 [01:22<27:21,  1.20s/batch, gan_loss=0.069, loss=10.7, mse_loss=0.78]\n"
    assert classify_text(err + bar.format(n=68)).failure_class == "none"
    assert classify_text(err + bar.format(n=3)).failure_class == "environment"  # too few steps to say it went on
    assert classify_text(bar.format(n=68) + err).failure_class == "environment"


def test_a_settings_block_in_a_config_dump_holds_no_losses():
    # A yacs config printed after training (dev, retired blind 21 sb-007): `LOSS_WEIGHTS:` then `loss_jloc: 8.0`.
    records = "".join(f"epoch: {i} iter: 45 loss: {0.99 - i / 100:.4f} loss_jloc: {0.0158 - i / 10000:.4f}\n" for i in range(12))
    dump = "MODEL:\n  DEVICE: cuda\n  LOSS_WEIGHTS:\n    loss_afm: 0.1\n    loss_jloc: 8.0\n  NAME: HRNet48v2\n"
    assert classify_text(records + dump).failure_class == "none"
    assert classify_text(records + dump.replace("LOSS_WEIGHTS:", "LOSSES:")).failure_class == "divergence"


def test_a_ppo_value_loss_that_grows_while_the_value_head_explains_the_returns_is_no_divergence():
    # SB3 PPO on Super Mario without episode stats (dev, retired blind 21 sb-014): the loss climbs from 0.05 to 20-200
    # while explained_variance stays near 0.9.
    def table(loss, ev):
        return (f"-----------------\n| train/ | |\n|    explained_variance   | {ev} |\n|    loss                 | {loss} |\n"
                f"|    value_loss           | {loss * 2} |\n-----------------\n")
    losses = [0.05, 0.06, 0.05, 0.04, 0.05, 0.06, 0.05, 0.07] + [20.0 + 5 * (i % 4) for i in range(16)]
    assert classify_text("".join(table(v, 0.9) for v in losses)).failure_class == "none"
    assert classify_text("".join(table(v, 0.05) for v in losses)).failure_class == "divergence"


def test_a_failure_before_a_trainers_start_banner_belongs_to_an_earlier_launch():
    # PaddleOCR's workerlog.0 collects every launch (dev, retired blind 21 sa-022): an OOM, then a relaunch training on.
    oom = ("Error Message Summary:\n----------------------\nResourceExhaustedError: \n\nOut of memory error on GPU 0. Cannot "
           "allocate 46.875000MB memory on GPU 0, 3.999512GB memory has been allocated and available memory is only 0.000000B.\n")
    relaunch = ("[2026/05/05 17:53:01] ppocr INFO: Architecture : \n[2026/05/05 17:53:01] ppocr INFO:     Backbone : \n"
                "[2026/05/05 17:53:07] ppocr INFO: epoch: [26/50], global_step: 10, lr: 0.000053, loss: 0.864222\n"
                "[2026/05/05 17:53:11] ppocr INFO: epoch: [26/50], global_step: 20, lr: 0.000053, loss: 0.838551\n")
    assert classify_text(oom + relaunch).failure_class == "none"
    assert classify_text(relaunch + oom).failure_class == "oom"
    hf = "***** Running training *****\n  Num examples = 100\n{'loss': 2.1, 'epoch': 0.1}\n"
    assert classify_text(oom + hf).failure_class == "none"


@pytest.mark.parametrize("name", ["none--b19qa-013.log", "none--b20qf-006.log", "none--b20qf-007.log",
                                  "environment--b16jb-005.log", "none--dev19rb-010.log"])
def test_progress_redraws_read_alike_with_their_carriage_returns_kept_turned_into_line_ends_or_dropped(name):
    # Tools turn tqdm's carriage returns into line ends (a CI runner's log, a notebook export) or drop them (a web
    # page's copy, GitHub's file view): each redraw then shows one postfix over many steps, or the redraws glue end to
    # end. Either way the run is the same run. (Five development logs that a first reading of the turned forms got wrong.)
    text = (LOGS / name).read_bytes().decode("utf-8", "replace").replace("\r\n", "\n")
    kept = classify_text(text).failure_class
    assert classify_text(text.replace("\r", "\n")).failure_class == kept
    assert classify_text(text.replace("\r", "")).failure_class == kept


def test_glued_redraws_are_read_as_their_last():
    from finetune_mcp.triage.parse import clean_line
    glued = "".join(f"epoch 41/50, batch {b}/2501, loss 0.0{b % 90 + 10:02d}" for b in range(1, 400, 20))
    assert clean_line(glued) == "epoch 41/50, batch 381/2501, loss 0.031"
    plain = "x" * 20 + " ".join(f"{i}" for i in range(200))  # a long line that does not repeat its start
    assert clean_line(plain) == plain


@pytest.mark.parametrize("name", ["env-nccl-watchdog-timeout-zero3.log", "oom-colab-kernel-restarted-tcmalloc-large-alloc.log",
                                  "oom--tf115-windows-training-bfc-inuse-chunks.log", "divergence--dev3d-024.log",
                                  "none--dev5f-002.log",
                                  # short captures, one or two lines at the window's width (fourteenth round)
                                  "environment--dev11t-011.log", "environment--b19qd-002.log", "oom-nvml-assert-large-alloc.log",
                                  "environment--b24xa-007.log"])
def test_a_log_captured_from_an_80_column_terminal_reads_as_the_log(name):
    # tmux / screen captures and copies from a terminal window break each long line into pieces of the window's width.
    # (Five development logs whose 80-column capture f3d253d read as another class.)
    text = (LOGS / name).read_bytes().decode("utf-8", "replace").replace("\r\n", "\n")
    wrapped = "\n".join(ln[i:i + 80] for ln in text.split("\n") for i in range(0, max(len(ln), 1), 80))
    assert classify_text(wrapped).failure_class == classify_text(text).failure_class


@pytest.mark.parametrize("name", ["divergence-dreamer-pytorch-named-losses-nan-table.log", "none--b20qg-002.log",
                                  "divergence--dev12y-013.log", "divergence--dev5h-029.log"])
def test_records_printed_to_one_width_are_not_a_wrapped_capture(name):
    # A fixed-format line per step (caffe's solver, a numpy loop's `Iteration    0: Cost ...`, a logger's records, a
    # table's rows): each such line is followed by another that starts as it does, which a wrap's continuation is not.
    from finetune_mcp.triage.parse import wrap_width
    lines = (LOGS / name).read_bytes().decode("utf-8", "replace").replace("\r\n", "\n").split("\n")
    assert wrap_width(lines) is None


def test_a_signal_named_as_the_shell_reports_it_ends_the_job():
    # An LSF job's stderr (dev 22, ya-005): bars, then bash's report of SIGUSR2, the signal LSF sends at the run limit.
    bars = "".join(f"sampling:  {i}%|█         | {i}/100 [00:00<00:00, 138.52it/s]\n" for i in range(10, 100, 10))
    assert classify_text(bars + "User defined signal 2\n").failure_class == "environment"
    assert classify_text(bars + "Epoch 3 was a user defined signal 2 of progress\n").failure_class == "none"


def test_a_shell_that_could_not_start_the_command_failed_the_job():
    # The whole log of dev 22 ya-021: the launcher script's path was wrong.
    assert classify_text("bash: /lstm_train.bash: No such file or directory\n").failure_class == "environment"
    assert classify_text("bash: line 3: torchrun: command not found\n").failure_class == "environment"
    went = "bash: warn.sh: No such file or directory\n" + "".join(f"epoch {i} loss {2 - i / 10:.2f}\n" for i in range(12))
    assert classify_text(went).failure_class == "none"


def test_a_scripts_own_shell_error_and_parsers_that_refused_the_command_line_failed_the_job():
    # Retired blind 24: bash names the script it runs (xa-007), argparse a prog of the script's choosing (xb-006),
    # Hydra a config directory that is not there (xa-022).
    banner = "nohup: ignoring input\n==========\nBaseline run\n==========\n"
    assert classify_text(banner + "./scripts/run_baseline.sh: line 27: cd: /home/u/state: No such file or directory\n"
                         ).failure_class == "environment"
    assert classify_text(banner + "Loading /home/u/state: no such run yet, starting fresh\n").failure_class == "none"
    usage = "usage: ConvNeXt training and evaluation script [-h] [--batch_size BATCH_SIZE]\n"
    assert classify_text(usage + "ConvNeXt training and evaluation script: error: unrecognized arguments: --lr0 3\n"
                         ).failure_class == "environment"
    assert classify_text(usage + "changelog: the old launcher's error: unrecognized arguments: --lr0 is fixed\n").failure_class == "none"
    hydra = ("Primary config directory not found.\nCheck that the config directory '/home/u/case_studies/z/' exists and "
             "readable\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")
    assert classify_text("nohup: ignoring input\n" + hydra).failure_class == "environment"
    # Hydra's line under an exception no other rule names still fails the run, by the fallback
    assert classify_text("epoch 1 loss 2.1\nKeyError: 'lr'\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete "
                         "stack trace.\n").failure_class == "environment"


def test_a_wandb_sweep_agent_stopped_by_ctrl_c_is_a_deliberate_stop():
    # Retired blind 24 xc-016: a sweep run's loss lines, then the agent's own words for the keystroke.
    rows = "".join(f"0m {i}s (- 14m 1s) ({i * 100} {i}%) {2.9 - i / 50:.4f}\n" for i in range(1, 8))
    r = classify_text(rows + "\x1b[34m\x1b[1mwandb\x1b[39m\x1b[22m: Ctrl + C detected. Stopping sweep.\n")
    assert (r.failure_class, r.healthy_or_unrecognised, r.signals) == ("none", "stopped", ["user-interrupt"])


def test_a_trackers_thread_dying_after_training_ran_to_its_end_is_no_failure():
    # Development 23 yc-010: Lightning's fit ends, the test runs, wandb syncs; then wandb's network-status thread
    # dies on the closed socket.
    fit = "".join(f"Epoch {e}: 100%|##########| 10/10 [00:01<00:00, loss=0.{9 - e}]\n" for e in range(3))
    done = "`Trainer.fit` stopped: `max_epochs=3` reached.\nwandb: Find logs at: ./wandb/run-1/logs\n"
    thread = ("Exception in thread NetStatThr:\nTraceback (most recent call last):\n"
              "  File \"/env/lib/python3.10/site-packages/wandb/sdk/lib/sock_client.py\", line 130, in _sendall_with_error_handle\n"
              "    sent = self._sock.send(data)\nBrokenPipeError: [Errno 32] Broken pipe\n")
    assert classify_text(fit + done + thread).failure_class == "none"
    assert classify_text(fit + thread).failure_class == "environment"  # no end of training before it
    main = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n    save()\nOSError: disk quota exceeded\n"
    assert classify_text(fit + done + thread + main).failure_class == "environment"  # the main program failed too


def test_kaldis_error_level_and_mpis_abort_fail_the_job():
    # Seventh wordings list: Kaldi's KALDI_ERR format and Open MPI's report of a rank that exited non-zero.
    kaldi = ("ERROR (nnet3-chain-train[5.5.1068~1-4b9ee]:SelectGpuId():cu-device.cc:214) Failed to create CUDA context, "
             "no more unused GPUs?\n")
    assert classify_text("LOG (nnet3-chain-train[5.5]:main():nnet3-chain-train.cc:72) Reading model\n" + kaldi
                         ).failure_class == "environment"
    assert classify_text("LOG (nnet3-chain-train[5.5]:main():x.cc:72) no ERROR (x) here\n").failure_class == "none"
    mpi = ("Primary job  terminated normally, but 1 process returned\na non-zero exit code. Per user-direction, the job has "
           "been aborted.\n")
    assert classify_text("epoch 1 loss 0.5\n" + mpi).failure_class == "environment"


def test_a_hand_written_loops_own_words_for_its_numbers():
    # Development 23 yd: a CUDA C++ trainer's NaN check stops the run (003); a C++ network prints its training error as
    # `Error: 0.000099999` after converging (007); a NaN check that skips the batch goes on (dev8e-016).
    assert classify_text("step 0\nnan loss caught... printing graph and stopping\nmake: *** [run] Error 1\n").failure_class == "divergence"
    skipped = "".join(f"epoch {e} loss {1 - e / 20:.3f}\n" for e in range(12))
    assert classify_text("[WARNING] NaN loss detected! Skipping batch.\n" + skipped).failure_class == "none"
    rows = "".join(f"Iteration: {i}\tError: {0.2 / i:.9f}\n" for i in range(100, 2000, 100))
    converged = "\nSUCCESS: Model converged after 16773 iterations!\nError: 0.000099999\n\nFinal truth table:\n"
    assert classify_text(rows + converged).failure_class == "none"
    assert classify_text(rows + "Error: could not open weights.bin\n").failure_class == "environment"


def test_old_torchs_terse_host_allocation_failure_is_oom():
    # Retired blind 24 xa-012: PyTorch 0.4 on CPU, loss.backward() -> "RuntimeError: can't alloc", after a loss that
    # rose (the rise is the runner-up, the allocator decides).
    rows = "".join(f"iter {i} loss {0.5 + i / 10:.2f}\n" for i in range(30))
    frame = "Traceback (most recent call last):\n  File \"train.py\", line 82, in <module>\n    loss.backward()\n"
    r = classify_text(rows + frame + "RuntimeError: can't alloc\n")
    assert r.failure_class == "oom" and "cpu-allocator-oom" in r.signals
    assert classify_text(rows + frame + "RuntimeError: can't alloc more workers\n").failure_class != "oom"


def test_numbas_object_mode_warning_quoting_a_typing_error_is_no_failure():
    # Retired blind 24 xa-011: numba's warning quotes, indented, the typing errors it fell back from; training goes on.
    warning = ("/w/geometry.py:229: NumbaWarning: \x1b[1m\nCompilation is falling back to object mode WITH looplifting "
               "enabled because Function \"points_in_convex_polygon_jit\" failed type inference due to: No implementation\n"
               "\x1b[1m   - Of which 2 did not match due to:\n   Rejected as the implementation raised a specific error:\n"
               "      NumbaTypeError: \x1b[1mUnsupported array index type list(int64)\x1b[0m\n"
               "     TypingError: Failed in nopython mode pipeline (step: nopython frontend)\n"
               "  raised from /usr/lib/numba/core/typing/arraydecl.py:102\n")
    rows = "".join(f"2024-04-12 04:18:{i:02d},968 - INFO - epoch[1][{i * 20}/1856]: lr: 0.0003, loss: {40 / i:.3f}\n"
                   for i in range(1, 5))
    assert classify_text(warning + rows).failure_class == "none"
    # the same typing error raised, unindented, is the run's failure
    assert classify_text(rows + "numba.core.errors.TypingError: Failed in nopython mode pipeline (step: nopython frontend)\n"
                         ).failure_class == "environment"


def test_a_caught_error_before_the_scripts_own_training_complete_line_did_not_end_the_run():
    # dev 22 ya-003: a missing config file, "using default", rewards per step, then "Completed training!".
    head = "Error:  [Errno 2] No such file or directory: 'config/conf.json'\nloading form config failed: using default\n"
    body = "".join(f"Step {i} reward {i / 10}\n" for i in range(5))
    assert classify_text(head + body + "Completed training!\n").failure_class == "none"
    assert classify_text(head + body).failure_class == "environment"


def test_a_runs_own_collapse_guard_is_divergence():
    # dev 22 ya-018: an SAC trainer's guard stops the run when the policy's log-probability turns positive.
    guard = "[EARLY STOP] log_pi +0.003 > 0.0 at step 130,954. Policy collapsed. Saving emergency checkpoint.\n"
    assert classify_text("step 130000 critic_loss 0.52\n" + guard + "Training complete.\n").failure_class == "divergence"


def test_an_interval_setting_of_inf_in_a_config_dict_is_no_metric():
    # DeepSpeed's config printed by a fine-tuning script (dev 22 ya-008): `'steps_per_print': inf`.
    cfg = "ds_config: {'train_batch_size': 'auto', 'gradient_clipping': 1.0, 'steps_per_print': inf, 'bf16': {'enabled': True}}\n"
    assert "nonfinite-metric" not in _find_ids(cfg)
    assert "nonfinite-metric" in _find_ids("step 10 | q_value: 3.2 | value_estimate: inf\n")


def test_a_discriminator_that_wins_within_its_first_logs_still_won():
    # Retired blind 25 zc-011: a conditional GAN's D loss falls from 0.105 to 0.004 in three epochs and to 6e-13 by the
    # end, while G climbs from 1.87 to 27.4: the median of D's first ten values is already near 0, the first is not.
    rows, d, g = [], 0.105, 1.87
    for e in range(60):
        rows.append(f"Epoch [{e + 1}/60]  Loss D: {d:.6g}, Loss G: {g:.6g}\n")
        d, g = d * 0.3, min(g + 1.5, 27.4)
    assert classify_text("".join(rows)).failure_class == "divergence"
    # a D that sat near 0 from its first log on is a scale of its own, not a game it won
    flat = "".join(f"Epoch [{e + 1}/60]  Loss D: {0.005 / (e + 1):.6g}, Loss G: {1.87 + e / 2:.6g}\n" for e in range(60))
    assert "discriminator-won" not in classify_text(flat).signals


def test_a_printed_history_of_every_epochs_loss_is_no_new_record():
    # Retired blind 25 zb-015: Keras' fit ends at loss 0.0871, then the notebook prints History.history, whose list
    # opens on epoch 1's loss (2.38): no rise.
    bars = "".join(f"Epoch {e}/35\n60/60 [==============================] - 2282s 38s/step - loss: {2.4 / e:.4f} - "
                   f"accuracy: 0.9\n" for e in range(1, 36))
    history = "{'loss': [2.3796660900115967,\n  2.312483549118042,\n  2.313373565673828,\n  0.0871],\n 'val_loss': [1.9,\n  1.5]}\n"
    assert classify_text(bars + history).failure_class == "none"
    # the same under srun's task label (`0: `), which stays on a line that starts with a number: the evaluate() bar
    # after fit is still an evaluation
    labelled = "\n".join("0: " + ln for ln in (bars + "19/19 [==============================] - 248s 13s/step - loss: 1.3188\n"
                                                + history).split("\n"))
    assert classify_text(labelled).failure_class == "none"
    # a list-valued key holds no value of this step; a bracketed single value still does
    assert parse_line(Metric(1, "x"), KEYS, "{'loss': [2.37, 2.31, 2.30]}").loss is None
    assert parse_line(Metric(1, "x"), KEYS, "step 3 loss: [2.37]").loss == 2.37
    # one value per parameter group (DeepSpeed's `lr=[0.001, 0.001]`) is this step's
    assert parse_line(Metric(1, "x"), KEYS, "[Rank 0] step=2000, skipped=1995, lr=[0.001, 0.001], mom=[0.0, 0.0]").lr == 0.001


def test_a_failed_install_in_a_notebook_that_later_cells_ran_past_did_not_end_it():
    # Retired blind 25 zc-018 (a Windows notebook): pip fails to build tensorflow-gpu, later cells train a DCGAN, and the
    # user interrupts the training cell (ipykernel's cell file under a Windows temp folder).
    pip = ("  Building wheel for tensorflow-gpu (setup.py): finished with status 'error'\n  error: subprocess-exited-with-error\n"
           "  ERROR: Failed building wheel for tensorflow-gpu\nerror: legacy-install-failure\n")
    cell = ("Time for epoch 2 is 761.27 sec\n\x1b[1;31mKeyboardInterrupt\x1b[0m                         Traceback (most recent call last)\n"
            "\x1b[1;32m~\\AppData\\Local\\Temp\\ipykernel_6156\\1376251600.py\x1b[0m in \x1b[0;36m?\x1b[1;34m()\x1b[0m\n"
            "\x1b[1;32m----> 1\x1b[1;33m gan.train(data,10)\n\x1b[1;31mKeyboardInterrupt\x1b[0m: \n")
    r = classify_text(pip + cell)
    assert (r.failure_class, r.healthy_or_unrecognised) == ("none", "stopped")
    # the same install failing in a script (no cell ran after it) is the job's failure
    assert classify_text(pip + "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
                         "KeyboardInterrupt\n").failure_class == "environment"


def test_a_sigkill_named_as_a_setting_in_a_config_dump_is_no_kill():
    # Retired blind 25 zd-007: NeMo's exp_manager prints its settings, among them the signal it would send a hung rank.
    cfg = ("[NeMo I 2025-03-03 12:35:37 exp_manager:470] {'explicit_log_dir': None, 'rank_termination_signal': "
           "<Signals.SIGKILL: 9>, 'log_level': 'INFO'}\n")
    r = classify_text(cfg + "TypeError: `model` must be a `LightningModule` or `torch._dynamo.OptimizedModule`, got "
                      "`EncDecCTCModel`\n")
    assert r.failure_class == "environment" and "sigkill-in-log" not in r.signals
    assert classify_text("epoch 1 loss 2.0\nprocess 0 died with <Signals.SIGKILL: 9>\n").failure_class == "oom"


def test_detectron2s_environment_report_of_its_own_extension_is_no_failure():
    # Retired blind 25 zd-011: collect_env's row at start-up; the run trains and evaluates after it.
    row = ("detectron2._C           not built correctly: /opt/conda/lib/python3.7/site-packages/detectron2/_C.cpython-37m-"
           "x86_64-linux-gnu.so: undefined symbol: _ZNK2at6Tensor4add_ERKS0_RKN3c106ScalarE\n")
    after = "[08/19 14:34:43] d2.engine.train_loop INFO: Starting training from iteration 90000\n"
    assert classify_text(row + after).failure_class == "none"
    assert classify_text("ImportError: /x/_C.so: undefined symbol: _ZNK2at6Tensor4add_ERKS0_RKN3c106ScalarE\n").failure_class == "environment"


def test_a_job_script_whose_last_step_lacks_its_input_failed():
    # Retired blind 25 za-012: training ran to its step limit, then the pipeline's next step could not copy its input.
    rows = "".join(f"INFO:__main__:epoch 0 | global step {s} | mode validation | loss {3 - s / 1000:.4f}\n" for s in range(0, 3100, 256))
    assert classify_text(rows + "cp: cannot stat ‘Output/bt_init/zh-en.de.val’: No such file or directory\n").failure_class == "environment"
    # a step that lacked its input before training went on did not end the run
    went = "mkdir: cannot create directory ‘out’: File exists\n" + rows
    assert classify_text(went).failure_class == "none"


def test_a_loss_scale_that_halved_and_then_grew_back_was_a_transient():
    # Development 28 yh-005: four apex ranks report each cut (glued lines repeat a value, which reads as the scale
    # holding), the scale halves 8192 -> 32, then grows to 128 and 512, and the run ends on its evaluation.
    cut = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {:.1f}"
    glued = cut + cut + "\n"  # two ranks' lines glued (no newline between them), as the log has them
    lines = "".join(cut.format(v) + "\n" for v in (32768, 16384, 8192)) + glued.format(8192, 8192) + cut.format(8192) + "\n"
    lines += "".join(cut.format(v) + "\n" for v in (4096, 2048, 1024, 512, 256, 128, 64, 32))
    grew = "".join(cut.format(v) + "\n" for v in (128, 64, 512, 256))
    assert "loss-scale-halving" in classify_text(lines).signals
    assert "loss-scale-halving" not in classify_text(lines + grew).signals


def test_a_loss_at_its_prints_last_digit_is_rounded_not_exactly_zero():
    # Development 28 yf-011: gunpowder prints `loss=0.000000` between `loss=0.000001`s for thousands of iterations.
    row = "INFO:gunpowder.nodes.generic_train:Train process: iteration={} loss={} time=2.41\n"
    tiny = "".join(row.format(18000 + i, "0.000001" if i % 7 == 0 else "0.000000") for i in range(60))
    assert "flat-loss" not in classify_text(tiny).signals
    # a loss of exactly 0 with no tiny value beside it is still nothing being trained
    zeros = "".join(row.format(18000 + i, "0.000000") for i in range(60))
    assert "flat-loss" in classify_text(zeros).signals


def test_yarns_diagnostics_of_an_application_its_user_killed_is_a_deliberate_stop():
    # Development 28 yg-003: a TensorFlow-on-YARN launcher's client log ends on the resource manager's diagnostics.
    client = ("19/11/03 12:29:36 INFO client.Client: Application application_1563433337431_19629206 finished with state "
              "KILLED at 1572755376685\nApplication killed by user.\n")
    r = classify_text("19/11/03 12:22:10 INFO client.Client: Submitting application\n" + client)
    assert (r.failure_class, r.healthy_or_unrecognised) == ("none", "stopped")


def test_a_line_that_happens_to_be_a_windows_width_is_not_joined_to_the_next():
    # Development dev9f-021: its first line (bash's complaint) is 120 characters long; the traceback after it starts a
    # line of its own, as a wrap's continuation (the rest of a word or a path) does not.
    lines = (LOGS / "environment--dev9f-021.log").read_text().splitlines()
    assert len(lines[0]) == 120 and lines[1].startswith("Traceback")
    assert wrap_width(lines) is None
    # the same line followed by the rest of a path is a capture's cut
    assert wrap_width([lines[0][:100], lines[0][100:] + "/x", lines[1]]) == 100


def test_caffes_test_net_outputs_are_test_losses():
    # Development 29 yi-005: an AM-softmax face model; the train net's loss stays near 5.5 (a margin by design), the
    # test net's output under the same name is near 1.1 - no rise from a minimum of 1.1 to 5.
    rows = []
    for it in range(150000, 160000, 500):
        v = 5.2 + (it * 7919 % 997) / 2000  # noisy, never recurring
        rows.append(f"I1201 13:21:02.921859  2928 solver.cpp:224] Iteration {it} (3.6 iter/s, 277.1s/1000 iters), loss = {v:.5f}\n")
        rows.append(f"I1201 13:21:02.922086  2928 solver.cpp:243]     Train net output #0: softmax_loss = {v:.5f} "
                    f"(* 1 = {v:.5f} loss)\n")
        if it % 1000 == 0:
            rows.append("I1201 13:19:02.250685  2928 solver.cpp:403]     Test net output #1: softmax_loss = 1.13505 "
                        "(* 1 = 1.13505 loss)\n")
    r = classify_text("".join(rows))
    assert r.failure_class == "none" and "loss-rise" not in r.signals
    test = parse_text("I1201 13:19:02.250685  2928 solver.cpp:403]     Test net output #1: softmax_loss = 1.13505 (* 1 = 1.13505 "
                      "loss)\n", KEYS)[0]
    assert test.named == {"eval_loss:softmax loss": 1.13505}  # a named test loss, no point of the training curve


def test_an_unbounded_limit_in_a_config_dump_is_no_metric():
    # Retired blind 27 zh-001: PySlowFast pretty-prints its yacs config one key a line before a KeyError ends the run.
    dump = "{'DATA': {'DECODING_BACKEND': 'pyav',\n          'DELTA_CLIPS_MAX': inf,\n          'DELTA_CLIPS_MIN': -inf,\n" \
           "          'NUM_FRAMES': 16},\n"
    r = classify_text(dump + "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\nKeyError: 'multi_cam_padding'\n")
    assert "nonfinite-metric" not in r.signals and r.failure_class == "environment"
    # a metric printed beside its step is a measurement, whatever its sign
    assert "nonfinite-metric" in classify_text("step 10 | elbo: -1.2\nstep 20 | elbo: -inf\n").signals


def test_a_metric_that_flickers_between_nan_and_a_number_is_a_mean_over_nothing():
    # Retired blind 27 zh-007: per-organ Dice scores print `nan` for an organ absent from an epoch's validation
    # batch and a number the next epoch; the losses beside them stay finite.
    def epoch(e, eye):
        return (f"Val Epoch {e}, iter 1, total time 21.8, loss {10 - e / 50:.6f}\n"
                f"Brainstem :  {0.2 + e / 1000:.4f} , \nEye_AL :  {eye} , \n")
    flicker = "".join(epoch(e, "nan" if e % 3 == 0 else f"{0.25 + e / 1000:.4f}") for e in range(1, 31))
    assert "nonfinite-metric" not in classify_text(flicker).signals
    # a metric that turns NaN and stays NaN is the run's numbers going wrong, even after it flickered
    stays = "".join(epoch(e, "nan" if e > 20 else f"{0.25 + e / 1000:.4f}") for e in range(1, 31))
    assert "nonfinite-metric" in classify_text(stays).signals
    assert "nonfinite-metric" in classify_text(flicker[:flicker.index("Val Epoch 21,")] + stays[stays.index("Val Epoch 21,"):]).signals


def test_keras_3_bars_drawn_with_equals_signs_are_redraws_mid_epoch():
    # Retired blind 27 zi-015: a Windows PowerShell capture of Keras 3's fit keeps every redraw of the bar (drawn with
    # `=` there), and its running mean sits at 0.0875 for the epoch's last twenty batches.
    def bar(n, v):
        return f"\x1b[1m{n}/143\x1b[0m \x1b[32m{'=' * (n * 20 // 143)}\x1b[0m\x1b[37m{'=' * (20 - n * 20 // 143)}\x1b[0m " \
               f"\x1b[1m{(143 - n) * 2}s\x1b[0m 2s/step - accuracy: 0.9731 - loss: {v:.4f}\r\n"
    text = "".join(bar(n, 0.0875 if n > 120 else 0.0900 - n / 50000) for n in range(100, 144))
    text += "\x1b[1m143/143\x1b[0m \x1b[32m====================\x1b[0m 346s 2s/step - accuracy: 0.9746 - loss: 0.0858\r\n"
    assert "flat-loss" not in classify_text(text).signals


def test_keras_3s_last_bar_drawn_to_its_total_closes_the_fit():
    # Development 23 yc-003 (Keras 3 in a notebook, `━`) and retired blind 27 zi-015 (the same bar in `=`): the line
    # after the last epoch's header is its bar at its total - the fit ran to its end.
    for bar in ("━" * 20, "=" * 20):
        text = f"Epoch 8/8\n\x1b[1m1105/1105\x1b[0m \x1b[32m{bar}\x1b[0m\x1b[37m\x1b[0m \x1b[1m7700s\x1b[0m 7s/step - acc: 0.9844 - loss: 0.0436\n"
        assert find(text).finished_at == 2
        assert find(text.replace("1105/1105", "1104/1105")).finished_at is None


def test_a_loss_that_prints_minus_zero_is_a_signed_value_rounded():
    # Retired blind 27 zj-006: a toy PPO RLHF loop's surrogate loss averages about 0 and prints `-0.0000` and `0.0000`.
    text = (LOGS / "none--b27zj-006.log").read_text()
    assert "Avg Loss: -0.0000" in text and "flat-loss" not in classify_text(text).signals
    # the same log with every loss printed 0.0000 is a zero run
    assert "flat-loss" in classify_text(text.replace("-0.0000", "0.0000")).signals


def test_tensorboardx_nan_warning_in_a_ray_tune_log_names_nothing():
    # Retired blind 27 zj-009: RLlib under Tune; Tune's TensorBoard logger writes every number of a result, reward means
    # over no finished episode among them, and tensorboardX warns on the root logger.
    status = ("== Status ==\nMemory usage on this node: 26.1/62.8 GiB\nNumber of trials: 1 (1 RUNNING)\n"
              "| PPO_PommeMultiAgent-1vs1_00000 | RUNNING  | 10.0.0.21:343746 |     46 |          1187.22 | 1884160 |  -1.5329 |\n")
    warn = "WARNING:root:NaN or Inf found in input tensor.\n"
    assert "tensorboard-nonfinite" not in classify_text(status + warn + status).signals
    r = classify_text("epoch 3 step 300 train loss 2.1\n" + warn * 3)
    assert "tensorboard-nonfinite" in r.signals and r.failure_class == "divergence"


def test_a_bce_loss_at_exactly_its_clamp_is_every_prediction_saturated():
    # Retired blind 27 zm-003: a DCGAN notebook; D falls toward 0 and G reads exactly 100.0, BCELoss's clamp.
    rows = [(0.1808454841375351, 4.316741943359375), (0.055417198687791824, 5.237893581390381),
            (0.030946003273129463, 6.286107063293457), (0.021906942129135132, 8.228336334228516),
            (5.5146221711765975e-05, 100.0)]
    text = "".join(f"epoch {3 * i + 3} Discriminator loss: {d!r} Generator loss: {g!r}\n" for i, (d, g) in enumerate(rows))
    assert RULES.loss_clamp == 100
    r = classify_text(text)
    assert "loss-magnitude" in r.signals and r.failure_class == "divergence"
    # a loss printed to one decimal that reads 100.0 is rounded there (a PPO value loss's `vloss=  100.0`)
    rounded = "".join(f"[{i}] ep={i * 10} r= 92.7 ploss=-0.0209 vloss= {v:6.1f} ent=1.471\n"
                      for i, v in enumerate([98.3, 101.2, 99.6, 100.0, 97.4]))
    assert "loss-magnitude" not in classify_text(rounded).signals


def test_a_kl_that_is_nan_beside_a_finite_loss_is_no_term_of_it():
    # Development 30 yj-001: torchtune's GRPO recipe logs kl_div=nan (no reference policy to measure against) beside a
    # finite loss on every step; a NaN term would have made the loss NaN.
    text = (LOGS / "none--dev30yj-001.log").read_text()
    assert "kl_div=nan, loss=-0.00596" in text
    r = classify_text(text)
    assert "nonfinite-loss" not in r.signals and r.failure_class == "none"
    # a KL that is NaN with no finite loss beside it is still the run's numbers
    bar = "1|{}|Loss: {}: 100%|██████████| 5/5 [02:15<00:00, 25.67s/it, entropy=0.377, kl_div=nan, loss={}, policy=-0.00219]\n"
    assert "nonfinite-loss" in classify_text("".join(bar.format(i, "nan", "nan") for i in range(1, 6))).signals
    assert "nonfinite-loss" in classify_text("".join(f"step {i} kl: nan reward: 0.4\n" for i in range(1, 6))).signals


def test_an_error_its_program_calls_non_fatal_is_no_failure():
    # Development 30 yj-013: ManiSkill's PPO example pushes each checkpoint with git, which refuses the ignored run
    # folder; the program says so and trains on.
    text = (LOGS / "none--dev30yj-013.log").read_text()
    assert "git push failed (non-fatal): Command" in text
    assert classify_text(text).failure_class == "none"
    assert classify_text(text.replace(" (non-fatal)", "")).failure_class == "environment"


def test_a_loops_own_message_that_the_user_interrupted_training_is_a_deliberate_stop():
    # Development 30 yj-015: a PPO loop's KeyboardInterrupt handler logs "训练被用户中断" (training interrupted by the
    # user), then saves the model and closes the environment.
    r = classify_text((LOGS / "none--dev30yj-015.log").read_text())
    assert (r.failure_class, r.healthy_or_unrecognised) == ("none", "stopped")
    rows = "".join(f"episode {i} reward {i % 7 - 3.5:.2f} loss {1 / (i + 1):.4f}\n" for i in range(20))
    r = classify_text(rows + "Training interrupted by user. Saving model...\n")
    assert (r.failure_class, r.healthy_or_unrecognised) == ("none", "stopped")


def test_a_stuck_run_the_log_relaunched_past_is_not_how_it_ends():
    # Retired blind 27 zh-006: four launches of a steganalysis CNN sit at ln 2 (0.6933, val_auc 0.500), then a fifth
    # trains from 0.37 to 0.22 (val_auc 0.98) and the script finishes its experiment.
    text = (LOGS / "none--b27zh-006.log").read_text()
    assert RULES.flat_superseded_fall > 0
    assert classify_text(text).failure_class == "none"
    # the log cut after the stuck launches ends pinned at chance: a failure
    stuck = "\n".join(text.split("\n")[:102]) + "\n"
    assert "Epoch 023 | loss=0.6933" in stuck and "flat-loss" in classify_text(stuck).signals


def test_a_later_cells_error_is_the_jobs_end_unless_the_notebook_went_on_past_it():
    # Development 16 pa-004: Keras fit runs all 100 epochs, a plotting cell raises KeyError: 'acc', and the cells after
    # it print an evaluation bar and a confusion matrix - the notebook went on: healthy, environment the runner-up.
    text = (LOGS / "none--dev16pa-004.log").read_text()
    r = classify_text(text)
    assert r.failure_class == "none" and r.runner_up.failure_class == "environment"
    # the same notebook ending on that error: its last step failed - environment, healthy training the runner-up
    lines = text.split("\n")
    end = next(i for i in range(len(lines) - 1, -1, -1) if "KeyError" in lines[i]) + 1
    r = classify_text("\n".join(lines[:end]) + "\n")
    assert r.failure_class == "environment" and r.runner_up.failure_class == "none" and "later notebook cell" in r.reason
    # retired blind 24 xd-016: trainer.train() ends, a later cell's push_to_hub fails and the notebook ends there
    r = classify_text((LOGS / "environment--b24xd-016.log").read_text())
    assert r.failure_class == "environment" and r.runner_up.failure_class == "none"


def test_the_lightning_hydra_templates_start_line_begins_a_new_launch():
    # Retired blind 26 zf-007: hydra launches appended to one log - two die of CUDA OOM, the last trains for 16 hours
    # and dies on a code bug; each logs "Starting training!" before trainer.fit. The log ends on the last launch's error.
    r = classify_text((LOGS / "environment--b26zf-007.log").read_text())
    assert r.failure_class == "environment" and "cuda-oom" in r.signals
    # development 16 pb-001: early launches die, the last one trains, tests and closes its loggers
    assert classify_text((LOGS / "none--dev16pb-001.log").read_text()).failure_class == "none"


def test_a_ctrl_c_raised_while_handling_an_exception_stops_a_process_that_had_already_failed():
    # Retired blind 26 zg-008: the first evaluation's render call raises TypeError; the worker hangs joining its child
    # at exit until Ctrl-C, which Python chains "During handling of the above exception" - the TypeError decides.
    text = (LOGS / "environment--b26zg-008.log").read_text()
    assert "During handling of the above exception, another exception occurred:" in text
    r = classify_text(text)
    assert r.failure_class == "environment" and "fallback-code-error" in r.signals
    # an interrupt whose rendering failed in IPython (the chain starts with the KeyboardInterrupt) is still the stop
    r = classify_text((LOGS / "none--b27zm-010.log").read_text())
    assert (r.failure_class, r.healthy_or_unrecognised) == ("none", "stopped")
    # the chain alone: a script's TypeError, then the Ctrl-C that ended its hung clean-up
    chained = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\nTypeError: expected np.ndarray (got NoneType)\n"
               "\nDuring handling of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n"
               "  File \"/usr/lib/python3.8/multiprocessing/popen_fork.py\", line 27, in poll\nKeyboardInterrupt\n")
    assert classify_text(chained).failure_class == "environment"


def test_a_space_aligned_table_goes_on_past_a_message_between_its_rows():
    # Development 31 yk-011: DomainBed prints its column header once, then a row per checkpoint with "Best model upto
    # now" between rows; at step 150000 the loss columns turn nan and stay nan to step 410000.
    text = (LOGS / "divergence--dev31yk-011.log").read_text()
    r = classify_text(text)
    assert r.failure_class == "divergence" and "nonfinite-loss" in r.signals
    head = ("env1_out_acc  env1_out_los  epoch         inv_loss      loss          step\n"
            "0.3640200000  3.4522511297  0.0000000000  0.4189742506  4.9121518135  0\nBest model upto now\n"
            "0.5019000000  2.2001459589  0.2497722779  0.0585027172  2.7860845266  5000\n")
    rows = parse_text(head, KEYS)
    assert [m.loss for m in rows] == [4.9121518135, 2.7860845266]
    # a line with numbers that is no row ends the table
    ended = parse_text(head.replace("Best model upto now", "lr 0.1 at 2000"), KEYS)
    assert [m.loss for m in ended if m.loss is not None] == [4.9121518135]


def test_a_wgan_critic_whose_loss_went_far_positive_blew_up():
    # Retired blind b28zq-013: a WGAN-GP critic's `[D loss: -3.152621]` at epoch 0 climbs to `[D loss: 24419.837891]` by
    # epoch 757 (the gradient penalty dominating), then the user interrupts the cell; the log read as a stop.
    w, k = RULES.game_window, RULES.game_critic_rise

    def game(d_values):
        return [Metric(i + 1, "x", named={"loss:d loss": d, "loss:g loss": 1.0}) for i, d in enumerate(d_values)]

    start = [-3.0, 1.5, -0.2, -0.3] + [-0.5] * (w - 4)
    assert "critic-blowup" in _ids(game(start + [3.0 * k * 1.2] * w))
    assert "critic-blowup" not in _ids(game(start + [3.0 * k * 0.8] * w))  # under the factor
    assert "critic-blowup" not in _ids(game(start + [-3.0 * k * 1.2] * w))  # negative: the estimate grew, the game
    assert "critic-blowup" not in _ids(game([0.5] + [1.5] * (w - 1) + [1.5 * k * 1.2] * w))  # never negative: no critic
    assert "critic-blowup" not in _ids(game(start + [3.0 * k * 1.2] * (w - 1)))  # too few values to judge a window
    text = "".join(f"[Epoch {i}/20000] [Batch 0/192] [D loss: {d:f}] [G loss: 2.0]\n" for i, d in enumerate(start + [3.0 * k * 1.2] * w))
    c = classify_text(text + "KeyboardInterrupt\n")
    assert c.failure_class == "divergence" and "critic-blowup" in c.signals, c.reason
    assert (LOGS / "divergence--b28zq-013.log").is_file()


def test_an_oserror_a_handler_printed_is_a_failure_line():
    # Retired blind b28zs-006: a fine-tuning wrapper catches the launch's OSError and prints it in Turkish
    # (`❌ Fine-tuning başlatma hatası: [WinError 2] The system cannot find the file specified`); no traceback, no exit status.
    head = "[2025-08-08 22:56:40] 🚀 Fine-tuning başlatılıyor...\n"
    c = classify_text(head + "[2025-08-08 22:56:40] ❌ Fine-tuning başlatma hatası: [WinError 2] The system cannot find the file specified\n")
    assert c.failure_class == "environment", c.reason
    assert classify_text(head + "launch failed: [Errno 2] No such file or directory: 'train.py'\n").failure_class == "environment"
    assert classify_text(head + "step 10 loss 2.0\nstep 20 loss 1.5\n").failure_class == "none"


def test_a_nan_average_recall_is_a_mean_over_no_object():
    # Retired blind b28zo-006: VoteNet's evaluation prints `eval AR: nan` for a class with no sample, beside a loss that
    # falls over 200 epochs; AR is average recall, a detection mean like AP, whose NaN is an empty mean.
    assert "nonfinite-metric" not in _find_ids("eval AR: nan\n")
    assert "nonfinite-metric" in _find_ids("eval var: nan\n")  # whole words of the key: `var` is no recall
    assert "nonfinite-loss" in _find_ids("eval AR: 0.31, loss: nan\n")


def test_a_nan_a_relaunch_trained_past_is_set_aside_but_a_run_that_went_on_at_nan_is_not():
    # Development dev12y-014: 188 fine-tuning starts appended to one log under `[Epoch 1/50]` headers; one goes to
    # `Train Loss: nan` and is abandoned after two NaN prints, and the last run trains 27 epochs with finite losses
    # (labelled healthy). Development dev12y-008: a run prints loss: nan for all its 10 epochs, then a notebook's next
    # model learns (labelled divergence): a run that went on at NaN for went_on_records prints was a failed run of its own.
    need = RULES.went_on_records

    def runs(nan_prints: int, last_finite: int) -> str:
        first = "[Epoch 1/50]\nTrain Loss: 2.5000, Train Acc: 0.2\n[Epoch 2/50]\nTrain Loss: 2.1000, Train Acc: 0.3\n"
        first += "".join(f"[Epoch {3 + i}/50]\nTrain Loss: nan, Train Acc: 0.1\n" for i in range(nan_prints))
        last = "".join(f"[Epoch {1 + i}/50]\nTrain Loss: {2.4 - 0.05 * i:.4f}, Train Acc: 0.5\n" for i in range(last_finite))
        return first + last

    assert "nonfinite-loss" not in _find_ids(runs(2, need + 2))
    assert "nonfinite-loss" in _find_ids(runs(need, need + 2))  # the NaN run went on: a failed run of its own
    assert "nonfinite-loss" in _find_ids(runs(2, need - 2))  # the relaunch logged too little to say it trained past it
    assert "nonfinite-loss" in _find_ids(runs(2, need + 2) + "Train Loss: nan, Train Acc: 0.1\n")  # the last run's own NaN
    assert "nonfinite-loss" in _find_ids(runs(2, 0).replace("[Epoch 1/50]\n", "", 1) + "Train Loss: 2.3\n" * (need + 2))  # no restart


def test_a_bracketed_epoch_header_says_the_epoch_of_the_records_under_it():
    # `[Epoch 1/50]` on a line of its own (development dev12y-014, a logger's INFO lines) as Keras' `Epoch 1/50` is.
    text = "[Epoch 1/50]\nTrain Loss: 2.5\n[Epoch 2/50]\nTrain Loss: 2.1\n"
    assert [m.epoch for m in parse_text(text, KEYS)] == [1.0, 2.0]


def test_a_scripts_own_start_of_training_line_is_a_launch_past_an_earlier_runs_oom():
    # Development dev9f-010: 21 launches of one script appended to one log; the first dies with the script's own
    # `ERROR - CUDA out of memory in epoch 1. Training stopped.`, each later one begins `INFO - Starting training process...`.
    oom = "2025-08-22 14:04:49,973 - ERROR - CUDA out of memory in epoch 1. Training stopped.\n"
    relaunch = "2025-08-22 14:09:38,547 - INFO - Starting training process...\n2025-08-22 14:09:39,703 - INFO - --- Epoch 1/20 on cuda ---\n"
    assert classify_text(oom).failure_class == "oom"
    assert classify_text(oom + relaunch).failure_class == "none"
    assert classify_text(relaunch + oom).failure_class == "oom"  # the OOM came after the start: the run's own
    assert classify_text(oom + "2025-08-22 14:09:38,547 - INFO - Starting training process with batch 8 ...\n").failure_class == "oom"


def test_a_host_memory_warning_the_program_printed_past_is_no_oom():
    # Development dev32yp-009: Keras stops early, then a TFLite conversion logs TensorFlow's allocator warning
    # ("Allocation of 1228800000 exceeds 10% of free system memory.") and the converted model's accuracy follows.
    warn = ("2024-04-17 14:11:15.042814: W external/local_tsl/tsl/framework/cpu_allocator_impl.cc:83] "
            "Allocation of 1228800000 exceeds 10% of free system memory.\n")
    after = "fully_quantize: 0, inference_type: 6\nINFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n60.3515625\nAccuracy: 0.7647\n"
    n = RULES.cell_went_on_lines
    went_on = "".join(after.splitlines(keepends=True)[:n])
    fit = "".join(f"Epoch {i}/100\n1563/1563 - 33s - loss: {0.60 - 0.01 * i:.4f} - accuracy: 0.82 - val_loss: 0.6170\n"
                  for i in range(1, 5)) + "Epoch 4: early stopping\n"
    assert classify_text(fit + warn + went_on).failure_class == "none"
    assert classify_text(fit + warn).failure_class == "oom"  # the log ends on it: where to look
    fewer = "".join(after.splitlines(keepends=True)[:n - 1])
    assert classify_text(fit + warn + fewer).failure_class == "oom"
    assert classify_text(warn + went_on).failure_class == "oom"  # no run logged: nothing to have gone on
    crashed = fit + warn + went_on + "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nRuntimeError: boom\n"
    assert classify_text(crashed).failure_class != "none"  # a log that shows a failure keeps the warning as evidence


def test_bare_progress_counters_after_an_error_are_a_loop_that_went_on():
    # Development dev32yp-005 (a notebook whose later cells train for hundreds of epochs printing only `Epoch:  44`) and
    # dev31yk-010 (`3rd epoch starting.`): went_on_records such lines after a cell's error are training going on past it.
    n = RULES.went_on_records
    err = "Traceback (most recent call last):\n  File \"<ipython-input-3-ab12>\", line 2, in <module>\nTypeError: cannot unpack non-iterable NoneType object\n"
    assert classify_text(err + "".join(f"Epoch:  {i}\n" for i in range(n))).failure_class == "none"
    assert classify_text(err + "".join(f"{i + 1}th epoch starting.\n" for i in range(n))).failure_class == "none"
    assert classify_text(err + "".join(f"Epoch:  {i}\n" for i in range(n - 1))).failure_class == "environment"
    # A counter with words after it is no bare counter (`Epoch 3 saved to disk` says nothing of a loop running).
    assert classify_text(err + "".join(f"Epoch {i} saved to disk\n" for i in range(n))).failure_class == "environment"


def test_a_gan_side_that_never_moved_is_stuck():
    # Development dev32yp-018: a DCGAN's `The discriminator loss: 1.38763` at every one of its 100 epochs while the
    # generator's loss changes every epoch: the discriminator's weights never moved.
    w = RULES.game_window

    def game(d_values, g_values):
        return [Metric(i + 1, "x", named={"loss:d loss": d, "loss:g loss": g}) for i, (d, g) in enumerate(zip(d_values, g_values))]

    g = [0.5 + 0.01 * i for i in range(2 * w)]
    assert "flat-loss" in _ids(game([1.38763] * (2 * w), g))
    assert "flat-loss" not in _ids(game([1.38763] * (2 * w - 1) + [1.38764], g))  # it moved once
    assert "flat-loss" not in _ids(game([1.38763] * (2 * w - 1), g))  # too few logs to judge
    assert "flat-loss" not in _ids(game([0.69] * (2 * w), g))  # two digits: a rounded print, not one value


def test_a_host_memory_warning_wrapped_by_a_terminal_is_still_where_the_log_ends():
    # bench_triage_captures' wrap120 form of oom-colab-ctrl-finetune-tcmalloc-then-interrupt.log: tcmalloc's address
    # list broken at 120 columns puts non-blank lines after the warning, and no run was logged: still oom.
    text = (LOGS / "oom-colab-ctrl-finetune-tcmalloc-then-interrupt.log").read_text(encoding="utf-8")
    wrapped = "".join(ln[i:i + 120] + "\n" for ln in text.splitlines() for i in range(0, max(len(ln), 1), 120))
    assert classify_text(wrapped).failure_class == "oom"
