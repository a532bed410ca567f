"""Phase 4 at run time, the tools: launch_run, poll_progress, stop_run, prune_checkpoints.

The run's state lives in its directory (run_state.py) and its records are read by cursor
(progress.py); these functions check their arguments, call those two, write the roadbook and shape
the result. Public names other phases use (read_json_file, run_config, config_value, run_state,
normalise_record, RECORD_KEYS) are re-exported here from the module that owns them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp import roadbook
from finetune_mcp import schemas as S
from finetune_mcp.context import PhaseContext
from finetune_mcp.digest import verify_folder
from finetune_mcp.errors import BadInput, NotFound, Refused
from finetune_mcp.launchers import get_launcher
from finetune_mcp.launchers.base import STOP_MARKER, RunSpec
from finetune_mcp.phases import progress
from finetune_mcp.phases.progress import RECORD_KEYS, normalise_record  # noqa: F401  (re-exported)
from finetune_mcp.phases.run_state import (  # noqa: F401  (re-exported)
    TERMINAL,
    RunState,
    checkpoints,
    config_value,
    latest_checkpoint,
    live_runs,
    logging_every,
    read_json_file,
    run_config,
    run_state,
)
from finetune_mcp.workspace import atomic_write_json, file_state, git, new_run_id, utc_now, validate_tag


# ================================================================ launch_run


def launch_run(pc: PhaseContext, experiment: str, tag: str, accept_warnings: bool = False, launcher: str = "local",
               nproc: int = 1, nodes: int = 1, gpus_per_node: int | None = None, partition: str | None = None,
               time_limit: str | None = None, account: str | None = None, resume_from: str | None = None) -> S.LaunchResult:
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
    if launcher == "slurm":  # before the preflight gate: these names go into the job script
        from finetune_mcp.launchers.slurm import check_names

        check_names(slurm_only)

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
    planned = _resolve_config(exp_dir, tag, {})
    try:  # a logging_steps the reader could not number records by is refused before anything exists
        logging_every(planned)
    except BadInput as e:
        raise BadInput(e.message, where=f"configs/run-{tag}.yaml (merged over configs/base.yaml): logging_steps", fix=e.fix) from None
    parent = resume_parent(pc, experiment, resume_from, tag, planned) if resume_from else None

    device = "cpu" if report.get("platform") == "cpu" else "cuda"
    gpus = _gpu_ids(device)
    run_id = new_run_id(_resumed_tag(tag, parent.generation) if parent else tag)
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
        if parent:
            meta.update(resume_from_checkpoint=str(parent.checkpoint), resume_generation=parent.generation,
                        resumed_from={"run_id": parent.run_ref, "checkpoint": parent.checkpoint.name, "step": parent.step})
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
        if parent:
            run_json["resumed_from"] = meta["resumed_from"]
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
    if parent:
        _roadbook(pc, run_dir, "resumed",
                  f"launch_run: resumes {parent.run_ref} ({parent.status}) from {parent.checkpoint.name}: model adapter, optimizer, "
                  f"scheduler and RNG state are restored from it, so records continue at step {parent.step + 1}; "
                  f"{parent.run_ref} keeps all its files")
        _roadbook(pc, parent.run_dir, "resumed-by", f"launch_run: {run_ref} continues this run from {parent.checkpoint.name}")
    return S.LaunchResult(
        summary=f"launched {run_ref} ({launcher}, {where})"
                + (f", resuming {parent.run_ref} at step {parent.step + 1} from {parent.checkpoint.name}" if parent else "")
                + f"; follow it with poll_progress(run_id={run_ref!r})",
        citations=_cites(pc, ("spark-preflight", "verdict"), ("dgx-spark-ops", "run-layout"),
                         *((("dgx-spark-ops", "resume"),) if parent else ())),
        run_id=run_ref, run_dir=str(run_dir), launcher=launcher, pid=rec.get("pid"), job_id=rec.get("job_id"),
        command=[str(c) for c in rec.get("command", [])], commit=commit, warnings_accepted=warnings,
        resumed_from=meta.get("resumed_from"),
    )


# ---------------------------------------------------------------- resume


@dataclass
class ResumeParent:
    run_ref: str
    run_dir: Path
    status: str
    checkpoint: Path
    step: int
    generation: int  # 1 for the first resume of a fresh run


# What must be the same in the run that resumes as in the run whose checkpoint it loads, and the trap a
# change walks into (FACTS "Resume": unsloth#233/#3108, peft#859, transformers#33336).
_GROUPS = "optimizer parameter groups would not match the checkpoint's optimizer state"
_JUMP = ("the restored optimizer, scheduler and data position assume the batches and schedule they were saved with: "
         "a loss jump after resume")
RESUME_FIXED_PREFIXES = {"calls.peft": _GROUPS, "calls.load": _GROUPS, "calls.quantization": _GROUPS, "model": _GROUPS,
                         "method": _GROUPS, "backend": _GROUPS, "data.dir": _JUMP, "data.train": _JUMP, "data.train_file": _JUMP}
RESUME_FIXED_KEYS = {
    "lora_r": _GROUPS, "r": _GROUPS, "target_modules": _GROUPS, "modules_to_save": _GROUPS, "optim": _GROUPS,
    "per_device_train_batch_size": _JUMP, "gradient_accumulation_steps": _JUMP, "learning_rate": _JUMP, "lr_scheduler_type": _JUMP,
    "warmup_steps": _JUMP, "warmup_ratio": _JUMP, "weight_decay": _JUMP, "max_steps": _JUMP, "num_train_epochs": _JUMP,
    "seed": _JUMP, "data_seed": _JUMP, "max_length": _JUMP, "max_seq_length": _JUMP, "packing": _JUMP, "max_grad_norm": _JUMP,
    "adam_beta1": _JUMP, "adam_beta2": _JUMP, "adam_epsilon": _JUMP,
}
_NOT_COMPARED = ("run", "tag", "sources", "call_sources", "warnings", "citations", "memory_estimate", "overrides", "backend_reason")
# A checkpoint without these would restart the optimizer or the schedule, or draw other batches.
CHECKPOINT_STATE = {"trainer_state.json": "the step and log history", "optimizer.pt": "the optimizer state",
                    "scheduler.pt": "the learning-rate schedule", "rng_state.pth": "the random state that draws the batches"}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            if prefix or k not in _NOT_COMPARED:
                out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def resume_conflicts(before: dict, after: dict) -> list[str]:
    """The settings that differ between a checkpoint's run config and the config that would resume it, each with its trap."""
    a, b = _flat(before), _flat(after)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        why = RESUME_FIXED_KEYS.get(key.rsplit(".", 1)[-1]) or next((w for p, w in RESUME_FIXED_PREFIXES.items()
                                                                     if key == p or key.startswith(p + ".")), None)
        if why:
            out.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r} ({why})")
    return out


