"""generate_config: resolve a run's hyperparameters from one recipe, the brief, the platform and the memory budget;
render train.py (with masking.py beside it for the SFT family) and train.sh; commit them.

Stages: load (brief, env report, recipe, dataset, base model) -> choose the backend -> resolve the values, each with
where it came from: the chosen method's recipe (skills: lora-qlora-recipes, preference-optimization,
grpo-rlvr-training, vision-sft) -> the brief (sequence length, packing, rewards) -> rules (platform, precision,
model) -> the memory budget -> the caller's overrides -> check what they add up to -> the library calls (the
escape-hatch table, lora-qlora-recipes and unsloth-trl-mapping) -> write and commit the files -> the result.
Nothing here imports the training stack; the estimate is domain/memory.py's arithmetic.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import BadInput, FtError, NotFound
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain import memory
from finetune_mcp.domain.brief import BRIEF_FILE, METHOD_LABELS, load_brief
from finetune_mcp.domain.machine import read_env_report
from finetune_mcp.domain.recipes import (
    BACKENDS,
    all_recipes,
    build_calls,
    check_value,
    choose_backend,
    effective_tokens,
    env_bf16,
    env_import_ok,
    find_dataset,
    key_owners,
    recipe_params,
    run_shape,
    time_estimate,
)
from finetune_mcp.domain.render import MASKING_FILE, needs_masking, render_masking_py, render_train_py, render_train_sh, run_yaml
from finetune_mcp.workspace import commit as git_commit, validate_experiment, validate_tag

SKILL = "lora-qlora-recipes"


@dataclass
class Inputs:
    """What the stages read once: the arguments, the brief, the preflight's report, the recipe, the data, the model."""
    experiment: str
    tag: str
    overrides: dict
    exp_dir: Path
    brief: Any
    report: dict
    platform: str
    method: str
    recipe: Any
    params: dict
    dataset_dir: Path
    meta: dict
    model_info: dict
    model_ref_path: Path
    warnings: list[str] = dataclass_field(default_factory=list)


def generate_config(pc: PhaseContext, args: S.GenerateConfigArgs) -> S.GenerateConfigResult:
    inp = _load(pc, args)
    chosen, backend_reason = choose_backend(args.backend, inp.method, inp.platform, inp.report, pc.skills, inp.warnings)
    vals = _resolve(pc, inp, chosen)
    mem = _fit_budget(pc, inp, vals, chosen)
    _check_resolved(pc, inp, vals)
    time_est = _time_for(inp.report, vals.value, inp.meta, inp.brief, inp.method, pc.skills)
    if time_est.get("within_budget") is False:
        inp.warnings.append(f"expected wall time ~{time_est['wall']} is over the brief's time budget ({time_est['budget_s']:g} s)")
    calls, call_origin = build_calls(pc.skills, inp.method, chosen, vals.value, inp.recipe, inp.platform)
    data = _data_section(inp)
    citations = _citations(pc, inp, vals, mem)
    rest = {"calls": calls, "sources": dict(vals.source), "call_sources": call_origin, "overrides": inp.overrides,
            "memory_estimate": mem, "time_estimate": time_est, "warnings": inp.warnings, "citations": citations}
    files, commit_id = _write(pc, inp, chosen, backend_reason, vals, data, rest)
    return S.GenerateConfigResult(
        summary=_summary(inp, chosen, vals, time_est, commit_id),
        citations=citations,
        experiment=inp.experiment,
        tag=inp.tag,
        method=inp.method,
        backend=chosen,
        backend_reason=backend_reason,
        resolved=_resolved(vals, calls, call_origin),
        files=[str(f) for f in files],
        commit=commit_id,
        warnings=inp.warnings,
        memory_estimate=mem or {},
        time_estimate=time_est,
        masking=(data.get("masking") or {}).get("method"),
    )


