"""Recipes and what a run's shape follows from them: recipe lookup, the prepared dataset, batch shape, the backend
choice, the escape-hatch calls, the resolved run config and the expected wall time.

Knowledge shared by preflight (its estimates), generate_config (its resolution), launch_run (resolve_run_config),
prepare_dataset (effective_max_seq_length) and triage. Nothing here imports the training stack.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.domain.brief import METHOD_LABELS
from finetune_mcp.workspace import validate_tag

RECIPE_SKILLS = ("lora-qlora-recipes", "preference-optimization", "grpo-rlvr-training", "vision-sft")
SKILL = "lora-qlora-recipes"
BACKENDS = ("unsloth", "trl")
FAMILY = {"sft-lora": "sft", "sft-qlora": "sft", "dpo": "preference", "orpo": "preference", "kto": "preference",
          "simpo": "preference", "grpo": "grpo", "vlm-sft": "vlm"}
CALLS = ("load", "quantization", "peft", "trainer", "script")
STACK = {"trl": "torch, transformers, trl, peft, datasets", "unsloth": "unsloth and its pinned torch, transformers, trl, peft, datasets"}


# ================================================================ recipes


def all_recipes(skills) -> dict[str, tuple[str, Any]]:
    """method -> (skill, Recipe) across the four recipe skills."""
    out: dict[str, tuple[str, Any]] = {}
    for skill in RECIPE_SKILLS:
        for method, recipe in skills.table(skill, "recipes").recipes.items():
            out[method] = (skill, recipe)
    return out


def recipe_params(skills, method: str) -> dict[str, Any]:
    """The full param set of a method's recipe: the inherited recipe's params minus drops, then its own."""
    recipes = all_recipes(skills)
    if method not in recipes:
        raise NotFound(f"no recipe for method {method!r}", fix="methods: " + ", ".join(recipes))
    _, recipe = recipes[method]
    params: dict[str, Any] = {}
    if recipe.inherits:
        parent_skill, parent = recipe.inherits.split("/")
        parent_recipe = skills.table(parent_skill, "recipes").recipes.get(parent)
        if parent_recipe is None:
            raise BadInput(f"recipe {method!r} inherits {recipe.inherits!r}, which does not exist", where=f"skills/{recipes[method][0]}/tables/recipes.yaml")
        params.update({k: v for k, v in recipe_params(skills, parent).items() if k not in recipe.drops})
    params.update(recipe.params)
    return params


def effective_max_seq_length(brief, skills) -> tuple[int, str, str]:
    """(tokens, "brief" or "default", where it came from): the brief's max_seq_length, else the method recipe's default."""
    if brief.max_seq_length:
        return int(brief.max_seq_length), "brief", "brief ## Dataset Expectation (max_seq_length)"
    p = recipe_params(skills, brief.method).get("max_seq_length")
    if p is None or not p.default:
        raise BadInput(f"the brief states no max_seq_length and the {brief.method} recipe has no default", where=brief.where("dataset_expectation"),
                       fix="add max_seq_length: <tokens> under ## Dataset Expectation")
    return int(p.default), "default", f"recipe default, {p.cite}"


def key_owners(skills, key: str) -> list[str]:
    """The methods whose recipes have this key."""
    return [m for m in all_recipes(skills) if key in recipe_params(skills, m)]


def _type_ok(p, value: Any) -> bool:
    if value is None:
        return p.nullable
    return {
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "list": isinstance(value, list),
        "dict": isinstance(value, dict),
    }[p.kind]


def check_value(key: str, p, value: Any) -> tuple[str | None, str | None]:
    """(error, warning) for a value of a recipe param: wrong type or choice is an error, outside the range a warning."""
    if not _type_ok(p, value):
        return f"{key}: {value!r} is not a {p.kind}" + (" or null" if p.nullable else ""), None
    if value is None:
        return None, None
    if p.choices is not None:
        items = value if p.kind == "list" else [value]
        bad = [v for v in items if v not in p.choices]
        if bad:
            return f"{key}: {bad[0]!r} is not one of {p.choices}", None
    if p.range is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = p.range
        if not lo <= value <= hi:
            return None, f"{key} = {value} is outside the settled range [{lo:g}, {hi:g}] ({p.cite})"
    return None, None


# ================================================================ the experiment's dataset


def _prepared_name(exp_dir: Path) -> str | None:
    """The dataset name data/prepare.py (written by prepare_dataset) rebuilds, from its PARAMS block."""
    script = exp_dir / "data" / "prepare.py"
    if not script.is_file():
        return None
    m = re.search(r'PARAMS = json\.loads\(r"""\n(.*?)\n"""\)', script.read_text(encoding="utf-8", errors="replace"), re.S)
    try:
        name = json.loads(m.group(1)).get("name") if m else None
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) else None


def find_dataset(pc, experiment: str) -> tuple[Path, dict]:
    """The prepared dataset of an experiment: the one its data/prepare.py names, else
    $DGX_SPARK_ROOT/datasets/<experiment>/, else a folder whose meta.json names the experiment.
    Returns (folder, meta)."""
    root = pc.ws.datasets_dir
    named = _prepared_name(pc.ws.experiments_dir / experiment)
    candidates = ([root / named] if named else []) + [root / experiment]
    if root.is_dir():
        for meta_path in sorted(root.glob("*/meta.json")):
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            if experiment in (meta.get("name"), meta.get("experiment")) and meta_path.parent not in candidates:
                candidates.append(meta_path.parent)
    for d in candidates:
        if (d / "train.jsonl").is_file():
            pc.guard.check_read(d / "train.jsonl", "prepared dataset")
            meta = {}
            if (d / "meta.json").is_file():
                try:
                    meta = json.loads(pc.guard.read_text(d / "meta.json"))
                except json.JSONDecodeError:
                    meta = {}
            return d, meta
    raise NotFound(
        f"experiment {experiment!r} has no prepared dataset (looked for train.jsonl in {candidates[0]})",
        where=str(candidates[0]),
        fix=f"run prepare_dataset for this experiment's brief first; it writes {root}/<name>/train.jsonl",
    )


def effective_tokens(meta: dict, max_seq_length: int, packing: bool) -> int:
    """Tokens per sequence at the peak: packed rows are full; otherwise a batch pads to its longest sequence, so
    the dataset's longest templated sequence (capped at max_seq_length) is what the largest batch holds."""
    longest = ((meta.get("tokens") or {}).get("tokens_per_sequence") or {}).get("max")
    if packing or not longest:
        return int(max_seq_length)
    return int(min(int(longest), int(max_seq_length)))


