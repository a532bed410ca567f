"""The classify part of triage alone: priorities, never silent on a failure, confidence, runner-up and missing evidence.

Findings are built from real dev-corpus lines and the table's own signals, so the rules are tested
apart from the log scanning.
"""

from __future__ import annotations

from pathlib import Path

from finetune_mcp.triage.classify import Classification, decide
from finetune_mcp.triage.parse import Metric
from finetune_mcp.triage.signals import Findings, Hit, find, load_signal_table

LOGS = Path(__file__).parent / "fixtures" / "logs"
TABLE = load_signal_table()
SIG = {s.id: s for s in TABLE.signals}


def _findings(hits=(), *, metrics=(), markers=(), exception=None, exit_code=None) -> Findings:
    return Findings(list(hits), list(metrics), list(markers), exception, False, exit_code, table=TABLE)


def test_highest_priority_wins_and_the_rest_is_the_runner_up():
    oom = Hit(SIG["cuda-oom"], [(9, "torch.OutOfMemoryError: CUDA out of memory.")])
    nccl = Hit(SIG["nccl-timeout"], [(3, "Watchdog caught collective operation timeout")])
    c = decide(_findings([nccl, oom]))
    assert (c.failure_class, c.signals[0]) == ("oom", "cuda-oom")
    assert c.runner_up.failure_class == "environment" and c.runner_up.confidence < c.confidence
    assert c.evidence == [(9, "torch.OutOfMemoryError: CUDA out of memory.")]


def test_never_silent_a_failure_with_no_signal_gets_a_weak_class():
    exc = (2, "ValueError: too many values to unpack (expected 2)")
    c = decide(_findings(markers=[(1, "Traceback (most recent call last):")], exception=exc))
    assert c.failure_class == "environment" and c.signals[0] == "fallback-setup"
    assert c.confidence < 0.5 and c.evidence[-1] == exc and c.missing_evidence
    # A failed lookup is the data's or the config's, whatever key it names (a NaN label, loss_scale).
    for key in ("'text'", "nan", "'loss_scale'"):
        c = decide(_findings(exception=(2, f"KeyError: {key}")))
        assert (c.failure_class, c.signals[0]) == ("environment", "fallback-lookup"), key
    # By exception type: a memory error reads oom, a floating-point error divergence.
    assert decide(_findings(exception=(1, "MemoryError"))).failure_class == "oom"
    assert decide(_findings(exception=(1, "FloatingPointError: Loss became infinite"))).failure_class == "divergence"
    assert decide(_findings(exit_code=2)).failure_class == "environment"


def test_a_requested_stop_is_none_stopped_and_outranks_only_the_fallback():
    stop = Hit(SIG["user-interrupt"], [(5, "KeyboardInterrupt")])
    c = decide(_findings([stop], exception=(5, "KeyboardInterrupt")))
    assert (c.failure_class, c.healthy_or_unrecognised) == ("none", "stopped")
    oom = Hit(SIG["cuda-oom"], [(2, "CUDA out of memory")])
    assert decide(_findings([stop, oom])).failure_class == "oom"


def test_a_stop_the_log_went_on_past_is_not_how_it_ends():
    from finetune_mcp.triage.classify import classify_text

    n = load_signal_table().records.went_on_records
    stop = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\nKeyboardInterrupt\n"
    resumed = "".join(f"step {i} loss {2.0 - i / 100:.3f}\n" for i in range(1, n + 2))
    c = classify_text("step 0 loss 2.100\n" + stop + resumed)  # a notebook cell stopped, then run again
    assert (c.failure_class, c.healthy_or_unrecognised) == ("none", "healthy")
    c = classify_text("step 0 loss 2.100\n" + stop + "step 1 loss 2.000\n")
    assert (c.failure_class, c.healthy_or_unrecognised) == ("none", "stopped")
    lightning = "UserWarning: Detected KeyboardInterrupt, attempting graceful shutdown...\n"
    assert classify_text("Epoch 3: loss=0.51\n" + lightning).healthy_or_unrecognised == "stopped"


def test_healthy_reads_none_and_says_what_it_checked():
    ms = [Metric(i, f"l{i}", step=i, loss=2.0 - i / 10) for i in range(1, 8)]
    c = decide(_findings(metrics=ms))
    assert (c.failure_class, c.healthy_or_unrecognised) == ("none", "healthy")
    assert c.runner_up.failure_class == "divergence" and "no other class has evidence" in c.runner_up.why
    assert "7 logged loss values" in c.reason and c.metrics["loss_min"] == 1.3
    bare = decide(_findings())
    assert bare.failure_class == "none" and bare.confidence < c.confidence and bare.missing_evidence


def test_numbers_alone_say_so_in_missing_evidence():
    text = (LOGS / "divergence-loss-zero-grad-norm-nan-minicpm-lora.log").read_text()
    c = decide(find(text))
    assert c.failure_class == "divergence" and "loss-zero-grad-nan" in c.signals
    assert any("rests on the logged numbers" in m for m in c.missing_evidence)
    lines = text.split("\n")
    assert all(lines[n - 1] == t for n, t in c.evidence)