def _load(pc: PhaseContext, args: S.GenerateConfigArgs) -> Inputs:
    validate_experiment(args.experiment)
    validate_tag(args.tag)
    if args.backend not in ("auto",) + BACKENDS:
        raise BadInput(f"unknown backend {args.backend!r}", where="backend", fix="auto (Unsloth where it can, else TRL), unsloth, or trl")
    overrides = _parse_overrides(args.overrides)
    exp_dir = pc.ws.experiment_dir(args.experiment)
    brief = load_brief(pc.guard.check_read(exp_dir / BRIEF_FILE, "training brief"))
    report = read_env_report(pc, exp_dir, args.experiment)
    method = brief.method
    skill, recipe = all_recipes(pc.skills)[method]
    params = recipe_params(pc.skills, method)
    pc.progress(0, 4, f"resolving {recipe.label} from {skill}")
    errors, warnings = _check_overrides(pc.skills, method, params, overrides)
    if errors:
        raise BadInput(
            f"{len(errors)} override(s) refused:\n  - " + "\n  - ".join(errors),
            where="overrides",
            fix=f"override only keys of the {recipe.label} recipe: " + ", ".join(sorted(params)),
        )
    dataset_dir, meta = find_dataset(pc, args.experiment)
    try:
        model_info = memory.load_model_info(pc.ws.base_models_dir, brief.base_model, data_dirs=pc.guard.read_roots)
    except NotFound as e:
        raise NotFound(str(e.message), where=e.where, fix=e.fix or "run prepare_dataset first; it builds or finds the base model") from None
    model_ref_path = Path(model_info["source"]).parent if model_info.get("source", "").endswith("config.json") else None
    if model_ref_path is None:
        raise NotFound(f"base model {brief.base_model!r} is not built or cached yet", where="brief ## Base Model",
                       fix="run prepare_dataset first; it builds the embedded model or checks the HF cache")
    return Inputs(args.experiment, args.tag, overrides, exp_dir, brief, report, report["platform"], method, recipe, params,
                  dataset_dir, meta, model_info, model_ref_path, warnings)


def _resolve(pc: PhaseContext, inp: Inputs, chosen: str) -> _Values:
    """1. the recipe, 2. the brief, 3. the rules that match this platform, method, backend, model and data."""
    params, brief, meta = inp.params, inp.brief, inp.meta
    vals = _Values()
    for k, p in params.items():
        vals.set(k, p.default, f"recipe {p.cite}")
    if "max_seq_length" in params and brief.max_seq_length:
        vals.set("max_seq_length", int(brief.max_seq_length), "brief ## Dataset Expectation (max_seq_length)")
    if "packing" in params:
        vals.set("packing", bool(brief.packing), "brief ## Dataset Expectation (packing)")
    if "rewards" in params and brief.reward:
        vals.set("rewards", list(brief.reward), "brief ## Reward")
    ctx = {
        "platform": inp.platform, "method": inp.method, "backend": chosen, "model": brief.base_model,
        "bf16": env_bf16(inp.report), "bitsandbytes": env_import_ok(inp.report, "bitsandbytes"),
        # A masking way prepare_dataset verified works as well as {% generation %} markers (common/masking.py).
        "generation_template": True if _masking_of(meta) else _generation_markers(inp.model_ref_path, meta),
        "format": meta.get("format") or brief.dataset_format,
    }
    for rule in pc.skills.table(SKILL, "rules").rules:
        if not _rule_matches(rule.when, ctx):
            continue
        for k in [k for k in rule.set if k in params]:
            vals.set(k, rule.set[k], f"{rule.kind} rule {rule.id} ({rule.cite})")
    if (ctx["generation_template"] is False and "assistant_only_loss" in params
            and meta.get("format", brief.dataset_format) == "messages"):
        inp.warnings.append("the model's chat template has no {% generation %} markers: the loss covers prompt tokens too")
    return vals


def _fit_budget(pc: PhaseContext, inp: Inputs, vals: _Values, chosen: str) -> dict | None:
    """4. the memory budget rules, then 5. the caller's overrides (and the estimate again, for the run that will start)."""
    budget_notes: list[str] = []
    pc.progress(1, 4, "fitting the memory budget")
    mem = None
    try:
        mem = _apply_budget(vals, inp.params, inp.brief, inp.method, inp.platform, inp.model_info, pc.skills, budget_notes, inp.meta, chosen)
    except FtError as e:  # an unusual config.json: the preflight's memory check reports the same problem
        budget_notes.append(f"no memory estimate: {e.message}")
    for k, v in inp.overrides.items():
        before = vals.source[k]
        vals.set(k, v, "override")
        if before.startswith("budget rule"):
            inp.warnings.append(f"the override of {k} replaces a budget rule's value ({before})")
    if mem is not None and inp.overrides:
        # The estimate must describe the run that will start: overrides may change its batch, rank or length.
        mem = _mem_result(_estimate(inp.model_info, inp.method, vals.value, inp.platform, pc.skills.table("spark-preflight", "memory"),
                                    inp.meta, chosen), mem["budget_gb"], mem["limit_gb"])
        if not mem["fits"]:
            budget_notes.append(f"with the overrides the estimate is {mem['total_gb']:.2f} GB, above {mem['limit_gb']:.2f} GB "
                                f"({mem['budget_gb']:g} GB budget with headroom)")
    inp.warnings += budget_notes
    return mem