def expected_padded_tokens(meta: dict, max_seq_length: int, packing: bool, micro_batch: int) -> int:
    """Tokens per sequence an average training step pads to, for the time estimate (memory takes the longest).

    An unpacked batch pads to its longest row, so with rows drawn at random this is E[max of micro_batch row
    lengths]. It comes from the dataset's length quantiles, the quantile function taken as linear between min,
    p50, p90, p95, p99 and max, each capped at max_seq_length: E[max of b] = integral of Q(u) d(u^b) over [0, 1].
    Packed rows are full; without prepared data, max_seq_length.
    """
    tps = (meta.get("tokens") or {}).get("tokens_per_sequence") or {}
    if packing or not tps.get("max"):
        return int(max_seq_length)
    pts = [(u, min(float(tps.get(k) or tps["max"]), float(max_seq_length)))
           for u, k in ((0.0, "min"), (0.5, "p50"), (0.9, "p90"), (0.95, "p95"), (0.99, "p99"), (1.0, "max"))]

    def q(u: float) -> float:
        for (u0, q0), (u1, q1) in zip(pts, pts[1:]):
            if u <= u1:
                return q0 + (q1 - q0) * (u - u0) / (u1 - u0)
        return pts[-1][1]

    b, n = max(1, int(micro_batch)), 2000
    return max(1, round(sum(q((k + 0.5) / n) * (((k + 1) / n) ** b - (k / n) ** b) for k in range(n))))


# ================================================================ backend and calls


def env_import_ok(report: dict, name: str) -> bool | None:
    """Whether the preflight found `name` importable in the training environment (None: not probed)."""
    imps = ((report.get("observed") or {}).get("env") or {}).get("imports") or {}
    if name not in imps:
        return None
    return bool((imps[name] or {}).get("ok"))


def env_bf16(report: dict) -> bool | None:
    """Whether the preflight's torch supports bf16 (None: unknown)."""
    t = ((report.get("observed") or {}).get("env") or {}).get("torch") or {}
    return t.get("bf16") if isinstance(t.get("bf16"), bool) else None


