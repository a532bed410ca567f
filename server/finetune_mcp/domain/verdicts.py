"""Signed evaluation results and verdicts: reading and verifying them, every check recomputed from the signed
figures, and the promotion report that carries a verdict.

The evaluation result ($DGX_SPARK_ROOT/eval/<experiment>/results/<run>.json) and the verdict
($DGX_SPARK_ROOT/verdicts/<experiment>/<run>/promotion-report.md, world-readable) are signed with the eval key
(helpers/GATE-LAYOUT.md); export verifies the verdict, and the evaluation it embeds, with the public key alone.
"""

from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path
from typing import Any

from finetune_mcp import signing
from finetune_mcp.common import scoring
from finetune_mcp.common.errors import Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.run_facts import base_model_identity, base_words, load_run_brief
from finetune_mcp.domain.suite import MAX_GOLDENS, THRESHOLD_KEYS
from finetune_mcp.workspace import Workspace, parse_run_ref

PROMOTION_REPORT = "promotion-report.md"
EVAL_FIX = "ask the eval engineer to run evaluate_checkpoint again: only it writes (and signs) an evaluation result"


def verify_evaluation(doc: Any, public_key, where: str) -> dict[str, Any]:
    """The payload of a signed evaluation result, or BadSignature (a result edited, forged, or signed elsewhere)."""
    return signing.verify_signed(doc, public_key, signing.EVAL_SCHEMA, where, f"the evaluation result {Path(where).name}", EVAL_FIX)


def load_eval_document(ws: Workspace, run_id: str, public_key=None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the signed document as stored, its verified payload) of run_id's evaluation, None when there is none.
    Eval role only: the file is eval-owned."""
    experiment, _ = parse_run_ref(run_id)
    p = ws.eval_result_path(experiment, run_id)
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise signing.BadSignature(f"the evaluation result {p.name} is not valid JSON ({e})", where=str(p), fix=EVAL_FIX) from None
    return doc, verify_evaluation(doc, public_key or signing.load_public_key(ws), str(p))


def read_eval_result(ws: Workspace, run_id: str, public_key=None) -> dict[str, Any] | None:
    """The verified payload of run_id's signed evaluation, None when there is none."""
    got = load_eval_document(ws, run_id, public_key)
    return got[1] if got else None


def measured(m: dict[str, Any]) -> dict[str, Any]:
    """The figure each threshold bounds."""
    d = m.get("drift") if isinstance(m.get("drift"), dict) else {}
    return {"min_accuracy": m.get("task_accuracy"), "max_eval_loss": m.get("eval_loss"), "max_kl": d.get("kl"),
            "max_perplexity_ratio": d.get("perplexity_ratio"), "max_drift": d.get("changed_share")}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def judge(m: dict[str, Any]) -> dict[str, bool]:
    """Every check's pass/fail, from the figures and thresholds alone (a stored pass/fail is never taken as it stands)."""
    figures = measured(m)
    passed: dict[str, bool] = {}
    for k, limit in (m.get("thresholds") or {}).items():
        if k not in THRESHOLD_KEYS:
            raise Refused(f"the evaluation carries an unknown threshold {k!r}", fix=EVAL_FIX)
        v = figures[k]
        passed[k] = _number(v) and _number(limit) and (v >= limit if k.startswith("min_") else v <= limit)
    checked = [g for g in m.get("goldens") or [] if isinstance(g, dict) and g.get("golden") is not None]
    if checked:
        passed["goldens"] = all(scoring.collapse(str(g.get("output"))) == scoring.collapse(str(g["golden"])) for g in checked)
    return passed


def check_text(k: str, m: dict[str, Any]) -> str:
    """One failed check in words: figure, bar and its source."""
    if k == "goldens":
        bad = sum(1 for g in m.get("goldens") or [] if g.get("golden") is not None
                  and scoring.collapse(str(g.get("output"))) != scoring.collapse(str(g["golden"])))
        return f"goldens ({bad} golden output(s) not reproduced)"
    v, limit = measured(m).get(k), (m.get("thresholds") or {}).get(k)
    op = "<" if k.startswith("min_") else ">"
    bar = format(limit, "g") if _number(limit) else repr(limit)
    return f"{k} ({THRESHOLD_KEYS[k]} {fmt_value(v)} {op} {bar} from {(m.get('threshold_sources') or {}).get(k, '?')})"


