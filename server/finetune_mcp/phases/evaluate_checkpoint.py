"""evaluate_checkpoint (eval role only): held-out accuracy of base vs fine-tuned, eval loss and drift, signed.

Stages: load (the run, its adapter digest, the suite, the brief's thresholds) -> measure (the evaluate job in the
worker; the adapter must not change meanwhile) -> sign (the result block, with the eval key) -> write (the report and
the signed result into eval/<experiment>/, committed there) -> the tool's result. Nothing is written into the run
folder: the training side writes that. domain/suite.py says what each suite file holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_mcp import schemas as S
from finetune_mcp import signing
from finetune_mcp.common import scoring
from finetune_mcp.common.errors import Forbidden, Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.eval_reports import eval_report
from finetune_mcp.domain.run_facts import (
    adapter_digest,
    base_model_identity,
    load_run_brief,
    prepared_eval_split,
    read_config,
    run_paths,
)
from finetune_mcp.domain.suite import (
    DRIFT_THRESHOLDS,
    EVAL_SKILL,
    MAX_GOLDENS,
    commit_eval,
    ensure_eval_repo,
    load_suite,
    suite_dir,
    suite_thresholds,
)
from finetune_mcp.domain.verdicts import fmt_value, judge
from finetune_mcp.worker import prewarm, run_job
from finetune_mcp.workspace import utc_now


@dataclass
class Evaluation:
    """What the stages hand on: the run, its suite and thresholds; then the job's result and the signed block."""
    run_id: str
    experiment: str
    run_dir: Path
    suite_dir: Path
    digest: str
    suite: dict[str, Any]
    brief: Any
    base: dict[str, Any]
    thresholds: dict[str, float]
    th_source: dict[str, str]
    res: dict[str, Any] | None = None
    machine: dict[str, Any] | None = None


def evaluate_checkpoint(pc: PhaseContext, args: S.EvaluateCheckpointArgs) -> S.EvalResult:
    if not pc.policy.may_sign_verdicts:
        raise Forbidden(f"the {pc.role} role may not evaluate", fix="evaluations come from the eval-engineer server")
    ev = _load(pc, args.run_id)
    params, loss_source = _job_params(pc, ev)
    ev.res = _measure(pc, ev, params)
    ev.machine = _result_block(pc, ev, loss_source)
    report_path, result_path = _write(pc, ev)
    return _tool_result(pc, ev, report_path, result_path)


def _load(pc: PhaseContext, run_id: str) -> Evaluation:
    experiment, r, e = run_paths(pc, run_id)
    d = suite_dir(pc, experiment)
    digest = adapter_digest(r, run_id)
    prewarm()
    suite = load_suite(d)
    brief = load_run_brief(r, e)
    base = base_model_identity(pc, r, brief)
    thresholds, th_source = suite_thresholds(brief, suite)
    return Evaluation(run_id, experiment, r, d, digest, suite, brief, base, thresholds, th_source)


def _job_params(pc: PhaseContext, ev: Evaluation) -> tuple[dict[str, Any], str]:
    """The evaluate job's parameters, and where its eval loss is measured (the prepared eval split, else the prompts)."""
    suite, opts = ev.suite, ev.suite.get("eval.yaml") or {}
    n_gold = int(opts.get("goldens") or MAX_GOLDENS)
    goldens = suite.get("goldens.jsonl") or [{"prompt": p["prompt"]} for p in suite["prompts.jsonl"][:n_gold]]
    loss_file, loss_rows = None, None
    loss_source = "eval/prompts.jsonl (prompt -> expected)"
    if opts.get("loss_data", "prepared") == "prepared":
        split = prepared_eval_split(pc, read_config(ev.run_dir))
        if split is not None:
            loss_file, loss_source = str(split), f"prepared eval split {split}"
    if loss_file is None:
        loss_rows = [{"prompt": p["prompt"], "expected": p["expected"]} for p in suite["prompts.jsonl"]]
    params = {
        "base_model": ev.base["name"],
        "adapter_dir": str(ev.run_dir / "adapter"),
        "prompts": [{"prompt": row["prompt"], "expected": scoring.accepted(row["expected"]), "scorer": spec.to_json()}
                    for row, spec in zip(suite["prompts.jsonl"], suite["scorers"])],
        "goldens": goldens,
        "drift": [{"prompt": d["prompt"]} for d in suite["drift_prompts"]],
        "general_text": suite["general_text"],
        "perplexity_window": opts.get("perplexity_window"),
        "perplexity_max_tokens": opts.get("perplexity_max_tokens"),
        "loss_file": loss_file,
        "loss_rows": loss_rows,
        "max_loss_rows": opts.get("max_loss_rows"),
        "max_new_tokens": opts.get("max_new_tokens"),
        "drift_max_new_tokens": opts.get("drift_max_new_tokens"),
        "batch_size": opts.get("batch_size"),
        "max_length": ev.brief.max_seq_length if ev.brief else None,
    }
    return params, loss_source


