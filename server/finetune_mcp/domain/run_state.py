"""A run's state from its directory alone: run.json, exit.json, config.yaml, checkpoints/ and a liveness probe.

A server started after a crash therefore sees the same status as the one that launched the run: the
supervisor is probed by pid and start time (a recycled pid is never taken for the run), a Slurm job by
asking the scheduler, and what a run has ended with is read from exit.json.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp.common.errors import BadInput, FtError
from finetune_mcp.launchers import get_launcher
from finetune_mcp.workspace import read_json_file

TERMINAL = ("succeeded", "failed", "stopped")
# A run directory without run.json younger than this is still being launched.
LAUNCH_GRACE_S = 120.0


@dataclass
class RunState:
    status: str
    exit_code: int | None = None
    signal: str | None = None
    detail: str | None = None
    exit: dict | None = None


def _state_from_exit(ex: dict) -> RunState:
    rc, sig = ex.get("returncode"), ex.get("signal")
    how = f"killed by {sig}" if sig else f"exit status {rc}"
    if ex.get("stopped_by"):
        return RunState("stopped", rc, sig, f"stopped by {ex['stopped_by']} ({how})", ex)
    if rc == 0:
        return RunState("succeeded", 0, None, "finished with exit status 0", ex)
    if sig == "SIGKILL":
        detail = ("killed by SIGKILL without a stop request — the signature of the kernel's out-of-memory killer; "
                  "triage_failure(run_id) reads the evidence")
    elif sig:
        detail = f"killed by {sig} without a stop request; triage_failure(run_id) reads the log"
    else:
        detail = f"exited with status {rc}; triage_failure(run_id) reads the log"
    return RunState("failed", rc, sig, detail, ex)


def run_state(run_dir: Path, run_json: dict | None, has_records: bool) -> RunState:
    """The run's status from its files and a liveness probe only."""
    if run_json is not None and run_json.get("launcher") == "slurm" and run_json.get("job_id"):
        return _scheduler_state(run_dir, run_json, has_records)
    ex = read_json_file(run_dir / "exit.json")
    if ex is not None:
        return _state_from_exit(ex)
    if run_json is None:
        try:
            age = time.time() - run_dir.stat().st_mtime
        except OSError:
            age = 0.0
        if age < LAUNCH_GRACE_S:
            return RunState("starting", detail="launch in progress")
        return RunState("failed", detail="the launch never completed: run.json was not written")
    try:
        alive = get_launcher(run_json.get("launcher") or "local").alive(run_dir, run_json)
    except FtError:
        alive = False
    if alive:
        return RunState("running" if has_records else "starting")
    ex = read_json_file(run_dir / "exit.json")  # it may have ended between the two looks
    if ex is not None:
        return _state_from_exit(ex)
    return RunState("failed", detail=(f"the run's supervisor (pid {run_json.get('pid')}) is gone and recorded no exit: "
                                      "the machine rebooted, or the supervisor itself was killed"))


def _scheduler_state(run_dir: Path, run_json: dict, has_records: bool) -> RunState:
    """A Slurm job: the scheduler's word while it knows the job (PENDING and why, TIMEOUT, NODE_FAIL), then
    what the job wrote into the run directory (launchers/slurm.py)."""
    st = get_launcher("slurm").state(run_dir, run_json)
    status = "starting" if st["status"] == "running" and not has_records else st["status"]
    return RunState(status, st.get("exit_code"), st.get("signal"), st.get("detail"), read_json_file(run_dir / "exit.json"))


def live_runs(output_root: Path) -> list[dict]:
    """run.json of every run under OUTPUT_ROOT whose supervisor is still alive."""
    out = []
    if not output_root.is_dir():
        return out
    for rj_path in output_root.glob("*/*/run.json"):
        run_dir = rj_path.parent
        if (run_dir / "exit.json").exists():
            continue
        try:
            rj = json.loads(rj_path.read_text())
            if get_launcher(rj.get("launcher") or "local").alive(run_dir, rj):
                out.append(rj)
        except (OSError, ValueError, FtError):
            continue
    return out


# ---------------------------------------------------------------- the resolved config of a run


_RUN_CONFIG: dict[str, dict] = {}
_LOCK = threading.Lock()


def run_config(run_dir: Path) -> dict:
    """The run's config.yaml ({} when missing or unreadable); a run's config never changes once written."""
    key = str(run_dir)
    with _LOCK:
        if key in _RUN_CONFIG:
            return _RUN_CONFIG[key]
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    with _LOCK:
        _RUN_CONFIG[key] = cfg
    return cfg


def config_value(run_dir: Path | dict, key: str) -> Any:
    """A trainer setting of this run (or of a config dict): the trainer call's own keyword (calls.trainer) first,
    else the key anywhere."""
    cfg = run_dir if isinstance(run_dir, dict) else run_config(run_dir)
    trainer = (cfg.get("calls") or {}).get("trainer") if isinstance(cfg.get("calls"), dict) else None
    if isinstance(trainer, dict) and key in trainer:
        return trainer[key]
    return _find_value(cfg, key)


def _find_value(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        if key in obj and not isinstance(obj[key], (dict, list)):
            return obj[key]
        for v in obj.values():
            r = _find_value(v, key)
            if r is not None:
                return r
    return None


def logging_every(cfg: dict | Path) -> int:
    """Steps between two trainer logs, as transformers counts them: a whole number >= 1 is the step count; a
    value in (0, 1) is a share of max_steps, rounded up (Trainer: ceil(max_steps * logging_steps)); unset is 1.

    The one place logging_steps is read: launch_run refuses a config this rejects, and the progress reader
    numbers the records of a trainer's printed log with it.
    """
    where = "logging_steps" if isinstance(cfg, dict) else f"{Path(cfg) / 'config.yaml'}: logging_steps"
    raw = config_value(cfg, "logging_steps")
    if raw is None:
        return 1
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw <= 0:
        raise BadInput(f"logging_steps {raw!r} is not a positive number", where=where,
                       fix="set logging_steps to a whole number of steps (e.g. 10) or a share of the run below 1 (e.g. 0.1)")
    if raw >= 1:
        if raw != int(raw):
            raise BadInput(f"logging_steps {raw!r} is neither a whole number of steps nor a share below 1", where=where,
                           fix=f"use {int(raw)} or {int(raw) + 1}")
        return int(raw)
    max_steps = config_value(cfg, "max_steps")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0:
        raise BadInput(f"logging_steps {raw!r} is a share of the run, but the run sets no max_steps to take it of", where=where,
                       fix="give logging_steps as a whole number of steps, or set max_steps")
    return max(1, math.ceil(max_steps * raw))


# ---------------------------------------------------------------- checkpoints


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of each trainer checkpoint of the run, oldest first."""
    out = []
    for p in (run_dir / "checkpoints").glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(run_dir: Path) -> str | None:
    cps = checkpoints(run_dir)
    return str(cps[-1][1]) if cps else None


def forget() -> None:
    """Drop what this server remembers of runs' configs (as a freshly started server would)."""
    with _LOCK:
        _RUN_CONFIG.clear()
