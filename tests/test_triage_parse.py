"""The parse part of triage alone: step, loss, grad norm, lr and loss scale out of every log format it claims.

Lines come from the development part of the real corpus where one exists; the other formats are
built the way their writers print them (Megatron's training_log format string, HF's trainer_state.json
and notebook table, JSON lines).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from finetune_mcp.triage.classify import classify_text
from finetune_mcp.triage.parse import (KeyMap, Metric, carries, clean_line, dedupe, normalise_key, parse_line, parse_records, parse_text,
                                        to_number)
from finetune_mcp.triage.signals import load_signal_table

LOGS = Path(__file__).parent / "fixtures" / "logs"
KEYS = KeyMap.from_table(load_signal_table().metric_keys)


def _lines(name: str) -> list[str]:
    return (LOGS / name).read_text(encoding="utf-8").split("\n")


def _one(line: str) -> Metric:
    return parse_line(Metric(1, line), KEYS, line)


def test_hf_trainer_dicts_including_tqdm_interleaved_lines():
    m = _one(_lines("divergence-loss-zero-grad-norm-nan-minicpm-lora.log")[0])  # a markdown fence glued in front
    assert (m.loss, m.lr, m.source) == (1.0778, 0.0, "dict") and math.isnan(m.grad_norm)
    m = _one(_lines("none-healthy-gemma-tpu-lora-dicts.log")[0])
    assert (m.loss, m.grad_norm) == (2.1488, 1.5078125)
    quoted = _one(_lines("none-healthy-plateau-alignment-handbook.log")[0])  # "> {'loss': ...}"
    assert quoted.loss == 1.0238
    # A DeepSpeed line printed into a tqdm redraw: its own step, not the bar's position.
    tqdm = _one(_lines("divergence-deepspeed-t5-loss-zero-skipped-steps.log")[3])
    assert (tqdm.step, tqdm.lr) == (2000.0, 0.001)


def test_key_value_and_key_colon_value_lines():
    m = _one(_lines("divergence-epoch-loss-nan-key-colon.log")[0])
    assert m.loss == 0.2105546216666698
    assert math.isnan(_one("epoch: 3451 loss: nan").loss)
    m = _one(_lines("none-healthy-torchtune-full-single-device.log")[0])  # "Step 0 | loss:1.75 lr:2e-05"
    assert (m.step, m.loss, m.lr) == (0.0, 1.7535516023635864, 2e-05)
    m = _one(_lines("none-healthy-mlx-lm-lora-cuda-a100.log")[10])  # "Iter 10: Train loss 2.662, Learning Rate 1.000e-05"
    assert (m.step, m.loss, m.lr) == (10.0, 2.662, 1e-05)
    m = _one(_lines("divergence-verl-sft-train-loss-nan.log")[0])  # verl "step:2 - ... - train/loss:nan - train/grad_norm:0.0"
    assert m.step == 2 and math.isnan(m.loss) and m.grad_norm == 0.0


def test_pipe_and_box_tables():
    header, row = "| Step | Training Loss | Validation Loss |", "| 10 | 2.345600 | 2.100000 |"
    metrics = parse_text(header + "\n" + row + "\n", KEYS)
    assert [(m.step, m.loss, m.eval_loss, m.line) for m in metrics] == [(10.0, 2.3456, 2.1, 2)]
    box = parse_text((LOGS / "none-healthy-ray-train-result-table.log").read_text(), KEYS)
    assert [m.loss for m in box if m.loss is not None] == [0.32971]


def test_comma_separated_tables_keras_csvlogger_and_a_log_history_export():
    # Keras' CSVLogger writes `epoch,<metric>,...` then one row per epoch (dev11t-003's header and first row).
    rows = ["epoch,loss,mean_absolute_error", "0,nan,2.6154770585594536e+34", "1,nan,0.9534672"]
    metrics = parse_text("\n".join(rows) + "\n", KEYS)
    assert [m.line for m in metrics] == [2, 3] and all(math.isnan(m.loss) for m in metrics)
    # A Trainer's log_history written as CSV (dev10o-006): empty cells where a record lacks a key.
    hist = (LOGS / "none--dev10o-006.log").read_text().split("\n")
    metrics = parse_text("\n".join(hist[:4]) + "\n", KEYS)
    assert [(m.step, m.loss) for m in metrics] == [(1.0, 1.1682), (10.0, 0.868), (20.0, 0.6473)]
    assert math.isnan(metrics[1].grad_norm) and metrics[0].grad_norm == pytest.approx(4.966434955596924)
    # A sentence with commas is no header, and a row only follows a header read as CSV.
    assert parse_text("Loading data, model, tokenizer\n0,1.5,2.0\n", KEYS) == []
    # srun --label's task number before each line: the rows are read as without it.
    labelled = parse_text("\n".join("0: " + r for r in rows) + "\n", KEYS)
    assert [m.line for m in labelled] == [2, 3] and all(math.isnan(m.loss) for m in labelled)


def test_an_epoch_announced_on_its_own_line_belongs_to_the_records_under_it():
    # Keras 2's model.fit: `Epoch 2/20`, then the epoch's last batch line, whose `211/211` is the same every epoch.
    text = "".join(f"Epoch {e}/20\n211/211 [======] - 3s 16ms/step - loss: inf - accuracy: 0.{e}\n" for e in (1, 2, 3))
    metrics = parse_text(text, KEYS)
    assert [(m.line, m.epoch) for m in metrics] == [(2, 1.0), (4, 2.0), (6, 3.0)]  # three epochs, not one redrawn
    # A record that names its own epoch keeps it; a tqdm redraw of one step in one epoch is still one record.
    assert parse_text("Epoch 4/20\nepoch: 7 loss: 0.5\n", KEYS)[0].epoch == 7.0
    assert len(parse_text("Epoch 1/2\n5/9 - loss: 0.52\n5/9 - loss: 0.52\n", KEYS)) == 1


def test_an_index_printed_before_a_key_is_not_part_of_it():
    # TransReID's logger (d13db-006) and its derivatives: `Epoch[2] done. Loss: 0.000 (Base: 0.000, ...)`.
    m = _one("2026-06-15 20:54:08 transreid.train INFO: Epoch[2] done. Loss: 0.000 (Base: 0.000, Orth: 0.000), Acc: 0.000%")
    assert m.loss == 0.0 and "loss:epoch 2 done loss" not in m.named
    assert _one("Epoch[1] Iteration[50/186] Loss: 5.660, Acc: 0.024, Base Lr: 3.50e-06").loss == 5.66
    assert _one("[Epoch 3] val. loss: 0.41").loss is None  # no index head: the key is read as printed


def test_cost_and_perplexity_keys():
    # Gradient descent as courses print it (d12y-013): `Iteration    9: Cost 8.62e+15`.
    assert _one("Iteration    9: Cost 8.62e+15  dj_dw:  8.236e+07, dj_db:  3.623e+07").loss == 8.62e15
    m = _one("| epoch  10 |  1800/ 2983 batches | lr 1.2500 | ms/batch 11.38 | loss  7.14 | ppl  1264.60")
    assert (m.loss, m.named) == (7.14, {"ppl:ppl": 1264.6})
    assert _one("Total Cost: 2").loss is None  # a count, not a cost function
    # A line that names only its cost (no step, no lr) is still read: `cost` is a listed loss key.
    assert _one("Epoch 3: cost=0.5").loss == 0.5


def test_objectives_printed_under_their_own_names_are_losses():
    from finetune_mcp.triage.parse import key_kind

    assert {k: key_kind(k) for k in ("nll", "train_bce", "xent", "ctc", "bpd", "val_nll", "mse", "bce_weight")} == {
        "nll": "loss", "train_bce": "loss", "xent": "loss", "ctc": "loss", "bpd": "loss", "val_nll": "eval_loss",
        "mse": None, "bce_weight": None}
    assert _one("Epoch 3: nll=2.25").named == {"loss:nll": 2.25}


def test_a_torch_tensor_printed_whole_is_its_number():
    # Plain PyTorch loops print the loss tensor itself: `print(f"Loss: {loss}")`.
    assert _one("Epoch 3, Loss: tensor(2.3456, device='cuda:0', grad_fn=<AddBackward0>)").loss == 2.3456
    assert _one("loss = tensor([0.52], device='cuda:0')").loss == 0.52
    assert math.isnan(_one("Epoch 9, Loss: tensor(nan, device='cuda:0', grad_fn=<AddBackward0>)").loss)


def _sb3_table(value_loss: str, timesteps: int) -> str:
    # Stable-Baselines3's logger (HumanOutputFormat): one key | value row per metric, sections ending in "/".
    rows = [("rollout/", ""), ("   ep_len_mean", "200"), ("   ep_rew_mean", "-1.2e+03"), ("time/", ""),
            ("   total_timesteps", str(timesteps)), ("train/", ""), ("   approx_kl", "0.012"),
            ("   entropy_loss", "-1.42"), ("   loss", value_loss), ("   value_loss", value_loss)]
    rule = "-" * 41
    return "\n".join([rule] + [f"| {k:<24}| {v:<12}|" for k, v in rows] + [rule]) + "\n"


def test_an_index_printed_before_a_dict_and_a_best_so_far_start_value():
    # `logger.info(f"Epoch {e}: {metrics}")`: the epoch before the dict is the record's, so a relaunch (epoch 0
    # again) starts a new run (d14fa-001).
    [m] = parse_text("2025-02-22 12:18:24,569 - titans_training - INFO - Epoch 50: {'loss': 1.1726027727127075}\n", KEYS)
    assert (m.epoch, m.loss) == (50.0, 1.1726027727127075)
    # A best-so-far tracker's +inf start value, printed when no epoch ran (d14fa-006), is no loss; a NaN is.
    assert _one("Best model found at epoch 0, Val Loss: inf, AUC: 0.00%, AP: 0.00%").eval_loss is None
    assert math.isnan(_one("Best model found at epoch 3, Val Loss: nan").eval_loss)


def test_darknet_iteration_lines_and_mxnet_cross_entropy():
    # darknet's detector.c: `%d: %f, %f avg loss, %f rate, ...` (pjreddie's original prints `avg,`); the running
    # average is the loss, and a NaN prints as `-nan` - whose line the prefix cleaner would cut the iteration from.
    rows = parse_text(" 8001: 0.595442, 0.612300 avg loss, 0.001300 rate, 13.209250 seconds, 512064 images, -1.000000 hours left\n"
                      " 8002: -nan, -nan avg, 0.001300 rate, 13.1 seconds, 512128 images\n", KEYS)
    assert (rows[0].step, rows[0].loss, rows[0].lr) == (8001.0, 0.6123, 0.0013)
    assert rows[1].step == 8002.0 and math.isnan(rows[1].loss)
    assert _one("Epoch[3] Batch [200]\tSpeed: 512.3 samples/sec\tTrain-cross-entropy=2.531").named == {"loss:train cross entropy": 2.531}


def test_a_space_aligned_table_under_a_header_of_names():
    # fastai's Recorder prints its table aligned with spaces; a NaN epoch there is a NaN loss.
    rows = parse_text("epoch     train_loss  valid_loss  accuracy  time    \n"
                      "0         0.523456    0.434567    0.812345  00:10     \n"
                      "1         nan         nan         0.100000  00:10     \n"
                      "Better model found at epoch 0 with valid_loss value: 0.434567.\n", KEYS)
    assert [(m.epoch, m.loss) for m in rows[:1]] == [(0.0, 0.523456)] and math.isnan(rows[1].loss)
    # Prose naming one metric is no header, and the numbers after it are no row.
    assert parse_text("the loss went down nicely here\n3 1.2 0.5 0.1 0.2 0.7\n", KEYS) == []


def test_msvc_printf_nan_and_inf():
    # A Windows build of Caffe or darknet printed NaN as 1.#QNAN / -1.#IND: read as a number it would be 1.0.
    assert math.isnan(_one("Iteration 100, loss = 1.#QNAN").loss)
    assert math.isnan(_one("Iteration 200, loss = -1.#IND").loss)
    assert _one("Iteration 300, loss = 1.#INF").loss == math.inf


def test_a_key_value_table_is_one_record():
    rows = parse_text(_sb3_table("12.5", 2048) + _sb3_table("nan", 4096), KEYS)
    assert [(m.step, m.rl) for m in rows] == [(2048.0, True), (4096.0, True)]
    assert rows[0].loss == 12.5 and rows[0].named == {"kl:approx kl": 0.012, "loss:entropy loss": -1.42, "loss:value loss": 12.5}
    assert math.isnan(rows[1].loss) and "nan" in rows[1].text  # evidence quotes the row that went non-finite
    # A log that ends inside a table still gives its record.
    assert len(parse_text(_sb3_table("3.0", 2048).rsplit("-" * 41, 1)[0], KEYS)) == 1


def test_megatron_iteration_lines_as_its_format_string_prints_them():
    # megatron/training/training.py training_log: ' iteration {:8d}/{:8d} |' ... ' lm loss: {:.6E} |' ' loss scale: {:.1f} |' ' grad norm: {:.3f} |'
    line = (f" iteration {3384:8d}/{8000:8d} | consumed samples: {216576:12d} | learning rate: {6.678e-06:.3E} |"
            f" lm loss: {0.7072597:.6E} | loss scale: {1.0:.1f} | grad norm: {float('nan'):.3f} | number of skipped iterations: {0:3d} |")
    m = _one(line)
    assert (m.step, m.loss, m.lr, m.loss_scale) == (3384.0, 0.7072597, 6.678e-06, 1.0) and math.isnan(m.grad_norm)


def test_json_lines_and_trainer_state_log_history():
    jl = "\n".join(json.dumps(r) for r in [{"step": 1, "loss": 2.5, "learning_rate": 1e-4},
                                          {"step": 2, "loss": float("nan"), "grad_norm": 3.0}])
    out = parse_text(jl, KEYS)
    assert [m.step for m in out] == [1.0, 2.0] and out[0].lr == 1e-4 and math.isnan(out[1].loss)
    state = json.dumps({"global_step": 20, "log_history": [{"epoch": 0.5, "grad_norm": 1.2, "learning_rate": 2e-4, "loss": 1.9, "step": 10},
                                                           {"epoch": 1.0, "grad_norm": 0.9, "learning_rate": 1e-4, "loss": 1.5, "step": 20}]}, indent=2)
    hist = parse_text(state, KEYS)
    assert [(m.step, m.loss, m.grad_norm) for m in hist] == [(10.0, 1.9, 1.2), (20.0, 1.5, 0.9)]
    # A pasted fragment of one (no closing brace) still yields its losses, line by line.
    frag = parse_text((LOGS / "none-healthy-llamafactory-trainer-state-log-history.log").read_text(), KEYS)
    assert [m.loss for m in frag if m.loss is not None] == [0.0604, 0.0578, 0.0814106387389618]  # the last is train_loss


def test_deepspeed_loss_scale_cuts_and_status_lines():
    cut = _one(_lines("divergence-loss-scale-stuck-at-1-t5-11b.log")[0])
    assert (cut.loss_scale, cut.scale_cut) == (1.0, True)
    step = _one(_lines("none-healthy-deepspeed-notebook-step-timer.log")[0])  # "[Rank 0] step=40, skipped=2, lr=[5e-05]"
    assert (step.step, step.lr, step.loss_scale) == (40.0, 5e-05, None)
    apex = _one(_lines("divergence-loss-scale-collapse-apex.log")[1])
    assert apex.loss_scale == pytest.approx(8.165126103939127e-202) and apex.scale_cut
    # ColossalAI's dynamic grad scaler after an overflow (colossalai/amp/naive_amp/grad_scaler/dynamic_grad_scaler.py).
    colossal = parse_line(Metric(1, "x"), KEYS, "Overflow occurs, the loss scale is adjusted to 1.0")
    assert (colossal.loss_scale, colossal.scale_cut) == (1.0, True)


def test_a_go_panics_set_literal_is_no_record():
    # wandb's Go core panicking prints its arguments as nested braces, which Python reads as a set of sets
    # (TypeError in literal_eval): no record, and no crash (dev batch 20, environment--dev20ta-006).
    line = "github.com/wandb/wandb/core/internal/stream.NewStream({{0x55fd14767620, 0x28}, 0xc00012a798, 0xc0000ac538, {0xc00005b800, 0x3c}, 0x0, 0xc00013f000})"
    assert parse_text(line + "\n", KEYS) == []
    assert parse_text("{{1, 2}, {3}}\n" + "{'loss': 0.5, 'epoch': 1.0}\n", KEYS)[0].loss == 0.5


def test_an_evaluation_loops_records_are_evaluation_losses():
    # pytorch/examples' ImageNet progress lines (retired blind b19qb-001): a training step's `Epoch: [77][180/250]`, a
    # test step's `Test: [10/242]`; the meters printed on lines of their own belong to the loop above them.
    text = ("Epoch: [77][180/250]\tTime 1.170 (1.163)\tLoss 0.5166 (0.4326)\ncos_sim_loss  0.047 (0.051)\n"
            "Test: [0/242]\tTime 0.608 (0.608)\tLoss 3.6813 (3.6813)\ncos_sim_loss  1.169 (1.169)\n"
            "Epoch: [78][0/250]\tTime 1.2 (1.2)\tLoss 0.51 (0.51)\ncos_sim_loss  0.049 (0.049)\n")
    ms = parse_text(text, KEYS)
    assert [(m.loss, m.eval_loss) for m in ms if m.loss or m.eval_loss] == [(0.5166, None), (None, 3.6813), (0.51, None)]
    assert [m.named for m in ms if m.named] == [{"loss:cos sim loss": 0.047}, {"eval_loss:cos sim loss": 1.169},
                                                 {"loss:cos sim loss": 0.049}]


def test_a_tagged_evaluation_line_holds_evaluation_losses():
    # PaddleClas (dev, retired blind 21 sa-007): every line carries its phase, `[Train][Epoch 3/1000]` / `[Eval][Epoch 3]`.
    text = ("[Train][Epoch 3/1000][Iter: 0/54]lr(LinearWarmup): 0.00019, CELoss: 2.04, loss: 2.04, top1: 0.375\n"
            "[Eval][Epoch 3][Iter: 30/34]CELoss: 0.09180, loss: 0.09180, top1: 0.81048\n"
            "[Train][Epoch 4/1000][Iter: 0/54]lr(LinearWarmup): 0.00019, CELoss: 1.98, loss: 1.98, top1: 0.4\n")
    ms = parse_text(text, KEYS)
    assert [(m.loss, m.eval_loss) for m in ms] == [(2.04, None), (None, 0.0918), (1.98, None)]


def test_an_average_from_batch_a_to_b_is_the_number_after_is():
    # DuReader's TF baseline (dev, retired blind 21 sa-014): `Average loss from batch 51 to 100 is 8.84`.
    m = parse_line(Metric(1, "x"), KEYS, "Average loss from batch 51 to 100 is 8.840906867980957")
    assert (m.step, m.loss, m.loss_key) == (100.0, 8.840906867980957, "average loss")


def test_a_loss_for_an_epoch_is_the_number_after_the_colon():
    # Retired blind 24 xb-012: `Loss on train for epoch 3: 0.99` (the epoch number was read as the loss, and the
    # hundredth epoch as a rise from 1 to 100).
    m = parse_line(Metric(1, "x"), KEYS, "Loss on train for epoch 100: 0.9980675049126149")
    assert (m.epoch, m.named) == (100.0, {"loss:loss on train": 0.9980675049126149})
    v = parse_line(Metric(1, "x"), KEYS, "Loss on validation for epoch 2: 1.0130228568346074")
    assert (v.epoch, v.named) == (2.0, {"eval_loss:loss on validation": 1.0130228568346074})
    text = "".join(f"Loss on train for epoch {e}: {1 + (e % 3) / 100}\nLoss on validation for epoch {e}: 1.01\n" for e in range(1, 101))
    assert classify_text(text).failure_class == "none"


def test_keras_bars_after_the_epochs_closing_bar_are_evaluation():
    # Retired blind 24 xb-016: model.fit's epochs, then model.evaluate() on two test sets; the second set's loss (16.1)
    # is no training loss risen from the epoch's 0.02.
    fit = "".join(f"Epoch {e}/3\n" + "".join(f"{k}/4 [====>....] - ETA: 1s - loss: {0.3 / e:.4f} - accuracy: 0.9\n" for k in range(1, 4))
                  + f"4/4 [==============================] - 35s 719ms/step - loss: {0.3 / e:.4f} - accuracy: 0.9 - val_loss: 0.2\n"
                  for e in range(1, 4))
    evaluate = ("1/1 [==============================] - ETA: 0s - loss: 16.1259 - accuracy: 0.5000\n"
                "1/1 [==============================] - 1s 1s/step - loss: 16.1259 - accuracy: 0.5000\n")
    ms = parse_text(fit + evaluate, KEYS)
    assert (ms[-1].eval_loss, ms[-1].loss) == (16.1259, None)
    assert [m.loss for m in ms[:-1]] == [0.3, 0.3, 0.3, 0.3, 0.15, 0.15, 0.15, 0.15, 0.1, 0.1, 0.1, 0.1]
    assert classify_text(fit + evaluate).failure_class == "none"
    # a bar under a new `Epoch N/M` line is training again
    more = "Epoch 4/4\n1/1 [==============================] - ETA: 0s - loss: 16.1259\n"
    assert parse_text(fit + evaluate + more, KEYS)[-1].loss == 16.1259


def _keras_fit(epochs: int, steps: int = 40) -> str:
    """Keras 2's model.fit as a file holds it: each redraw erased with backspaces, then a carriage return; the mean
    loss of an epoch settles to four decimals late in the epoch, as it does."""
    out = []
    for e in range(1, epochs + 1):
        bars = []
        for k in range(1, steps + 1):
            loss = 0.05 / e + 0.01 / k
            bars.append(f"{k}/{steps} [{'=' * (k * 30 // steps)}>{'.' * (30 - k * 30 // steps)}] - ETA: {steps - k}s - "
                        f"loss: {loss:.4f} - accuracy: {0.9 + k / 1000:.4f}")
        bars.append(f"{steps}/{steps} [{'=' * 30}] - 35s 719ms/step - loss: {0.05 / e:.4f} - accuracy: 0.95 - val_loss: 0.05")
        out.append(f"Epoch {e}/{epochs}\n" + "".join(b + "\x08" * len(b) + "\r" for b in bars[:-1]) + bars[-1] + "\n")
    return "".join(out)


def test_keras_redraws_read_alike_however_the_carriage_returns_were_handed_over():
    # Retired blind 24 xb-016 as tools hand it over: with its carriage returns, turned into line ends (each redraw a
    # line: the epoch's running mean repeats at four decimals late in the epoch, no flat loss), or dropped (the
    # backspaces Keras erases each redraw with still separate them).
    text = _keras_fit(6)
    as_lf, dropped = text.replace("\r", "\n"), text.replace("\r", "")
    assert [classify_text(t).failure_class for t in (text, as_lf, dropped)] == ["none"] * 3
    closing = [m.loss for m in parse_text(dropped, KEYS)]
    assert closing == [round(0.05 / e, 4) for e in range(1, 7)]  # one record per epoch: its last redraw
    assert clean_line("1/4 [>...] - loss: 9.0" + "\x08" * 20 + "4/4 [====] - 1s 2ms/step - loss: 0.5") == "4/4 [====] - 1s 2ms/step - loss: 0.5"


def test_a_metric_at_a_step_is_read_after_its_colon():
    # RotatE-style KGE logging (retired blind b19qd-008): `<metric> at step N: value`.
    m = parse_line(Metric(1, "x"), KEYS, "Training average loss at step 175800: 0.061791")
    assert (m.step, m.named) == (175800.0, {"loss:training average loss": 0.061791})
    e = parse_line(Metric(1, "x"), KEYS, "Training average loss at epoch 3: 0.5")
    assert (e.epoch, e.step) == (3.0, None)


def test_a_source_files_line_number_and_a_sentence_about_cost_are_no_metrics():
    # A warning's location (`losses.py:49:`), glog's (`cost_estimator.cc:699]`), and a math problem an RL run prints among
    # its samples ("the cost of 6 cards") are no records; a key that ends in cost still is one.
    for line in ("/home/u/E2DTC/losses.py:49: UserWarning: Creating a tensor from a list of numpy.ndarrays is slow",
                 "W0000 00:00:1755712869.739954 1154753 op_level_cost_estimator.cc:699] Error in PredictCost()",
                 "1. **Calculate the cost of 6 cards from each box:**"):
        assert not parse_line(Metric(1, "x"), KEYS, line).named, line
    assert parse_line(Metric(1, "x"), KEYS, "epoch 3 train cost: 0.52").loss == 0.52
    assert parse_line(Metric(1, "x"), KEYS, "step 9 policy cost: 0.31").named == {"loss:policy cost": 0.31}


def test_keys_outside_the_table_are_ignored():
    # A NaN timer is not a NaN loss; an auxiliary loss is not the training loss.
    m = _one("{'batch_time': 0.0002, 'train_loss': 0.185, 'setup_proc_time_mean': nan, 'epoch': 2}")
    assert m.loss == 0.185 and m.grad_norm is None
    assert _one("mtp_1 loss: 1.115410E+00 | load_balancing_loss: 1.02").loss is None
    assert normalise_key("train/loss") == "train loss" and normalise_key("'grad_norm'") == "grad norm" and normalise_key("[Loss]") == "loss"


def test_tqdm_redraws_are_deduplicated_by_step():
    # torchtune redraws each step's loss on the next step's bar (`1|26|Loss: 1.2436: 26%| 26/101` then `... 27/101`): the
    # same postfix on two counts is one record, never a flat run.
    text = (LOGS / "none-healthy-torchtune-lora-multinode.log").read_text()
    losses = [m.loss for m in parse_text(text, KEYS)]
    assert losses[:5] == [1.2621808052062988, 1.2436443567276, 1.1958776712417603, 1.2151892185211182, 1.2168413400650024]
    a, b = Metric(1, "x", step=3, loss=1.0), Metric(2, "y", step=3, loss=1.0)
    assert dedupe([a, b]) == [a]


def test_a_count_out_of_a_total_is_the_step_and_the_loss_keeps_its_key():
    lines = _lines("none--dev7f-015.log")  # a two-phase run: "Loss" in pre-training, "Avg Loss" per epoch
    pre = _one(lines[15])
    assert (pre.step, pre.loss, pre.loss_key) == (20.0, 6.4668, "loss")  # "Pre-training iteration 20/100, Loss: 6.4668"
    main = _one(lines[27])
    assert (main.epoch, main.loss, main.loss_key) == (1.0, 51136.5554, "avg loss")  # "Epoch 1/10, Avg Loss: ..."
    assert _one("Step [40/500] lr 0.001 loss 1.25").step == 40.0 and _one("batch: 7/120 loss=0.5").step == 7.0
    assert _one("epoch 3 loss 0.5 batch_size 32/64").step is None  # a setting is no count


def test_a_notebooks_interrupt_ends_a_run_and_wandb_names_a_dropped_records_step():
    lines = _lines("none--dev7f-017.log")  # a notebook cell stopped by hand, then training resumed under wandb
    stop = _one(clean_line(lines[461]))  # "\x1b[0;31mKeyboardInterrupt\x1b[0m: " - the traceback's last line
    assert stop.run_end is not None and carries(stop)
    assert _one(clean_line(lines[202])).run_end is not None  # its first line, "KeyboardInterrupt   Traceback (most recent call last)"
    assert _one("    raise KeyboardInterrupt()").run_end is None  # a frame that quotes it is no stop
    dropped = _one(clean_line(lines[574]))  # wandb: WARNING (User provided step: 883 is less than current step: 884. Dropping entry: {...})
    assert (dropped.step, dropped.loss) == (883.0, 2.6767020225524902)


def test_a_log_is_read_in_the_encoding_its_first_bytes_show():
    import codecs

    from finetune_mcp.triage.parse import decode_log, log_encoding

    data = (LOGS / "environment--dev9z-001.log").read_bytes()  # PowerShell's `python main.py > output.log 2>&1`
    assert data.startswith(codecs.BOM_UTF16_LE) and log_encoding(data) == "utf-16"
    text = decode_log(data)
    assert "ValueError: ndarray is not C-contiguous" in text and "\x00" not in text
    assert log_encoding(data[2:]) == "utf-16-le" and decode_log(data[2:]) == text  # the BOM lost: NULs say it
    assert decode_log(codecs.BOM_UTF8 + b"loss: 1.0\n") == "loss: 1.0\n"
    gbk = "loss 表 1.0\n".encode("gbk")
    assert log_encoding(gbk) == "utf-8" and "loss" in decode_log(gbk)  # not UTF-8 at all: read around it


def test_records_and_numbers():
    out = parse_records([{"step": 1, "loss": None}, {"step": 2, "loss": 1.5, "lr": 1e-4}, "junk"], KEYS)
    assert math.isnan(out[0].loss) and out[1].loss == 1.5 and len(out) == 2  # poll writes NaN as null
    assert to_number("1,024") == 1024.0 and to_number("[5e-05]") == 5e-05 and to_number("abc") is None and to_number(True) is None


# --- logs as they really are (issue 32) ------------------------------------------------------------


def test_clean_line_drops_escapes_bars_and_prefixes():
    from finetune_mcp.triage.parse import clean_line

    assert clean_line("\x1b[33m(raylet)\x1b[0m Task was killed due to the node running low on memory") == \
        "Task was killed due to the node running low on memory"
    assert clean_line("^[[33m(raylet)^[[0m [2024-08-13 13:53:27,026 E 85978 86010] (raylet) node_manager.cc:3069: x") == "node_manager.cc:3069: x"
    assert clean_line("[36m(WorkerDict pid=150008)[0m loss: 2.1") == "loss: 2.1"  # the ESC byte lost in a paste
    assert clean_line("ESC[31mESC[1mERROR   ESC[0m | loss is nan") == "ERROR    | loss is nan"  # ESC spelled out by a viewer
    assert clean_line("(RayWorker pid=1, ip=10.0.0.1) Killed") == "Killed"
    assert clean_line("[rank3]: torch.OutOfMemoryError: CUDA out of memory.") == "torch.OutOfMemoryError: CUDA out of memory."
    assert clean_line("10.0.0.1: RuntimeError: NCCL error") == "RuntimeError: NCCL error"
    assert clean_line("2020-12-08 21:40:40.870695  | actor_loss/Median  nan") == " | actor_loss/Median  nan"  # one separator goes
    assert clean_line("[ 1234.567890] Out of memory: Killed process 42 (python)") == "Out of memory: Killed process 42 (python)"
    assert clean_line("  1%|▏   | 1/90 [00:01<01:30]\r  2%|▎   | 2/90 [00:02<01:29]\r{'loss': 1.5}") == "{'loss': 1.5}"
    assert clean_line('  File "train.py", line 3, in <module>') == '  File "train.py", line 3, in <module>'  # no prefix: untouched
    # A prefix and the one space after it go; the line keeps its own indentation (a traceback frame stays a frame).
    assert clean_line('[rank0]:   File "train.py", line 3, in <module>') == '  File "train.py", line 3, in <module>'
    # Loggers' levels and names: python logging (its default and the examples' format), Hydra, transformers'
    # and LLaMA-Factory's, loguru, PaddleDetection's; journald; srun --label; a CRI log line; docker compose.
    for prefixed in ("2024-05-01 12:00:00,123 - root - INFO - Traceback (most recent call last):",
                     "10/15/2023 14:46:49 - WARNING - __main__ - Traceback (most recent call last):",
                     "INFO:__main__:Traceback (most recent call last):",
                     "[2025-10-29 23:59:01,773][root][WARNING] - Traceback (most recent call last):",
                     "[INFO|configuration_utils.py:673] 2025-04-01 06:58:03,984 >> Traceback (most recent call last):",
                     "[INFO|2025-04-01 06:58:03] llamafactory.hparams.parser:373 >> Traceback (most recent call last):",
                     "2023-01-25 00:21:09.074 | ERROR    | trainers.base_trainer:train_epochs:256 - Traceback (most recent call last):",
                     "[2024/05/01 12:00:01] ppdet.engine INFO: Traceback (most recent call last):",
                     "Dec  6 12:00:01 gpu-node-3 python[12345]: Traceback (most recent call last):",
                     "  3: Traceback (most recent call last):",
                     "2024-05-01T12:00:01.123456789Z stderr F Traceback (most recent call last):",
                     "trainer-1  | Traceback (most recent call last):"):
        assert clean_line(prefixed) == "Traceback (most recent call last):", prefixed
    # pip's `ERROR:` under a CI runner's timestamp is the message, not a logger's level.
    assert clean_line("2024-05-01T12:00:01.1234567Z ERROR: No matching distribution found for torch==9") == \
        "ERROR: No matching distribution found for torch==9"
    assert clean_line("12: loss 0.5") == "loss 0.5" and clean_line("12: 0.5") == "12: 0.5"  # a task number, not a value
    # Escapes go before the carriage-return redraws: a bar's last segment may be only a colour reset or tqdm's cursor-up.
    assert clean_line("\x1b[31mKilled\r\x1b[0m") == "Killed" and clean_line("loss 0.5\r\x1b[A") == "loss 0.5"


def test_clean_lines_is_clean_line_on_every_corpus_log():
    # ... line by line, except in a terminal's wrapped capture, whose lines are first joined (a property of the whole
    # log): there the continuation lines are left empty, so line numbers stay the file's.
    from finetune_mcp.triage.parse import _last_segment, clean_line, clean_lines, split_lines, wrap_width

    wrapped = 0
    for p in LOGS.glob("*.log"):
        lines = split_lines(p.read_text(encoding="utf-8", errors="replace"))
        width = wrap_width([_last_segment(ln) if "\r" in ln else ln for ln in lines])
        out = clean_lines(lines)
        if width is None:
            assert out == [clean_line(ln) for ln in lines], p.name
        else:
            wrapped += 1
            assert len(out) == len(lines), p.name
            full = [i for i, ln in enumerate(lines) if len(ln) == width and i + 1 < len(lines)]
            assert all(out[i + 1] == "" for i in full), p.name
    assert wrapped < 20  # captures are rare: most logs are files a program wrote


PREFIXES = yaml.safe_load((Path(__file__).parent / "fixtures" / "log-prefixes.yaml").read_text())["prefixes"]
# Real logs whose verdict an added prefix changed before the line cleaner knew it: an anchored signal (Ctrl-C,
# Apptainer's FATAL, pip's ERROR), the fallback's KeyError rule, a traceback's frames under `[rank0]: `, a
# colour reset after a Windows line end, Keras bars redrawn under a timestamp, a notebook's caught spike.
PREFIX_PROBES = ("none--dev7f-012.log", "none--dev7f-017.log", "environment--dev7g-002.log", "environment--dev9f-012.log",
                 "environment--dev5g-019.log", "environment--dev4e-013.log", "none--dev4e-020.log", "environment--dev7f-005.log",
                 "divergence--stable-baselines-ppo1-actions-turn-nan.log")


@pytest.mark.parametrize("prefix", PREFIXES, ids=[p["name"] for p in PREFIXES])
def test_a_log_reads_the_same_under_every_prefix_its_writers_add(prefix):
    from finetune_mcp.triage import classify_text
    from finetune_mcp.triage.parse import clean_lines, decode_log, split_lines

    index = {c["file"]: c["class"] for c in yaml.safe_load((LOGS / "index.yaml").read_text())["cases"]}
    for name in PREFIX_PROBES:
        text = decode_log((LOGS / name).read_bytes())
        lines = text.split("\n")
        wrapped = "\n".join(prefix["format"].format(line=ln, ss=f"{i % 60:02d}") if ln else ln for i, ln in enumerate(lines))
        plain, read = classify_text(text), classify_text(wrapped)
        assert plain.failure_class == index[name], name
        assert (read.failure_class, read.signals) == (plain.failure_class, plain.signals), (prefix["name"], name)
        raw = split_lines(wrapped)
        assert clean_lines(raw) == [clean_line(ln) for ln in raw], (prefix["name"], name)


def test_a_redrawn_record_is_the_same_record_under_a_new_timestamp():
    lines = [f"[2024-05-01T12:00:0{i}.1Z] 10/20 [=====>....] - ETA: 3s - loss: 0.3732" for i in range(2)]
    assert len(parse_text("\n".join(lines), KEYS)) == 1


def test_ipython_shows_source_around_a_frame_and_that_source_is_no_record():
    from finetune_mcp.triage.parse import clean_lines, code_lines, decode_log, split_lines

    # A notebook's HF Trainer run stopped by hand: IPython prints trainer.py around each frame's running line.
    text = decode_log((LOGS / "none--dev10o-005.log").read_bytes())
    clean = clean_lines(split_lines(text))
    code = code_lines(clean)
    comment = next(i for i, ln in enumerate(clean) if "# if loss is nan or inf" in ln)
    running = next(i for i, ln in enumerate(clean) if ln.startswith("-> 2548"))
    assert comment in code and running not in code  # the neighbour is not output; the arrow's line ran
    assert not [m for m in parse_text(text, KEYS) if m.named or m.loss is not None]  # no NaN "loss" from the comment
    # Python's own traceback prints only the line that ran: a `raise` quoting the failure stays evidence.
    plain = ['Traceback (most recent call last):', '  File "train.py", line 9, in step', '    raise RuntimeError(" [!] NaN loss with loss.")']
    assert code_lines(plain) == set()


def test_named_metrics_of_any_name_and_format():
    from finetune_mcp.triage.parse import key_kind

    kinds = {k: key_kind(k) for k in ("value_loss", "actor/pg_loss", "loss_a", "lm loss avg", "kl", "approx_kl", "model_grad_norm",
                                      "grad_norm_actor/Max", "grad_scale", "scaler", "eval/val_loss", "max_grad_norm", "kl_coef",
                                      "init_loss_scale", "reward", "loss_weight", "DecoderLoss", "GradNormST")}
    assert kinds == {"value_loss": "loss", "actor/pg_loss": "loss", "loss_a": "loss", "lm loss avg": "loss", "kl": "kl",
                     "approx_kl": "kl", "model_grad_norm": "grad_norm", "grad_norm_actor/Max": "grad_norm", "grad_scale": "loss_scale",
                     "scaler": "loss_scale", "eval/val_loss": "eval_loss", "max_grad_norm": None, "kl_coef": None,
                     "init_loss_scale": None, "reward": "reward", "loss_weight": None, "DecoderLoss": "loss", "GradNormST": "grad_norm"}
    m = _one("step 7 | loss_a=1.25 loss_b=inf grad_norm=nan")
    assert m.step == 7 and m.named["loss:loss a"] == 1.25 and math.isinf(m.named["loss:loss b"]) and math.isnan(m.grad_norm)
    plain = _one("Epoch 3 Step 40 loss 2.1")
    assert (plain.step, plain.loss) == (40.0, 2.1)
    keras = _one("120/120 [==============================] - 3s 25ms/step - loss: 0.1000 - val_loss: nan")
    assert keras.loss == 0.1 and math.isnan(keras.eval_loss)
    rl = _one("{'actor/pg_loss': 0.02, 'critic/vf_loss': 4.1, 'actor/kl': nan}")
    assert rl.named == {"loss:actor pg loss": 0.02, "loss:critic vf loss": 4.1, "kl:actor kl": rl.named["kl:actor kl"]}
    assert math.isnan(rl.named["kl:actor kl"])
    # A setting is not a measurement: an infinite clip threshold is no NaN.
    assert _one("max_grad_norm=inf lr=2e-4").named == {}
    rows = parse_text("| step | value_loss | grad_scale |\n| 5 | 0.31 | 1024.0 |\n", KEYS)
    assert [(m.step, m.named) for m in rows] == [(5.0, {"loss:value loss": 0.31, "loss_scale:grad scale": 1024.0})]


def test_a_camelcase_key_a_qualified_key_and_the_bar_before_the_last_redraw():
    # JAX/Equinox's `LossTrajs` is a loss like `DecoderLoss`: camel case is split before the case is folded.
    m = _one("    Outer Step:     2      LossTrajs: 1.87387228     ContextsNorm: 0.03895722")
    assert m.named == {"loss:losstrajs": 1.87387228}
    # A qualifier in brackets between a key and its value is the key's, not a new key.
    assert _one("Step 60/3500 | Loss (avg over last 20): 9.9984").loss == 9.9984
    assert _one("epoch 3 loss (ce): 0.52").loss == 0.52
    # One line of carriage-return redraws whose last bar (validation) logs no loss: the training bar before it did.
    line = ("Training:  99%|#9| 290/294 [00:18<00:00, 16.39it/s, loss=0.27]\rTraining: 100%|#| 293/294 [00:18<00:00, "
            "14.28it/s, loss=0.0687]\rValidating: 100%|##########| 33/33 [00:02<00:00, 18.18it/s]")
    assert [m.loss for m in parse_text(line + "\n", KEYS)] == [0.0687]
    assert parse_text("Validating: 50%|#| 1/2 [00:01<00:01]\rValidating: 100%|##| 2/2 [00:02<00:00]\n", KEYS) == []
    # An OrderedDict of (name, value) tuples printed whole, as a plain loop's `print(f"training: {stats}")` does.
    m = _one("[Epoch 2] training: OrderedDict([('loss', nan), ('acc', 0.5)])")
    assert math.isnan(m.loss) and m.source == "tuples"