def _measure(pc: PhaseContext, ev: Evaluation, params: dict[str, Any]) -> dict[str, Any]:
    res = run_job("evaluate", params, progress=pc.progress, timeout=3600)
    # The adapter must be the one that was evaluated, down to the byte.
    if adapter_digest(ev.run_dir, ev.run_id) != ev.digest:
        raise Refused("adapter/ changed while it was being evaluated", where=str(ev.run_dir / "adapter"), fix="call evaluate_checkpoint again")
    return res


def _drift(ev: Evaluation) -> dict[str, Any]:
    res, ppl = ev.res, ev.res.get("perplexity") or {}
    return {
        "kl": res.get("kl"),
        "perplexity_ratio": ppl.get("ratio"),
        "perplexity_base": ppl.get("base"),
        "perplexity_tuned": ppl.get("tuned"),
        "changed_share": res.get("changed_share"),
        "prompts": len(res.get("drift_items") or []),
        "kl_tokens": res.get("kl_tokens"),
        "perplexity_tokens": ppl.get("tokens"),
        "prompts_source": ev.suite["drift_source"],
        "text_source": ev.suite["general_text_source"],
    }


def _result_block(pc: PhaseContext, ev: Evaluation, loss_source: str) -> dict[str, Any]:
    """The result as it is signed: figures, thresholds and their sources, digests, goldens; `passed` judged from them."""
    res = ev.res
    scorers: dict[str, int] = {}
    for it in res["items"]:
        scorers[it["scorer_label"]] = scorers.get(it["scorer_label"], 0) + 1
    machine = {
        "run_id": ev.run_id,
        "experiment": ev.experiment,
        "adapter_sha256": ev.digest,
        "base_model": ev.base,
        "suite_sha256": ev.suite["sha256"],
        "suite_files": ev.suite["files"],
        "evaluated_at": utc_now(),
        "task_accuracy": res.get("task_accuracy"),
        "base_accuracy": res.get("base_accuracy"),
        "scorers": scorers,
        "side_by_side": res.get("side_by_side"),
        "eval_loss": res.get("eval_loss"),
        "base_eval_loss": res.get("base_eval_loss"),
        "drift": _drift(ev),
        "golden_match": res.get("golden_match"),
        "thresholds": ev.thresholds,
        "threshold_sources": ev.th_source,
        "drift_thresholds_unset": _unset(ev),
        "max_new_tokens": res.get("max_new_tokens"),
        "drift_max_new_tokens": res.get("drift_max_new_tokens"),
        "batch_size": res.get("batch_size"),
        # what export replays (prompt, output) and, where the suite gave one, the output it had to reproduce
        "goldens": [{"prompt": g["prompt"], "output": g["output"], **({"golden": g["golden"]} if "golden" in g else {})} for g in res["goldens"]],
        "loss_source": loss_source,
        "loss_rows": res.get("loss_rows"),
        "report": str(pc.ws.eval_report_path(ev.experiment, ev.run_id)),
        "versions": res.get("versions"),
        # the fine-tuned passes ran on base + adapter merged (the same model, one matmul per layer), or why not
        "adapter_merged": res.get("adapter_merged"),
        **({"unmerged_because": res["unmerged_because"]} if res.get("unmerged_because") else {}),
        "timings_s": res.get("timings"),
    }
    machine["passed"] = judge(machine)
    return machine


