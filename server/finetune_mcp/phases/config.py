"""Phase 4: resolve a run's hyperparameters from one recipe, the brief, the platform and the memory budget; render train.py and train.sh; commit them.

Public API:
  generate_config(pc, experiment, tag, backend="auto", overrides=None) -> schemas.GenerateConfigResult
  resolve_run_config(experiment_dir, tag, run_meta) -> dict     (launch_run writes it as <run>/config.yaml)
  recipe_params(skills, method), render_train_py(...), render_train_sh(...)   (tests and bench use these)

Resolution order, each value recorded with where it came from: the chosen method's recipe (skills:
lora-qlora-recipes, preference-optimization, grpo-rlvr-training, vision-sft) -> the brief (sequence
length, packing, rewards) -> rules (platform, precision, model) -> the memory budget -> the caller's
overrides. Then the escape-hatch table (lora-qlora-recipes, unsloth-trl-mapping) turns the values
into the keyword arguments of each library call for the chosen backend. Nothing here imports the
training stack; the estimate is phases/memory.py's arithmetic.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp import schemas as S
from finetune_mcp.errors import BadInput, FtError, NotFound, Refused
from finetune_mcp.phases import memory
from finetune_mcp.phases.brief import BRIEF_FILE, METHOD_LABELS, load_brief
from finetune_mcp.workspace import commit as git_commit, validate_experiment, validate_tag

RECIPE_SKILLS = ("lora-qlora-recipes", "preference-optimization", "grpo-rlvr-training", "vision-sft")
SKILL = "lora-qlora-recipes"
ENV_REPORT = "env-report.json"
BACKENDS = ("unsloth", "trl")
FAMILY = {"sft-lora": "sft", "sft-qlora": "sft", "dpo": "preference", "orpo": "preference", "kto": "preference",
          "simpo": "preference", "grpo": "grpo", "vlm-sft": "vlm"}
CALLS = ("load", "quantization", "peft", "trainer", "script")
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
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


# ================================================================ checks on values


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


# ================================================================ context from the experiment


def _read_env_report(pc, exp_dir: Path, experiment: str) -> dict:
    path = exp_dir / ENV_REPORT
    if not path.is_file():
        raise Refused(
            f"experiment {experiment!r} has no {ENV_REPORT}: no preflight, no training script",
            where=str(path),
            fix=f"run preflight(experiment={experiment!r}) first; generate_config reads the platform and the training environment from its report",
        )
    try:
        report = json.loads(pc.guard.read_text(path))
    except json.JSONDecodeError as e:
        raise BadInput(f"{ENV_REPORT} is not valid JSON: {e.msg}", where=f"{path}:{e.lineno}", fix="run preflight again; it rewrites the report") from None
    if report.get("platform") not in ("cpu", "generic-nvidia", "dgx-spark"):
        raise BadInput(f"{ENV_REPORT} names no known platform ({report.get('platform')!r})", where=f"{path}: platform", fix="run preflight again")
    return report


def _import_ok(report: dict, name: str) -> bool | None:
    imps = ((report.get("observed") or {}).get("env") or {}).get("imports") or {}
    if name not in imps:
        return None
    return bool((imps[name] or {}).get("ok"))


def _bf16(report: dict) -> bool | None:
    t = ((report.get("observed") or {}).get("env") or {}).get("torch") or {}
    return t.get("bf16") if isinstance(t.get("bf16"), bool) else None


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


def _masking_of(meta: dict) -> dict | None:
    """The assistant-only masking prepare_dataset chose and checked for conversations (meta.json), or None."""
    tpl = meta.get("chat_template")
    return tpl.get("masking") if isinstance(tpl, dict) else None


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


def _generation_markers(model_path: Path | None, meta: dict) -> bool | None:
    """Whether the chat template marks assistant turns for assistant_only_loss (the data phase records it)."""
    tpl = (meta.get("chat_template") or {}) if isinstance(meta.get("chat_template"), dict) else {}
    if isinstance(tpl.get("generation_markers"), bool):
        return tpl["generation_markers"]
    if model_path is None:
        return None
    texts = []
    jinja = model_path / "chat_template.jinja"
    if jinja.is_file():
        texts.append(jinja.read_text(encoding="utf-8", errors="replace"))
    tok_cfg = model_path / "tokenizer_config.json"
    if tok_cfg.is_file():
        try:
            texts.append(str(json.loads(tok_cfg.read_text(encoding="utf-8")).get("chat_template") or ""))
        except json.JSONDecodeError:
            pass
    if not any(texts):
        return None
    return any(re.search(r"\{%-?\s*generation\s*-?%\}", t) for t in texts)


# ================================================================ resolution


class _Values:
    """Resolved values in recipe order, each with the source that set it last."""

    def __init__(self):
        self.value: dict[str, Any] = {}
        self.source: dict[str, str] = {}

    def set(self, key: str, value: Any, source: str) -> None:
        self.value[key] = copy.deepcopy(value)
        self.source[key] = source


def _rule_matches(when, ctx: dict) -> bool:
    for field in ("platform", "method", "backend", "model", "format"):
        allowed = getattr(when, field)
        if allowed is not None and ctx.get(field) not in allowed:
            return False
    for field in ("bf16", "bitsandbytes", "generation_template"):
        want = getattr(when, field)
        if want is not None and ctx.get(field) is not want:  # an unknown fact matches no rule
            return False
    return True


def _qlora_allowed(brief, words: list[str]) -> bool:
    text = " ".join([brief.sections.get("memory_budget", ""), brief.sections.get("chosen_method", "")]).lower()
    text = re.sub(r"\s+", " ", text)
    return any(w.lower() in text for w in words)


def _estimate(model_info, method: str, values: dict, platform: str, mem_table, meta: dict | None = None,
              backend: str | None = None) -> dict:
    est_method = "sft-qlora" if values.get("load_in_4bit") and method == "sft-lora" else method
    seq = int(values.get("max_seq_length") or 2048)
    return memory.estimate(
        model_info, est_method, seq, platform, mem_table,
        tokens_per_sequence=effective_tokens(meta or {}, seq, bool(values.get("packing"))),
        micro_batch_size=int(values.get("per_device_train_batch_size") or 1),
        lora_r=int(values.get("lora_r") or 16),
        lora_targets=[t.replace("_proj", "") for t in (values.get("target_modules") or ["q", "k", "v", "o", "gate", "up", "down"])],
        gradient_checkpointing=bool(values.get("gradient_checkpointing")),
        backend=backend,
    )


def _apply_budget(vals: _Values, params: dict, brief, method: str, platform: str, model_info, skills, notes: list[str],
                  meta: dict | None = None, backend: str | None = None) -> dict | None:
    """The memory-budget rules, in the table's order, until the estimate fits (lora-qlora-recipes#memory-budget)."""
    budget_gb = brief.memory_budget_gb
    rules = skills.table(SKILL, "rules").budget
    if not budget_gb or model_info is None or not model_info.get("config"):
        return None
    mem_table = skills.table("spark-preflight", "memory")
    limit = budget_gb * rules.headroom
    where = f"budget rule ({rules.cite}; {budget_gb:g} GB budget, {rules.headroom:.0%} headroom)"
    est = _estimate(model_info, method, vals.value, platform, mem_table, meta, backend)
    for step in rules.order:
        if est["gb"]["total"] <= limit:
            break
        if step == "gradient-checkpointing" and "gradient_checkpointing" in params and not vals.value.get("gradient_checkpointing"):
            vals.set("gradient_checkpointing", True, where + ": gradient checkpointing on")
        elif step == "halve-batch" and "per_device_train_batch_size" in params:
            while est["gb"]["total"] > limit and int(vals.value["per_device_train_batch_size"]) > 1:
                b = int(vals.value["per_device_train_batch_size"])
                vals.set("per_device_train_batch_size", b // 2, where + f": batch {b} -> {b // 2}")
                if "gradient_accumulation_steps" in params:
                    g = int(vals.value.get("gradient_accumulation_steps") or 1)
                    vals.set("gradient_accumulation_steps", g * 2, where + f": accumulation {g} -> {g * 2}, same effective batch")
                est = _estimate(model_info, method, vals.value, platform, mem_table, meta, backend)
            continue
        elif step == "qlora" and "load_in_4bit" in params and not vals.value.get("load_in_4bit"):
            if method not in rules.qlora_methods:
                continue
            if not _qlora_allowed(brief, rules.qlora_allowed_words):
                notes.append(f"the estimate ({est['gb']['total']:.2f} GB) still exceeds {limit:.2f} GB; QLoRA would fit more, "
                             "but the brief does not allow it (say 'QLoRA allowed' in its Memory Budget section)")
                continue
            vals.set("load_in_4bit", True, where + ": the brief allows QLoRA")
        else:
            continue
        est = _estimate(model_info, method, vals.value, platform, mem_table, meta, backend)
    fits = est["gb"]["total"] <= limit
    if not fits:
        notes.append(f"estimated {est['gb']['total']:.2f} GB exceeds {rules.headroom:.0%} of the {budget_gb:g} GB budget after every budget rule; "
                     "the preflight's memory check decides whether this run may start")
    return _mem_result(est, budget_gb, limit)


def _mem_result(est: dict, budget_gb: float, limit: float) -> dict:
    return {"total_gb": est["gb"]["total"], "budget_gb": budget_gb, "limit_gb": round(limit, 3), "fits": est["gb"]["total"] <= limit,
            "gb": est["gb"], "assumptions": est["assumptions"], "cite": est["cite"], "micro_batch_size": est["micro_batch_size"],
            "tokens_per_sequence": est["tokens_per_sequence"]}


def _choose_backend(requested: str, method: str, platform: str, report: dict, skills, notes: list[str]) -> tuple[str, str]:
    table = skills.table(SKILL, "backends")
    supported = method in table.unsloth_supports.get(platform, [])
    importable = _import_ok(report, "unsloth")
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


def _parse_overrides(overrides: Any) -> dict:
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        try:
            overrides = yaml.safe_load(overrides) if overrides.strip() else {}
        except yaml.YAMLError as e:
            raise BadInput(f"overrides are not a mapping: {e}", where="overrides", fix='pass a mapping such as {"learning_rate": 1e-4}') from None
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise BadInput("overrides must be a mapping of recipe keys to values", where="overrides", fix='e.g. {"learning_rate": 1e-4, "lora_r": 32}')
    return overrides


def _check_overrides(skills, method: str, params: dict, overrides: dict) -> tuple[list[str], list[str]]:
    errors, warnings = [], []
    label = METHOD_LABELS[method]
    for key, value in overrides.items():
        if key not in params:
            owners = key_owners(skills, key)
            if owners:
                names = ", ".join(METHOD_LABELS[m] for m in owners)
                errors.append(f"overrides.{key}: {key!r} belongs to {names}, not to {label}: the brief's Chosen Method picks "
                              f"one recipe and its keys only (no blending across methods)")
            else:
                close = difflib.get_close_matches(key, list(params), n=1)
                errors.append(f"overrides.{key}: not a key of the {label} recipe" + (f" (did you mean {close[0]!r}?)" if close else ""))
            continue
        err, warn = check_value(key, params[key], value)
        if err:
            errors.append("overrides." + err)
        if warn:
            warnings.append("override " + warn)
    return errors, warnings


# ================================================================ rendering


_DIRECTIVE = re.compile(r"^\s*#>>\s*(if|else|end)\b\s*(.*)$")
_COND = re.compile(r"^(\w+)\s*(==|!=)\s*\"([^\"]*)\"$")
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def _preprocess(text: str, env: dict[str, str], name: str) -> str:
    """Keep the lines whose `#>> if <var> == "<value>"` / `#>> else` / `#>> end` blocks hold for env."""
    out, stack = [], []  # stack of (this block's condition, currently active)
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        m = _DIRECTIVE.match(line)
        if not m:
            if all(active for _, active in stack):
                out.append(line)
            continue
        kind, rest = m.groups()
        if kind == "if":
            c = _COND.match(rest.strip())
            if not c or c.group(1) not in env:
                raise ValueError(f"{name}:{n}: bad template condition {rest.strip()!r}")
            var, op, val = c.groups()
            holds = (env[var] == val) == (op == "==")
            stack.append((holds, holds))
        elif kind == "else":
            if not stack:
                raise ValueError(f"{name}:{n}: #>> else without #>> if")
            holds, _ = stack.pop()
            stack.append((holds, not holds))
        else:
            if not stack:
                raise ValueError(f"{name}:{n}: #>> end without #>> if")
            stack.pop()
    if stack:
        raise ValueError(f"{name}: {len(stack)} unclosed #>> if block(s)")
    return "".join(out)


def _substitute(text: str, subs: dict[str, str], name: str) -> str:
    def repl(m):
        if m.group(1) not in subs:
            raise ValueError(f"{name}: unknown placeholder {{{{{m.group(1)}}}}}")
        return subs[m.group(1)]

    return _PLACEHOLDER.sub(repl, text)


def render_train_py(method: str, backend: str, experiment: str, recipe) -> str:
    """The standalone train.py for method x backend: head, model loading, common callbacks, the method family, main."""
    if backend not in BACKENDS:
        raise BadInput(f"unknown backend {backend!r}", where="backend", fix="auto, unsloth or trl")
    family = FAMILY[method]
    env = {"method": method, "backend": backend, "family": family}
    subs = {
        "METHOD": method, "BACKEND": backend, "LABEL": recipe.label, "EXPERIMENT": experiment, "STACK": STACK[backend],
        "TRAINER_MODULE": recipe.trainer.module, "TRAINER_CONFIG": recipe.trainer.config, "TRAINER_CLASS": recipe.trainer.trainer,
    }
    parts = ["head.py", f"model_{backend}.py", "common.py", f"{family}.py", "main.py"]
    text = ""
    for part in parts:
        raw = (TEMPLATES / "train" / part).read_text(encoding="utf-8")
        text += _substitute(_preprocess(raw, env, part), subs, part)
        if part == "common.py" and family == "sft":
            text += masking_source()
    return text


def masking_source() -> str:
    """jobs/masking.py as a train.py section: the trainer masks with the code prepare_dataset checked with."""
    src = (Path(__file__).resolve().parent.parent / "jobs" / "masking.py").read_text(encoding="utf-8")
    src = src.replace("from __future__ import annotations\n", "")
    return ("\n\n# --- assistant-only masking: a verbatim copy of finetune_mcp/jobs/masking.py "
            + "-" * 20 + "\n\n" + src)


def render_train_sh(method: str, backend: str, experiment: str, tag: str, label: str) -> str:
    raw = (TEMPLATES / "train.sh").read_text(encoding="utf-8")
    return _substitute(raw, {"EXPERIMENT": experiment, "TAG": tag, "LABEL": label, "BACKEND": backend}, "train.sh")


def _yaml_value(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10_000, allow_unicode=True).strip().removesuffix("\n...").strip()


def _run_yaml(header: str, top: dict, hparams: dict, sources: dict, rest: dict) -> str:
    """run-<tag>.yaml: hparams annotated with their sources inline, the rest as plain YAML."""
    lines = [header.rstrip(), yaml.safe_dump(top, sort_keys=False, allow_unicode=True).rstrip(), "hparams:"]
    for k, v in hparams.items():
        lines.append(f"  {k}: {_yaml_value(v)}  # {sources[k]}")
    lines.append(yaml.safe_dump(rest, sort_keys=False, allow_unicode=True, width=120).rstrip())
    text = "\n".join(lines) + "\n"
    parsed = yaml.safe_load(text)
    assert parsed["hparams"] == hparams, "annotated hparams did not round-trip"  # the comments must not change a value
    return text


# ================================================================ the tool


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


def _time_for(report: dict, values: dict, meta: dict, brief, method: str, skills) -> dict:
    """The preflight's expected wall time restated for the resolved values: this run's batch, accumulation, length and
    steps, read from the same timed training steps (overrides such as max_steps or the batch come after preflight)."""
    from finetune_mcp.phases.preflight import time_estimate

    seq = int(values.get("max_seq_length") or values.get("max_length") or brief.max_seq_length or 2048)
    shape = run_shape(values, meta, seq, bool(values.get("packing")), method, skills.table("spark-preflight", "memory"))
    return time_estimate((report.get("observed") or {}).get("step_probe"), shape, brief.time_budget_s)


def generate_config(pc, experiment: str, tag: str, backend: str = "auto", overrides: dict | None = None) -> S.GenerateConfigResult:
    validate_experiment(experiment)
    validate_tag(tag)
    if backend not in ("auto",) + BACKENDS:
        raise BadInput(f"unknown backend {backend!r}", where="backend", fix="auto (Unsloth where it can, else TRL), unsloth, or trl")
    overrides = _parse_overrides(overrides)
    skills = pc.skills
    ws = pc.ws
    exp_dir = ws.experiment_dir(experiment)
    brief = load_brief(pc.guard.check_read(exp_dir / BRIEF_FILE, "training brief"))
    report = _read_env_report(pc, exp_dir, experiment)
    platform = report["platform"]
    method = brief.method
    skill, recipe = all_recipes(skills)[method]
    params = recipe_params(skills, method)
    pc.progress(0, 4, f"resolving {recipe.label} from {skill}")

    errors, warnings = _check_overrides(skills, method, params, overrides)
    if errors:
        raise BadInput(
            f"{len(errors)} override(s) refused:\n  - " + "\n  - ".join(errors),
            where="overrides",
            fix=f"override only keys of the {recipe.label} recipe: " + ", ".join(sorted(params)),
        )
    dataset_dir, meta = find_dataset(pc, experiment)
    try:
        model_info = memory.load_model_info(ws.base_models_dir, brief.base_model, data_dirs=pc.guard.read_roots)
    except NotFound as e:
        raise NotFound(str(e.message), where=e.where, fix=e.fix or "run prepare_dataset first; it builds or finds the base model") from None
    model_ref_path = Path(model_info["source"]).parent if model_info.get("source", "").endswith("config.json") else None
    if model_ref_path is None:
        raise NotFound(f"base model {brief.base_model!r} is not built or cached yet", where="brief ## Base Model",
                       fix="run prepare_dataset first; it builds the embedded model or checks the HF cache")

    chosen, backend_reason = _choose_backend(backend, method, platform, report, skills, warnings)

    # 1. recipe
    vals = _Values()
    for k, p in params.items():
        vals.set(k, p.default, f"recipe {p.cite}")
    # 2. brief
    if "max_seq_length" in params and brief.max_seq_length:
        vals.set("max_seq_length", int(brief.max_seq_length), "brief ## Dataset Expectation (max_seq_length)")
    if "packing" in params:
        vals.set("packing", bool(brief.packing), "brief ## Dataset Expectation (packing)")
    if "rewards" in params and brief.reward:
        vals.set("rewards", list(brief.reward), "brief ## Reward")
    # 3. rules
    ctx = {
        "platform": platform, "method": method, "backend": chosen, "model": brief.base_model,
        "bf16": _bf16(report), "bitsandbytes": _import_ok(report, "bitsandbytes"),
        # A masking way prepare_dataset verified works as well as {% generation %} markers (jobs/masking.py).
        "generation_template": True if _masking_of(meta) else _generation_markers(model_ref_path, meta),
        "format": meta.get("format") or brief.dataset_format,
    }
    applied_rules = []
    for rule in skills.table(SKILL, "rules").rules:
        if not _rule_matches(rule.when, ctx):
            continue
        touched = [k for k in rule.set if k in params]
        for k in touched:
            vals.set(k, rule.set[k], f"{rule.kind} rule {rule.id} ({rule.cite})")
        if touched:
            applied_rules.append(rule)
    if (ctx["generation_template"] is False and "assistant_only_loss" in params
            and meta.get("format", brief.dataset_format) == "messages"):
        warnings.append("the model's chat template has no {% generation %} markers: the loss covers prompt tokens too")
    # 4. memory budget
    budget_notes: list[str] = []
    pc.progress(1, 4, "fitting the memory budget")
    mem = None
    try:
        mem = _apply_budget(vals, params, brief, method, platform, model_info, skills, budget_notes, meta, chosen)
    except FtError as e:  # an unusual config.json: the preflight's memory check reports the same problem
        budget_notes.append(f"no memory estimate: {e.message}")
    # 5. overrides
    for k, v in overrides.items():
        before = vals.source[k]
        vals.set(k, v, "override")
        if before.startswith("budget rule"):
            warnings.append(f"the override of {k} replaces a budget rule's value ({before})")
    if mem is not None and overrides:
        # The estimate must describe the run that will start: overrides may change its batch, rank or length.
        mem = _mem_result(_estimate(model_info, method, vals.value, platform, skills.table("spark-preflight", "memory"), meta, chosen),
                          mem["budget_gb"], mem["limit_gb"])
        if not mem["fits"]:
            budget_notes.append(f"with the overrides the estimate is {mem['total_gb']:.2f} GB, above {mem['limit_gb']:.2f} GB "
                                f"({mem['budget_gb']:g} GB budget with headroom)")
    warnings += budget_notes
    if "rewards" in vals.value:
        known = skills.table("grpo-rlvr-training", "rewards").rewards
        unknown = [r for r in vals.value["rewards"] or [] if r not in known]
        if unknown or not vals.value["rewards"]:
            raise BadInput(f"reward function(s) {unknown or '(none)'} are not ones train.py has",
                           where="overrides.rewards" if vals.source["rewards"] == "override" else brief.where("reward"),
                           fix="use " + ", ".join(known) + " (grpo-rlvr-training#reward-functions)")

    if vals.value.get("load_in_4bit") and _import_ok(report, "bitsandbytes") is False:
        warnings.append("load_in_4bit needs bitsandbytes, which the training environment cannot import")
    if report.get("verdict") == "blocked":
        warnings.append("the preflight verdict is blocked: launch_run will refuse until a new preflight clears it")
    time_est = _time_for(report, vals.value, meta, brief, method, skills)
    if time_est.get("within_budget") is False:
        warnings.append(f"expected wall time ~{time_est['wall']} is over the brief's time budget ({time_est['budget_s']:g} s)")

    calls, call_origin = build_calls(skills, method, chosen, vals.value, recipe, platform)
    data = {
        "dir": str(dataset_dir),
        "train": "train.jsonl",
        "eval": "eval.jsonl" if (dataset_dir / "eval.jsonl").is_file() else None,
        "format": meta.get("format") or brief.dataset_format,
        "reference_field": meta.get("reference_field") if method == "grpo" else None,
    }
    mk = _masking_of(meta)
    if mk and data["format"] == "messages":
        # How prepare_dataset made assistant-only loss work on this template; train.py masks the same way.
        data["masking"] = {"method": mk["method"], "plan": mk["plan"], "template_file": meta["chat_template"].get("file", "chat_template.jinja"),
                           "system_prompt": mk.get("system_prompt")}
    if method == "grpo" and not data["reference_field"]:
        data["reference_field"] = "answer"

    # Citations: the recipe, each section a value came from, the rules and tables applied.
    cites = [recipe.cite]
    for src in vals.source.values():
        cites += re.findall(r"[a-z0-9-]+#[A-Za-z0-9_.-]+", src)
    cites += [p.cite for k, p in params.items() if vals.source[k].startswith("recipe")]
    cites.append(skills.table(SKILL, "backends").cite)
    cites.append(skills.table(SKILL, "unsloth-trl-mapping").cite)
    if mem:
        cites += [skills.table(SKILL, "rules").budget.cite, mem["cite"]]
    citations = [skills.cite(*c.split("#")) for c in dict.fromkeys(cites)]

    # ---- files
    pc.progress(2, 4, "rendering train.py and train.sh")
    cfg_dir = exp_dir / "configs"
    base = {
        "experiment": experiment,
        "method": method,
        "method_label": recipe.label,
        "skill": recipe.cite,
        "model": {"name": brief.base_model, "path": str(model_ref_path), "embedded": bool(model_info.get("embedded"))},
        "data": data,
        "signal": recipe.signal.model_dump(),
        "brief": {"task": brief.task_slug, "memory_budget_gb": brief.memory_budget_gb,
                  "deployment_target": brief.deployment_target, "evaluation": brief.evaluation},
        # The brief's Tracking section: train.py points the tracker at a local store under the run's logs/.
        "tracking": {"report_to": brief.report_to, "project": brief.tracking_project or experiment},
    }
    base_text = (
        f"# {experiment}: what every run of this experiment trains on. Written by finetune-mcp generate_config;\n"
        f"# each configs/run-<tag>.yaml is merged over it (launch_run writes the result as <run>/config.yaml).\n"
        + yaml.safe_dump(base, sort_keys=False, allow_unicode=True)
    )
    top = {"method": method, "backend": chosen, "backend_reason": backend_reason, "platform": platform, "tag": tag}
    rest = {
        "calls": calls,
        "sources": dict(vals.source),
        "call_sources": call_origin,
        "overrides": overrides,
        "memory_estimate": mem,
        "time_estimate": time_est,
        "warnings": warnings,
        "citations": citations,
    }
    header = (
        f"# {experiment} run {tag}: {recipe.label} with {chosen}. Start it with launch_run(experiment, tag={tag!r}),\n"
        f"# or by hand: RUN_TAG={tag} ./train.sh. hparams are the resolved recipe values (source after each);\n"
        f"# calls are the exact keyword arguments train.py passes (built from {skills.table(SKILL, 'unsloth-trl-mapping').cite})."
    )
    run_text = _run_yaml(header, top, vals.value, vals.source, rest)
    train_py = render_train_py(method, chosen, experiment, recipe)
    compile(train_py, "train.py", "exec")  # a template bug must fail here, not at launch
    train_sh = render_train_sh(method, chosen, experiment, tag, recipe.label)

    files = [
        pc.guard.write_text(cfg_dir / "base.yaml", base_text),
        pc.guard.write_text(cfg_dir / f"run-{tag}.yaml", run_text),
        pc.guard.write_text(exp_dir / "train.py", train_py, mode=0o755),
        pc.guard.write_text(exp_dir / "train.sh", train_sh, mode=0o755),
    ]
    pc.progress(3, 4, "committing")
    commit_id = git_commit(ws.experiments_repo, files, f"generate_config {experiment} {tag}: {recipe.label} with {chosen}")
    pc.progress(4, 4, commit_id[:12])

    resolved = {k: S.ResolvedValue(value=vals.value[k], source=vals.source[k]) for k in vals.value}
    for key, origin in call_origin.items():
        if not origin.startswith("recipe") and origin not in vals.value:
            resolved[f"calls.{key}"] = S.ResolvedValue(value=calls[key.split(".")[0]][key.split(".", 1)[1]], source=origin)
    changed = [k for k, s in vals.source.items() if not s.startswith("recipe")]
    summary = (f"{recipe.label} config '{tag}' for {experiment} with {chosen} on {platform}: "
               f"lr {vals.value.get('learning_rate'):g}"
               + (f", r {vals.value['lora_r']}" if "lora_r" in vals.value else "")
               + (f", batch {vals.value['per_device_train_batch_size']}x{vals.value.get('gradient_accumulation_steps', 1)}"
                  if "per_device_train_batch_size" in vals.value else "")
               + (f"; expected wall time ~{time_est['wall']}" if time_est.get("wall") else "")
               + f"; {len(changed)} value(s) from brief/rules/budget/overrides; committed {commit_id[:12]}"
               + (f"; {len(warnings)} warning(s)" if warnings else ""))
    return S.GenerateConfigResult(
        summary=summary,
        citations=citations,
        experiment=experiment,
        tag=tag,
        method=method,
        backend=chosen,
        backend_reason=backend_reason,
        resolved=resolved,
        files=[str(f) for f in files],
        commit=commit_id,
        warnings=warnings,
        memory_estimate=mem or {},
        time_estimate=time_est,
        masking=(data.get("masking") or {}).get("method"),
    )


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
