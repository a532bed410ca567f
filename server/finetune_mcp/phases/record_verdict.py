"""record_verdict (eval role only): the signed PROMOTE or REJECT of a run, in verdicts/<experiment>/<run>/.

Stages: check the words (evidence; a REJECT's remediation; an override only for a PROMOTE) -> load the signed
evaluation of this run's current adapter (a result that does not verify is refused whatever the verdict) -> for a
PROMOTE, recompute every check from the signed figures (the suite, the base model, the drift bars, the goldens) ->
sign the verdict, with the evaluation it rests on embedded -> write the promotion report (world-readable: export
verifies it with the public key alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_mcp import schemas as S
from finetune_mcp import signing
from finetune_mcp.common.errors import BadInput, Forbidden, Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.run_facts import adapter_digest, base_model_identity, base_words, load_run_brief, run_paths
from finetune_mcp.domain.suite import DRIFT_THRESHOLDS, EVAL_SKILL, MAX_GOLDENS, MIN_GOLDENS, load_suite, suite_dir
from finetune_mcp.domain.verdicts import check_text, judge, load_eval_document, promotion_report
from finetune_mcp.workspace import utc_now


@dataclass
class Words:
    verdict: str
    evidence: str
    top_remediation: str
    override_reason: str


def record_verdict(pc: PhaseContext, args: S.RecordVerdictArgs) -> S.VerdictResult:
    if not pc.policy.may_sign_verdicts:
        raise Forbidden(f"the {pc.role} role may not sign verdicts", fix="verdicts come from the eval-engineer server")
    w = _words(args)
    run_id = args.run_id
    experiment, r, e = run_paths(pc, run_id)
    digest = adapter_digest(r, run_id)
    suite_dir(pc, experiment)  # refuses a legacy <experiment>/eval layout before anything is read
    key = signing.load_or_create_private_key(pc.ws)
    evaluation, ev = _signed_evaluation(pc, run_id, digest, key.public_key())
    override, goldens = None, []
    if w.verdict == "PROMOTE":
        override, goldens = _promote_checks(pc, run_id, r, e, ev, w.override_reason)
    payload = _payload(run_id, experiment, digest, w, ev, evaluation, override, goldens)
    block = signing.sign_block(key, payload)
    report = _write_report(pc, experiment, run_id, block)
    return S.VerdictResult(
        summary=f"{w.verdict} recorded for {run_id}, signed ({block['key_id']}) over adapter {digest[:12]}…"
                + (f"; OVERRIDE of failed check(s) {', '.join(override['failed_checks'])}: {w.override_reason}" if override else ""),
        citations=[pc.skills.cite("quantized-export", "verdict-gate"), pc.skills.cite(EVAL_SKILL, "drift")],
        run_id=run_id,
        verdict=w.verdict,
        adapter_sha256=digest,
        report=str(report),
        signed_at=payload["signed_at"],
        override=override,
    )


def _words(args: S.RecordVerdictArgs) -> Words:
    verdict = args.verdict
    if verdict not in ("PROMOTE", "REJECT"):
        raise BadInput(f"verdict must be PROMOTE or REJECT, got {verdict!r}", where="verdict")
    w = Words(verdict, (args.evidence or "").strip(), (args.top_remediation or "").strip(), (args.override_reason or "").strip())
    if not w.evidence:
        raise BadInput("evidence is empty", where="evidence", fix="state the figures the verdict rests on (accuracy, loss, drift, failures seen)")
    if verdict == "REJECT" and not w.top_remediation:
        raise BadInput("a REJECT needs a top remediation", where="top_remediation", fix="name the one change to try first, e.g. 'double the examples of the failing pattern'")
    if verdict == "REJECT" and w.override_reason:
        raise BadInput("override_reason is for a PROMOTE against failed checks; a REJECT overrides nothing", where="override_reason",
                       fix="leave override_reason empty for a REJECT")
    return w


def _signed_evaluation(pc: PhaseContext, run_id: str, digest: str, public_key) -> tuple[dict | None, dict | None]:
    """The signed evaluation document and its payload, for this run's current adapter; (None, None) where there is none."""
    experiment = run_id.split("/", 1)[0]
    result_path = pc.ws.eval_result_path(experiment, run_id)
    # A result that does not verify is refused whatever the verdict: nothing signed may rest on a forged figure.
    got = load_eval_document(pc.ws, run_id, public_key)
    evaluation, ev = got if got else (None, None)
    if ev is not None and ev.get("run_id") != run_id:
        raise Refused(f"the evaluation result at {result_path.name} was signed for run {ev.get('run_id')!r}, not {run_id!r}: it was copied "
                      "from another run", where=str(result_path), fix=f"call evaluate_checkpoint on {run_id}")
    if ev is not None and ev.get("adapter_sha256") != digest:
        return None, None  # an evaluation of some other adapter says nothing about this one
    return evaluation, ev


