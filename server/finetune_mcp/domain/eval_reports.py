"""What an evaluation writes for people to read: eval/<experiment>/reports/<run tag>.md, the figures against their
thresholds, the drift prompts, the goldens, and every prompt's base and fine-tuned answers side by side."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

from finetune_mcp.domain.suite import DRIFT_THRESHOLDS, RESULTS_DIR
from finetune_mcp.domain.verdicts import cell, fmt_value, prompt_text


def eval_report(run_id: str, m: dict[str, Any], res: dict[str, Any]) -> str:
    """The whole report: the figures, then the side-by-side answers."""
    return _figures_report(run_id, m, res) + "\n" + _side_by_side_report(run_id, m, res)


def _threshold_rows(m: dict[str, Any]) -> list[tuple[str, Any, str | None]]:
    d = m.get("drift") or {}
    return [
        ("task accuracy", m.get("task_accuracy"), "min_accuracy"),
        ("base accuracy", m.get("base_accuracy"), None),
        ("eval loss", m.get("eval_loss"), "max_eval_loss"),
        ("base eval loss", m.get("base_eval_loss"), None),
        ("drift: mean KL(base ‖ tuned), nats/token", d.get("kl"), "max_kl"),
        ("drift: perplexity ratio tuned / base", d.get("perplexity_ratio"), "max_perplexity_ratio"),
        ("drift: general prompts whose answer changed", d.get("changed_share"), "max_drift"),
        ("golden match", m.get("golden_match"), "goldens" if "goldens" in m["passed"] else None),
    ]


def _metric_table(m: dict[str, Any]) -> list[str]:
    out = ["| metric | value | threshold | pass |", "|---|---|---|---|"]
    for name, v, key in _threshold_rows(m):
        th = m["thresholds"].get(key) if key else None
        ok = m["passed"].get(key) if key else None
        if th is not None:
            th_s = f"{'≥' if key.startswith('min_') else '≤'} {th:g} ({m['threshold_sources'][key]})"
        elif key == "goldens":
            th_s = "all match"
        elif key in DRIFT_THRESHOLDS:
            th_s = "waived: " + m["threshold_sources"][key] if key in m["threshold_sources"] else "**not set**"
        else:
            th_s = ""
        out.append(f"| {name} | {fmt_value(v)} | {th_s} | {'' if ok is None else ('yes' if ok else 'NO')} |")
    return out


def _figures_report(run_id: str, m: dict[str, Any], res: dict[str, Any]) -> str:
    d = m["drift"]
    sbs = m.get("side_by_side") or {}
    base = m.get("base_model") or {}
    out = [f"# Evaluation: {run_id}", "", f"Evaluated {m['evaluated_at']} against adapter sha256 `{m['adapter_sha256']}` on base model "
           f"{base.get('name')}" + (f" (sha256 `{base['sha256'][:16]}…`)" if base.get("sha256") else "")
           + f" with suite {', '.join('eval/' + f for f in m['suite_files'])} (sha256 `{m['suite_sha256'][:16]}…`). "
           f"Eval-only: this report quotes the suite; the signed result is `{m['experiment']}/{RESULTS_DIR}/{Path(m['report']).stem}.json`.", "",
           *_metric_table(m), "",
           f"Scorers: {', '.join(f'{k} ({v} prompts)' for k, v in m['scorers'].items())}. "
           f"Side by side: {sbs.get('improved', 0)} improved, {sbs.get('regressed', 0)} regressed, {sbs.get('unchanged', 0)} unchanged "
           f"(every answer: below).", "",
           f"Eval loss: {m['loss_source']}, {m['loss_rows']} rows. KL: {d['prompts']} prompts from {d['prompts_source']}, "
           f"{d['kl_tokens']} continuation tokens of up to {m['drift_max_new_tokens']}. Perplexity: {d['text_source']}, "
           f"{d['perplexity_tokens']} tokens (base {fmt_value(d['perplexity_base'])}, tuned {fmt_value(d['perplexity_tuned'])}).", ""]
    if res.get("drift_items"):
        out += ["## Drift prompts (the base model's own continuation, and how far the fine-tuned model follows it)", "",
                "| # | prompt | base continuation | KL | tuned parts at token |", "|---|---|---|---|---|"]
        for i, it in enumerate(res["drift_items"], 1):
            fd = it["first_divergence"]
            out.append(f"| {i} | {cell(prompt_text(it['prompt']), 40)} | {cell(it['base_output'], 60)} | {fmt_value(it['kl'])} | "
                       f"{'never' if fd is None else fd} |")
    out += ["", "## Goldens (recorded outputs; export replays them)", "", "| # | prompt | output | golden | match |", "|---|---|---|---|---|"]
    for i, g in enumerate(res["goldens"], 1):
        out.append(f"| {i} | {cell(prompt_text(g['prompt']), 50)} | {cell(g['output'], 50)} | {cell(g.get('golden', ''), 50)} | "
                   f"{'' if 'match' not in g else ('yes' if g['match'] else 'NO')} |")
    out.append("")
    return "\n".join(out)


def _quote_block(text: str) -> list[str]:
    """Model output shown verbatim in markdown: an indented block keeps newlines and cannot break the page;
    control characters (an untrained model emits them) are shown escaped."""
    text = "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in (text or "(empty)"))
    return ["    " + line for line in text.splitlines()] or ["    (empty)"]


def _side_by_side_report(run_id: str, m: dict[str, Any], res: dict[str, Any]) -> str:
    sbs = m.get("side_by_side") or {}
    out = [f"## Side by side: {run_id}", "",
           f"Base model vs fine-tuned (base + adapter `{m['adapter_sha256'][:12]}…`), greedy, up to {m['max_new_tokens']} new tokens; "
           f"evaluated {m['evaluated_at']}.", "",
           "| | prompts |", "|---|---|",
           f"| improved (base wrong, fine-tuned right) | {sbs.get('improved', 0)} |",
           f"| regressed (base right, fine-tuned wrong) | {sbs.get('regressed', 0)} |",
           f"| unchanged | {sbs.get('unchanged', 0)} |", "",
           f"Accuracy: base {fmt_value(m['base_accuracy'])} → fine-tuned {fmt_value(m['task_accuracy'])}. "
           f"Scorers: {', '.join(f'{k} ({v})' for k, v in m['scorers'].items())}.", ""]
    order = {"regressed": 0, "improved": 1, "unchanged": 2}
    for i, it in sorted(enumerate(res["items"], 1), key=lambda x: (order[x[1]["change"]], x[0])):
        exp = it["expected"]
        shown = exp[0] if len(exp) == 1 else " | ".join(exp)
        score = "" if it["scorer"]["name"] != "rouge_l" else f" (ROUGE-L {it['base_score']:.2f} → {it['score']:.2f})"
        out += [f"### {i}. {it['change']}: {cell(prompt_text(it['prompt']), 70)}", "",
                f"Scorer `{it['scorer_label']}`; accepted: `{cell(shown, 200)}`{score}", "",
                f"**Base** ({'right' if it['base_correct'] else 'wrong'}):", "", *_quote_block(it["base_output"]), "",
                f"**Fine-tuned** ({'right' if it['correct'] else 'wrong'}):", "", *_quote_block(it["output"]), ""]
    return "\n".join(out)
