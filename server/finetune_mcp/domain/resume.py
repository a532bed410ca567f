"""Resume: which run a launch continues, from which checkpoint, refused by name for every known trap;
and the loss jump a poll reports when a resumed run did not get its training state back."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import NotFound, Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain import progress
from finetune_mcp.domain.run_state import checkpoints, run_config, run_state
from finetune_mcp.workspace import read_json_file


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


def resumed_tag(tag: str, generation: int) -> str:
    suffix = f"-r{generation}"
    return tag[: 48 - len(suffix)] + suffix


def _parent_dir(pc: PhaseContext, experiment: str, resume_from: str) -> Path:
    """The directory of the run resume_from names: 'latest' is the newest failed or stopped run with a checkpoint."""
    root = pc.ws.output_root / experiment
    if resume_from == "latest":
        candidates = sorted((p for p in root.iterdir() if p.is_dir()), reverse=True) if root.is_dir() else []
        picked = next((p for p in candidates if _resumable_checkpoint(p) is not None
                       and run_state(p, read_json_file(p / "run.json"), True).status in ("failed", "stopped")), None)
        if picked is None:
            raise NotFound(f"{experiment} has no failed or stopped run with a checkpoint to resume", where=str(root),
                           fix="launch without resume_from; set save_steps so that a run leaves checkpoints to resume from")
        return picked
    ref = resume_from if "/" in resume_from else f"{experiment}/{resume_from}"
    if ref.split("/", 1)[0] != experiment:
        raise Refused(f"{resume_from!r} is a run of another experiment: a run resumes only within its own",
                      where="resume_from", fix=f"name a run of {experiment}, or 'latest'")
    return pc.guard.check_read(pc.ws.run_dir(ref))


def resume_parent(pc: PhaseContext, experiment: str, resume_from: str, tag: str, planned: dict) -> ResumeParent:
    """The run a launch resumes and its newest complete checkpoint; Refused, by name, for every known trap."""
    run_dir = _parent_dir(pc, experiment, resume_from)
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


_PARENT_MEDIAN: dict[tuple[str, int], float | None] = {}


def resume_jumps(pc: PhaseContext, run_dir: Path, records: list[dict]) -> list[S.Anomaly]:
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


def forget() -> None:
    """Drop the parent medians this server remembers (a freshly started server)."""
    _PARENT_MEDIAN.clear()