def _resumed_tag(tag: str, generation: int) -> str:
    suffix = f"-r{generation}"
    return tag[: 48 - len(suffix)] + suffix


def resume_parent(pc: PhaseContext, experiment: str, resume_from: str, tag: str, planned: dict) -> ResumeParent:
    """The run a launch resumes and its newest complete checkpoint; Refused, by name, for every known trap."""
    root = pc.ws.output_root / experiment
    if resume_from == "latest":
        candidates = sorted((p for p in root.iterdir() if p.is_dir()), reverse=True) if root.is_dir() else []
        picked = next((p for p in candidates if _resumable_checkpoint(p) is not None
                       and run_state(p, read_json_file(p / "run.json"), True).status in ("failed", "stopped")), None)
        if picked is None:
            raise NotFound(f"{experiment} has no failed or stopped run with a checkpoint to resume", where=str(root),
                           fix="launch without resume_from; set save_steps so that a run leaves checkpoints to resume from")
        run_dir = picked
    else:
        ref = resume_from if "/" in resume_from else f"{experiment}/{resume_from}"
        if ref.split("/", 1)[0] != experiment:
            raise Refused(f"{resume_from!r} is a run of another experiment: a run resumes only within its own",
                          where="resume_from", fix=f"name a run of {experiment}, or 'latest'")
        run_dir = pc.guard.check_read(pc.ws.run_dir(ref))
    run_ref = f"{experiment}/{run_dir.name}"
    state = run_state(run_dir, read_json_file(run_dir / "run.json"), True)
    if state.status in ("starting", "running"):
        raise Refused(f"{run_ref} is still {state.status}: two trainers would share one checkpoint", where="resume_from",
                      fix=f"stop_run(run_id={run_ref!r}) first (it saves a checkpoint), then resume it")
    if state.status == "succeeded":
        raise Refused(f"{run_ref} succeeded: it has nothing left to train", where="resume_from",
                      fix="launch a new run (another tag) to train further")
    found = _resumable_checkpoint(run_dir)
    if found is None:
        cps = [p.name for _, p in checkpoints(run_dir)]
        raise Refused(f"{run_ref} has no complete checkpoint to resume from" + (f" ({', '.join(cps)} lack trainer state)" if cps else ""),
                      where=str(run_dir / "checkpoints"),
                      fix="launch it again from the start; lower save_steps so the next run leaves checkpoints (stop_run saves one)")
    step, cp, missing = found
    if missing:
        raise Refused(f"{cp.name} of {run_ref} has no " + ", ".join(f"{f} ({CHECKPOINT_STATE[f]})" for f in missing)
                      + ": resuming would restart it, a loss jump after resume", where=str(cp),
                      fix="resume from a checkpoint the trainer saved whole, or start a new run")
    conflicts = resume_conflicts(run_config(run_dir), planned)
    if conflicts:
        raise Refused(f"configs/run-{tag}.yaml differs from the config {run_ref} was trained with, in what a resume keeps:\n  "
                      + "\n  ".join(conflicts), where=f"configs/run-{tag}.yaml",
                      fix=f"resume with the tag {run_ref} ran ({run_config(run_dir).get('tag') or 'its own'}) and its committed config, "
                          "or start a new run with the new values")
    generation = int((run_config(run_dir).get("run") or {}).get("resume_generation") or 0) + 1
    return ResumeParent(run_ref, run_dir, state.status, cp, step, generation)