def _check_resolved(pc: PhaseContext, inp: Inputs, vals: _Values) -> None:
    """What the values add up to: reward functions train.py has; 4-bit where bitsandbytes imports; the verdict."""
    if "rewards" in vals.value:
        known = pc.skills.table("grpo-rlvr-training", "rewards").rewards
        unknown = [r for r in vals.value["rewards"] or [] if r not in known]
        if unknown or not vals.value["rewards"]:
            raise BadInput(f"reward function(s) {unknown or '(none)'} are not ones train.py has",
                           where="overrides.rewards" if vals.source["rewards"] == "override" else inp.brief.where("reward"),
                           fix="use " + ", ".join(known) + " (grpo-rlvr-training#reward-functions)")
    if vals.value.get("load_in_4bit") and env_import_ok(inp.report, "bitsandbytes") is False:
        inp.warnings.append("load_in_4bit needs bitsandbytes, which the training environment cannot import")
    if inp.report.get("verdict") == "blocked":
        inp.warnings.append("the preflight verdict is blocked: launch_run will refuse until a new preflight clears it")


def _data_section(inp: Inputs) -> dict:
    meta, dataset_dir = inp.meta, inp.dataset_dir
    data = {
        "dir": str(dataset_dir),
        "train": "train.jsonl",
        "eval": "eval.jsonl" if (dataset_dir / "eval.jsonl").is_file() else None,
        "format": meta.get("format") or inp.brief.dataset_format,
        "reference_field": meta.get("reference_field") if inp.method == "grpo" else None,
    }
    mk = _masking_of(meta)
    if mk and data["format"] == "messages":
        # How prepare_dataset made assistant-only loss work on this template; train.py masks the same way.
        data["masking"] = {"method": mk["method"], "plan": mk["plan"], "template_file": meta["chat_template"].get("file", "chat_template.jinja"),
                           "system_prompt": mk.get("system_prompt")}
    if inp.method == "grpo" and not data["reference_field"]:
        data["reference_field"] = "answer"
    return data


def _citations(pc: PhaseContext, inp: Inputs, vals: _Values, mem: dict | None) -> list[str]:
    """The recipe, each section a value came from, the rules and tables applied."""
    skills = pc.skills
    cites = [inp.recipe.cite]
    for src in vals.source.values():
        cites += re.findall(r"[a-z0-9-]+#[A-Za-z0-9_.-]+", src)
    cites += [p.cite for k, p in inp.params.items() if vals.source[k].startswith("recipe")]
    cites.append(skills.table(SKILL, "backends").cite)
    cites.append(skills.table(SKILL, "unsloth-trl-mapping").cite)
    if mem:
        cites += [skills.table(SKILL, "rules").budget.cite, mem["cite"]]
    return [skills.cite(*c.split("#")) for c in dict.fromkeys(cites)]


def _base_yaml(inp: Inputs, data: dict) -> str:
    brief, recipe = inp.brief, inp.recipe
    base = {
        "experiment": inp.experiment,
        "method": inp.method,
        "method_label": recipe.label,
        "skill": recipe.cite,
        "model": {"name": brief.base_model, "path": str(inp.model_ref_path), "embedded": bool(inp.model_info.get("embedded"))},
        "data": data,
        "signal": recipe.signal.model_dump(),
        "brief": {"task": brief.task_slug, "memory_budget_gb": brief.memory_budget_gb,
                  "deployment_target": brief.deployment_target, "evaluation": brief.evaluation},
        # The brief's Tracking section: train.py points the tracker at a local store under the run's logs/.
        "tracking": {"report_to": brief.report_to, "project": brief.tracking_project or inp.experiment},
    }
    return (
        f"# {inp.experiment}: what every run of this experiment trains on. Written by finetune-mcp generate_config;\n"
        f"# each configs/run-<tag>.yaml is merged over it (launch_run writes the result as <run>/config.yaml).\n"
        + yaml.safe_dump(base, sort_keys=False, allow_unicode=True)
    )