def choose_backend(requested: str, method: str, platform: str, report: dict, skills, notes: list[str]) -> tuple[str, str]:
    """(backend, why): Unsloth where it imports and trains the method on this platform, else TRL; notes get the caveats."""
    table = skills.table(SKILL, "backends")
    supported = method in table.unsloth_supports.get(platform, [])
    importable = env_import_ok(report, "unsloth")
    label = METHOD_LABELS[method]
    if requested == "trl":
        return "trl", "forced by backend='trl' (the escape hatch: lora-qlora-recipes#escape-hatch)"
    if requested == "unsloth":
        if importable is not True:
            notes.append("backend='unsloth' was forced, but the preflight found no importable unsloth in the training "
                         "environment; point FINETUNE_MCP_TRAIN_PYTHON at one that has it and rerun preflight")
        if not supported:
            notes.append(f"backend='unsloth' was forced, but Unsloth does not train {label} on {platform} "
                         f"({table.cite}); this train.py is for another machine")
        return "unsloth", "forced by backend='unsloth'"
    if supported and importable:
        return "unsloth", f"unsloth imports in the training environment and supports {label} on {platform} ({table.cite})"
    why = []
    if importable is not True:
        why.append("unsloth does not import in the training environment (env-report.json)" if importable is False
                   else "the preflight did not probe unsloth")
    if not supported:
        why.append(f"Unsloth does not train {label} on {platform}")
    return "trl", "TRL + PEFT escape hatch: " + "; ".join(why) + f" ({table.cite})"


def _translate(values, v: Any) -> Any:
    for mv in values:
        if type(mv.value) is type(v) and mv.value == v:
            return copy.deepcopy(mv.becomes)
    return copy.deepcopy(v)


def build_calls(skills, method: str, backend: str, values: dict, recipe, platform: str) -> tuple[dict, dict]:
    """The keyword arguments of each call the template makes, from the escape-hatch table alone.

    Returns (calls, call_sources): call_sources maps 'call.arg' to the param or fact it came from.
    """
    rows = {r.key: r for r in skills.table(SKILL, "unsloth-trl-mapping").rows}
    calls: dict[str, dict] = {c: {} for c in CALLS}
    origin: dict[str, str] = {}
    for key, value in values.items():
        row = rows.get(key)
        if row is None:
            calls["trainer"][key] = copy.deepcopy(value)
            origin[f"trainer.{key}"] = key
            continue
        for t in (row.unsloth if backend == "unsloth" else row.trl):
            if t.methods is not None and method not in t.methods:
                continue
            calls[t.call][t.arg] = _translate(t.values, value)
            origin[f"{t.call}.{t.arg}"] = key
    for k, v in recipe.trainer.fixed.items():
        calls["trainer"][k] = copy.deepcopy(v)
        origin[f"trainer.{k}"] = f"recipe {recipe.cite} (fixed for {recipe.label})"
    if platform == "cpu":
        calls["trainer"]["use_cpu"] = True
        origin["trainer.use_cpu"] = "platform cpu (env-report.json)"
    if not values.get("load_in_4bit"):
        calls["quantization"] = {}
    return calls, origin


# ================================================================ the run's shape and time


def run_shape(values: dict, meta: dict, max_seq_length: int, packing: bool, method: str, mem_table) -> dict:
    """A run's batch shape and length from its hyperparameter values (the recipe's defaults at preflight, the
    resolved ones here): what the memory and time estimates read."""
    micro = int(values.get("per_device_train_batch_size") or 1)
    packed = (meta.get("packing") or {}).get("rows") if packing else None
    return {
        "micro_batch": micro,
        "grad_accum": int(values.get("gradient_accumulation_steps") or 1),
        "epochs": float(values.get("num_train_epochs") or 1),
        "max_steps": int(values["max_steps"]) if values.get("max_steps") is not None else -1,
        "max_seq_length": max_seq_length,
        "tokens_per_sequence": effective_tokens(meta, max_seq_length, packing),
        "time_tokens_per_sequence": expected_padded_tokens(meta, max_seq_length, packing, micro),
        "sequences_per_example": mem_table.methods[method].sequences_per_example if method in mem_table.methods else 1,
        "train_rows": int(packed or (meta.get("counts") or {}).get("train") or 0) or None,
    }


def seconds_per_micro_step(probe: Mapping[str, Any], rows: int, tokens: int) -> tuple[float, str]:
    """Seconds per micro-step of `rows` sequences padded to `tokens`, from the step probe's timed shapes, and how.

    At a timed shape, its measured median. Otherwise a line a + c x (rows x tokens) through the two timed shapes
    (the longest and the average padded length at the probe's batch): a step's time grows with the tokens it
    holds, plus a part that does not (optimizer step, per-layer overheads). With one timed shape, proportional.
    """
    pts = [(probe["batch_shape"][0] * probe["batch_shape"][1], float(probe["s_per_micro_step"]), probe["batch_shape"])]
    exp = probe.get("expected") or {}
    if exp.get("s_per_micro_step"):
        pts.append((exp["batch_shape"][0] * exp["batch_shape"][1], float(exp["s_per_micro_step"]), exp["batch_shape"]))
    n = rows * tokens
    for n0, t0, shape in pts:
        if abs(n - n0) <= 0.02 * n0:
            return t0, f"timed at {shape[0]} x {shape[1]} tokens"
    if len(pts) == 2 and pts[0][0] != pts[1][0]:
        (n0, t0, s0), (n1, t1, s1) = pts
        c = (t0 - t1) / (n0 - n1)
        if c > 0:
            return max(t1 + c * (n - n1), 0.1 * min(t0, t1)), \
                f"on the line through the timed {s0[0]} x {s0[1]} ({t0:.3g} s) and {s1[0]} x {s1[1]} ({t1:.3g} s) tokens"
    n0, t0, shape = min(pts, key=lambda pt: abs(pt[0] - n))
    return t0 * n / n0, f"scaled by tokens from the timed {shape[0]} x {shape[1]}"


