"""What prepare_dataset writes for people: the dataset card, the validation report, the Phase 2 exit checklist,
and the lines they share (conversion, lengths, transformations, masking).

Pure text from the worker job's result (a dict), the brief, the skill's tables and the data settings: nothing
here reads the records again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetune_mcp import schemas as S
from finetune_mcp.domain.brief import Brief
from finetune_mcp.domain.sources import license_of

def conversion_lines(job: dict, tables: dict) -> list[str]:
    """The card's account of a conversion: the source shape and where it is defined, each step with its rule, what
    the steps did (counted in records), and what was dropped (the content: nothing; unused columns: named)."""
    rep = job.get("conversion_report") or {}
    shape = job.get("shape")
    spec = (tables["formats"].get("shapes") or {}).get(shape) or {}
    convs = {c["id"]: c for c in tables["formats"]["conversions"]}
    L = [f"- Source format: {shape}" + (f" ({', '.join(spec['fields'])}), as defined by {spec['origin']}" if spec else "")]
    steps = rep.get("steps") or ([job["conversion"]] if job.get("conversion") else [])
    if not steps:
        L.append("- Conversion: none; the records are already in the trainer's format")
    for st in steps:
        c = convs.get(st, {})
        L.append(f"- Conversion {st}: {c.get('how', '')} (rule: {c.get('cite', 'see the skill')})"
                 + (f"; trained: {c['trained']}" if c.get("trained") else ""))
    for text, n in sorted((rep.get("notes") or {}).items(), key=lambda kv: (-kv[1], kv[0])):
        L.append(f"  - {text}: {n} records")
    for key, f in sorted((rep.get("filled") or {}).items()):
        L.append(f"- Placeholder {{{{{key}}}}} filled with {f['value']!r} (the brief's `fill:`) in {f['records']} records")
    w = rep.get("message_weights") or {}
    if w:
        L.append(f"- Per-message weights kept on the assistant messages: {', '.join(f'{k} on {v}' for k, v in sorted(w.items()))}"
                 + ("; weight 0 messages are context, not trained (meta.json trainer_settings.message_weights)" if w.get("weight 0") else ""))
    left = rep.get("left_out_columns") or {}
    L.append("- Dropped from the records' content: nothing"
             + (f". Columns the trainer does not read, left out of train.jsonl: {', '.join(f'{k} ({v} records)' for k, v in sorted(left.items()))}" if left else ""))
    return L


def removed_said(job: dict) -> str:
    """The summary's clause on records removed or cut, so a large share dropped is never only in the warnings."""
    c = job.get("counts") or {}
    lr = job.get("long_records") or {}
    parts = []
    if c.get("dropped_long"):
        parts.append(f"{c['dropped_long']} of {lr.get('records')} records longer than {lr.get('max_seq_length')} tokens dropped "
                     f"({c['dropped_long'] / max(lr.get('records') or 1, 1):.1%}; `long_records: truncate` or `max_seq_length: "
                     f"{(lr.get('max_seq_length_for') or {}).get('95%')}` keeps them)")
    if c.get("truncated"):
        parts.append(f"{c['truncated']} records truncated to {lr.get('max_seq_length')} tokens")
    if c.get("dropped_exact_duplicates"):
        parts.append(f"{c['dropped_exact_duplicates']} exact duplicates removed")
    return "".join(f"; {p}" for p in parts)


def long_records_said(job: dict, data: dict) -> str:
    """One line on the records longer than max_seq_length and what the brief's long_records policy did with them."""
    tok = job.get("tokens") or {}
    lr = job.get("long_records") or {}
    q = tok.get("record_lengths") or tok.get("tokens_per_sequence") or {}
    over = tok.get("over_max_seq_length", 0)
    line = (f"{over} of {lr.get('records', '?')} records over max_seq_length {data['max_seq_length']} "
            f"({tok.get('over_share', 0):.1%}), long_records: {lr.get('policy', 'drop')}")
    if over:
        line += (f": {len(lr.get('dropped') or [])} dropped, {len(lr.get('truncated') or [])} truncated"
                 + (f" ({lr.get('cut_inside_answer', 0)} cut inside an answer)" if lr.get("truncated") else "")
                 + f", {tok.get('tokens_cut', 0)} tokens cut")
    return (line + f"; record lengths p50 {q.get('p50')}, p95 {q.get('p95')}, p99 {q.get('p99')}, max {q.get('max')}: "
            f"max_seq_length {q.get('p95')} keeps 95%, {q.get('p99')} keeps 99%")


