"""Phase 4 at run time: launch_run, poll_progress, stop_run, prune_checkpoints.

A run's state lives only in its directory (run.json, exit.json, logs/) plus a liveness probe of
the recorded supervisor (pid and start time, so a recycled pid is never taken for the run). A
server started after a crash therefore sees the same records and the same status as the one that
launched the run.

poll_progress cursor: a byte offset into the run's record source, always at a line boundary.
The source is logs/progress.jsonl (written by our train.py); a run whose train.py never writes
that file (a hand-written script without our callback) is read from logs/stdout.log instead,
where the trainer prints its log dicts. The source of a run never changes: while a train.py that
writes progress.jsonl has not created it yet, polls return nothing and keep the cursor at 0. A
partial last line (the trainer is mid-write) is not consumed; a poll reads only the bytes after
the cursor, plus a bounded look-back of at most the spike window when this server has not seen
the run before. The trainer's printed dicts carry no step: from stdout.log, the n-th record is
step n x logging_steps (from config.yaml), and mem_gb / temp_c are null.
"""

from __future__ import annotations

import ast
import collections
import fcntl
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp import schemas as S
from finetune_mcp.context import PhaseContext
from finetune_mcp.digest import verify_folder
from finetune_mcp.errors import BadInput, FtError, NotFound, Refused
from finetune_mcp.launchers import get_launcher
from finetune_mcp.launchers.base import STOP_MARKER, RunSpec
from finetune_mcp.workspace import atomic_write_json, file_state, git, new_run_id, utc_now, validate_tag

RECORD_KEYS = ("step", "loss", "lr", "mem_gb", "temp_c")
# A loss spike is what triage calls one (dgx-spark-ops failure-signals table, `records`: above
# spike_factor x the median of the previous spike_window finite losses, once spike_min_history of them
# exist), so a poll and a later triage of the same run agree. A live run with no new record for
# FINETUNE_MCP_STALL_MINUTES (default 10) has stalled.
STALL_MINUTES_DEFAULT = 10.0
# A run directory without run.json younger than this is still being launched.
LAUNCH_GRACE_S = 120.0
TERMINAL = ("succeeded", "failed", "stopped")
_CHUNK = 1 << 16


# ================================================================ launch_run


