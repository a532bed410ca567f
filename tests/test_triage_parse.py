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

from finetune_mcp.triage.parse import KeyMap, Metric, dedupe, normalise_key, parse_line, parse_records, parse_text, to_number
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


def test_keys_outside_the_table_are_ignored():
    # A NaN timer is not a NaN loss; an auxiliary loss is not the training loss.
    m = _one("{'batch_time': 0.0002, 'train_loss': 0.185, 'setup_proc_time_mean': nan, 'epoch': 2}")
    assert m.loss == 0.185 and m.grad_norm is None
    assert _one("mtp_1 loss: 1.115410E+00 | load_balancing_loss: 1.02").loss is None
    assert normalise_key("train/loss") == "train loss" and normalise_key("'grad_norm'") == "grad norm" and normalise_key("[Loss]") == "loss"


def test_tqdm_redraws_are_deduplicated_by_step():
    # torchtune prints each step's loss twice, on two tqdm positions: at most two in a row, never a flat run.
    text = (LOGS / "none-healthy-torchtune-lora-multinode.log").read_text()
    losses = [m.loss for m in parse_text(text, KEYS)]
    assert losses[:5] == [1.2621808052062988, 1.2436443567276, 1.2436443567276, 1.1958776712417603, 1.1958776712417603]
    a, b = Metric(1, "x", step=3, loss=1.0), Metric(2, "y", step=3, loss=1.0)
    assert dedupe([a, b]) == [a]


def test_records_and_numbers():
    out = parse_records([{"step": 1, "loss": None}, {"step": 2, "loss": 1.5, "lr": 1e-4}, "junk"], KEYS)
    assert math.isnan(out[0].loss) and out[1].loss == 1.5 and len(out) == 2  # poll writes NaN as null
    assert to_number("1,024") == 1024.0 and to_number("[5e-05]") == 5e-05 and to_number("abc") is None and to_number(True) is None
