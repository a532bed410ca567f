"""compare_runs: the runs of one experiment side by side, as a table and one PNG with their loss curves overlaid.

Every figure comes from what the run left in its directory: config.yaml (the values that differ from the
first run compared), the records (final and best loss), metrics.json (wall time, end-of-run eval loss),
the eval engineer's signed evaluation (task accuracy, eval loss: for the training role the one its
signed verdict embeds, since the evaluation files are eval-owned), logs/log_history.jsonl (tokens/s). Nothing is
written; the plot is drawn in a child process (jobs/plot_loss.py), like poll_progress's.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune_mcp import schemas as S
from finetune_mcp import signing
from finetune_mcp.common.errors import BadInput, FtError, NotFound
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain import progress
from finetune_mcp.domain.run_state import RunState, run_config, run_state
from finetune_mcp.domain.verdicts import read_eval_result, verify_evaluation
from finetune_mcp.worker import run_job
from finetune_mcp.workspace import parse_run_ref, read_json_file, validate_experiment


MAX_RUNS = 200
# Settings that are bookkeeping, not what a run varied.
_NOT_COMPARED = ("run", "tag", "sources", "call_sources", "warnings", "citations", "memory_estimate", "overrides", "backend_reason",
                 "brief", "skill", "method_label", "experiment")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            if prefix or k not in _NOT_COMPARED:
                out.update(_flat(v, f"{prefix}{k}."))
        return out
    if isinstance(d, list):
        return {prefix[:-1]: json.dumps(d)}
    return {prefix[:-1]: d}


def _settings(cfg: dict) -> dict[str, Any]:
    """The values a run was trained with, by dotted key. A generated config states each once under hparams
    (calls repeats them as library keywords), so only those are compared there."""
    flat = _flat(cfg)
    if any(k.startswith("hparams.") for k in flat):
        keep = ("hparams.", "method", "backend", "platform", "model.path", "data.dir", "data.train", "tracking.report_to")
        flat = {k: v for k, v in flat.items() if k.startswith(keep[0]) or k in keep[1:]}
    return flat


def _wall_s(run_json: dict | None, metrics: dict | None, state: RunState) -> float | None:
    if metrics and isinstance(metrics.get("train_runtime_s"), (int, float)):
        return float(metrics["train_runtime_s"])
    rj = run_json or {}
    start = rj.get("start_time") or _epoch(rj.get("created_at"))
    if not start:
        return None
    ex = state.exit or {}
    end = _epoch(ex.get("ended_at")) or (time.time() if state.status in ("starting", "running") else None)
    return round(end - float(start), 1) if end else None


def _epoch(iso: Any) -> float | None:
    try:
        return _dt.datetime.fromisoformat(str(iso)).timestamp() if iso else None
    except ValueError:
        return None


def _tokens_per_s(run_dir: Path) -> float | None:
    """Tokens over time between the first and the last trainer log that count tokens (the whole run's average)."""

    def parse(line: bytes) -> dict | None:
        try:
            d = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return None
        counted = isinstance(d, dict) and isinstance(d.get("time"), (int, float)) and any(k in d for k in progress.TOKEN_KEYS)
        return d if counted else None

    try:
        with open(run_dir / "logs" / "log_history.jsonl", "rb") as f:
            first = parse(f.readline())
            tail = progress.records_backward(f, os.fstat(f.fileno()).st_size, 1, parse, max_bytes=1 << 20)
    except OSError:
        return None
    if not first or not tail:
        return None
    last = tail[-1]
    for k in progress.TOKEN_KEYS:
        if isinstance(first.get(k), (int, float)) and isinstance(last.get(k), (int, float)) and last["time"] > first["time"]:
            # The first log already counts the tokens before it: the rate is over the stretch between the two.
            return (last[k] - first[k]) / (last["time"] - first["time"])
    return None


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _run_dirs(pc: PhaseContext, experiment: str, runs: list[str] | None) -> list[Path]:
    validate_experiment(experiment)
    root = pc.ws.output_root / experiment
    if runs:
        dirs = []
        for r in runs:
            ref = r if "/" in r else f"{experiment}/{r}"
            exp, _ = parse_run_ref(ref)
            if exp != experiment:
                raise BadInput(f"{r!r} is a run of {exp}, not of {experiment}", where="runs", fix=f"compare runs of one experiment; list {experiment}'s runs")
            dirs.append(pc.guard.check_read(pc.ws.run_dir(ref)))
    else:
        dirs = sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.yaml").is_file()) if root.is_dir() else []
    if not dirs:
        raise NotFound(f"{experiment} has no runs to compare", where=str(root), fix="launch_run first; compare_runs reads the runs it leaves")
    if len(dirs) > MAX_RUNS:
        raise BadInput(f"{len(dirs)} runs named; compare_runs takes at most {MAX_RUNS}", where="runs",
                       fix="name the runs to compare with runs=[...]")
    return dirs


def compare_runs(pc: PhaseContext, args: S.CompareRunsArgs) -> S.CompareResult:
    experiment = args.experiment
    dirs = _run_dirs(pc, experiment, args.runs)
    settings = [_settings(run_config(d)) for d in dirs]
    first = settings[0]
    varied = sorted({k for s in settings[1:] for k in set(s) | set(first) if s.get(k) != first.get(k)})
    rows, series = [], []
    for d, s in zip(dirs, settings):
        run_id = f"{experiment}/{d.name}"
        recs = progress.all_records(d)
        run_json = read_json_file(d / "run.json")
        state = run_state(d, run_json, has_records=bool(recs))
        metrics = read_json_file(d / "metrics.json") or {}
        finite = [r for r in recs if math.isfinite(r["loss"])]
        best = min(finite, key=lambda r: r["loss"]) if finite else None
        ev = _eval_result(pc, run_id)
        rows.append(S.CompareRow(
            run_id=run_id, status=state.status, differs={k: s.get(k) for k in varied},
            steps=recs[-1]["step"] if recs else 0,
            final_loss=_finite(recs[-1]["loss"]) if recs else None,
            best_loss=_finite(best["loss"]) if best else None, best_step=best["step"] if best else None,
            eval_loss=_finite((ev or {}).get("eval_loss")) or _finite((metrics.get("eval") or {}).get("eval_loss")),
            eval_accuracy=_finite((ev or {}).get("task_accuracy")),
            wall_s=_wall_s(run_json, metrics, state), tokens_per_s=_tokens_per_s(d),
            resumed_from=((run_config(d).get("run") or {}).get("resumed_from") or {}).get("run_id"),
        ))
        if finite:
            series.append({"label": d.name, "points": [[r["step"], r["loss"]] for r in finite]})
    best_row = min((r for r in rows if r.best_loss is not None), key=lambda r: r.best_loss, default=None)
    result = S.CompareResult(
        summary=f"{experiment}: {len(rows)} run(s); {len(varied)} setting(s) differ from {rows[0].run_id.split('/')[1]}"
                + (f"; lowest loss {best_row.best_loss:.4g} in {best_row.run_id.split('/')[1]} at step {best_row.best_step}" if best_row else ""),
        experiment=experiment, baseline=rows[0].run_id, varied=varied, runs=rows,
    )
    if args.plot and series:
        with tempfile.TemporaryDirectory(prefix="ftmcp-compare-") as tmp:
            out = Path(tmp) / "compare.png"
            run_job("plot_loss", {"out": str(out), "title": f"{experiment}: training loss", "series": series}, timeout=300, light=True)
            result._image_png = out.read_bytes()
    return result


def _eval_result(pc: PhaseContext, run_id: str) -> dict | None:
    """The verified signed evaluation of the run: from eval/ for the eval role, from the signed verdict for the
    training role (which may not read eval/); None when there is none, or it does not verify."""
    try:
        if pc.policy.may_sign_verdicts:
            return read_eval_result(pc.ws, run_id)
        path = pc.ws.verdict_path(*parse_run_ref(run_id))
        if not path.is_file():
            return None
        public = signing.load_public_key(pc.ws)
        block = signing.verify_report(pc.guard.read_text(path), public, str(path))
        ev = verify_evaluation(block.get("evaluation"), public, str(path)) if block.get("evaluation") else None
        return ev if ev and ev.get("run_id") == block.get("run_id") == run_id else None
    except FtError:
        return None