def _unset(ev: Evaluation) -> list[str]:
    return [k for k in DRIFT_THRESHOLDS if k not in ev.thresholds and k not in ev.th_source]


def _write(pc: PhaseContext, ev: Evaluation) -> tuple[Path, Path]:
    """The report and the signed result into eval/<experiment>/, committed in the suite's repository."""
    report_path = pc.ws.eval_report_path(ev.experiment, ev.run_id)
    result_path = pc.ws.eval_result_path(ev.experiment, ev.run_id)
    # Signed as it is written: record_verdict and export trust these figures only with the eval key's signature.
    signed = signing.sign_block(signing.load_or_create_private_key(pc.ws), {**ev.machine, "signed_at": utc_now()}, signing.EVAL_SCHEMA)
    ensure_eval_repo(ev.suite_dir)
    pc.guard.write_text(report_path, eval_report(ev.run_id, ev.machine, ev.res))
    pc.guard.write_text(result_path, json.dumps(signed, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    commit_eval(ev.suite_dir, [report_path, result_path], f"eval: {ev.experiment} {ev.run_id.split('/', 1)[1]}")
    return report_path, result_path


def _summary(ev: Evaluation) -> str:
    res, m = ev.res, ev.machine
    passed, drift, unset = m["passed"], m["drift"], m["drift_thresholds_unset"]
    failed = [k for k, ok in passed.items() if not ok]
    sbs = res.get("side_by_side") or {}
    return (
        f"{ev.run_id}: task accuracy {fmt_value(res.get('task_accuracy'))} (base {fmt_value(res.get('base_accuracy'))}) on {len(res['items'])} prompts "
        f"[{', '.join(f'{k} x{v}' for k, v in m['scorers'].items())}]: {sbs.get('improved', 0)} improved, {sbs.get('regressed', 0)} regressed, "
        f"{sbs.get('unchanged', 0)} unchanged; eval loss {fmt_value(res.get('eval_loss'))}; drift KL {fmt_value(drift['kl'])} nats/token, "
        f"perplexity ratio {fmt_value(drift['perplexity_ratio'])}; "
        + (f"FAILS {', '.join(failed)}" if failed else ("passes every threshold" if passed else "no thresholds set"))
        + (f"; no threshold set for {', '.join(unset)} (a PROMOTE needs one)" if unset else "")
    )


def _details(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The first drift prompts whose answer changed, then every golden."""
    details: list[dict[str, Any]] = []
    for di in res.get("drift_items") or []:
        if di["changed"] and len(details) < 10:
            details.append({"kind": "drift", "prompt": di["prompt"], "base_output": di["base_output"], "kl": di["kl"],
                            "first_divergence": di["first_divergence"]})
    for g in res["goldens"]:
        details.append({"kind": "golden", "prompt": g["prompt"], "output": g["output"], **({"golden": g["golden"], "match": g["match"]} if "match" in g else {})})
    return details


def _tool_result(pc: PhaseContext, ev: Evaluation, report_path: Path, result_path: Path) -> S.EvalResult:
    res, m = ev.res, ev.machine
    items = [S.EvalItem(prompt=it["prompt"], expected=it["expected"], scorer=it["scorer_label"], base_output=it["base_output"],
                        output=it["output"], base_correct=it["base_correct"], correct=it["correct"], base_score=it["base_score"],
                        score=it["score"], change=it["change"]) for it in res["items"]]
    return S.EvalResult(
        summary=_summary(ev),
        citations=[pc.skills.cite(EVAL_SKILL, "scorers"), pc.skills.cite(EVAL_SKILL, "drift")],
        run_id=ev.run_id,
        task_accuracy=res.get("task_accuracy"),
        base_accuracy=res.get("base_accuracy"),
        eval_loss=res.get("eval_loss"),
        base_eval_loss=res.get("base_eval_loss"),
        drift=S.DriftFigures(**m["drift"]),
        side_by_side=S.SideBySide(**(res.get("side_by_side") or {})),
        scorers=m["scorers"],
        items=items,
        thresholds={k: {"value": v, "source": ev.th_source[k]} for k, v in ev.thresholds.items()},
        passed=m["passed"],
        details=_details(res),
        report=str(report_path),
        side_by_side_report=str(report_path),
        result=str(result_path),
    )