# ---------------------------------------------------------------- report text


def fmt_value(v: Any) -> str:
    """A figure as reports show it (4 decimals; n/a when there is none)."""
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def prompt_text(p: Any) -> str:
    """A prompt (text or chat messages) on one line."""
    if isinstance(p, str):
        return p
    return " | ".join(f"{m['role']}: {m['content']}" for m in p)


def cell(s: Any, n: int = 80) -> str:
    """One markdown table cell: newlines and pipes kept from breaking the row, control characters shown escaped."""
    s = str(s).replace("\n", "⏎").replace("|", "\\|")
    s = "".join(c if unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in s)
    return s if len(s) <= n else s[: n - 1] + "…"


# ---------------------------------------------------------------- the verdict, as export reads it


def read_verdict(pc: PhaseContext, r: Path, run_id: str, digest: str) -> dict[str, Any]:
    """The verified verdict payload bound to this run, this adapter and this base model, or Refused saying why not.
    Public key only: the training user can run this where the private key is out of its reach."""
    experiment, _ = parse_run_ref(run_id)
    path = pc.ws.verdict_path(experiment, run_id)
    if not path.is_file():
        raise Refused(
            f"run {run_id} has no verdict: export needs a signed PROMOTE from the eval engineer",
            where=str(path),
            fix="hand the run over for Phase 5: the eval engineer runs evaluate_checkpoint and record_verdict",
        )
    public = signing.load_public_key(pc.ws)
    block = signing.verify_report(pc.guard.read_text(path), public, str(path))
    if block.get("run_id") != run_id:
        raise Refused(
            f"the verdict in promotion-report.md was signed for run {block.get('run_id')!r}, not {run_id!r}: it was copied from another run",
            where=str(path),
            fix="a verdict covers only the run it was recorded for; ask the eval engineer to evaluate this run",
        )
    if block.get("adapter_sha256") != digest:
        raise Refused(
            f"the adapter changed after the verdict: it was judged at sha256 {str(block.get('adapter_sha256'))[:12]}…, adapter/ is now {digest[:12]}…",
            where=str(r / "adapter"),
            fix="a verdict covers only the exact adapter it judged; ask the eval engineer to evaluate the current adapter",
        )
    if signing.sha256_text(block.get("evidence") or "") != block.get("evidence_sha256"):
        raise Refused("the verdict's evidence does not match its digest", where=str(path), fix="ask the eval engineer to record the verdict again")
    if block.get("verdict") != "PROMOTE":
        return block
    # The evaluation the PROMOTE rests on, with its own signature: of this run, this adapter, this base model.
    where = f"{path}: evaluation"
    ev = verify_evaluation(block.get("evaluation"), public, where)
    if ev.get("run_id") != run_id or ev.get("experiment") != experiment:
        raise Refused(f"the verdict embeds an evaluation of run {ev.get('run_id')!r}, not {run_id!r}", where=where,
                      fix="ask the eval engineer to evaluate this run and record the verdict again")
    if ev.get("adapter_sha256") != digest:
        raise Refused(f"the verdict embeds an evaluation of adapter sha256 {str(ev.get('adapter_sha256'))[:12]}…, not of adapter/ "
                      f"({digest[:12]}…)", where=where, fix="ask the eval engineer to evaluate the current adapter")
    goldens = [{"prompt": g.get("prompt"), "output": g.get("output")} for g in (ev.get("goldens") or [])[:MAX_GOLDENS]]
    if block.get("goldens") != goldens or block.get("base_model") != ev.get("base_model"):
        raise Refused("the verdict's goldens or base model differ from those of the evaluation it embeds", where=str(path),
                      fix="ask the eval engineer to record the verdict again")
    base = base_model_identity(pc, r, load_run_brief(r, pc.ws.experiments_dir / experiment))
    if base != ev.get("base_model"):
        raise Refused(
            f"the base model is not the one the verdict judged: evaluated on {base_words(ev.get('base_model'))}, the run now loads {base_words(base)}",
            where=str(r / "config.yaml"),
            fix="restore the base model the run was evaluated on (base-models/ or the run's config.yaml), or ask the eval engineer to evaluate "
                "the run on this one and record the verdict again",
        )
    return block