def _resumable_checkpoint(run_dir: Path) -> tuple[int, Path, list[str]] | None:
    """The newest checkpoint the trainer finished writing (trainer_state.json is its last file), with what it lacks."""
    for step, cp in reversed(checkpoints(run_dir)):
        if (cp / "trainer_state.json").is_file():
            missing = [f for f in ("trainer_state.json", "scheduler.pt") if not (cp / f).is_file()]
            if not any((cp / n).is_file() for n in ("optimizer.pt", "optimizer.bin")):  # .bin: saved through Accelerate
                missing.append("optimizer.pt")
            if not any(cp.glob("rng_state*.pth")):  # rng_state_<rank>.pth under DDP
                missing.append("rng_state.pth")
            return step, cp, missing
    return None


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


def _refuse_busy(pc: PhaseContext, spec: RunSpec) -> None:
    live = [r for r in live_runs(pc.ws.output_root) if r.get("launcher") != "slurm"]  # those run on the cluster's nodes
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


# ================================================================ poll_progress


def poll_progress(pc: PhaseContext, run_id: str, cursor: int = 0, limit: int = 200, plot: bool = False) -> S.PollResult:
    run_dir = pc.guard.check_read(pc.ws.run_dir(run_id))
    run_json = read_json_file(run_dir / "run.json")
    got = progress.read(run_dir, cursor, limit, progress.spike_rule(pc.skills))
    last, anomalies = got.last, got.anomalies

    state = run_state(run_dir, run_json, has_records=last is not None)
    if state.status in ("starting", "running") and run_json is not None:
        minutes = progress.stall_minutes()
        since = got.mtime if got.mtime is not None else (run_dir / "run.json").stat().st_mtime
        idle = (time.time() - since) / 60.0
        if idle >= minutes:
            what = f"no new step for {idle:.0f} minutes" if last else f"no first step {idle:.0f} minutes after launch"
            anomalies.append(S.Anomaly(kind="stalled", step=last["step"] if last else None,
                                       message=f"{what} (threshold {minutes:g} min, FINETUNE_MCP_STALL_MINUTES)"))

    anomalies += _resume_jumps(pc, run_dir, got.records)
    _lifecycle_notes(pc, run_dir, state, last)
    pace = progress.throughput(run_dir, last["step"] if last else None, running=state.status == "running")

    if last is not None:
        max_steps = config_value(run_dir, "max_steps")
        total = float(max_steps) if isinstance(max_steps, (int, float)) and max_steps > 0 else None
        pc.progress(float(last["step"]), total, f"step {last['step']} loss {_loss_text(last['loss'])}"
                    + (f", {_duration(pace.eta_s)} left" if pace.eta_s is not None else ""))

    n = len(got.records)
    bits = [f"{run_id}: {state.status}"]
    if state.exit_code is not None or state.signal:
        bits.append(f"({state.signal or 'exit ' + str(state.exit_code)})")
    if last is not None:
        bits.append(f"at step {last['step']}, loss {_loss_text(last['loss'])}")
    if pace.tokens_per_s is not None:
        bits.append(f"; {pace.tokens_per_s:,.0f} tokens/s")
    if pace.eta_s is not None:
        bits.append(f"; about {_duration(pace.eta_s)} left")
    bits.append(f"; {n} new record{'s' if n != 1 else ''}" + (" (more waiting)" if got.more else ""))
    if anomalies:
        bits.append(f"; {len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'}: " + ", ".join(sorted({a.kind for a in anomalies})))
    result = S.PollResult(
        summary=" ".join(bits).replace(" ;", ";"),
        citations=_cites(pc, ("dgx-spark-ops", "failure-signals")),
        run_id=run_id, status=state.status, exit_code=state.exit_code, signal=state.signal, detail=state.detail,
        records=[S.ProgressRecord(**r) for r in got.records],
        last=S.ProgressRecord(**last) if last else None,
        anomalies=anomalies, cursor=cursor, next_cursor=got.next_cursor, more=got.more,
        tokens_per_s=pace.tokens_per_s, steps_per_s=pace.steps_per_s, eta_s=pace.eta_s,
    )
    if plot:
        result._image_png = _loss_png(pc, run_dir, run_id, got.src is not None)
    return result


