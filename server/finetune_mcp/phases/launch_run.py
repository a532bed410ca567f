"""launch_run: start training in the background, on the preflight's verdict and a committed config.

Stages: check the arguments (launcher options) -> the preflight gate (no report, a blocked one, or warnings not
accepted: refused) -> the committed config and script (what runs is exactly a commit) -> the run to resume, if any ->
the run's spec (device, GPUs, id, environment) and what it would clash with -> start it (config.yaml, copies, run.json;
nothing left behind if the start fails) -> the roadbook and the result.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import BadInput, NotFound, Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.recipes import resolve_run_config
from finetune_mcp.domain.render import MASKING_FILE
from finetune_mcp.domain.resume import ResumeParent, resume_parent, resumed_tag
from finetune_mcp.domain.run_notes import cites, note
from finetune_mcp.domain.run_state import live_runs, logging_every
from finetune_mcp.launchers import get_launcher
from finetune_mcp.launchers.base import RunSpec
from finetune_mcp.launchers.slurm import check_names
from finetune_mcp.worker import child_env, release_warm, train_python
from finetune_mcp.workspace import file_state, git, new_run_id, utc_now, validate_tag

# What a run directory gets a copy of, from the experiment, before anything runs (layout seed, rule 3).
RUN_COPIES = ("env-report.json", "training-brief.md", "data/dataset-card.md", "data/validation-report.md", "train.py", MASKING_FILE)


@dataclass
class Started:
    rec: dict
    meta: dict
    copied: list[str]


def launch_run(pc: PhaseContext, args: S.LaunchRunArgs) -> S.LaunchResult:
    exp_dir = _check_arguments(pc, args)
    report, report_path = _env_report(pc, exp_dir, args.experiment)
    warnings = _preflight_gate(report, report_path, args.accept_warnings, args.experiment)
    commit = _committed(pc, exp_dir, args.experiment, args.tag)
    planned = resolve_run_config(exp_dir, args.tag, {})
    try:  # a logging_steps the reader could not number records by is refused before anything exists
        logging_every(planned)
    except BadInput as e:
        raise BadInput(e.message, where=f"configs/run-{args.tag}.yaml (merged over configs/base.yaml): logging_steps", fix=e.fix) from None
    parent = resume_parent(pc, args.experiment, args.resume_from, args.tag, planned) if args.resume_from else None
    spec = _spec(pc, args, report, parent)
    started = _start(pc, exp_dir, args, spec, commit, parent)
    where = f"slurm job {started.rec['job_id']}" if started.rec.get("job_id") else f"supervisor pid {started.rec['pid']}"
    _notes(pc, args, spec, parent, started, where, commit, warnings)
    return S.LaunchResult(
        summary=f"launched {spec.run_ref} ({args.launcher}, {where})"
                + (f", resuming {parent.run_ref} at step {parent.step + 1} from {parent.checkpoint.name}" if parent else "")
                + f"; follow it with poll_progress(run_id={spec.run_ref!r})",
        citations=cites(pc, ("spark-preflight", "verdict"), ("dgx-spark-ops", "run-layout"),
                        *((("dgx-spark-ops", "resume"),) if parent else ())),
        run_id=spec.run_ref, run_dir=str(spec.run_dir), launcher=args.launcher, pid=started.rec.get("pid"), job_id=started.rec.get("job_id"),
        command=[str(c) for c in started.rec.get("command", [])], commit=commit, warnings_accepted=warnings,
        resumed_from=started.meta.get("resumed_from"),
    )


def _slurm_only(args: S.LaunchRunArgs) -> dict:
    return {"nodes": args.nodes if args.nodes != 1 else None, "gpus_per_node": args.gpus_per_node, "partition": args.partition,
            "time_limit": args.time_limit, "account": args.account}


def _check_arguments(pc: PhaseContext, args: S.LaunchRunArgs) -> Path:
    validate_tag(args.tag)
    exp_dir = pc.guard.check_read(pc.ws.experiment_dir(args.experiment))
    slurm_only = _slurm_only(args)
    given = [k for k, v in slurm_only.items() if v is not None]
    if args.launcher != "slurm" and given:
        raise BadInput(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only to launcher='slurm'",
                       where=given[0], fix=f"drop {', '.join(given)} for launcher={args.launcher!r}, or launch with launcher='slurm'")
    if args.launcher == "local" and args.nproc != 1:
        raise BadInput("launcher='local' runs one process", where="nproc", fix="use launcher='torchrun' for nproc > 1")
    get_launcher(args.launcher)
    if args.launcher == "slurm":  # before the preflight gate: these names go into the job script
        check_names(slurm_only)
    return exp_dir


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


def _committed(pc: PhaseContext, exp_dir: Path, experiment: str, tag: str) -> str:
    """The experiment commit the run is: the config and the script that will run must be exactly what is committed."""
    repo = pc.ws.experiments_repo
    run_cfg = exp_dir / "configs" / f"run-{tag}.yaml"
    script = exp_dir / "train.py"
    for p, what in ((run_cfg, f"configs/run-{tag}.yaml"), (script, "train.py")):
        if not p.is_file():
            raise NotFound(f"{experiment} has no {what}", where=str(p),
                           fix=f"run generate_config(experiment={experiment!r}, tag={tag!r}); it writes and commits the config and train.py")
    optional = [exp_dir / "configs" / "base.yaml", exp_dir / MASKING_FILE]
    for p in [run_cfg, script] + [p for p in optional if p.is_file()]:
        state = file_state(repo, p)
        rel = p.relative_to(exp_dir).as_posix()
        if state == "untracked":
            raise Refused(f"{rel} is not committed: a run whose config is not committed cannot be reproduced", where=str(p),
                          fix=f"run generate_config(experiment={experiment!r}, tag={tag!r}), which commits it, then launch again")
        if state == "modified":
            raise Refused(f"{rel} has changed since its last commit: the run would not match any commit", where=str(p),
                          fix="commit the change (or run generate_config again, which commits), or restore the committed version; then launch")
    return git(repo, "rev-parse", "HEAD").strip()


def _gpu_ids(device: str) -> tuple[str, ...]:
    if device == "cpu":
        return ()
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return ("all",)
    return tuple(x.strip() for x in vis.split(",") if x.strip())


def _spec(pc: PhaseContext, args: S.LaunchRunArgs, report: dict, parent: ResumeParent | None) -> RunSpec:
    """The run as the launcher starts it; refused where the id exists or a live run holds the same devices."""
    device = "cpu" if report.get("platform") == "cpu" else "cuda"
    gpus = _gpu_ids(device)
    run_id = new_run_id(resumed_tag(args.tag, parent.generation) if parent else args.tag)
    run_ref = f"{args.experiment}/{run_id}"
    run_dir = pc.guard.check_write(pc.ws.output_root / args.experiment / run_id)
    env = child_env()
    if device == "cpu":
        # A CPU run shares its cores (with the server, the agent, other runs). OpenMP threads that
        # spin while they wait for a core starve everything else: measured here (2 cores, load ~4),
        # the tiny SFT run did 1.5 steps/s by default and 21.6 with passive waiting.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    spec = RunSpec(run_ref=run_ref, run_dir=run_dir, python=train_python(), nproc=args.nproc, device=device, gpus=gpus,
                   env=env, mounts={"output_root": pc.ws.output_root, "datasets": pc.ws.datasets_dir,
                                    "base_models": pc.ws.base_models_dir},
                   options=({**_slurm_only(args), "nodes": args.nodes} if args.launcher == "slurm" else {}))
    get_launcher(args.launcher).check(spec)
    # (f) then (e): an existing run id; a live run holding the same devices.
    if run_dir.exists():
        raise Refused(f"run {run_ref} already exists", where=str(run_dir),
                      fix="run ids carry the minute they started: launch again in a minute, or use another tag")
    if args.launcher != "slurm":  # the scheduler allocates a Slurm job's nodes; this machine's runs are not in its way
        _refuse_busy(pc, spec)
    return spec


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


def _start(pc: PhaseContext, exp_dir: Path, args: S.LaunchRunArgs, spec: RunSpec, commit: str, parent: ResumeParent | None) -> Started:
    """The run directory with its config.yaml and copies, the launcher started, run.json; nothing partial if it fails."""
    run_dir, run_ref = spec.run_dir, spec.run_ref
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_dir.mkdir()
    except FileExistsError:
        raise Refused(f"run {run_ref} already exists", where=str(run_dir), fix="launch again in a minute, or use another tag") from None
    try:
        created = utc_now()
        meta = {"run_id": run_ref, "run_dir": str(run_dir), "experiment_commit": commit, "launcher": args.launcher, "created_at": created}
        if parent:
            meta.update(resume_from_checkpoint=str(parent.checkpoint), resume_generation=parent.generation,
                        resumed_from={"run_id": parent.run_ref, "checkpoint": parent.checkpoint.name, "step": parent.step})
        config = resolve_run_config(exp_dir, args.tag, meta)
        # The reproducibility record exists before anything runs (layout seed, rule 3).
        pc.guard.write_text(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
        copied = []
        for rel in RUN_COPIES:
            src = exp_dir / rel
            if src.is_file():
                pc.guard.write_bytes(run_dir / rel, pc.guard.read_bytes(src))
                copied.append(rel)
        (run_dir / "logs").mkdir()
        # The run takes the machine (on a unified-memory box, its memory too): the warm job worker steps aside.
        release_warm()
        rec = get_launcher(args.launcher).start(spec)
        run_json = {"run_id": run_ref, **rec, "launcher": args.launcher, "created_at": created, "device": spec.device,
                    "gpus": list(spec.gpus), "nproc": args.nproc, "train_python": spec.python, "experiment_commit": commit}
        if parent:
            run_json["resumed_from"] = meta["resumed_from"]
        pc.guard.write_text(run_dir / "run.json", json.dumps(run_json, indent=2) + "\n")
    except BaseException:
        # Nothing partial: a launch that did not start leaves no run directory behind.
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return Started(rec, meta, copied)


def _notes(pc: PhaseContext, args: S.LaunchRunArgs, spec: RunSpec, parent: ResumeParent | None, started: Started, where: str,
           commit: str, warnings: list[str]) -> None:
    missing = [r for r in ("training-brief.md", "data/dataset-card.md", "data/validation-report.md") if r not in started.copied]
    gpus = spec.gpus
    note(pc, spec.run_dir, "launched",
         f"launch_run: {args.launcher} (nproc {args.nproc}, {spec.device}{' ' + ','.join(gpus) if gpus else ''}), {where}, "
         f"experiment commit {commit[:12]}" + (f"; accepted warnings: {'; '.join(warnings)}" if warnings else "")
         + (f"; not found to copy: {', '.join(missing)}" if missing else ""))
    if parent:
        note(pc, spec.run_dir, "resumed",
             f"launch_run: resumes {parent.run_ref} ({parent.status}) from {parent.checkpoint.name}: model adapter, optimizer, "
             f"scheduler and RNG state are restored from it, so records continue at step {parent.step + 1}; "
             f"{parent.run_ref} keeps all its files")
        note(pc, parent.run_dir, "resumed-by", f"launch_run: {spec.run_ref} continues this run from {parent.checkpoint.name}")
