"""progress.py alone: reading records by cursor, numbering a printed trainer log, the backward scan, throughput."""

from __future__ import annotations

import json
import time

import yaml

from finetune_mcp.domain import progress as P
from finetune_mcp.domain import run_state

RULE = P.SpikeRule(factor=3.0, window=5, min_history=3)


def make_run(tmp_path, *, progress_lines=None, stdout=None, config=None, history=None, writes_progress=True):
    d = tmp_path / "exp" / "20250101-0000-t"
    (d / "logs").mkdir(parents=True)
    (d / "train.py").write_text("# writes logs/progress.jsonl\n" if writes_progress else "# a plain script\n")
    if progress_lines is not None:
        (d / "logs" / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in progress_lines))
    if stdout is not None:
        (d / "logs" / "stdout.log").write_text(stdout)
    if config is not None:
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    if history is not None:
        (d / "logs" / "log_history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    P.forget()
    run_state.forget()
    return d


def rec(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "mem_gb": 1.0, "temp_c": None}


def test_read_pages_by_cursor_and_flags_a_spike(tmp_path):
    d = make_run(tmp_path, progress_lines=[rec(i, 1.0) for i in range(1, 6)] + [rec(6, 9.0)])
    first = P.read(d, 0, 4, RULE)
    assert [r["step"] for r in first.records] == [1, 2, 3, 4] and first.more and first.last["step"] == 6
    rest = P.read(d, first.next_cursor, 100, RULE)
    assert [r["step"] for r in rest.records] == [5, 6] and not rest.more
    assert [a.kind for a in rest.anomalies] == ["loss-spike"]
    # A server that never saw the run finds the same spike from the same cursor (bounded look-back).
    P.forget()
    again = P.read(d, first.next_cursor, 100, RULE)
    assert again.records == rest.records and [a.kind for a in again.anomalies] == ["loss-spike"]


def test_a_printed_trainer_log_is_numbered_with_a_logging_ratio(tmp_path):
    # logging_steps 0.1 of 30 steps logs every 3 steps; the printed dicts carry no step of their own.
    lines = "".join(f"{{'loss': {2.0 - i / 10}, 'grad_norm': 1.0, 'learning_rate': 0.001, 'epoch': {i / 10}}}\n" for i in range(4))
    d = make_run(tmp_path, stdout="warming up\n" + lines, writes_progress=False,
                 config={"calls": {"trainer": {"max_steps": 30, "logging_steps": 0.1}}})
    got = P.read(d, 0, 100, RULE)
    assert got.src.kind == "stdout" and [r["step"] for r in got.records] == [3, 6, 9, 12]
    assert P.all_records(d) == got.records and P.first_record(d)["step"] == 3


def test_backward_scan_reads_only_the_tail(tmp_path):
    d = make_run(tmp_path, progress_lines=[rec(i, 1.0) for i in range(1, 20001)])
    path = d / "logs" / "progress.jsonl"
    with open(path, "rb") as f:
        got = P.records_backward(f, path.stat().st_size, 3, P.parse_progress_line, max_bytes=1 << 16)
    assert [r["step"] for r in got] == [19998, 19999, 20000]


def test_throughput_and_eta_from_the_trainer_log(tmp_path):
    now = time.time()
    # Two steps a second, 512 tokens a step; a resume (step going back) starts the window afresh.
    old = [{"step": s, "loss": 1.0, "time": now - 1000 + s, "num_tokens": 100 * s} for s in range(1, 30)]
    new = [{"step": s, "loss": 1.0, "time": now - (40 - s) / 2, "num_tokens": 512 * s} for s in range(20, 41)]
    summary = {"step": 40, "train_runtime": 10.0, "time": now}
    d = make_run(tmp_path, progress_lines=[rec(40, 1.0)], history=old + new + [summary],
                 config={"calls": {"trainer": {"max_steps": 100}}})
    pace = P.throughput(d, 40, running=True)
    assert abs(pace.steps_per_s - 2.0) < 1e-6 and abs(pace.tokens_per_s - 1024.0) < 1e-3
    assert 29.0 < pace.eta_s <= 30.0  # 60 steps at 2 steps/s, less the moment since the newest log
    assert P.throughput(d, 40, running=False).eta_s is None
    assert P.throughput(make_run(tmp_path / "b", progress_lines=[]), None, running=True).tokens_per_s is None