def _write(pc: PhaseContext, inp: Inputs, chosen: str, backend_reason: str, vals: _Values, data: dict, rest: dict) -> tuple[list[Path], str]:
    """configs/base.yaml, configs/run-<tag>.yaml, train.py (and masking.py), train.sh: written, then committed."""
    pc.progress(2, 4, "rendering train.py and train.sh")
    experiment, tag, recipe, exp_dir = inp.experiment, inp.tag, inp.recipe, inp.exp_dir
    top = {"method": inp.method, "backend": chosen, "backend_reason": backend_reason, "platform": inp.platform, "tag": tag}
    header = (
        f"# {experiment} run {tag}: {recipe.label} with {chosen}. Start it with launch_run(experiment, tag={tag!r}),\n"
        f"# or by hand: RUN_TAG={tag} ./train.sh. hparams are the resolved recipe values (source after each);\n"
        f"# calls are the exact keyword arguments train.py passes (built from {pc.skills.table(SKILL, 'unsloth-trl-mapping').cite})."
    )
    run_text = run_yaml(header, top, vals.value, vals.source, rest)
    train_py = render_train_py(inp.method, chosen, experiment, recipe)
    compile(train_py, "train.py", "exec")  # a template bug must fail here, not at launch
    train_sh = render_train_sh(inp.method, chosen, experiment, tag, recipe.label)
    cfg_dir = exp_dir / "configs"
    files = [
        pc.guard.write_text(cfg_dir / "base.yaml", _base_yaml(inp, data)),
        pc.guard.write_text(cfg_dir / f"run-{tag}.yaml", run_text),
        pc.guard.write_text(exp_dir / "train.py", train_py, mode=0o755),
        pc.guard.write_text(exp_dir / "train.sh", train_sh, mode=0o755),
    ]
    if needs_masking(inp.method):
        # The declared copy: common/masking.py byte for byte beside train.py, which imports it.
        files.append(pc.guard.write_text(exp_dir / MASKING_FILE, render_masking_py()))
    pc.progress(3, 4, "committing")
    commit_id = git_commit(pc.ws.experiments_repo, files, f"generate_config {experiment} {tag}: {recipe.label} with {chosen}")
    pc.progress(4, 4, commit_id[:12])
    return files, commit_id


def _resolved(vals: _Values, calls: dict, call_origin: dict) -> dict[str, S.ResolvedValue]:
    resolved = {k: S.ResolvedValue(value=vals.value[k], source=vals.source[k]) for k in vals.value}
    for key, origin in call_origin.items():
        if not origin.startswith("recipe") and origin not in vals.value:
            resolved[f"calls.{key}"] = S.ResolvedValue(value=calls[key.split(".")[0]][key.split(".", 1)[1]], source=origin)
    return resolved


def _summary(inp: Inputs, chosen: str, vals: _Values, time_est: dict, commit_id: str) -> str:
    changed = [k for k, s in vals.source.items() if not s.startswith("recipe")]
    v = vals.value
    return (f"{inp.recipe.label} config '{inp.tag}' for {inp.experiment} with {chosen} on {inp.platform}: "
            f"lr {v.get('learning_rate'):g}"
            + (f", r {v['lora_r']}" if "lora_r" in v else "")
            + (f", batch {v['per_device_train_batch_size']}x{v.get('gradient_accumulation_steps', 1)}"
               if "per_device_train_batch_size" in v else "")
            + (f"; expected wall time ~{time_est['wall']}" if time_est.get("wall") else "")
            + f"; {len(changed)} value(s) from brief/rules/budget/overrides; committed {commit_id[:12]}"
            + (f"; {len(inp.warnings)} warning(s)" if inp.warnings else ""))


# ================================================================ resolution helpers


class _Values:
    """Resolved values in recipe order, each with the source that set it last."""

    def __init__(self):
        self.value: dict[str, Any] = {}
        self.source: dict[str, str] = {}

    def set(self, key: str, value: Any, source: str) -> None:
        self.value[key] = copy.deepcopy(value)
        self.source[key] = source


def _masking_of(meta: dict) -> dict | None:
    """The assistant-only masking prepare_dataset chose and checked for conversations (meta.json), or None."""
    tpl = meta.get("chat_template")
    return tpl.get("masking") if isinstance(tpl, dict) else None


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


def _time_for(report: dict, values: dict, meta: dict, brief, method: str, skills) -> dict:
    """The preflight's expected wall time restated for the resolved values: this run's batch, accumulation, length and
    steps, read from the same timed training steps (overrides such as max_steps or the batch come after preflight)."""
    seq = int(values.get("max_seq_length") or values.get("max_length") or brief.max_seq_length or 2048)
    shape = run_shape(values, meta, seq, bool(values.get("packing")), method, skills.table("spark-preflight", "memory"))
    return time_estimate((report.get("observed") or {}).get("step_probe"), shape, brief.time_budget_s)
