"""What triage_failure and the `finetune-mcp triage LOG` command do: read the run's files, classify, attach remedies.

A run of ours is triaged from its stdout.log, exit.json and env-report.json, and - when the log alone
reads healthy - from its progress.jsonl; any other log is triaged from its text alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetune_mcp.common.errors import NotFound
from finetune_mcp.domain.machine import gpus
from finetune_mcp.domain.run_state import run_config
from finetune_mcp.schemas import CauseCheck, EvidenceLine, MetricsSeen, RunnerUp, TriageResult
from finetune_mcp.triage.classify import Classification, classify_file, classify_records, classify_text
from finetune_mcp.triage.remedies import (
    divergence_causes,
    find_value,
    method_level,
    method_ranges,
    next_step,
    oom_next_rung,
    rungs_tried,
)
from finetune_mcp.triage.signals import SKILL
from finetune_mcp.worker import run_job
from finetune_mcp.workspace import read_json_file


def _result(c: Classification, *, evidence, summary: str, citations: list[str], causes=(), rung=None, tried=(), step: str):
    return TriageResult(
        summary=summary, citations=list(dict.fromkeys(citations)), failure_class=c.failure_class,
        none_reason=c.healthy_or_unrecognised, evidence=evidence, check_id=c.check_id,
        causes=[CauseCheck(**x) for x in causes], next_rung=rung.id if rung else None, tried_rungs=list(tried),
        next_step=step, halt_run=c.failure_class == "divergence", confidence=c.confidence,
        runner_up=RunnerUp(failure_class=c.runner_up.failure_class, confidence=c.runner_up.confidence, why=c.runner_up.why) if c.runner_up else None,
        signals=c.signals, missing_evidence=c.missing_evidence, metrics=MetricsSeen(**c.metrics) if c.metrics else None,
    )


def _headline(c: Classification) -> str:
    kind = c.healthy_or_unrecognised
    head = c.failure_class + (f" ({kind})" if kind else "") + (f", check {c.check_id}" if c.check_id else "")
    return head + f" [confidence {c.confidence:.2f}" + (f"; runner-up {c.runner_up.failure_class}" if c.runner_up else "") + "]"


def triage_log_file(path: Path, *, platform: str | None = None):
    """Triage one log file a user hands in (the `finetune-mcp triage LOG` command and log_path)."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"no log file at {path}", where=str(path), fix="pass the path of a training log (stdout.log or similar)")
    c = classify_file(path, platform=platform)
    rung = oom_next_rung([]) if c.failure_class == "oom" else None
    causes = divergence_causes({}, None, {}, None) if c.failure_class == "divergence" else []
    for cc in causes:
        cc["why"] = "a bare log carries no config: triage the run to check this cause (" + cc["why"] + ")"
    cites = [f"{SKILL}#failure-signals"] + ([f"{SKILL}#oom-ladder"] if rung else []) + ([f"{SKILL}#divergence-causes"] if causes else [])
    return _result(c, evidence=[EvidenceLine(file=str(path), line=n, text=t) for n, t in c.evidence],
                   summary=f"{_headline(c)}: {c.reason}", citations=cites, causes=causes, rung=rung, step=next_step(c, rung))


def _config_history(run_dir: Path) -> list[dict]:
    """The experiment's config history: every run's resolved config.yaml up to this one, oldest first."""
    runs = sorted(p for p in run_dir.parent.iterdir() if p.is_dir() and p.name <= run_dir.name)
    return [c for c in map(run_config, runs) if c]


def _packing_check(config: dict, run_dir: Path):
    """Re-decode packed samples of the run's dataset with the run's tokenizer and TRL packing (in the worker)."""

    def check():
        res = run_job("packing_check", {"config": config, "run_dir": str(run_dir)}, timeout=600)
        return {"ok": bool(res.get("ok")), "why": str(res.get("why", ""))}

    return check