def _loss_text(loss: float) -> str:
    return f"{loss:.4g}" if math.isfinite(loss) else str(loss)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 90:
        return f"{s}s"
    if s < 90 * 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _loss_png(pc: PhaseContext, run_dir: Path, run_id: str, has_records: bool) -> bytes | None:
    png = run_dir / "loss.png"
    if png.is_file():
        return pc.guard.read_bytes(png)
    if not has_records:
        return None
    from finetune_mcp.worker import run_job

    with tempfile.TemporaryDirectory(prefix="ftmcp-plot-") as tmp:
        out = Path(tmp) / "loss.png"
        points = [[r["step"], r["loss"]] for r in progress.all_records(run_dir)]
        run_job("plot_loss", {"out": str(out), "title": run_id, "points": points}, timeout=120, light=True)
        return out.read_bytes()


# ================================================================ roadbook


def _roadbook(pc: PhaseContext, run_dir: Path, event: str, text: str, once: bool = False) -> bool:
    return roadbook.append(pc.guard, run_dir, text, event=event, once=once)


_NOTED: dict[str, set] = {}


def _lifecycle_notes(pc: PhaseContext, run_dir: Path, state: RunState, last: dict | None) -> None:
    key = str(run_dir)
    noted = _NOTED.setdefault(key, set())
    todo = []
    if last is not None and "first-step" not in noted:
        first = progress.first_record(run_dir) or last
        todo.append(("first-step", f"poll_progress: first record, step {first['step']} loss {first['loss']:.4g}"))
    if state.status in TERMINAL:
        ev = {"succeeded": "finished", "failed": "failed", "stopped": "stopped"}[state.status]
        if ev not in noted:
            how = state.signal or (f"exit {state.exit_code}" if state.exit_code is not None else "no exit record")
            at = f", last step {last['step']} loss {last['loss']:.4g}" if last else ""
            todo.append((ev, f"poll_progress: {state.status} ({how}){at}" + (f" — {state.detail}" if state.detail and ev == "failed" else "")))
    for ev, text in todo:
        _roadbook(pc, run_dir, ev, text, once=True)
        noted.add(ev)
    _requeue_notes(pc, run_dir, noted)


_PARENT_MEDIAN: dict[tuple[str, int], float | None] = {}


def _resume_jumps(pc: PhaseContext, run_dir: Path, records: list[dict]) -> list[S.Anomaly]:
    """A resumed run whose first losses sit far above where the run it continues had got to (transformers#33336:
    a fresh optimizer or schedule, other batches, a model reloaded without its adapter)."""
    resumed = (run_config(run_dir).get("run") or {}).get("resumed_from")
    if not isinstance(resumed, dict) or not records:
        return []
    rule = progress.spike_rule(pc.skills)
    step = int(resumed.get("step") or 0)
    early = [r for r in records if r["step"] <= step + rule.window and math.isfinite(r["loss"])]
    if not early:
        return []
    key = (str(resumed.get("run_id")), step)
    if key not in _PARENT_MEDIAN:
        before = [r["loss"] for r in progress.all_records(pc.ws.output_root / key[0]) if r["step"] <= step and math.isfinite(r["loss"])]
        _PARENT_MEDIAN[key] = statistics.median(before[-rule.window:]) if len(before) >= rule.min_history else None
    med = _PARENT_MEDIAN[key]
    return [S.Anomaly(kind="loss-jump-after-resume", step=r["step"],
                      message=f"loss {r['loss']:.4g} at step {r['step']} is {r['loss'] / med:.1f}x the median {med:.4g} of "
                              f"{key[0]} before {resumed.get('checkpoint')}: the resume did not restore the training state "
                              "(optimizer, schedule, data order or adapter); compare both runs' config.yaml and stop this one")
            for r in early if med and med > 0 and r["loss"] > rule.factor * med]