def _promote_checks(pc: PhaseContext, run_id: str, r: Path, e: Path, ev: dict | None, override_reason: str) -> tuple[dict | None, list[dict]]:
    """What a PROMOTE rests on, recomputed from the signed figures: the override it records (if any) and the goldens."""
    experiment = run_id.split("/", 1)[0]
    d = suite_dir(pc, experiment)
    result_path = pc.ws.eval_result_path(experiment, run_id)
    if ev is None:
        raise Refused(f"no signed evaluation of run {run_id}'s current adapter", where=str(result_path),
                      fix="call evaluate_checkpoint first; PROMOTE rests on its figures and goldens")
    if load_suite(d)["sha256"] != ev.get("suite_sha256"):
        raise Refused("the eval suite changed after the last evaluation", where=str(d), fix="call evaluate_checkpoint again, then record the verdict")
    base = base_model_identity(pc, r, load_run_brief(r, e))
    if base != ev.get("base_model"):
        raise Refused(f"the base model under the adapter is not the one evaluated ({base_words(ev.get('base_model'))}; now {base_words(base)})",
                      where=str(result_path), fix="call evaluate_checkpoint again on the base model the run names, then record the verdict")
    override = _override(ev, override_reason, result_path)
    _drift_bars_set(ev, d)
    goldens = [{"prompt": g["prompt"], "output": g["output"]} for g in (ev.get("goldens") or [])[:MAX_GOLDENS]]
    if len(goldens) < MIN_GOLDENS:
        raise Refused(f"the evaluation recorded {len(goldens)} golden outputs; export's smoke test needs {MIN_GOLDENS}-{MAX_GOLDENS}",
                      where=str(d / "goldens.jsonl"), fix="write 3-5 prompts to eval/goldens.jsonl and evaluate again")
    return override, goldens


def _override(ev: dict, override_reason: str, result_path: Path) -> dict | None:
    """A PROMOTE against failed checks only with a reason, recorded; a reason with nothing failed is refused."""
    failed = [k for k, ok in judge(ev).items() if not ok]
    if failed and not override_reason:
        raise Refused(
            f"the evaluation fails {', '.join(check_text(k, ev) for k in failed)}, so it cannot be promoted "
            f"(recomputed from the signed figures of {result_path.name})",
            where=str(result_path),
            fix="record REJECT with the top remediation; or, if a threshold is wrong, change it in eval/eval.yaml and evaluate again; "
                "or PROMOTE anyway with override_reason saying why (the signed verdict records the override)",
        )
    if override_reason and not failed:
        raise BadInput("override_reason given, but the evaluation fails no check: there is nothing to override", where="override_reason",
                       fix="leave override_reason empty")
    if not failed:
        return None
    return {"reason": override_reason, "failed_checks": failed, "checks": [check_text(k, ev) for k in failed]}


def _drift_bars_set(ev: dict, d: Path) -> None:
    unset = [k for k in DRIFT_THRESHOLDS if k not in (ev.get("thresholds") or {}) and k not in (ev.get("threshold_sources") or {})]
    if unset:
        raise Refused(
            f"the evaluation had no threshold for {', '.join(unset)}: a PROMOTE needs a bar for harm to general ability",
            where=str(d / "eval.yaml"),
            fix=f"set thresholds {', '.join(unset)} in eval/eval.yaml (or in the brief's ## Evaluation), or waive one on purpose with "
                f"null, then evaluate again; {EVAL_SKILL}#drift says how to choose them",
        )


def _payload(run_id: str, experiment: str, digest: str, w: Words, ev: dict | None, evaluation: dict | None,
             override: dict | None, goldens: list[dict]) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "experiment": experiment,
        "verdict": w.verdict,
        "adapter_sha256": digest,
        "base_model": ev.get("base_model") if ev else None,
        "evidence_sha256": signing.sha256_text(w.evidence),
        "evidence": w.evidence,
        "top_remediation": w.top_remediation,
        "override": override,
        "metrics": {k: ev.get(k) for k in ("task_accuracy", "base_accuracy", "scorers", "side_by_side", "eval_loss", "drift", "thresholds",
                                           "threshold_sources", "evaluated_at", "max_new_tokens")} | {"passed": judge(ev)} if ev else None,
        "goldens": goldens,
        # The signed evaluation itself (its own signature kept): export verifies both with the public key alone.
        "evaluation": evaluation,
        "signed_at": utc_now(),
    }


def _write_report(pc: PhaseContext, experiment: str, run_id: str, block: dict[str, Any]) -> Path:
    report = pc.ws.verdict_path(experiment, run_id)
    for folder in (pc.ws.verdicts_root, report.parent.parent, report.parent):
        if not folder.exists():
            pc.guard.check_write(folder)
            folder.mkdir(mode=0o755, exist_ok=True)
    pc.guard.write_text(report, promotion_report(block), mode=0o644)
    return report