def launch_run(pc: PhaseContext, experiment: str, tag: str, accept_warnings: bool = False, launcher: str = "local",
               nproc: int = 1, nodes: int = 1, gpus_per_node: int | None = None, partition: str | None = None,
               time_limit: str | None = None, account: str | None = None) -> S.LaunchResult:
    validate_tag(tag)
    exp_dir = pc.guard.check_read(pc.ws.experiment_dir(experiment))
    slurm_only = {"nodes": nodes if nodes != 1 else None, "gpus_per_node": gpus_per_node, "partition": partition,
                  "time_limit": time_limit, "account": account}
    given = [k for k, v in slurm_only.items() if v is not None]
    if launcher != "slurm" and given:
        raise BadInput(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only to launcher='slurm'",
                       where=given[0], fix=f"drop {', '.join(given)} for launcher={launcher!r}, or launch with launcher='slurm'")
    if launcher == "local" and nproc != 1:
        raise BadInput("launcher='local' runs one process", where="nproc", fix="use launcher='torchrun' for nproc > 1")
    lau = get_launcher(launcher)

    # (a)-(c): no preflight, a blocked one, or warnings the caller has not accepted.
    report, report_path = _env_report(pc, exp_dir, experiment)
    warnings = _preflight_gate(report, report_path, accept_warnings, experiment)

    # (d): the config and the script that will run must be exactly what is committed.
    repo = pc.ws.experiments_repo
    run_cfg = exp_dir / "configs" / f"run-{tag}.yaml"
    script = exp_dir / "train.py"
    for p, what in ((run_cfg, f"configs/run-{tag}.yaml"), (script, "train.py")):
        if not p.is_file():
            raise NotFound(f"{experiment} has no {what}", where=str(p),
                           fix=f"run generate_config(experiment={experiment!r}, tag={tag!r}); it writes and commits the config and train.py")
    checked = [run_cfg, script] + ([exp_dir / "configs" / "base.yaml"] if (exp_dir / "configs" / "base.yaml").is_file() else [])
    for p in checked:
        state = file_state(repo, p)
        rel = p.relative_to(exp_dir).as_posix()
        if state == "untracked":
            raise Refused(f"{rel} is not committed: a run whose config is not committed cannot be reproduced", where=str(p),
                          fix=f"run generate_config(experiment={experiment!r}, tag={tag!r}), which commits it, then launch again")
        if state == "modified":
            raise Refused(f"{rel} has changed since its last commit: the run would not match any commit", where=str(p),
                          fix="commit the change (or run generate_config again, which commits), or restore the committed version; then launch")
    commit = git(repo, "rev-parse", "HEAD").strip()

    device = "cpu" if report.get("platform") == "cpu" else "cuda"
    gpus = _gpu_ids(device)
    run_id = new_run_id(tag)
    run_ref = f"{experiment}/{run_id}"
    run_dir = pc.guard.check_write(pc.ws.output_root / experiment / run_id)
    from finetune_mcp.worker import child_env, train_python

    env = child_env()
    if device == "cpu":
        # A CPU run shares its cores (with the server, the agent, other runs). OpenMP threads that
        # spin while they wait for a core starve everything else: measured here (2 cores, load ~4),
        # the tiny SFT run did 1.5 steps/s by default and 21.6 with passive waiting.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    spec = RunSpec(run_ref=run_ref, run_dir=run_dir, python=train_python(), nproc=nproc, device=device, gpus=gpus,
                   env=env, mounts={"output_root": pc.ws.output_root, "datasets": pc.ws.datasets_dir,
                                            "base_models": pc.ws.base_models_dir},
                   options=({"nodes": nodes, "gpus_per_node": gpus_per_node, "partition": partition,
                             "time_limit": time_limit, "account": account} if launcher == "slurm" else {}))
    lau.check(spec)

    # (f) then (e): an existing run id; a live run holding the same devices.
    if run_dir.exists():
        raise Refused(f"run {run_ref} already exists", where=str(run_dir),
                      fix="run ids carry the minute they started: launch again in a minute, or use another tag")
    if launcher != "slurm":  # the scheduler allocates a Slurm job's nodes; this machine's runs are not in its way
        _refuse_busy(pc, spec)

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_dir.mkdir()
    except FileExistsError:
        raise Refused(f"run {run_ref} already exists", where=str(run_dir), fix="launch again in a minute, or use another tag") from None
    try:
        created = utc_now()
        meta = {"run_id": run_ref, "run_dir": str(run_dir), "experiment_commit": commit, "launcher": launcher,
                "created_at": created}
        config = _resolve_config(exp_dir, tag, meta)
        # The reproducibility record exists before anything runs (layout seed, rule 3).
        pc.guard.write_text(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
        copied = []
        for rel in ("env-report.json", "training-brief.md", "data/dataset-card.md", "data/validation-report.md", "train.py"):
            src = exp_dir / rel
            if src.is_file():
                pc.guard.write_bytes(run_dir / rel, pc.guard.read_bytes(src))
                copied.append(rel)
        (run_dir / "logs").mkdir()
        # The run takes the machine (on a unified-memory box, its memory too): the warm job worker steps aside.
        from finetune_mcp.worker import release_warm

        release_warm()
        rec = lau.start(spec)
        run_json = {"run_id": run_ref, **rec, "launcher": launcher, "created_at": created, "device": device,
                    "gpus": list(gpus), "nproc": nproc, "train_python": spec.python, "experiment_commit": commit}
        pc.guard.write_text(run_dir / "run.json", json.dumps(run_json, indent=2) + "\n")
    except BaseException:
        # Nothing partial: a launch that did not start leaves no run directory behind.
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    missing = [r for r in ("training-brief.md", "data/dataset-card.md", "data/validation-report.md") if r not in copied]
    where = f"slurm job {rec['job_id']}" if rec.get("job_id") else f"supervisor pid {rec['pid']}"
    _roadbook(pc, run_dir, "launched",
              f"launch_run: {launcher} (nproc {nproc}, {device}{' ' + ','.join(gpus) if gpus else ''}), {where}, "
              f"experiment commit {commit[:12]}" + (f"; accepted warnings: {'; '.join(warnings)}" if warnings else "")
              + (f"; not found to copy: {', '.join(missing)}" if missing else ""))
    return S.LaunchResult(
        summary=f"launched {run_ref} ({launcher}, {where}); follow it with poll_progress(run_id={run_ref!r})",
        citations=_cites(pc, ("spark-preflight", "verdict"), ("dgx-spark-ops", "run-layout")),
        run_id=run_ref, run_dir=str(run_dir), launcher=launcher, pid=rec.get("pid"), job_id=rec.get("job_id"),
        command=[str(c) for c in rec.get("command", [])], commit=commit, warnings_accepted=warnings,
    )


def _env_report(pc: PhaseContext, exp_dir: Path, experiment: str) -> tuple[dict, Path]:
    path = exp_dir / "env-report.json"
    if not path.is_file():
        raise Refused(f"{experiment} has no env-report.json: no preflight, no launch", where=str(path),
                      fix=f"run preflight(experiment={experiment!r}) first")
    try:
        report = json.loads(pc.guard.read_text(path))
    except json.JSONDecodeError as e:
        raise BadInput(f"env-report.json is not valid JSON: {e.msg}", where=f"{path}:{e.lineno}:{e.colno}",
                       fix=f"run preflight(experiment={experiment!r}) again; it rewrites the report") from None
    if not isinstance(report, dict) or report.get("verdict") not in ("ready", "ready-with-warnings", "blocked"):
        raise BadInput("env-report.json has no verdict (ready / ready-with-warnings / blocked)", where=f"{path}: verdict",
                       fix=f"run preflight(experiment={experiment!r}) again; it rewrites the report")
    return report, path


def _check_line(c: dict) -> str:
    s = f"{c.get('id', '?')} {c.get('name', '')}".strip() + f" ({c.get('status')}): observed {c.get('observed', '?')}"
    if c.get("threshold"):
        s += f", needs {c['threshold']}"
    if c.get("remediation"):
        s += f" — {c['remediation']}"
    return s


def _preflight_gate(report: dict, path: Path, accept_warnings: bool, experiment: str) -> list[str]:
    checks = [c for c in report.get("checks") or [] if isinstance(c, dict)]
    if report["verdict"] == "blocked":
        failing = [_check_line(c) for c in checks if c.get("status") == "fail"] or ["(the report names no failing check)"]
        raise Refused(
            "preflight verdict is blocked; failing checks:\n  " + "\n  ".join(failing),
            where=str(path),
            fix=(f"fix what those checks name, then re-run preflight(experiment={experiment!r}) and launch only on its new verdict; "
                 "relaunching without a fresh preflight only spends another run on the same diagnosis"),
        )
    warnings = [_check_line(c) for c in checks if c.get("status") == "warn"]
    if report["verdict"] == "ready-with-warnings":
        if not accept_warnings:
            raise Refused(
                "preflight verdict is ready-with-warnings; launching is the caller's decision:\n  " + "\n  ".join(warnings or ["(no check listed)"]),
                where=str(path),
                fix="if these warnings are acceptable for this run, call launch_run again with accept_warnings=true; otherwise fix them and re-run preflight",
            )
        return warnings
    return []


def _gpu_ids(device: str) -> tuple[str, ...]:
    if device == "cpu":
        return ()
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return ("all",)
    return tuple(x.strip() for x in vis.split(",") if x.strip())


def max_cpu_runs() -> int:
    raw = os.environ.get("FINETUNE_MCP_MAX_CPU_RUNS", "1")
    try:
        return max(1, int(raw))
    except ValueError:
        raise BadInput(f"FINETUNE_MCP_MAX_CPU_RUNS={raw!r} is not a whole number", where="FINETUNE_MCP_MAX_CPU_RUNS",
                       fix="set it to the number of CPU runs allowed at once, e.g. 1") from None


def live_runs(pc: PhaseContext) -> list[dict]:
    """run.json of every run under OUTPUT_ROOT whose supervisor is still alive."""
    out = []
    root = pc.ws.output_root
    if not root.is_dir():
        return out
    for rj_path in root.glob("*/*/run.json"):
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


def _refuse_busy(pc: PhaseContext, spec: RunSpec) -> None:
    live = [r for r in live_runs(pc) if r.get("launcher") != "slurm"]  # those run on the cluster's nodes
    if spec.device == "cpu":
        cpu = [r for r in live if r.get("device") == "cpu"]
        limit = max_cpu_runs()
        if len(cpu) >= limit:
            raise Refused(
                f"{len(cpu)} CPU run(s) already live, the limit is {limit}: " + ", ".join(r["run_id"] for r in cpu),
                where="FINETUNE_MCP_MAX_CPU_RUNS",
                fix="wait for it to finish (poll_progress) or stop it (stop_run); or raise FINETUNE_MCP_MAX_CPU_RUNS for the server",
            )
        return
    mine = set(spec.gpus)
    for r in live:
        theirs = set(r.get("gpus") or [])
        if r.get("device") == "cuda" and ("all" in mine or "all" in theirs or mine & theirs):
            held = ",".join(sorted(theirs)) or "all"
            raise Refused(
                f"run {r['run_id']} is live on GPU(s) {held}, which this run would share",
                where="CUDA_VISIBLE_DEVICES",
                fix="wait for it (poll_progress) or stop it (stop_run); or give each run its own GPUs with CUDA_VISIBLE_DEVICES for the server",
            )


def _resolve_config(exp_dir: Path, tag: str, meta: dict) -> dict:
    from finetune_mcp.phases.config import resolve_run_config

    return resolve_run_config(exp_dir, tag, meta)


# ================================================================ status


@dataclass
class RunState:
    status: str
    exit_code: int | None = None
    signal: str | None = None
    detail: str | None = None
    exit: dict | None = None


def _read_json_file(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, OSError):
        return None


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
    ex = _read_json_file(run_dir / "exit.json")
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
    ex = _read_json_file(run_dir / "exit.json")  # it may have ended between the two looks
    if ex is not None:
        return _state_from_exit(ex)
    return RunState("failed", detail=(f"the run's supervisor (pid {run_json.get('pid')}) is gone and recorded no exit: "
                                      "the machine rebooted, or the supervisor itself was killed"))


def _scheduler_state(run_dir: Path, run_json: dict, has_records: bool) -> RunState:
    """A Slurm job: the scheduler's word while it knows the job (PENDING and why, TIMEOUT, NODE_FAIL), then
    what the job wrote into the run directory (launchers/slurm.py)."""
    st = get_launcher("slurm").state(run_dir, run_json)
    status = "starting" if st["status"] == "running" and not has_records else st["status"]
    return RunState(status, st.get("exit_code"), st.get("signal"), st.get("detail"), _read_json_file(run_dir / "exit.json"))


# ================================================================ records


def _num(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError("boolean")
    return float(v)


def normalise_record(d: Any) -> dict | None:
    """Exactly {"step","loss","lr","mem_gb","temp_c"} in that order, or None for a line that is not a record."""
    if not isinstance(d, dict) or "step" not in d or "loss" not in d or "lr" not in d:
        return None
    try:
        step = int(d["step"])
        loss = _num(d["loss"])
        lr = _num(d["lr"])
        mem = _num(d.get("mem_gb"))
        temp = _num(d.get("temp_c"))
    except (TypeError, ValueError):
        return None
    if loss is None or lr is None:
        return None
    return {"step": step, "loss": loss, "lr": lr, "mem_gb": mem, "temp_c": temp}


def _parse_progress_line(line: bytes) -> dict | None:
    line = line.strip()
    if not line:
        return None
    try:
        return normalise_record(json.loads(line))
    except (ValueError, UnicodeDecodeError):
        return None


_LOG_DICT = re.compile(r"\{'loss': [^{}]*\}")


def _parse_stdout_line(line: bytes) -> dict | None:
    """A trainer log dict as printed by transformers (PrinterCallback / ProgressCallback), without its step."""
    if b"'loss'" not in line:
        return None
    text = line.decode("utf-8", "replace")
    for m in reversed(list(_LOG_DICT.finditer(text))):
        try:
            d = ast.literal_eval(m.group(0))
        except (ValueError, SyntaxError):
            continue
        if isinstance(d, dict) and "learning_rate" in d:
            try:
                return {"loss": float(d["loss"]), "lr": float(d["learning_rate"])}
            except (TypeError, ValueError):
                return None
    return None


@dataclass
class _Source:
    kind: str  # "progress" | "stdout"
    path: Path


_WRITES_PROGRESS: dict[str, bool] = {}


def _record_source(run_dir: Path) -> _Source | None:
    prog = run_dir / "logs" / "progress.jsonl"
    if prog.exists():
        return _Source("progress", prog)
    key = str(run_dir)
    if key not in _WRITES_PROGRESS:
        try:
            _WRITES_PROGRESS[key] = b"progress.jsonl" in (run_dir / "train.py").read_bytes()
        except OSError:
            _WRITES_PROGRESS[key] = True
    if _WRITES_PROGRESS[key]:
        return None
    out = run_dir / "logs" / "stdout.log"
    return _Source("stdout", out) if out.exists() else None


@dataclass
class _Cache:
    """What one server remembers of a run's source between polls (a pure speed-up: never required)."""

    ino: int
    offset: int
    window: collections.deque = field(default_factory=collections.deque)
    ordinal: int = 0  # stdout source: records before offset
    last: dict | None = None  # the newest record before offset


_CACHE: dict[str, _Cache] = {}
_CACHE_LOCK = threading.Lock()


def _lines_forward(f, start: int, limit_records: int, parse) -> tuple[list[tuple[int, dict]], int, bool, int]:
    """Parse complete lines from `start` until limit_records records; returns (records with end offsets, next offset, more, lines seen)."""
    f.seek(start)
    out: list[tuple[int, dict]] = []
    pos = start
    buf = b""
    lines = 0
    eof = False
    while len(out) < limit_records and not eof:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        buf += chunk
        i = 0
        while len(out) < limit_records:
            nl = buf.find(b"\n", i)
            if nl < 0:
                break
            rec = parse(buf[i:nl])
            lines += 1
            pos += nl + 1 - i
            i = nl + 1
            if rec is not None:
                out.append((pos, rec))
        buf = buf[i:]
    more = False
    if len(out) >= limit_records:
        # Are there further records past `pos`? Look for one more complete line that parses.
        f.seek(pos)
        rest = b""
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            rest += chunk
            j = 0
            while (nl := rest.find(b"\n", j)) >= 0:
                if parse(rest[j:nl]) is not None:
                    more = True
                    break
                j = nl + 1
            if more:
                break
            rest = rest[j:]
    return out, pos, more, lines


def _records_backward(f, end: int, want: int, parse, max_bytes: int = 8 << 20) -> list[dict]:
    """Up to `want` records from complete lines ending at or before `end`, oldest first (bounded read)."""
    found: list[dict] = []
    pos = end
    tail = b""
    scanned = 0
    first = True
    block_size = 4096  # the last record or two usually sit in the last few kilobytes
    while pos > 0 and len(found) < want and scanned < max_bytes:
        step = min(block_size, pos)
        block_size = _CHUNK
        pos -= step
        f.seek(pos)
        block = f.read(step) + tail
        scanned += step
        lines = block.split(b"\n")
        if first:
            lines.pop()  # what follows the last newline is a line still being written, never a record yet
            first = False
        # lines[0] may be cut at the block start unless we reached the file start.
        tail = lines[0] if pos > 0 and lines else b""
        complete = lines[1:] if pos > 0 else lines
        for ln in reversed(complete):
            rec = parse(ln)
            if rec is not None:
                found.append(rec)
                if len(found) >= want:
                    break
    found.reverse()
    return found


def _check_cursor(f, cursor: int, size: int, src: _Source) -> None:
    if cursor > size:
        raise BadInput(f"cursor {cursor} is past the end of {src.path.name} ({size} bytes)", where="cursor",
                       fix="pass the next_cursor of your previous poll, or 0 to read from the start")
    if cursor > 0:
        f.seek(cursor - 1)
        if f.read(1) != b"\n":
            raise BadInput(f"cursor {cursor} is not at a line boundary of {src.path.name}", where="cursor",
                           fix="pass the next_cursor of your previous poll unchanged, or 0 to read from the start")


@dataclass(frozen=True)
class SpikeRule:
    factor: float
    window: int
    min_history: int


def spike_rule(pc: PhaseContext) -> SpikeRule:
    r = pc.skills.table("dgx-spark-ops", "failure-signals").records
    return SpikeRule(float(r.spike_factor), int(r.spike_window), int(r.spike_min_history))


def _anomalies(records: list[dict], window: collections.deque, rule: SpikeRule) -> list[S.Anomaly]:
    out: list[S.Anomaly] = []
    for r in records:
        loss = r["loss"]
        if math.isnan(loss):
            out.append(S.Anomaly(kind="nan-loss", step=r["step"], message=f"loss is NaN at step {r['step']}"))
            continue
        if math.isinf(loss):
            out.append(S.Anomaly(kind="inf-loss", step=r["step"], message=f"loss is infinite at step {r['step']}"))
            continue
        if len(window) >= rule.min_history:
            med = statistics.median(window)
            if med > 0 and loss > rule.factor * med:
                out.append(S.Anomaly(kind="loss-spike", step=r["step"],
                                     message=f"loss {loss:.4g} at step {r['step']} is {loss / med:.1f}x the running median {med:.4g} "
                                             f"of the previous {len(window)} records"))
        window.append(loss)
    return out


def stall_minutes() -> float:
    try:
        return float(os.environ.get("FINETUNE_MCP_STALL_MINUTES") or STALL_MINUTES_DEFAULT)
    except ValueError:
        return STALL_MINUTES_DEFAULT


def config_value(run_dir: Path, key: str) -> Any:
    """A trainer setting of this run: the trainer call's own keyword (calls.trainer) first, else the key anywhere."""
    cfg = _run_config(run_dir)
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


_RUN_CONFIG: dict[str, dict] = {}


def run_config(run_dir: Path) -> dict:
    """A run's resolved config.yaml as a dict ({} when missing or unreadable); triage reads it too."""
    return _run_config(run_dir)


def _run_config(run_dir: Path) -> dict:
    key = str(run_dir)
    if key not in _RUN_CONFIG:
        try:
            _RUN_CONFIG[key] = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            return {}
    return _RUN_CONFIG[key]


# ================================================================ poll_progress


def poll_progress(pc: PhaseContext, run_id: str, cursor: int = 0, limit: int = 200, plot: bool = False) -> S.PollResult:
    run_dir = pc.guard.check_read(pc.ws.run_dir(run_id))
    if cursor < 0:
        raise BadInput("cursor must be 0 or more", where="cursor", fix="pass 0, or the next_cursor of your previous poll")
    if limit < 1:
        raise BadInput("limit must be at least 1", where="limit")
    run_json = _read_json_file(run_dir / "run.json")
    src = _record_source(run_dir)
    records: list[dict] = []
    last: dict | None = None
    anomalies: list[S.Anomaly] = []
    next_cursor, more, src_mtime = cursor, False, None

    if src is None and cursor:
        raise BadInput(f"cursor {cursor} given but {run_id} has no records yet", where="cursor", fix="poll with cursor 0")
    if src is not None:
        parse = _parse_progress_line if src.kind == "progress" else _parse_stdout_line
        with open(src.path, "rb") as f:
            st = os.fstat(f.fileno())
            src_mtime = st.st_mtime
            _check_cursor(f, cursor, st.st_size, src)
            key = str(src.path)
            with _CACHE_LOCK:
                # Taken out while in use, so two concurrent polls never share one window.
                c = _CACHE.pop(key, None)
            rule = spike_rule(pc)
            cold = c is None or c.ino != st.st_ino or c.offset != cursor or c.window.maxlen != rule.window
            if cold:
                c = _Cache(st.st_ino, cursor, collections.deque(maxlen=rule.window))
            if cold and cursor > 0:
                # A server that has not followed this run looks back a bounded amount for the spike window.
                prev = _records_backward(f, cursor, rule.window, parse)
                c.window.extend(r["loss"] for r in prev if math.isfinite(r["loss"]))
                if src.kind == "stdout":
                    c.ordinal = _count_records(f, cursor, parse)
                    every = int(config_value(run_dir, "logging_steps") or 1)
                    c.last = {"step": c.ordinal * every, **prev[-1], "mem_gb": None, "temp_c": None} if prev else None
                else:
                    c.last = prev[-1] if prev else None
            got, next_cursor, more, _ = _lines_forward(f, cursor, limit, parse)
            raw = [r for _, r in got]
            if src.kind == "stdout":
                every = int(config_value(run_dir, "logging_steps") or 1)
                raw = [{"step": (c.ordinal + i + 1) * every, "loss": r["loss"], "lr": r["lr"], "mem_gb": None, "temp_c": None}
                       for i, r in enumerate(raw)]
                c.ordinal += len(raw)
            records = raw
            anomalies = _anomalies(records, c.window, rule)
            c.offset = next_cursor
            if records:
                c.last = records[-1]
            with _CACHE_LOCK:
                _CACHE[key] = c
            if not more:
                last = c.last  # nothing newer is complete past next_cursor
            else:
                tail = _records_backward(f, st.st_size, 1, parse)
                if tail:
                    last = tail[-1]
                    if src.kind == "stdout":
                        # The newest printed dict carries no step; it is the ordinal-th of its kind.
                        total = c.ordinal if not more else _count_records(f, st.st_size, parse)
                        every = int(config_value(run_dir, "logging_steps") or 1)
                        last = {"step": total * every, "loss": last["loss"], "lr": last["lr"], "mem_gb": None, "temp_c": None}

    state = run_state(run_dir, run_json, has_records=last is not None)
    if state.status in ("starting", "running") and run_json is not None:
        minutes = stall_minutes()
        since = src_mtime if src_mtime is not None else (run_dir / "run.json").stat().st_mtime
        idle = (time.time() - since) / 60.0
        if idle >= minutes:
            what = f"no new step for {idle:.0f} minutes" if last else f"no first step {idle:.0f} minutes after launch"
            anomalies.append(S.Anomaly(kind="stalled", step=last["step"] if last else None,
                                       message=f"{what} (threshold {minutes:g} min, FINETUNE_MCP_STALL_MINUTES)"))

    _lifecycle_notes(pc, run_dir, run_id, state, last, src)

    if last is not None:
        max_steps = config_value(run_dir, "max_steps")
        total = float(max_steps) if isinstance(max_steps, (int, float)) and max_steps > 0 else None
        loss_txt = f"{last['loss']:.4g}" if math.isfinite(last["loss"]) else str(last["loss"])
        pc.progress(float(last["step"]), total, f"step {last['step']} loss {loss_txt}")

    n = len(records)
    bits = [f"{run_id}: {state.status}"]
    if state.exit_code is not None or state.signal:
        bits.append(f"({state.signal or 'exit ' + str(state.exit_code)})")
    if last is not None:
        lt = f"{last['loss']:.4g}" if math.isfinite(last["loss"]) else str(last["loss"])
        bits.append(f"at step {last['step']}, loss {lt}")
    bits.append(f"; {n} new record{'s' if n != 1 else ''}" + (" (more waiting)" if more else ""))
    if anomalies:
        bits.append(f"; {len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'}: " + ", ".join(sorted({a.kind for a in anomalies})))
    result = S.PollResult(
        summary=" ".join(bits).replace(" ;", ";"),
        citations=_cites(pc, ("dgx-spark-ops", "failure-signals")),
        run_id=run_id, status=state.status, exit_code=state.exit_code, signal=state.signal, detail=state.detail,
        records=[S.ProgressRecord(**r) for r in records],
        last=S.ProgressRecord(**last) if last else None,
        anomalies=anomalies, cursor=cursor, next_cursor=next_cursor, more=more,
    )
    if plot:
        result._image_png = _loss_png(pc, run_dir, run_id, src)
    return result


def _count_records(f, end: int, parse) -> int:
    n = 0
    f.seek(0)
    pos = 0
    buf = b""
    while pos < end:
        chunk = f.read(min(_CHUNK, end - pos))
        if not chunk:
            break
        pos += len(chunk)
        buf += chunk
        *lines, buf = buf.split(b"\n")
        n += sum(1 for ln in lines if parse(ln) is not None)
    return n


def _loss_png(pc: PhaseContext, run_dir: Path, run_id: str, src: _Source | None) -> bytes | None:
    png = run_dir / "loss.png"
    if png.is_file():
        return pc.guard.read_bytes(png)
    if src is None:
        return None
    from finetune_mcp.worker import run_job

    with tempfile.TemporaryDirectory(prefix="ftmcp-plot-") as tmp:
        out = Path(tmp) / "loss.png"
        params: dict[str, Any] = {"out": str(out), "title": run_id}
        if src.kind == "progress":
            params["progress_path"] = str(src.path)
        else:
            with open(src.path, "rb") as f:
                got, _, _, _ = _lines_forward(f, 0, 10**9, _parse_stdout_line)
            every = int(config_value(run_dir, "logging_steps") or 1)
            params["points"] = [[(i + 1) * every, r["loss"]] for i, (_, r) in enumerate(got)]
        run_job("plot_loss", params, timeout=120, light=True)
        return out.read_bytes()


# ================================================================ roadbook


_NOTE_RE = re.compile(r"<!-- event:([a-z-]+) -->")


def _roadbook(pc: PhaseContext, run_dir: Path, event: str, text: str, once: bool = False) -> bool:
    """Append one line to the run's roadbook.md; with once=True only if that event is not there yet. False when not written."""
    path = run_dir / "roadbook.md"
    try:
        pc.guard.check_write(path)
    except FtError:
        return False  # a role that may not write here (the eval side) only reads
    with open(run_dir / ".roadbook.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            existing = path.read_text(encoding="utf-8") if path.exists() else ""
            if once and f"<!-- event:{event} -->" in existing:
                return False
            if not existing:
                existing = f"# Roadbook: {run_dir.parent.name}/{run_dir.name}\n\n"
            line = f"- {utc_now()} **{event}** — {text} <!-- event:{event} -->\n"
            pc.guard.write_text(path, existing + line)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _first_record(src: _Source, run_dir: Path) -> dict | None:
    parse = _parse_progress_line if src.kind == "progress" else _parse_stdout_line
    with open(src.path, "rb") as f:
        got, _, _, _ = _lines_forward(f, 0, 1, parse)
    if not got:
        return None
    r = got[0][1]
    return r if src.kind == "progress" else {**r, "step": int(config_value(run_dir, "logging_steps") or 1)}


def _lifecycle_notes(pc: PhaseContext, run_dir: Path, run_id: str, state: RunState, last: dict | None,
                     src: _Source | None) -> None:
    key = str(run_dir)
    with _CACHE_LOCK:
        noted = _NOTED.setdefault(key, set())
    todo = []
    if last is not None and "first-step" not in noted and src is not None:
        first = _first_record(src, run_dir) or last
        todo.append(("first-step", f"poll_progress: first record, step {first['step']} loss {first['loss']:.4g}"))
    if state.status in TERMINAL:
        ev = {"succeeded": "finished", "failed": "failed", "stopped": "stopped"}[state.status]
        if ev not in noted:
            how = state.signal or (f"exit {state.exit_code}" if state.exit_code is not None else "no exit record")
            at = f", last step {last['step']} loss {last['loss']:.4g}" if last else ""
            todo.append((ev, f"poll_progress: {state.status} ({how}){at}" + (f" — {state.detail}" if state.detail and ev == "failed" else "")))
    for ev, text in todo:
        _roadbook(pc, run_dir, ev, text, once=True)
        with _CACHE_LOCK:
            noted.add(ev)


_NOTED: dict[str, set] = {}


# ================================================================ stop_run


def _latest_checkpoint(run_dir: Path) -> str | None:
    cps = []
    for p in (run_dir / "checkpoints").glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and p.is_dir():
            cps.append((int(m.group(1)), p))
    return str(max(cps)[1]) if cps else None


def stop_run(pc: PhaseContext, run_id: str, grace_seconds: float = 30.0) -> S.StopResult:
    run_dir = pc.guard.check_read(pc.ws.run_dir(run_id))
    pc.guard.check_write(run_dir / STOP_MARKER)
    run_json = _read_json_file(run_dir / "run.json")
    if run_json is None:
        raise Refused(f"{run_id} has no run.json yet: its launch has not completed", where=str(run_dir / "run.json"),
                      fix="poll_progress until it reports running, then stop it")
    state = run_state(run_dir, run_json, has_records=True)
    if state.status in TERMINAL:
        return S.StopResult(summary=f"{run_id} had already ended: {state.status}" + (f" ({state.detail})" if state.detail else ""),
                            run_id=run_id, status=state.status, signal_sent=[], checkpoint=_latest_checkpoint(run_dir))
    pc.guard.write_text(run_dir / STOP_MARKER, json.dumps({"requested_at": utc_now(), "by": "stop_run",
                                                           "grace_seconds": grace_seconds}) + "\n")
    _roadbook(pc, run_dir, "stop-requested", f"stop_run: SIGTERM (the trainer saves a checkpoint), SIGKILL after {grace_seconds:g}s")
    lau = get_launcher(run_json.get("launcher") or "local")
    t0 = time.monotonic()
    sent = lau.stop(run_dir, run_json, float(grace_seconds),
                    tick=lambda what: pc.progress(time.monotonic() - t0, float(grace_seconds), what))
    if _read_json_file(run_dir / "exit.json") is None and not lau.alive(run_dir, run_json):
        # The supervisor died without recording the exit (it was killed with the group): record it here.
        atomic_write_json(run_dir / "exit.json", {"returncode": 137, "signal": "SIGKILL", "ended_at": utc_now(),
                                                  "stopped_by": "stop_run", "pid": None, "wrapper_pid": run_json.get("pid"),
                                                  "note": "written by stop_run: the supervisor recorded no exit"})
    state = run_state(run_dir, run_json, has_records=True)
    cp = _latest_checkpoint(run_dir)
    _roadbook(pc, run_dir, "stopped", f"stop_run: {state.status} after {', '.join(sent) or 'no signal'}"
              + (f"; last checkpoint {Path(cp).name}" if cp else "; no checkpoint"), once=True)
    with _CACHE_LOCK:
        _NOTED.setdefault(str(run_dir), set()).add("stopped")
    return S.StopResult(
        summary=f"{run_id}: {state.status} ({' then '.join(sent) or 'no signal needed'})"
                + (f"; checkpoint kept: {Path(cp).name}" if cp else "; no checkpoint was saved"),
        citations=_cites(pc, ("dgx-spark-ops", "failure-signals"), ("dgx-spark-ops", "run-layout")),
        run_id=run_id, status=state.status, signal_sent=sent, checkpoint=cp,
    )


# ================================================================ prune_checkpoints


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def prune_checkpoints(pc: PhaseContext, run_id: str) -> S.PruneResult:
    run_dir = pc.guard.check_read(pc.ws.run_dir(run_id))
    state = run_state(run_dir, _read_json_file(run_dir / "run.json"), has_records=True)
    if state.status != "succeeded":
        raise Refused(f"{run_id} is {state.status}, not succeeded: its checkpoints may be all that is left of it",
                      where=str(run_dir / "checkpoints"),
                      fix="prune only after a run succeeded; a failed or stopped run resumes from its checkpoints")
    adapter = run_dir / "adapter"
    if not adapter.is_dir() or adapter.is_symlink():
        raise Refused(f"{run_id} has no adapter/ directory: the product would exist only inside checkpoints/",
                      where=str(adapter), fix="check the run's stdout.log for why train.py did not copy the adapter; keep the checkpoints")
    ok, actual, recorded = verify_folder(adapter)
    if not ok:
        why = "has no DIGEST" if recorded is None else f"does not match its DIGEST (recorded {recorded[:16]}…, files {actual[:16]}…)"
        raise Refused(f"adapter/ {why}; checkpoints are kept until the adapter verifies", where=str(adapter / "DIGEST"),
                      fix="the adapter copy is incomplete or was changed; re-export it from the last checkpoint before pruning")
    cp = run_dir / "checkpoints"
    if cp.is_symlink():
        raise Refused("checkpoints/ is a symbolic link; refusing to delete through it", where=str(cp))
    pc.guard.check_write(cp)
    if not cp.exists():
        return S.PruneResult(summary=f"{run_id}: nothing to prune (no checkpoints/); adapter/ verifies", run_id=run_id, freed_bytes=0)
    if adapter.resolve().is_relative_to(cp.resolve()):
        raise Refused("adapter/ lies inside checkpoints/; nothing is deleted", where=str(adapter))
    freed = _tree_bytes(cp)
    removed = sorted(p.name for p in cp.iterdir())
    shutil.rmtree(cp)
    _roadbook(pc, run_dir, "pruned", f"prune_checkpoints: deleted checkpoints/ ({len(removed)} entries, {_human(freed)}); adapter/ verified {actual[:16]}…")
    return S.PruneResult(
        summary=f"{run_id}: freed {_human(freed)} ({', '.join(removed) or 'empty'}); adapter/ kept and verified",
        citations=_cites(pc, ("dgx-spark-ops", "run-layout")),
        run_id=run_id, freed_bytes=freed, removed=removed,
    )


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _cites(pc: PhaseContext, *refs: tuple[str, str]) -> list[str]:
    """The sections a result applied; one not (yet) in the skills is left out rather than failing the tool."""
    out = []
    for skill, anchor in refs:
        try:
            out.append(pc.skills.cite(skill, anchor))
        except Exception:
            continue
    return out
