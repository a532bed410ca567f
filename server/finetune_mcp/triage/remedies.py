"""What to do about a verdict: the divergence causes in their fixed order, the OOM ladder, the preflight check, the next step - each cited from skills.

The ladder is skills/dgx-spark-ops/tables/oom-ladder.yaml; the cause order, the learning-rate ranges and
the packing check come from the seed and the method skills. Nothing here reads a log.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from finetune_mcp.common.errors import BadInput
from finetune_mcp.domain.recipes import all_recipes, recipe_params
from finetune_mcp.triage.signals import SKILL, load_table

# The seed fixes this order; triage stops at the first cause that explains the divergence.
CAUSE_ORDER = ("precision", "learning-rate", "packing")


def load_ladder_table(path: Path | None = None):
    """The validated oom-ladder table (OomLadderTable)."""
    return load_table("oom-ladder", path)


# --- divergence causes -------------------------------------------------------------------------


def find_value(config: dict, *keys: str):
    """A config value by any of its spellings, at top level or one section down."""
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    for v in config.values():
        if isinstance(v, dict):
            for k in keys:
                if k in v and v[k] is not None:
                    return v[k]
    return None


def _precision(config: dict) -> str | None:
    if find_value(config, "fp16") is True:
        return "fp16"
    if find_value(config, "bf16") is True:
        return "bf16"
    p = find_value(config, "precision", "mixed_precision", "dtype", "torch_dtype")
    if isinstance(p, str):
        p = p.lower().replace("torch.", "")
        if p in ("fp16", "float16", "half", "16-mixed"):
            return "fp16"
        if p in ("bf16", "bfloat16", "bf16-mixed"):
            return "bf16"
        if p in ("fp32", "float32", "32", "no"):
            return "fp32"
    if find_value(config, "fp16") is False and find_value(config, "bf16") is False:
        return "fp32"
    return None


def _bf16_support(env_report: dict | None) -> tuple[bool | None, str]:
    """(supported?, how we know). None when the env-report does not say."""
    if not env_report:
        return None, "no env-report"
    for key in ("bf16_supported", "bf16"):
        v = env_report.get(key)
        if isinstance(v, bool):
            return v, f"env-report {key}={v}"
    checks = env_report.get("checks")
    items = checks.items() if isinstance(checks, dict) else ((c.get("id"), c) for c in checks or [] if isinstance(c, dict))
    for cid, c in items:
        if cid in ("G7", "N5") and isinstance(c, dict):
            status = str(c.get("status", "")).lower()
            if status in ("pass", "ok", "ready"):
                return True, f"preflight {cid} {status}"
            if status in ("fail", "failed", "blocked", "warn", "warning"):
                # A warning means bf16 is not solid there - the seed's silent-divergence case.
                return False, f"preflight {cid} {status}"
    if str(env_report.get("platform", "")).lower() == "cpu":
        return False, "platform cpu"
    return None, "env-report has no bf16 check"


def _range(spec) -> tuple[float, float] | None:
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)) and len(spec) == 2:
        return float(spec[0]), float(spec[1])
    if isinstance(spec, dict):
        for lo, hi in (("min", "max"), ("lr_min", "lr_max"), ("low", "high")):
            if lo in spec and hi in spec:
                return float(spec[lo]), float(spec[hi])
        if "lr" in spec:
            return _range(spec["lr"])
        if "learning_rate" in spec:
            return _range(spec["learning_rate"])
    raise BadInput(f"learning-rate range {spec!r} is not [low, high] or {{min, max}}", where="method_ranges", fix="give each method a [low, high] pair from its method skill")


def _cause_precision(config: dict, env_report: dict | None) -> tuple[str, str]:
    prec = _precision(config)
    support, how = _bf16_support(env_report)
    if prec == "fp16":
        fix = "switch to bf16" if support else "use fp32 (this hardware has no solid bf16)" if support is False else "switch to bf16 if preflight shows support, else fp32"
        return "explains", f"the run trains in fp16 ({how}); fp16's narrow range is a known silent divergence source: {fix}"
    if prec == "bf16":
        if support is True:
            return "cleared", f"bf16 on hardware that supports it ({how})"
        if support is False:
            return "explains", f"bf16 requested but the hardware lacks solid bf16 support ({how}): use fp32 or move to bf16-capable hardware"
        return "not-checked", f"bf16 is requested but hardware support is unknown ({how}); run preflight to confirm"
    if prec == "fp32":
        return "cleared", "the run trains in fp32, so half-precision overflow cannot be the cause"
    return "not-checked", "the config names no precision (fp16/bf16/precision)"


def _cause_lr(config: dict, method_ranges: dict) -> tuple[str, str]:
    method = find_value(config, "method", "method_id")
    lr = find_value(config, "learning_rate", "lr")
    if method is None or lr is None:
        return "not-checked", "the config names no " + ("method" if method is None else "learning_rate")
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        raise BadInput(f"learning_rate {lr!r} is not a number", where="config.learning_rate", fix="give the learning rate as a number") from None
    rng = _range(method_ranges.get(method))
    if rng is None:
        return "not-checked", f"no settled learning-rate range is known for method {method!r}"
    lo, hi = rng
    if lo <= lr <= hi:
        return "cleared", f"learning_rate {lr:g} is inside {method}'s settled range {lo:g}-{hi:g}"
    others = [m for m, spec in method_ranges.items() if m != method and (r := _range(spec)) and r[0] <= lr <= r[1]]
    ported = f"; it sits in the range of {', '.join(sorted(others))} - a rate ported from another method" if others else ""
    side = f"above the top ({lr / hi:.1f}x {hi:g})" if lr > hi else f"below the bottom ({lo:g}), which stalls the curve"
    return "explains", f"learning_rate {lr:g} is {side} of {method}'s settled range {lo:g}-{hi:g}{ported}"


def _cause_packing(config: dict, packing_check: Callable | None) -> tuple[str, str]:
    packing = find_value(config, "packing", "sample_packing")
    if packing is False:
        return "cleared", "packing is off, so packed-sequence corruption cannot occur"
    if packing_check is None:
        return "not-checked", "no packing check was supplied: decode packed samples as dataset-curation does and check boundaries and masks"
    res = packing_check()
    if isinstance(res, dict):
        ok, why = res.get("ok"), res.get("why", "")
    elif isinstance(res, tuple) and len(res) == 2:
        ok, why = res
    else:
        ok, why = res, ""
    if not isinstance(ok, bool):
        raise BadInput(f"packing_check returned {res!r}", where="packing_check", fix="return True/False, (ok, why) or {'ok': bool, 'why': str}")
    if ok:
        return "cleared", why or "re-decoded packed samples keep their boundaries and loss masks"
    return "explains", why or "re-decoded packed samples show broken boundaries or masks"


def divergence_causes(config: dict, env_report: dict | None, method_ranges: dict,
                      packing_check: Callable[[], Any] | None) -> list[dict]:
    """The divergence causes in the seed's order, stopping at the first that explains it.

    Returns one {cause, verdict: explains|cleared|not-checked, why} per cause; the causes after
    the explaining one are not-checked. method_ranges maps a method id to its settled
    learning-rate range ([low, high] or {min, max}) from the method skill.
    packing_check() returns True/False, (ok, why) or {"ok", "why"}.
    """
    if not isinstance(config, dict):
        raise BadInput("config must be a mapping (the run's resolved config)", where="config", fix="pass config.yaml as a dict")
    out: list[dict] = []
    explained: str | None = None
    for cause in CAUSE_ORDER:
        if explained:
            out.append({"cause": cause, "verdict": "not-checked", "why": f"stopped at {explained}, which explains the divergence"})
            continue
        if cause == "precision":
            verdict, why = _cause_precision(config, env_report)
        elif cause == "learning-rate":
            verdict, why = _cause_lr(config, method_ranges or {})
        else:
            verdict, why = _cause_packing(config, packing_check)
        out.append({"cause": cause, "verdict": verdict, "why": why})
        if verdict == "explains":
            explained = cause
    return out


# --- OOM ladder --------------------------------------------------------------------------------


@dataclass
class Rung:
    """The step to take next: a ladder rung, an escalation, or "exhausted"."""

    id: str
    kind: str  # "rung" | "escalation" | "exhausted"
    action: str
    how: list[str]
    why: str
    detail: str = ""
    cite: str = f"{SKILL}#oom-ladder"


def oom_next_rung(tried: list[str], *, current_method: str | None = None, table=None) -> Rung:
    """The next step of the spark-memory-thermal-ops OOM ladder given the rungs already tried.

    Rungs go flush -> reduce-batch-or-seq -> downgrade-method, each taken once and none skipped, so
    a batch reduction is never first. Escalation (smaller-model, multi-node) comes only after every
    rung. current_method ("full", "bf16-lora", "qlora") names where the downgrade rung leads; a
    QLoRA run has nothing left to downgrade to, so that rung counts as spent.
    """
    t = table or load_ladder_table()
    steps = {s.id: s for s in (*t.rungs, *t.escalation)}
    tried = list(tried or [])
    unknown = [x for x in tried if x not in steps]
    if unknown:
        raise BadInput(f"unknown OOM ladder step(s) {unknown}", where="tried", fix=f"use ids from {list(steps)}")
    if current_method is not None and current_method not in ("full", "bf16-lora", "qlora"):
        raise BadInput(f"current_method {current_method!r} is not full, bf16-lora or qlora", where="current_method", fix="map the method: sft-qlora -> qlora, LoRA methods -> bf16-lora")
    notes = []
    for s in t.rungs:
        if s.id in tried:
            continue
        if s.id == "downgrade-method" and current_method is not None:
            target = t.method_downgrade.get(current_method)
            if target is None:
                notes.append(f"downgrade-method is spent: the run is already {current_method}, the last downgrade")
                continue
            return Rung(s.id, "rung", s.action, list(s.how), s.why, f"move from {current_method} to {target}")
        return Rung(s.id, "rung", s.action, list(s.how), s.why, "; ".join(notes))
    for s in t.escalation:
        if s.id not in tried:
            return Rung(s.id, "escalation", s.action, list(s.how), s.why,
                        "; ".join(notes + ["every rung of the ladder has been tried"]))
    return Rung("exhausted", "exhausted", "Report the OOM with the ladder climbed; nothing is left to try on this hardware.",
                [], "Every rung and escalation has been tried.", "; ".join(notes))


def rungs_tried(history: list[dict]) -> list[str]:
    """The ladder rungs an experiment's config history shows, oldest config first.

    A config may name the rung it applied (`oom_rung`); otherwise a drop in batch size or
    max_length reads as reduce-batch-or-seq and a move full -> LoRA -> QLoRA as downgrade-method.
    A flush leaves no trace in a config, so it counts only when recorded as oom_rung.
    """
    tried: list[str] = []

    def add(r):
        if r not in tried:
            tried.append(r)

    def lvl(c):
        m = str(find_value(c, "method") or "").lower()
        if "qlora" in m or find_value(c, "load_in_4bit") is True:
            return 2
        if "lora" in m or find_value(c, "lora_r", "r") is not None:
            return 1
        return 0 if m in ("full", "sft-full") else None

    for i, c in enumerate(history):
        if not isinstance(c, dict):
            raise BadInput(f"config history entry {i} is not a mapping", where=f"history[{i}]", fix="pass the resolved configs as dicts")
        if c.get("oom_rung"):
            add(str(c["oom_rung"]))
        if i == 0:
            continue
        prev = history[i - 1]
        for key in (("per_device_train_batch_size", "batch_size"), ("max_length", "max_seq_length", "seq_length")):
            a, b = find_value(prev, *key), find_value(c, *key)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b < a:
                add("reduce-batch-or-seq")
        la, lb = lvl(prev), lvl(c)
        if la is not None and lb is not None and lb > la:
            add("downgrade-method")
    return tried


def next_step(c, rung: Rung | None) -> str:
    """The one next step for a Classification (and the OOM rung it leads to), in words an agent acts on."""
    if c.signals and c.signals[0].startswith("fallback-"):
        return (f"Read the error lines shown and fix that error: no known signal names the cause, so {c.failure_class} is only the "
                f"likeliest class (confidence {c.confidence:.2f}). Relaunch once it is fixed; never relaunch blind.")
    if c.failure_class == "environment":
        if c.check_id:
            return f"Re-run preflight for check {c.check_id} and fix what it reports before any relaunch; never relaunch blind."
        return "Fix the platform problem named above (no preflight check covers it), then relaunch once."
    if c.failure_class == "oom":
        return f"Climb the OOM ladder of spark-memory-thermal-ops ({SKILL}#oom-ladder): next rung {rung.id} - {rung.action}"
    if c.failure_class == "divergence":
        return "Halt the run; check the causes in order - precision, learning rate, packing - and fix the first that explains it."
    if c.healthy_or_unrecognised == "stopped":
        return "The run was stopped on request; nothing to fix."
    return "Nothing to fix: the log shows no failure."


def method_ranges(skills) -> dict:
    """method -> settled learning-rate range, from every recipe skill (what the divergence check compares to)."""
    out = {}
    for method in all_recipes(skills):
        lr = recipe_params(skills, method).get("learning_rate")
        rng = getattr(lr, "range", None)
        if rng:
            out[method] = list(rng)
    return out


def method_level(config: dict) -> str | None:
    """full / bf16-lora / qlora for the OOM ladder's downgrade rung, from a resolved config."""
    m = str(find_value(config, "method", "method_id") or "")
    if not m:
        return None
    if "qlora" in m or find_value(config, "load_in_4bit") is True:
        return "qlora"
    return "full" if m.endswith("full") else "bf16-lora"