def transformation_lines(job: dict, data: dict, n: int = 5) -> list[str]:
    """The card's account of what was removed or changed, with counts and the first few records of each."""
    counts = job.get("counts") or {}
    lr = job.get("long_records") or {}
    dups = job.get("duplicates") or []
    L = [f"- Exact duplicates removed: {counts.get('dropped_exact_duplicates', 0)}"
         + (": " + "; ".join(f"{d['where']} (same as {d['same_as']})" for d in dups[:n]) + (f"; and {len(dups) - n} more" if len(dups) > n else "")
            if dups else "")]
    L.append(f"- Longer than max_seq_length {data['max_seq_length']}: {(job.get('tokens') or {}).get('over_max_seq_length', 0)} records; "
             f"policy long_records: {lr.get('policy', 'drop')} (the brief's ## Dataset Expectation)")
    for key, label, what in (("dropped", "Dropped for length", "why"), ("truncated", "Truncated", "what")):
        items = lr.get(key) or []
        L.append(f"- {label}: {len(items)}" + (": " + "; ".join(f"{d['where']} ({d['tokens']} tokens: {d[what]})" for d in items[:n])
                                              + (f"; and {len(items) - n} more" if len(items) > n else "") if items else ""))
    if lr.get("truncated"):
        L.append(f"- Truncations that fall inside a trained answer: {lr.get('cut_inside_answer', 0)} (their end-of-turn token is cut too, "
                 "so the model is not taught to stop there); every kept record keeps trained answer tokens")
    L.append(f"- Kept: {counts.get('kept')} of {counts.get('read')} records read; the full lists are in validation-report.md "
             "and `python data/prepare.py` rebuilds exactly these files")
    return L


def seq_said(data: dict) -> str:
    """The sequence length and where it came from, for people: "64 (brief)" or "2048 (recipe default, ...; not in the brief)"."""
    if data["max_seq_length_from"] == "brief":
        return f"{data['max_seq_length']} (brief)"
    return f"{data['max_seq_length']} ({data['max_seq_length_cite']}; the brief states none)"


def _masking_lines(mk: dict | None) -> list[str]:
    """The card's account of how assistant-only loss was made to work on this template (common/masking.py)."""
    if not mk:
        return []
    L = ["## Assistant-only masking", "",
         f"- Method: **{mk['method']}** — {mk['summary']}. Every record was checked: its trained tokens decode to exactly "
         "its assistant replies (and their tool calls) plus the end-of-turn token.",
         "- Ways tried, in order: " + "; ".join(f"{a['method']} {'verified' if a['ok'] else 'failed (' + str(a['why']) + ')'}"
                                               for a in mk.get("attempts") or []),
         "- Row kinds on the probe: " + ", ".join(f"{k}: {v}" for k, v in (mk.get("rows") or {}).items())]
    if mk.get("default_system_prompt"):
        L.append(f"- The template writes its own system prompt when a conversation has none: {mk['default_system_prompt']!r}. "
                 + ("The brief's `system_prompt:` replaces it in every conversation without one." if mk.get("system_prompt")
                    else "The brief's `system_prompt: none` gives such conversations an empty system turn instead."
                    if mk.get("system_prompt") == "" else
                    "Conversations without a system turn are trained with it; set `system_prompt:` in the brief's Dataset "
                    "Expectation to use your own, or `system_prompt: none`."))
    elif mk.get("system_prompt") is not None:
        L.append(f"- System prompt from the brief for conversations without one: {mk['system_prompt']!r}.")
    return L + [""]


def where_said(p) -> str:
    get = (lambda k: getattr(p, k)) if not isinstance(p, dict) else p.get
    loc = Path(get("file")).name if get("file") else ""
    if get("line"):
        loc += f":{get('line')}"
    elif get("record") is not None:
        loc += f" record {get('record')}"
    if get("field"):
        loc += f" [{get('field')}]"
    return loc.strip() or "dataset"


