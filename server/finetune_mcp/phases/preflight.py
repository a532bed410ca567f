"""Phase 3: probe the machine and the training environment, apply the spark-preflight checks, write env-report.json.

The probes, checks and estimates are domain/machine.py's (a recorded machine replays exactly through them);
this is the tool: observe -> time a few steps -> evaluate -> write the report -> result.

FINETUNE_MCP_PREFLIGHT_REPLAY=<observation.json> makes the tool evaluate a recorded observation
instead of probing (how a GB10 or an H100 is replayed on a machine without one);
FINETUNE_MCP_PREFLIGHT_RECORD=<path.json> makes a real probe also save its observation there, in
the same format, so a session on a GPU machine can record one. tests/fixtures/observations/ holds
such files.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_mcp import schemas as S
from finetune_mcp.domain.brief import BRIEF_FILE, Brief, load_brief
from finetune_mcp.domain.machine import (ENV_REPORT, RECORD_ENV, REPLAY_ENV, SKILL, brief_facts, detect_platform, evaluate,
                                         load_observation, model_for, probe, step_probe, training_shape)
from finetune_mcp.workspace import atomic_write_json, utc_now


@dataclass
class Observed:
    observed: dict[str, Any]
    replay: str | None
    shape: dict[str, Any]


def _observe(pc, experiment: str, brief: Brief) -> Observed:
    """A recorded observation replayed, else a real probe (saved too under RECORD_ENV); the model and the training shape."""
    replay = os.environ.get(REPLAY_ENV)
    pc.progress(0, 4, "replaying a recorded observation" if replay else "probing the host and the training environment")
    if replay:
        observed = copy.deepcopy(load_observation(replay))
    else:
        observed = probe(pc.ws, progress=lambda done, total, msg: pc.progress(1, 4, msg))
        if os.environ.get(RECORD_ENV):
            atomic_write_json(os.environ[RECORD_ENV], observed)
    observed["model"] = model_for(pc, observed, brief.base_model)
    shape = training_shape(pc, experiment, brief, detect_platform(observed, pc.skills.table(SKILL, "checks")))
    return Observed(observed, replay, shape)


def _time_steps(pc, obs: Observed) -> None:
    """Seconds per step measured, not guessed: a few real steps at the expected batch shape (not on a replay)."""
    if obs.replay or not obs.observed["model"].get("config"):
        return
    if os.environ.get("FINETUNE_MCP_STEP_PROBE", "1").strip() in ("0", "false", "no", "off"):
        return
    pc.progress(2, 4, f"timing {obs.shape['micro_batch']} x {obs.shape['tokens_per_sequence']}-token training steps")
    obs.observed["step_probe"] = step_probe(pc, obs.observed["model"], obs.shape)
    if os.environ.get(RECORD_ENV):
        atomic_write_json(os.environ[RECORD_ENV], obs.observed)


def _summary(result: dict, obs: Observed) -> str:
    host = (obs.observed.get("host") or {}).get("hostname")
    counts = {s: sum(1 for c in result["checks"] if c.status == s) for s in ("pass", "warn", "fail")}
    flagged = [f"{c.id} {c.status}" for c in result["checks"] if c.status != "pass"]
    return (f"preflight {result['verdict']} on {result['platform']} ({host}"
            + (", replayed" if obs.replay else "") + f"): {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail"
            + (f" — {', '.join(flagged)}" if flagged else "")
            + (f"; expected wall time ~{result['time_estimate']['wall']}" if result["time_estimate"].get("wall") else ""))


def _write_report(pc, d: Path, experiment: str, brief: Brief, obs: Observed, result: dict, summary: str) -> Path:
    report = {
        "platform": result["platform"],
        "verdict": result["verdict"],
        "checks": [c.model_dump(mode="json") for c in result["checks"]],
        "observed": obs.observed,
        "created_at": utc_now(),
        "host": (obs.observed.get("host") or {}).get("hostname"),
        "experiment": experiment,
        "brief": brief_facts(brief),
        "memory_estimate": result["memory_estimate"],
        "time_estimate": result["time_estimate"],
        "training_shape": obs.shape,
        "replayed_from": str(Path(obs.replay).expanduser().absolute()) if obs.replay else None,
        "summary": summary,
    }
    return pc.guard.write_text(d / ENV_REPORT, json.dumps(report, indent=2, default=str) + "\n")


def preflight(pc, args: S.PreflightArgs) -> S.PreflightResult:
    experiment = args.experiment
    d = pc.ws.experiment_dir(experiment)
    brief = load_brief(pc.guard.check_read(d / BRIEF_FILE, "training brief"))
    obs = _observe(pc, experiment, brief)
    _time_steps(pc, obs)
    pc.progress(3, 4, "evaluating checks")
    result = evaluate(obs.observed, brief, pc.skills, obs.shape)
    summary = _summary(result, obs)
    path = _write_report(pc, d, experiment, brief, obs, result, summary)
    pc.progress(4, 4, result["verdict"])
    citations = list(dict.fromkeys([c.cite for c in result["checks"]] + ([pc.skills.cite(SKILL, "memory-estimate")] if result["memory_estimate"] else [])))
    return S.PreflightResult(
        summary=summary,
        citations=citations,
        experiment=experiment,
        platform=result["platform"],
        verdict=result["verdict"],
        checks=result["checks"],
        memory_estimate=result["memory_estimate"],
        time_estimate=result["time_estimate"],
        env_report=str(path),
    )