def test_to_dict_carries_the_new_fields():
    d = Classification("oom", "r", [(1, "x")], ["cuda-oom"], confidence=0.9).to_dict()
    assert d["evidence"] == [{"line": 1, "text": "x"}] and d["confidence"] == 0.9 and d["runner_up"] is None
    # Every verdict names a runner-up, even when no other class has evidence.
    alone = decide(_findings([Hit(SIG["sigkill-in-log"], [(1, "Killed")])]))
    assert alone.runner_up.failure_class == "environment" and alone.runner_up.confidence < alone.confidence


def test_a_kill_with_memory_far_below_the_limit_is_weak_evidence_of_oom():
    # Issue 30: a trainer killed with kill -9 while using 0.58 of 24 GB read oom at 0.84 with no evidence.
    far = decide(find("", exit_info={"returncode": 137}), memory={"used_gb": 0.58, "limit_gb": 24.0})
    near = decide(find("", exit_info={"returncode": 137}), memory={"used_gb": 23.1, "limit_gb": 24.0})
    unknown = decide(find("", exit_info={"returncode": 137}))
    assert far.failure_class == near.failure_class == unknown.failure_class == "oom"
    assert far.confidence <= 0.35 < near.confidence == unknown.confidence
    assert far.runner_up.failure_class == "environment" and far.runner_up.confidence >= far.confidence - 0.1
    assert any("0.58 of 24 GB" in m and "far below the limit" in m for m in far.missing_evidence), far.missing_evidence
    assert "weak evidence of OOM" in far.reason
    assert any("96%" in m for m in near.missing_evidence) and not any("far below" in m for m in near.missing_evidence)
    assert any("not known" in m for m in unknown.missing_evidence)
    # An allocator's own OOM is evidence whatever the reading: the memory note only weighs a bare kill.
    text = (LOGS / "oom-trl-ci-other-processes.log").read_text(encoding="utf-8")
    cuda = decide(find(text, exit_info={"returncode": 1}), memory={"used_gb": 0.58, "limit_gb": 24.0})
    assert cuda.failure_class == "oom" and cuda.confidence > 0.35 and not any("far below" in m for m in cuda.missing_evidence)


def test_never_none_on_a_named_nan_a_spike_or_a_halving_scale():
    # The shapes of issue 32's misses, as rules and not patterns: each reads a failure class, never none.
    named = decide(find("step 1 | loss_a=1.3 loss_b=0.8 grad_norm=2.0\nstep 2 | loss_a=1.2 loss_b=inf grad_norm=nan\n"))
    assert named.failure_class == "divergence" and named.runner_up is not None and named.evidence
    plain = "".join(f"Epoch 1 Step {i} loss {v}\n" for i, v in enumerate([2.1, 2.0, 1.9, 1.85, 1.8, 25.0, 24.0], 1))
    spike = decide(find(plain))
    assert spike.failure_class == "divergence" and "loss-spike" in spike.signals
    assert any("Step 6 loss 25.0" in t for _, t in spike.evidence) and spike.missing_evidence
    scale = "".join(f"iter {i} | value_loss: {vl} | grad_scale: {s:g}\n"
                    for i, (vl, s) in enumerate([(0.5, 65536), (0.5, 65536), (0.6, 65536), (0.9, 32768), (1.2, 16384), (1.4, 8192)]))
    halving = decide(find(scale))
    assert halving.failure_class == "divergence" and halving.signals[0] == "loss-scale-halving"


def test_the_memory_reading_of_a_run_comes_from_its_progress_and_env_report(tmp_path):
    # The records poll_progress reads (templates/train/head.py writes them) and the env report preflight writes.
    from finetune_mcp.triage.tool import _memory_reading

    progress = tmp_path / "progress.jsonl"
    progress.write_text("".join(f'{{"step": {i}, "loss": 1.0, "lr": 0.0002, "mem_gb": {m}, "temp_c": null}}\n'
                                for i, m in enumerate([0.41, 0.58, 0.55, 0.52, 0.57, 0.56], 1)))
    gpu = {"observed": {"host": {"nvml": {"devices": [{"name": "NVIDIA A10G", "memory": {"supported": True, "total_gb": 24.0}}]},
                                 "memory": {"total_gb": 64.0}}}}
    assert _memory_reading(progress, gpu) == {"used_gb": 0.58, "limit_gb": 24.0}
    unified = {"observed": {"host": {"nvml": {"devices": [{"name": "NVIDIA GB10", "memory": {"supported": False}}]},
                                     "memory": {"total_gb": 128.0}}}}
    assert _memory_reading(progress, unified) == {"used_gb": 0.58, "limit_gb": 128.0}
    assert _memory_reading(progress, None) == {"used_gb": 0.58}
    assert _memory_reading(tmp_path / "missing.jsonl", gpu) is None