def checklist(brief: Brief, job: dict, tables: dict, final_dir: Path | None, card_ok: bool, commit_id: str, data: dict) -> list[S.ChecklistItem]:
    items = {i["id"]: i["item"] for i in tables["card"]["exit_checklist"]}
    ok = bool(job.get("ok"))
    pc_counts = job.get("problem_counts") or {}
    errors = {k: v["error"] for k, v in pc_counts.items() if v["error"]}
    warns = {k: v["warning"] for k, v in pc_counts.items() if v["warning"]}
    fmt = job.get("format")
    tok = job.get("tokens") or {}
    tpl = job.get("template") or {}
    pk = job.get("packing") or {}
    col = job.get("collapse") or {}
    out: list[S.ChecklistItem] = []

    def add(i: str, good: bool, evidence: str) -> None:
        out.append(S.ChecklistItem(item=f"{i}: {items[i]}", ok=bool(good), evidence=evidence))

    add("brief-read", True, f"method {brief.method_label} ({brief.method}); format {brief.dataset_format}; max_seq_length {seq_said(data)}; "
        f"packing {str(brief.packing).lower()}" + (f"; defaults: {', '.join(brief.defaults_applied)}" if brief.defaults_applied else ""))
    fits = fmt in [n for n, s in tables["formats"]["formats"].items() if brief.method in s["methods"]]
    add("format-fits-method", bool(fmt) and fits,
        f"detected {job.get('shape')}" + (f", converted by {job['conversion']}" if job.get("conversion") else "")
        + f"; {brief.method} takes {', '.join(n for n, s in tables['formats']['formats'].items() if brief.method in s['methods'])}")
    add("validation-clean", not errors and job.get("stage") != "validation",
        ("no failing problem" if not errors else "errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())))
        + ("; warnings: " + ", ".join(f"{k} x{v}" for k, v in sorted(warns.items())) if warns else ""))
    if ok:
        add("template-before-packing", bool(tpl.get("sha256")) or fmt == "grpo" or not tpl.get("assistant_only_loss"),
            f"per-example apply_chat_template ({tpl.get('source')}, sha256 {str(tpl.get('sha256'))[:12]}) ran before "
            + ("trl.data_utils.pack_dataset" if pk.get("enabled") else "any batching (packing off)"))
        tt = tok.get("trained_tokens_per_sequence")
        stop = tpl.get("stop_token_trained")
        add("loss-mask", fmt == "grpo" or (tt is not None and tt["min"] > 0),
            ("GRPO: loss on sampled completions; no target tokens in the data" if fmt == "grpo" else
             f"trained tokens per sequence min {tt['min']}, mean {tt['mean']}; "
             + ("assistant turns only" if tpl.get("assistant_only_loss") else "completion only")
             + ("; end-of-turn token inside the mask" if stop else "; end-of-turn token NOT in the mask" if stop is False else "")))
        dmin = tables["validation"]["decoded_samples"]["min"]
        if pk.get("enabled"):
            att = pk.get("attention") or {}
            n = pk.get("decoded_rows", 0)
            add("packing-inspected", n >= min(dmin, pk.get("rows", 0)) and att.get("verified") is True,
                f"{n} packed rows decoded into validation-report.md with boundaries and trained spans marked; efficiency "
                f"{pk.get('efficiency'):.1%}; attention separation {'verified' if att.get('verified') else 'NOT verified'} "
                f"({att.get('samples', 0)} samples: position_ids restarts and cu_seq_lens match the sample boundaries)")
        else:
            add("packing-inspected", True, f"packing off in the brief; {len(job.get('decoded_samples') or [])} templated examples decoded with trained spans marked")
        add("lengths-fit", "too-long" not in errors, long_records_said(job, data))
        vals = col.get("values") or {}
        add("collapse-guard", "fail" not in (col.get("verdicts") or {}).values(),
            ", ".join(f"{k} {v} ({(col.get('verdicts') or {}).get(k)})" for k, v in vals.items()))
        files = [f for f in ("train.jsonl", "eval.jsonl", "meta.json") if final_dir and (final_dir / f).is_file()]
        counts = job.get("counts") or {}
        add("splits-written", len(files) == 3,
            f"{final_dir}: {', '.join(files)}; train {counts.get('train')} / eval {counts.get('eval')}; sha256 "
            + ", ".join(f"{k} {v[:12]}" for k, v in (job.get("files_sha256") or {}).items()))
        add("card-complete", card_ok, "data/dataset-card.md has " + ", ".join(f["title"] for f in tables["card"]["card_fields"]) if card_ok else "card missing a field")
    else:
        for i in ("template-before-packing", "loss-mask", "packing-inspected", "lengths-fit", "collapse-guard", "splits-written", "card-complete"):
            add(i, False, f"not reached: the {job.get('stage')} stage failed")
    add("committed", bool(commit_id) and ok, f"experiments commit {commit_id[:12]}" + ("" if ok else " (brief and failure report only)"))
    return out


def _fence(text: str) -> str:
    return "````text\n" + text.replace("````", "` ` ` `") + "\n````"


def report(brief: Brief, name: str, final_dir: Path, src: dict, job: dict, tables: dict, now: str, data: dict) -> str:
    ok = bool(job.get("ok"))
    counts = job.get("counts") or {}
    L = [f"# Validation report: {name}", "",
         f"- Prepared: {now} by finetune-mcp prepare_dataset",
         f"- Brief: {brief.path} — method {brief.method_label}, max_seq_length {seq_said(data)}, packing {str(brief.packing).lower()}",
         f"- Source: {src.get('given') or src.get('path') or src.get('id')}",
         f"- Verdict: {'PASSED — written to ' + str(final_dir) if ok else 'FAILED in the ' + str(job.get('stage')) + ' stage — nothing written to datasets/'}",
         f"- Format: detected {job.get('shape')}" + (f", converted by {job['conversion']}" if job.get("conversion") else "") + f" → {job.get('format')}",
         f"- Records: {', '.join(f'{k} {v}' for k, v in counts.items())}", ""]
    if job.get("ignored_files"):
        L += [f"- Ignored (held-out split files in the source folder): {', '.join(job['ignored_files'])}", ""]
    L += _problem_lines(job, tables)
    if not ok:
        if (final_dir / "meta.json").is_file():
            L += [f"{final_dir} still holds the dataset an earlier run prepared; data/dataset-card.md describes that one.", ""]
        return "\n".join(L)
    tpl = job.get("template") or {}
    L += ["## Conversion", "", *conversion_lines(job, tables), ""]
    L += _length_lines(job, data)
    L += ["",
          "## Chat template and loss mask", "",
          f"- Template: {tpl.get('source')} (sha256 {tpl.get('sha256')}), applied to each example on its own before any packing.",
          f"- Generation markers in the base template: {tpl.get('generation_markers')}; loss on "
          + ("assistant turns (assistant_only_loss)" if tpl.get("assistant_only_loss") else "the completion only" if job.get("format") != "grpo" else "sampled completions (GRPO)"),
          f"- Assistant end-of-turn token inside the loss mask: {tpl.get('stop_token_trained')}", ""]
    L += _masking_lines(tpl.get("masking"))
    L += _packing_lines(job.get("packing"))
    L += _collapse_lines(job, tables)
    return "\n".join(L)


def _problem_lines(job: dict, tables: dict) -> list[str]:
    L = ["## Problems", ""]
    pcounts = job.get("problem_counts") or {}
    if not pcounts:
        return L + ["None.", ""]
    L += ["| code | errors | warnings |", "|---|---|---|"]
    L += [f"| {k} | {v['error']} | {v['warning']} |" for k, v in sorted(pcounts.items())]
    L += ["", f"Listed one by one (up to {tables['validation']['listed_per_code']} per code):", "",
          "| severity | code | where | record | field | message |", "|---|---|---|---|---|---|"]
    for p in job.get("problems", []):
        loc = (Path(p["file"]).name if p.get("file") else "") + (f":{p['line']}" if p.get("line") else "")
        msg = str(p["message"]).replace("|", "\\|").replace("\n", " ")
        L.append(f"| {p['severity']} | {p['code']} | {loc} | {'' if p.get('record') is None else p['record']} | {p.get('field') or ''} | {msg} |")
    return L + [""]


def _length_lines(job: dict, data: dict) -> list[str]:
    """Token length quantiles, the long_records outcome, and every record dropped, truncated or deduplicated."""
    tok = job.get("tokens") or {}
    L = ["## Token lengths", "", "| measure | min | p50 | p90 | p95 | p99 | max | mean |", "|---|---|---|---|---|---|---|---|"]
    for label, key in (("templated records, before long_records", "record_lengths"), ("tokens per sequence, as trained", "tokens_per_sequence"),
                       ("trained tokens per sequence", "trained_tokens_per_sequence")):
        s = tok.get(key)
        if s:
            L.append(f"| {label} | {s['min']} | {s['p50']} | {s['p90']} | {s.get('p95')} | {s['p99']} | {s['max']} | {s['mean']} |")
    lr = job.get("long_records") or {}
    L += ["", f"- {long_records_said(job, data)}.", ""]
    for title, items, fmt in (("Dropped for length", lr.get("dropped") or [], lambda d: f"{d['tokens']} tokens: {d['why']}"),
                              ("Truncated", lr.get("truncated") or [], lambda d: f"{d['tokens']} tokens: {d['what']}"),
                              ("Exact duplicates removed", job.get("duplicates") or [], lambda d: f"same as {d['same_as']}")):
        if items:
            L += [f"### {title} ({len(items)})", "", "| where | record | what |", "|---|---|---|"]
            L += [f"| {d['where']} | {d['record']} | {fmt(d).replace('|', chr(92) + '|')} |" for d in items] + [""]
    return L


def _packing_lines(pk: dict | None) -> list[str]:
    L = ["## Packing", ""]
    if pk and pk.get("enabled"):
        att = pk.get("attention") or {}
        L += [f"- {pk['function']}(strategy=\"{pk['strategy']}\", seq_length={pk['seq_length']}) on {pk['sequences_in']} training sequences "
              f"→ {pk['rows']} rows ({pk['rows_with_several_samples']} hold several samples).",
              f"- Packing efficiency (real tokens / rows × seq_length): {pk['efficiency']:.2%}.",
              f"- Cross-sample attention: {att.get('how')}.",
              f"- Checked on the decoded rows with TRL's collator and transformers' find_packed_sequence_indices: "
              + ("verified" if att.get("verified") else f"NOT verified {att.get('error', '')}")
              + f" ({att.get('samples', 0)} samples; segment starts match: {att.get('segment_starts_match')}, cu_seq_lens match: "
              f"{att.get('cu_seq_lens_match')}, attention mask dropped: {att.get('attention_mask_dropped')}).", ""]
    else:
        L += ["Packing is off in the brief; each example is its own sequence, truncated at max_seq_length.", ""]
    return L


def _collapse_lines(job: dict, tables: dict) -> list[str]:
    """The decoded samples, then the collapse guard's readings against their bounds and the near-duplicate count."""
    pk = job.get("packing")
    L = ["## Decoded samples", "",
         f"Trained tokens are wrapped in {'⟦'} {'⟧'}; `──` lines mark sample boundaries"
         + (" inside a packed row (the labels shown are the ones TRL's padding-free collator hands the model)" if pk and pk.get("enabled") else "")
         + ".", ""]
    for t in job.get("decoded_samples") or []:
        L += [_fence(t), ""]
    col = job.get("collapse") or {}
    bounds = tables["collapse"]["metrics"]
    L += ["## Collapse guard", "", f"Measured on the trained text ({col.get('sample_words')} words sampled for distinct-n).", "",
          "| metric | value | bounds | verdict |", "|---|---|---|---|"]
    for k, v in (col.get("values") or {}).items():
        b = bounds.get(k, {})
        bs = ", ".join(f"{x.replace('_', ' ')} {b[x]}" for x in ("fail_below", "warn_below", "warn_above", "fail_above") if b.get(x) is not None) or "reported only"
        L.append(f"| {k} | {v} | {bs} | {(col.get('verdicts') or {}).get(k)} |")
    nd = job.get("near_duplicates") or {}
    L += ["", f"Near duplicates: {nd.get('records', 0)} records ({nd.get('share', 0):.1%}); each cluster was kept within one split.", ""]
    return L


def card(brief: Brief, name: str, final_dir: Path, src: dict, model, job: dict, tables: dict, eval_fraction: float, now: str,
          data: dict) -> str:
    fields = {f["key"]: f["title"] for f in tables["card"]["card_fields"]}
    counts = job.get("counts") or {}
    tpl = job.get("template") or {}
    pk = job.get("packing") or {}
    col = job.get("collapse") or {}
    meta = {}
    try:
        meta = json.loads((final_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    license_text, license_src = license_of(src)
    if license_text is None and brief.dataset_expectation.get("license"):
        license_text, license_src = str(brief.dataset_expectation["license"]), "the brief's Dataset Expectation"
    spec = tables["formats"]["formats"].get(job.get("format") or "", {})
    ts = job.get("trainer_settings") or {}
    L = [f"# Dataset card: {name}", "", f"Prepared {now} by finetune-mcp prepare_dataset for experiment {brief.experiment}. "
         f"Files: {final_dir}/train.jsonl, eval.jsonl, meta.json. Rebuild with `python data/prepare.py`.", ""]
    L += [f"## {fields['source-and-license']}", "",
          f"- Source: {src.get('given') or src.get('path') or src.get('id')}"
          + (f" (HF dataset {src['id']}" + (f", config {src['config']}" if src.get("config") else "") + (f", split {src['split']}" if src.get("split") else "")
             + ", loaded by datasets.load_dataset)" if src["kind"] == "hf" else ""),
          *(f"- {Path(f).name}: sha256 {d}" for f, d in (meta.get("source_sha256") or {}).items()),
          f"- License: {license_text + ' (' + license_src + ')' if license_text else 'not stated by the source'}", ""]
    L += [f"## {fields['format-and-method-fit']}", "",
          *conversion_lines(job, tables),
          f"- Format: {job.get('format')} — required columns {', '.join(spec.get('required_fields', []))}",
          f"- Chosen method: {brief.method_label}; the format table lists {job.get('format')} for "
          f"{', '.join(spec.get('methods', []))}, so it fits.",
          f"- Loss on: {spec.get('loss_on')}", f"- Trainer setting: {spec.get('trainer_setting')}", ""]
    L += [f"## {fields['size-and-split']}", "",
          f"- Records read {counts.get('read')}, exact duplicates dropped {counts.get('dropped_exact_duplicates', 0)}, "
          f"dropped for length {counts.get('dropped_long', 0)}, truncated {counts.get('truncated', 0)}, kept {counts.get('kept')}",
          f"- Train {counts.get('train')} / eval {counts.get('eval')} (eval_fraction {eval_fraction}); split by a content hash with seed 0, "
          "so a record always lands in the same split; near-duplicate clusters share a split.", ""]
    L += [f"## {fields['token-length-statistics']}", "", *_card_length_lines(model, job, data), ""]
    L += [f"## {fields['processing']}", "",
          f"- Template: {tpl.get('source')} of the base model, sha256 {tpl.get('sha256')}; applied per example before packing.",
          f"- Masking: " + ("assistant turns only (assistant_only_loss=True)" if tpl.get("assistant_only_loss") else
                            "sampled completions only (GRPO)" if job.get("format") == "grpo" else "completion only")
          + (f"; end-of-turn token trained: {tpl.get('stop_token_trained')}" if tpl.get("stop_token_trained") is not None else ""),
          (f"- Packing: TRL pack_dataset, strategy bfd, {pk.get('seq_length')} tokens, {pk.get('rows')} rows, efficiency {pk.get('efficiency'):.1%}; "
           f"cross-sample attention kept apart by padding-free position_ids restarts ({'verified' if (pk.get('attention') or {}).get('verified') else 'not verified'})"
           if pk.get("enabled") else "- Packing: off"),
          f"- Trainer settings to use (meta.json trainer_settings): {json.dumps(ts)}", "",
          "### Records removed or changed", "", *transformation_lines(job, data), ""]
    L += _masking_lines(tpl.get("masking"))
    L += [f"## {fields['known-limitations-and-risks']}", "", *(f"- {r}" for r in _card_risks(brief, job, tables, data, license_text)), "",
          "Collapse guard readings: " + ", ".join(f"{k} {v}" for k, v in (col.get("values") or {}).items()) + ".", ""]
    return "\n".join(L)


def _card_length_lines(model, job: dict, data: dict) -> list[str]:
    tok = job.get("tokens") or {}
    tpl = job.get("template") or {}
    tps = tok.get("tokens_per_sequence") or {}
    tts = tok.get("trained_tokens_per_sequence") or {}
    return [
        f"- Tokenizer: {model.name} ({model.load_path})",
        f"- Tokens per record under the real template ({tpl.get('source')}; a preference pair counts as two sequences): "
        f"p50 {tps.get('p50')}, p95 {tps.get('p95')}, p99 {tps.get('p99')}, max {tps.get('max')} (min {tps.get('min')}, mean {tps.get('mean')}; total {tok.get('total_tokens')})",
        (f"- Trained tokens per sequence: min {tts.get('min')}, median {tts.get('p50')}, max {tts.get('max')}, mean {tts.get('mean')}" if tts else "- Trained tokens: none in the data (GRPO samples its completions)"),
        f"- Share over max_seq_length {seq_said(data)}: {tok.get('over_share', 0):.1%} ({tok.get('over_max_seq_length', 0)} records, {tok.get('tokens_cut', 0)} tokens cut)",
        f"- {long_records_said(job, data)}",
        *([f"- max_seq_length was not in the brief: the method's default applies; the data's p99 is {tps.get('p99')} tokens, "
           f"so `max_seq_length: {tps.get('p99')}` fits 99% of the records"] if data["max_seq_length_from"] == "default" else []),
    ]


def _card_risks(brief: Brief, job: dict, tables: dict, data: dict, license_text: str | None) -> list[str]:
    counts = job.get("counts") or {}
    risks: list[str] = []
    if license_text is None:
        risks.append("No license was found with the source (no LICENSE file beside it, no license in a dataset card or in the brief): "
                     "check the terms before sharing the model.")
    prov = job.get("provenance") or data.get("provenance") or {}
    if prov.get("value"):
        rule = tables["collapse"]["provenance"][prov["value"]]
        risks.append(f"Provenance: {prov['value']}" + (f" ({'stated by ' + prov['from'] if prov.get('stated', True) and prov.get('from') else 'not stated; the default'})")
                     + f": the collapse guard's fail bounds {'fail the set' if rule['on_fail'] == 'error' else 'are reported as warnings'}.")
    for p in job.get("problems") or []:
        if p["severity"] == "warning" and p["code"].startswith(("collapse-", "provenance-", "fill-")):
            risks.append(p["message"] + ".")
    pcounts = job.get("problem_counts") or {}
    for code, label in (("exact-duplicate", "exact duplicates dropped"), ("near-duplicate", "near duplicates kept (each cluster in one split)"),
                        ("too-long", f"records longer than max_seq_length (long_records: {(job.get('long_records') or {}).get('policy', 'drop')}; see Processing)"),
                        ("stop-token", "end-of-turn token outside the loss mask"), ("one-sided-labels", "KTO labels all one kind")):
        n = (pcounts.get(code) or {}).get("warning", 0)
        if n:
            risks.append(f"{n} {label}.")
    risks.append(f"The eval split ({counts.get('eval')} records) comes from the same source by content hash: it measures fit to this "
                 "distribution, not generalisation beyond it.")
    if brief.sections.get("dataset_expectation"):
        prose = [ln.strip() for ln in brief.sections["dataset_expectation"].splitlines() if ln.strip() and not re.match(r"^[-*]?\s*\w[\w ]{0,40}:\s*\S", ln.strip())]
        if prose:
            risks.append("From the brief: " + " ".join(prose))
    return risks