def _progress_records(progress: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    recs, lines = [], []
    for i, raw in enumerate(progress.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            d = json.loads(raw.replace("NaN", "null").replace("Infinity", "null"))
        except ValueError:
            continue
        if isinstance(d, dict):
            recs.append(d)
            lines.append((i, raw))
    return recs, lines


def _memory_reading(progress: Path, env_report: dict | None) -> dict | None:
    """Memory in use near the end of a run (the highest mem_gb of its last progress records) and the limit it
    ran against (the GPU's total, or the host's on a unified-memory or GPU-less machine, from env-report.json)."""
    if not progress.is_file():
        return None
    with progress.open("rb") as fh:
        fh.seek(0, 2)
        fh.seek(max(0, fh.tell() - 64 * 1024))
        tail = fh.read().decode("utf-8", errors="replace").splitlines()[-5:]
    used = []
    for raw in tail:
        try:
            v = json.loads(raw).get("mem_gb")
        except (ValueError, AttributeError):
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            used.append(float(v))
    if not used or not env_report:
        return {"used_gb": max(used)} if used else None
    observed = env_report.get("observed") or {}
    gs = gpus(observed)
    limit = None
    if gs and not any(g.unified for g in gs):
        limit = min((g.total_gb for g in gs if g.total_gb), default=None)
    if limit is None:
        limit = ((observed.get("host") or {}).get("memory") or {}).get("total_gb")
    return {"used_gb": max(used), "limit_gb": limit}


def triage_run(pc, run_id: str) -> TriageResult:
    """Triage a run launched here: its stdout.log, exit.json and env-report.json, then its progress records."""
    run_dir = pc.ws.run_dir(run_id)
    config = run_config(run_dir)
    env_report = read_json_file(run_dir / "env-report.json")
    c, evidence = _classify_run(run_dir, env_report)
    cites, causes, rung, tried = _remedies(pc, c, config, env_report, run_dir)
    explains = next((x["cause"] for x in causes if x["verdict"] == "explains"), None)
    summary = f"{_headline(c)} in {run_id}: {c.reason}" + (f"; cause: {explains}" if explains else "") + (f"; next rung: {rung.id}" if rung else "")
    step = next_step(c, rung)
    if explains:
        fix = {"precision": "switch to bf16 where the hardware supports it (or fp32), not fp16",
               "learning-rate": "bring the learning rate back inside the method's settled range",
               "packing": "re-run prepare_dataset and inspect the decoded packed samples"}[explains]
        step = f"Halt the run (stop_run if it is still going). The first cause that explains it is {explains}: {fix}."
    return _result(c, evidence=evidence, summary=summary, citations=cites, causes=causes, rung=rung, tried=tried, step=step)


def _classify_run(run_dir: Path, env_report: dict | None) -> tuple[Classification, list]:
    """The class of the run's failure from its log and exit record; where that reads healthy, from its progress."""
    platform = (env_report or {}).get("platform")
    exit_info = read_json_file(run_dir / "exit.json")
    log = run_dir / "logs" / "stdout.log"
    progress = run_dir / "logs" / "progress.jsonl"
    memory = _memory_reading(progress, env_report)
    c = (classify_file(log, exit_info=exit_info, platform=platform, memory=memory) if log.is_file()
         else classify_text("", exit_info=exit_info, platform=platform, memory=memory))
    evidence = [EvidenceLine(file=str(log), line=n, text=t) for n, t in c.evidence]

    # A run that never raised can still have diverged: its progress records show it.
    if c.failure_class == "none" and progress.is_file():
        recs, lines = _progress_records(progress)
        rc = classify_records(recs)
        if rc.failure_class == "divergence":
            by_step = {str(d.get("step")): (n, raw) for (n, raw), d in zip(lines, recs)}
            ev = []
            for n, t in rc.evidence:
                # record evidence refers to records; map it back to verbatim lines of progress.jsonl
                step = re.search(r'"step":\s*(\d+)', t)
                n2, raw = by_step.get(step.group(1), (n, t)) if step else (n, t)
                ev.append(EvidenceLine(file=str(progress), line=n2, text=raw))
            c, evidence = rc, ev
    return c, evidence


def _remedies(pc, c: Classification, config: dict, env_report: dict | None, run_dir: Path):
    """(citations, divergence causes, the next OOM rung, the rungs tried) for the class found."""
    cites = [f"{SKILL}#failure-signals"]
    causes: list[dict] = []
    rung = None
    tried: list[str] = []
    if c.failure_class == "divergence":
        causes = divergence_causes(config, env_report, method_ranges(pc.skills), _packing_check(config, run_dir))
        cites.append(f"{SKILL}#divergence-causes")
        method = find_value(config, "method", "method_id")
        for skill in ("lora-qlora-recipes", "preference-optimization", "grpo-rlvr-training", "vision-sft"):
            if skill in pc.skills.skills and method and any(method == m for m in pc.skills.table(skill, "recipes").recipes):
                cites.append(f"{skill}#learning-rate" if "learning-rate" in pc.skills.get(skill).anchors else f"{skill}#{method}")
    elif c.failure_class == "oom":
        tried = rungs_tried(_config_history(run_dir))
        rung = oom_next_rung(tried, current_method=method_level(config))
        cites.append(f"{SKILL}#oom-ladder")
    elif c.failure_class == "environment" and c.check_id:
        cites.append(f"spark-preflight#{c.check_id.lower()}")
    return cites, causes, rung, tried