_RESUMES_SEEN: dict[str, int] = {}


def _requeue_notes(pc: PhaseContext, run_dir: Path, noted: set) -> None:
    """Each time train.py resumed in its own directory (a requeued Slurm job, a restarted trainer), once in the roadbook."""
    path = run_dir / "logs" / "resumes.jsonl"
    try:
        size = os.stat(path).st_size
    except OSError:
        return
    if _RESUMES_SEEN.get(str(path)) == size:
        return  # nothing new since this server last looked
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    _RESUMES_SEEN[str(path)] = size
    for i, line in enumerate(lines, 1):
        ev = f"requeued-{i}"
        if ev in noted:
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        _roadbook(pc, run_dir, ev, f"train.py restarted in this run directory (attempt {r.get('attempt', '?')}) and resumed from its own "
                                   f"{r.get('checkpoint')}: optimizer, scheduler and RNG state restored; the records of steps it "
                                   f"recomputes after step {r.get('step')} were already written and are not repeated", once=True)
        noted.add(ev)


def forget() -> None:
    """Drop everything this server remembers of runs (tests and benchmarks: a freshly started server)."""
    from finetune_mcp.phases import run_state

    _NOTED.clear()
    _PARENT_MEDIAN.clear()
    _RESUMES_SEEN.clear()
    progress.forget()
    run_state.forget()


# ================================================================ stop_run


def stop_run(pc: PhaseContext, run_id: str, grace_seconds: float = 30.0) -> S.StopResult:
    run_dir = pc.guard.check_read(pc.ws.run_dir(run_id))
    pc.guard.check_write(run_dir / STOP_MARKER)
    run_json = read_json_file(run_dir / "run.json")
    if run_json is None:
        raise Refused(f"{run_id} has no run.json yet: its launch has not completed", where=str(run_dir / "run.json"),
                      fix="poll_progress until it reports running, then stop it")
    state = run_state(run_dir, run_json, has_records=True)
    if state.status in TERMINAL:
        return S.StopResult(summary=f"{run_id} had already ended: {state.status}" + (f" ({state.detail})" if state.detail else ""),
                            run_id=run_id, status=state.status, signal_sent=[], checkpoint=latest_checkpoint(run_dir))
    pc.guard.write_text(run_dir / STOP_MARKER, json.dumps({"requested_at": utc_now(), "by": "stop_run",
                                                           "grace_seconds": grace_seconds}) + "\n")
    _roadbook(pc, run_dir, "stop-requested", f"stop_run: SIGTERM (the trainer saves a checkpoint), SIGKILL after {grace_seconds:g}s")
    lau = get_launcher(run_json.get("launcher") or "local")
    t0 = time.monotonic()
    sent = lau.stop(run_dir, run_json, float(grace_seconds),
                    tick=lambda what: pc.progress(time.monotonic() - t0, float(grace_seconds), what))
    if read_json_file(run_dir / "exit.json") is None and not lau.alive(run_dir, run_json):
        # The supervisor died without recording the exit (it was killed with the group): record it here.
        atomic_write_json(run_dir / "exit.json", {"returncode": 137, "signal": "SIGKILL", "ended_at": utc_now(),
                                                  "stopped_by": "stop_run", "pid": None, "wrapper_pid": run_json.get("pid"),
                                                  "note": "written by stop_run: the supervisor recorded no exit"})
    state = run_state(run_dir, run_json, has_records=True)
    cp = latest_checkpoint(run_dir)
    _roadbook(pc, run_dir, "stopped", f"stop_run: {state.status} after {', '.join(sent) or 'no signal'}"
              + (f"; last checkpoint {Path(cp).name}" if cp else "; no checkpoint"), once=True)
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
    state = run_state(run_dir, read_json_file(run_dir / "run.json"), has_records=True)
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