# ---------------------------------------------------------------- the promotion report


def _quote(text: str) -> list[str]:
    return ["> " + line if line else ">" for line in text.splitlines()] or [">"]


def promotion_report(b: dict[str, Any]) -> str:
    out = [f"# Promotion report: {b['run_id']}", "", f"**Verdict: {b['verdict']}**", "",
           f"- adapter sha256: `{b['adapter_sha256']}`", f"- base model: {base_words(b.get('base_model'))}",
           f"- signed at: {b['signed_at']} by the eval-engineer key `{b['key_id']}`",
           "", "## Evidence", "", *_quote(b["evidence"]), ""]
    if b.get("override"):
        o = b["override"]
        out += ["## OVERRIDE", "", f"Promoted although the evaluation fails {', '.join(o['checks'])}. The eval engineer's reason:", "",
                *_quote(o["reason"]), ""]
    if b["top_remediation"]:
        out += ["## Top remediation", "", *_quote(b["top_remediation"]), ""]
    if b.get("metrics"):
        m = b["metrics"]
        d = m.get("drift") if isinstance(m.get("drift"), dict) else {}
        th, src = m.get("thresholds") or {}, m.get("threshold_sources") or {}

        def bar(key: str) -> str:
            if key in th:
                return f"threshold {'≥' if key.startswith('min_') else '≤'} {th[key]:g} from {src.get(key)}, " + ("passed" if (m.get("passed") or {}).get(key) else "FAILED")
            return "waived in " + src[key].replace(" (cleared)", "") if key in src else "no threshold set"

        sbs = m.get("side_by_side") or {}
        out += ["## Evaluation", "",
                f"- Task accuracy {fmt_value(m.get('task_accuracy'))} (base {fmt_value(m.get('base_accuracy'))}), scored with "
                f"{', '.join(f'{k} ({v})' for k, v in (m.get('scorers') or {}).items()) or 'n/a'}; {bar('min_accuracy')}. "
                f"Side by side: {sbs.get('improved', 0)} improved, {sbs.get('regressed', 0)} regressed, {sbs.get('unchanged', 0)} unchanged.",
                f"- Drift, mean per-token KL(base ‖ tuned) on the base model's own continuations of {d.get('prompts', 'n/a')} general prompts: "
                f"{fmt_value(d.get('kl'))} nats/token; {bar('max_kl')}.",
                f"- Drift, perplexity ratio tuned / base on {d.get('text_source', 'a general text')}: {fmt_value(d.get('perplexity_ratio'))} "
                f"({fmt_value(d.get('perplexity_base'))} → {fmt_value(d.get('perplexity_tuned'))}); {bar('max_perplexity_ratio')}.",
                f"- Eval loss {fmt_value(m.get('eval_loss'))}; {bar('max_eval_loss')}. Evaluated {m.get('evaluated_at')}.", ""]
    if b.get("goldens"):
        out += ["## Goldens (export's smoke test must reproduce these)", "", "| # | prompt | output |", "|---|---|---|"]
        for i, g in enumerate(b["goldens"], 1):
            out.append(f"| {i} | {cell(prompt_text(g['prompt']), 60)} | {cell(g['output'], 60)} |")
        out.append("")
    out += ["## Signature", "", "The block below binds run id, adapter and base model digests, verdict, evidence digest, time, and the signed",
            "evaluation it rests on (with that evaluation's own signature); export verifies both with the eval role's public key.",
            "Any edit to it, or a copy into another run, makes it invalid.", "", signing.render_block(b)]
    return "\n".join(out)