def time_estimate(probe: Mapping[str, Any] | None, shape: Mapping[str, Any] | None, budget_s: float | None) -> dict[str, Any]:
    """Expected wall time of the run: seconds per micro-step x micro-steps per optimizer step x steps.

    A micro-step is read at the average padded length (time_tokens_per_sequence: a batch pads to its longest
    row, not to the data's longest), from the probe's timed shapes. Steps: max_steps when the recipe caps the
    run, else epochs x ceil(rows / (micro batch x accumulation)).
    """
    if not probe or probe.get("error") or not shape:
        why = (probe or {}).get("error") or ("no training steps were measured" if shape else "no batch shape")
        return {"measured": False, "why": why, "budget_s": budget_s}
    micro, accum = shape["micro_batch"], shape["grad_accum"]
    tokens = int(shape.get("time_tokens_per_sequence") or shape["tokens_per_sequence"])
    s_micro, read = seconds_per_micro_step(probe, micro * int(shape.get("sequences_per_example") or 1), tokens)
    s_step = s_micro * accum
    rows = shape.get("train_rows")
    if shape.get("max_steps", -1) and shape["max_steps"] > 0:
        steps, how = shape["max_steps"], f"max_steps {shape['max_steps']}"
    elif rows:
        per_epoch = math.ceil(rows / (micro * accum))
        steps = math.ceil(per_epoch * shape["epochs"])
        how = f"{shape['epochs']:g} epoch(s) x ceil({rows} rows / ({micro} x {accum}))"
    else:
        return {"measured": True, "s_per_step": round(s_step, 3), "why": "the training rows are unknown (no prepared dataset)",
                "budget_s": budget_s, "probe": dict(probe)}
    wall = steps * s_step + probe.get("first_step_s", 0)
    return {
        "measured": True,
        "device": probe.get("device"),
        "s_per_micro_step": round(s_micro, 4),
        "s_per_step": round(s_step, 3),
        "steps": steps,
        "steps_from": how,
        "micro_batch": micro,
        "tokens_per_sequence": tokens,
        "wall_s": round(wall, 1),
        "wall": duration(wall),
        "budget_s": budget_s,
        "within_budget": None if not budget_s else wall <= budget_s,
        "batch_shape": probe.get("batch_shape"),
        "probe_peak_gb": probe.get("peak_gb"),
        "how": f"{probe.get('steps')} real training steps of the base model with LoRA on {probe.get('device')} (the first, "
               f"{probe.get('first_step_s')} s, pays one-time costs); a micro-step of {micro} x {tokens} tokens (the average "
               f"padded length: a batch pads to its longest row) {read}; {accum} micro-steps per optimizer step",
    }


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ================================================================ launch_run's side


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def resolve_run_config(experiment_dir: Path | str, tag: str, run_meta: dict) -> dict:
    """The fully resolved config of one run: configs/base.yaml, configs/run-<tag>.yaml merged over it
    (mappings merge key by key, anything else is replaced), then {"run": run_meta}. train.sh does the same."""
    validate_tag(tag)
    d = Path(experiment_dir)
    cfg: dict = {}
    for path in (d / "configs" / "base.yaml", d / "configs" / f"run-{tag}.yaml"):
        if not path.is_file():
            raise NotFound(f"{path.relative_to(d)} not found", where=str(path),
                           fix=f"run generate_config(experiment={d.name!r}, tag={tag!r}); it writes and commits the configs")
        try:
            part = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise BadInput(f"{path.name} is not valid YAML: {e}", where=str(path), fix="run generate_config again") from None
        if not isinstance(part, dict):
            raise BadInput(f"{path.name} is not a mapping", where=str(path), fix="run generate_config again")
        cfg = _deep_merge(cfg, part)
    cfg["run"] = dict(run_meta)
    return cfg
