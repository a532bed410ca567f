"""Worker job behind prepare_dataset: load, validate, template, tokenize, guard, pack, decode and write a dataset.

Runs in the training Python (`python -m finetune_mcp.jobs.prepare_data`, params as JSON on stdin) and is
also what an experiment's data/prepare.py calls to rebuild the same files. The pipeline order is fixed:
records are validated, each example is templated with the base model's chat template on its own, and
only then are the token sequences packed with TRL's pack_dataset (strategy "bfd"), the function and
strategy SFTTrainer uses. Files are written to params["out_dir"], which the caller renames into place.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_mcp.common import records as R
from finetune_mcp.common import masking as M
from finetune_mcp.common.proto import JobError, emit_progress, follow_lifeline, in_job, run_main
from finetune_mcp.jobs.collapse_guard import UNSTATED, collapse_metrics, judge_collapse, near_duplicates, what_repeats

STAGES = 7
# Trained spans in decoded samples; chosen because chat text rarely contains them.
MARK_OPEN, MARK_CLOSE = "⟦", "⟧"
SAMPLE_RULE = "──"


def _progress(done: float, message: str, total: float = STAGES) -> None:
    if in_job():
        emit_progress(done, total, message)
    else:
        print(f"[{done:.1f}/{total}] {message}", file=sys.stderr)


# ---------------------------------------------------------------- loading


def load_rows(src: dict, per_code: int) -> tuple[R.Raw, R.Sink]:
    """Rows from any supported source. src: {"kind": "path", "path": ...} or {"kind": "hf", "id", "config", "split", "hub"}.

    A hub dataset is looked for, in order: built in the datasets cache (what datasets.load_dataset leaves), as files in
    the hub cache (snapshot_download; a config's own subfolder when one is named), and then, when src["hub"] allows
    it, downloaded from the hub by the very command the error would name."""
    if src["kind"] == "hf":
        hf_id, config, split = src["id"], src.get("config"), src.get("split")
        try:
            return _load_hf(hf_id, config, split), R.Sink(per_code)
        except JobError as e:
            if e.kind != "NotFound":
                raise
            snap = Path(src["snapshot"]) if src.get("snapshot") else None
            if snap is not None and (not config or (snap / config).is_dir()):
                return load_rows({"kind": "path", "path": str(snap / config) if config else str(snap)}, per_code)
            if not src.get("hub"):
                raise
        _progress(0.5, f"downloading {hf_id} from the hub")
        _download(hf_id, config, split)
        return _load_hf(hf_id, config, split), R.Sink(per_code)
    path = Path(src["path"])
    kind, files, ignored = R.source_files(path)
    if kind == "text":
        return R.read_text_source(path, per_code)
    sink = R.Sink(per_code)
    raw = R.Raw(ignored=[str(p) for p in ignored])
    if kind == "parquet":
        import pyarrow.parquet as pq

        for f in files:
            try:
                rows = pq.read_table(f).to_pylist()
            except Exception as e:  # pyarrow raises several types for a broken file
                sink.error("unreadable", f"not a readable Parquet file: {e}", file=str(f))
                continue
            raw.rows += rows
            raw.origins += [(str(f), None)] * len(rows)
            raw.files.append(str(f))
    elif kind == "arrow":
        import datasets

        for f in files:
            try:
                rows = datasets.Dataset.from_file(str(f)).to_list()
            except Exception as e:
                sink.error("unreadable", f"not a readable Arrow file: {e}", file=str(f))
                continue
            raw.rows += rows
            raw.origins += [(str(f), None)] * len(rows)
            raw.files.append(str(f))
    else:  # save_to_disk
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:
            raise JobError(f"cannot load the save_to_disk folder: {e}", kind="BadInput", where=str(path)) from None
        ds = _pick_split(ds, src.get("split"), str(path))
        raw.rows = ds.to_list()
        raw.origins = [(str(path), None)] * len(raw.rows)
        raw.files.append(str(path))
    return raw, sink


def _pick_split(ds, split: str | None, where: str):
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        name = split or ("train" if "train" in ds else (names[0] if len(names) == 1 else None))
        if name is None or name not in ds:
            raise JobError(f"the dataset has splits {', '.join(names)} and none is called train", kind="BadInput", where=where,
                           fix="save the training split alone, or name it train")
        return ds[name]
    return ds


def download_command(hf_id: str, config: str | None, split: str | None) -> str:
    """The command that puts a hub dataset where an offline datasets.load_dataset finds it (the datasets cache)."""
    args = ", ".join([repr(hf_id)] + ([repr(config)] if config else []) + ([f"split={split!r}"] if split else []))
    return f'python -c "import datasets; datasets.load_dataset({args})"'


def _download(hf_id: str, config: str | None, split: str | None) -> None:
    """Run the download command with the hub allowed (this child was started offline: its libraries read the setting
    at import), so the datasets cache then holds the build an offline load finds."""
    import subprocess

    code = "import sys, datasets; datasets.load_dataset(sys.argv[1], sys.argv[2] or None, split=sys.argv[3] or None)"
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}
    try:
        p = subprocess.run([sys.executable, "-c", code, hf_id, config or "", split or ""], env=env, capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        p = None
    if p is None or p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1][:300] if p is not None else "timed out after an hour"
        raise JobError(
            f"dataset {hf_id!r}" + (f" (config {config!r})" if config else "") + f" is not in the local HF cache and could not be downloaded: {tail}",
            kind="NotFound", where=hf_id,
            fix=f"download it where the hub can be reached, with the same HF_HOME: {download_command(hf_id, config, split)}; "
            "then call prepare_dataset again (or save the data to a file and pass its path)",
        )


def _load_hf(hf_id: str, config: str | None, split: str | None) -> R.Raw:
    """datasets.load_dataset in this (offline) child: what the local datasets cache holds."""
    import datasets

    named = f"{hf_id!r}" + (f" (config {config!r})" if config else "")
    try:
        ds = datasets.load_dataset(hf_id, config, split=split) if split else datasets.load_dataset(hf_id, config)
    except Exception as e:
        msg = str(e).replace("\n", " ")[:300]
        if isinstance(e, ValueError) and msg.startswith("Unknown split"):
            raise JobError(f"dataset {named} has no split {split!r}: {msg}", kind="BadInput", where=hf_id,
                           fix="name an existing split: org/name:split, or org/name:config:split") from None
        raise JobError(
            f"dataset {named} is not in the local HF cache ({type(e).__name__}: {msg})",
            kind="NotFound",
            where=hf_id,
            fix=f"download it where the hub can be reached, with the same HF_HOME: {download_command(hf_id, config, split)}; "
            "then call prepare_dataset again (or save the data to a file and pass its path)",
        ) from None
    ds = _pick_split(ds, split, hf_id)
    raw = R.Raw(files=[hf_id])
    raw.rows = ds.to_list()
    raw.origins = [(hf_id, None)] * len(raw.rows)
    return raw


# ---------------------------------------------------------------- tokenization (TRL's own helpers)


# Rendering the Jinja chat template record by record is the bulk of the work; large sets are
# spread over forked workers (the templater is inherited, not pickled). Order is kept.
PARALLEL_MIN_RECORDS = 4000
_TP: "Templater | None" = None


def _template_one(rec):
    try:
        return ("ok", _TP.sequences(rec))
    except JobError as e:
        return ("job-error", e)
    except RecordMaskError as e:
        return ("mask-error", str(e))
    except Exception as e:
        return ("error", f"{type(e).__name__}: {str(e)[:200]}")


class _Templating:
    """Templating of every record, started as soon as it is made: for a large set the forked workers template
    while this process goes on (the near-duplicate pass), and iterating collects the results in order."""

    def __init__(self, tp: "Templater", records: list):
        global _TP
        _TP = tp
        workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1), 8)
        self.pool = None
        if workers < 2 or len(records) < PARALLEL_MIN_RECORDS or tp.processor is not None or sys.platform != "linux":
            self.results = map(_template_one, records)
            return
        import multiprocessing as mp

        self.pool = mp.get_context("fork").Pool(workers, initializer=follow_lifeline)  # each worker ends with the server
        self.results = self.pool.imap(_template_one, records, chunksize=256)

    def __iter__(self):
        try:
            yield from self.results
        finally:
            self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None


class RecordMaskError(Exception):
    """One conversation on which the chosen masking does not give exactly the assistant's replies."""


class Templater:
    """Templating and masking as the trainers will do it, with the template and masking training will use."""

    def __init__(self, model_path: str, fmt: str, method: str, system_prompt: str | None = None):
        from transformers import AutoTokenizer
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers, is_chat_template_stop_token_trained
        from trl.data_utils import _tokenize, common_prefix_length

        self._tokenize, self._cpl = _tokenize, common_prefix_length
        self.processor = None
        if fmt == "vision":
            from transformers import AutoProcessor

            try:
                self.processor = AutoProcessor.from_pretrained(model_path)
            except Exception:
                self.processor = None
            if self.processor is None or getattr(self.processor, "image_processor", None) is None:
                raise JobError(
                    f"VLM-SFT needs a vision-language base model, and {model_path} has no image processor",
                    kind="Refused", where=f"{model_path} (brief ## Base Model)",
                    fix="name a vision-language model that is in the local HF cache under ## Base Model",
                )
        try:
            self.tok = self.processor.tokenizer if self.processor is not None else AutoTokenizer.from_pretrained(model_path)
        except Exception as e:
            raise JobError(f"cannot load the base model's tokenizer: {type(e).__name__}: {e}", kind="JobFailed", where=model_path) from None
        self.fmt, self.method = fmt, method
        self.system_prompt = system_prompt
        tpl = M.template_text(self.tok)
        self.base_template = tpl
        self.template_source = "tokenizer"
        self.chat_template = None  # None: the tokenizer's own, as the trainer passes it
        self.assistant_only = fmt in ("messages", "vision")
        self.generation_markers = bool(tpl) and has_generation_markers(tpl)
        self.stop_token_trained: bool | None = None
        self.masking: dict | None = None  # the masking choice for conversations (common/masking.py)
        if fmt in ("messages", "vision") and not tpl:
            raise JobError("the base model's tokenizer has no chat template, so conversations cannot be templated", kind="BadInput",
                           where=f"{model_path}/tokenizer_config.json", fix="use a model with a chat template, or prompt/completion text rows")
        if fmt == "messages":
            # Assistant-only loss on any template: the first masking way that verifies (common/masking.py).
            try:
                trl_tpl = get_training_chat_template(self.tok)
            except Exception:
                trl_tpl = None
            choice = M.choose(self.tok, trl_tpl)
            if choice["plan"] is None:
                raise JobError(
                    f"no way to mask the assistant's tokens verifies on this chat template (sha256 {M.template_sha256(tpl)[:12]}): "
                    + "; ".join(f"{a['method']}: {a['why']}" for a in choice["attempts"]),
                    kind="Refused", where=f"{model_path}: chat_template",
                    fix="give the data as prompt/completion (loss on the completion needs no template markers), "
                        "or use a chat template that writes an end-of-turn token after each assistant reply",
                )
            self.masking = choice
            self.chat_template = choice["template"] if choice["template"] != tpl else None
            self.template_source = choice["plan"]["method"]
            self.stop_token_trained = True  # check() asserts it on every record
        elif self.assistant_only:
            try:
                patched = get_training_chat_template(self.tok)
            except Exception:
                patched = None
            if patched is not None:
                self.chat_template = patched
                self.template_source = "trl-training-template"
            try:
                self.stop_token_trained = bool(is_chat_template_stop_token_trained(self.tok, chat_template=self.chat_template))
            except Exception:
                self.stop_token_trained = None
        used = self.chat_template or tpl or ""
        self.template_sha256 = hashlib.sha256(used.encode()).hexdigest() if used else None
        self.eos = self.tok.eos_token or ""

    def with_system(self, messages: list) -> list:
        """The brief's system prompt for conversations that have none ("" renders an empty system turn)."""
        if self.system_prompt is None or (messages and messages[0].get("role") == "system"):
            return messages
        return [{"role": "system", "content": self.system_prompt}] + list(messages)

    def _kw(self, rec: dict) -> dict:
        tools = rec.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        return {"chat_template": self.chat_template, "tools": tools, **(rec.get("chat_template_kwargs") or {})}

    def conversation(self, rec: dict) -> tuple[list[int], list[int]]:
        if self.processor is not None:
            # Vision: the text as the processor's template renders it. Image tokens are added by the
            # processor at batch time and are not counted here; the trainer's collator does the masking.
            text = self.processor.apply_chat_template(rec["messages"], tokenize=False)
            ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
            return ids, list(ids)
        messages = self.with_system(rec["messages"])
        kw = self._kw(rec)
        tpl = self.masking["template"]
        plan = self.masking["plan"]
        try:
            ids, mask = M.encode(self.tok, plan, tpl, messages, kw.get("tools"), rec.get("chat_template_kwargs"))
            M.check(self.tok, plan, messages, ids, mask)
        except M.MaskError as e:
            raise RecordMaskError(f"{plan['method']} masking: {e}") from None
        return ids, [t if m else -100 for t, m in zip(ids, mask)]

    def prompt_completion(self, prompt: Any, completion: Any, rec: dict) -> tuple[list[int], list[int], int]:
        """(ids, labels, prompt_len) with loss on the completion, as SFT/DPO/KTO trainers build them."""
        if isinstance(prompt, list):
            kw = self._kw(rec)
            p = self._tokenize(self.tok, prompt, add_generation_prompt=True, **kw)["input_ids"]
            pc = self._tokenize(self.tok, prompt + completion, **kw)["input_ids"]
        else:
            if self.eos and not completion.endswith(self.eos):
                completion = completion + self.eos
            p = self._tokenize(self.tok, prompt)["input_ids"]
            pc = self._tokenize(self.tok, prompt + completion)["input_ids"]
        p, pc = list(p), list(pc)
        n = self._cpl(p, pc)
        return pc, [-100] * n + pc[n:], n

    def prompt_only(self, prompt: Any, rec: dict) -> list[int]:
        if isinstance(prompt, list):
            return list(self._tokenize(self.tok, prompt, add_generation_prompt=True, **self._kw(rec))["input_ids"])
        return list(self._tokenize(self.tok, prompt)["input_ids"])

    def sequences(self, rec: dict) -> list[tuple[str, list[int], list[int]]]:
        """[(part, ids, labels)] for one record: one sequence, or chosen and rejected for preference pairs."""
        f = self.fmt
        if f in ("messages", "vision") and "messages" in rec:
            ids, labels = self.conversation(rec)
            return [("", ids, labels)]
        if f == "text":
            # Language modelling as SFTTrainer does it: EOS appended to the text, every token trained.
            text = rec["text"] if not self.eos or rec["text"].endswith(self.eos) else rec["text"] + self.eos
            ids = list(self._tokenize(self.tok, text)["input_ids"])
            return [("", ids, list(ids))]
        if f in ("prompt-completion", "kto", "vision"):
            ids, labels, _ = self.prompt_completion(rec["prompt"], rec["completion"], rec)
            return [("", ids, labels)]
        if f == "preference":
            c_ids, c_lab, _ = self.prompt_completion(rec["prompt"], rec["chosen"], rec)
            r_ids, r_lab, _ = self.prompt_completion(rec["prompt"], rec["rejected"], rec)
            return [("chosen", c_ids, c_lab), ("rejected", r_ids, r_lab)]
        if f == "grpo":
            ids = self.prompt_only(rec["prompt"], rec)
            return [("prompt", ids, [-100] * len(ids))]
        raise JobError(f"no tokenization for format {f}", kind="JobFailed")

    def render(self, ids: list[int], labels: list[int]) -> str:
        """Decoded text with every run of trained tokens wrapped in ⟦ ⟧."""
        out, run, trained = [], [], None
        for t, lab in zip(ids, labels):
            tr = lab != -100
            if trained is not None and tr != trained:
                out.append(self._piece(run, trained))
                run = []
            run.append(t)
            trained = tr
        if run:
            out.append(self._piece(run, bool(trained)))
        return "".join(out)

    def _piece(self, ids: list[int], trained: bool) -> str:
        text = self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return f"{MARK_OPEN}{text}{MARK_CLOSE}" if trained else text


# ---------------------------------------------------------------- records longer than max_seq_length


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """(prompt, answer) token budgets within cutoff_len: LLaMA-Factory's own rule
    (src/llamafactory/data/processor/processor_utils.py, infer_seqlen). A short answer is kept whole, a short
    prompt is kept whole, else both shrink in proportion to their lengths."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def _cut_front(tok, text: str, drop: int) -> str:
    """text without its first `drop` tokens (cut at a token's first character)."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    if drop >= len(offs):
        return ""
    return text[offs[drop][0]:]


def cut_prompt(tp: "Templater", rec: dict, keep: int, floor: int = 16) -> dict:
    """rec with its prompt shortened from the start until the templated prompt has at most `keep` tokens (the end of
    the prompt, the question, stays next to the answer). Earlier exchanges go whole; a system turn is kept; the last
    turn keeps at least its last `floor` tokens, so the result may still exceed `keep` (the caller checks what fits)."""
    prompt = rec["prompt"]
    for _ in range(12):
        n = len(tp.prompt_only(prompt, rec))
        if n <= keep:
            break
        over = n - keep
        if isinstance(prompt, str):
            ntok = len(tp.tok(prompt, add_special_tokens=False)["input_ids"])
            cut = min(over, ntok - floor)
            if cut <= 0:
                break
            prompt = _cut_front(tp.tok, prompt, cut)
            continue
        msgs = list(prompt)
        j = next((k for k, m in enumerate(msgs) if m.get("role") != "system" and isinstance(m.get("content"), str) and m["content"]), None)
        if j is None:
            break
        content = msgs[j]["content"]
        ntok = len(tp.tok(content, add_special_tokens=False)["input_ids"])
        if over >= ntok and j + 2 < len(msgs):
            # The whole earliest exchange goes (a user turn and the reply to it), so the turns still alternate.
            prompt = msgs[:j] + msgs[j + 2:]
            continue
        cut = min(over, ntok - floor)
        if cut <= 0:
            break
        msgs[j] = {**msgs[j], "content": _cut_front(tp.tok, content, cut)}
        prompt = msgs
    return {**rec, "prompt": prompt}


def apply_length_policy(tp: "Templater", records: list, seqs: list, origins, fmt: str, seq_len: int, policy: str, sink: R.Sink) -> dict:
    """What happens to the records longer than seq_len, by the brief's long_records policy:

    drop (the default, Axolotl's way): the record is left out; refuse: each one is an error; truncate: a prompt is cut
    from its start to LLaMA-Factory's prompt budget (records[i] and seqs[i] are replaced), the answer is cut at
    seq_len by the trainer's own keep_start truncation, which also cuts its end-of-turn token, so the model is never
    taught to stop where the cut fell; conversations and text are cut at seq_len by the trainer, and a record
    left with no trained token is dropped. Every kept record keeps trained answer tokens. The caller refuses the set
    only when too few records are left to train on."""
    rec_len = [max((len(p[1]) for p in parts), default=0) for parts in seqs]
    q = _stats(rec_len)
    out = {"policy": policy, "max_seq_length": seq_len, "records": len(records), "record_lengths": q,
           "max_seq_length_for": {"95%": q["p95"], "99%": q["p99"], "100%": q["max"]},
           "dropped": [], "truncated": [], "cut_inside_answer": 0, "tokens_cut": 0}
    over_idx = [i for i, L in enumerate(rec_len) if L > seq_len]
    dropped: set[int] = set()
    field = R.main_field(fmt)

    def drop(i: int, why: str) -> None:
        dropped.add(i)
        out["dropped"].append({"where": _loc(origins, i), "record": origins[i][2], "tokens": rec_len[i], "why": why})

    for i in over_idx:
        over_by = rec_len[i] - seq_len
        if policy == "refuse":
            sink.error("too-long", f"{rec_len[i]} tokens, {over_by} past max_seq_length {seq_len} (long_records: refuse)", **_where(origins, i), field=field)
            continue
        if policy == "drop" or fmt == "grpo":
            why = (f"{rec_len[i]} tokens > max_seq_length {seq_len}" if fmt != "grpo" else
                   f"the templated prompt has {rec_len[i]} tokens, leaving no room to generate within {seq_len}")
            drop(i, why)
            sink.warn("too-long", f"dropped: {why} (long_records: {policy})", **_where(origins, i), field=field)
            continue
        cut = _truncate(tp, records, seqs, i, fmt, seq_len, rec_len[i])
        if cut.dropped:
            drop(i, cut.dropped)
            sink.warn("too-long", f"dropped: {cut.dropped}", **_where(origins, i), field=cut.field or field)
            continue
        what, in_answer, parts = cut.what, cut.in_answer, seqs[i]
        out["cut_inside_answer"] += in_answer
        out["tokens_cut"] += rec_len[i] - min(max(len(p[1]) for p in parts), seq_len)
        out["truncated"].append({"where": _loc(origins, i), "record": origins[i][2], "tokens": rec_len[i], "what": what.rstrip("; ")})
        sink.warn("too-long", f"truncated: {what.rstrip('; ')} (long_records: truncate)", **_where(origins, i), field=field)
    n = max(len(records), 1)
    out.update(over=len(over_idx), over_share=round(len(over_idx) / n, 4), dropped_set=dropped,
               max_overflow=max((rec_len[i] - seq_len for i in over_idx), default=0))
    if over_idx and policy != "refuse":
        done = (f"dropped {len(out['dropped'])}" if out["dropped"] else "") + (
            (", " if out["dropped"] else "") + f"truncated {len(out['truncated'])}" if out["truncated"] else "")
        sink.warn("long-records", field="max_seq_length", message=(
            f"{len(over_idx)} of {len(records)} records ({len(over_idx) / n:.1%}) are longer than max_seq_length {seq_len}: {done} "
            f"(long_records: {policy}); record lengths p50 {q['p50']}, p90 {q['p90']}, p95 {q['p95']}, p99 {q['p99']}, max {q['max']}: "
            f"`max_seq_length: {q['p95']}` keeps 95%, `max_seq_length: {q['p99']}` keeps 99%"))
    return out


@dataclass
class _Cut:
    """What truncating one record did: what was cut and whether inside an answer, or why it was dropped instead."""

    what: str = ""
    in_answer: bool = False
    dropped: str | None = None
    field: str | None = None


def _trained_within(parts, seq_len: int) -> bool:
    return all(any(x != -100 for x in lab[:seq_len]) for _, _, lab in parts)


def _truncate(tp: "Templater", records: list, seqs: list, i: int, fmt: str, seq_len: int, length: int) -> _Cut:
    """Truncate record i in place (records[i], seqs[i]): a prompt to LLaMA-Factory's prompt budget, the rest by the trainer."""
    parts = seqs[i]
    what, in_answer = "", False
    if fmt in ("preference", "kto", "prompt-completion"):
        plen = _prompt_len(parts)
        alen = max(len(ids) - plen for _, ids, _ in parts)
        src, _ = infer_seqlen(plen, alen, seq_len)
        if plen > src:
            new = cut_prompt(tp, records[i], src)
            new_parts = tp.sequences(new)
            if not _trained_within(new_parts, seq_len):
                return _Cut(dropped=f"the prompt ({plen} tokens) cannot be cut below {_prompt_len(new_parts)} without losing its last turn, "
                                    f"which leaves no answer token within {seq_len}", field="prompt")
            records[i] = new
            seqs[i] = parts = new_parts
            what = f"prompt cut from {plen} to {_prompt_len(parts)} tokens (its start dropped); "
        after = max(len(p[1]) for p in parts)
        if after > seq_len:
            what += f"answer cut at {seq_len - _prompt_len(parts)} of its {alen} tokens by the trainer"
            in_answer = True
    else:
        lost = sum(1 for _, _, lab in parts for x in lab[seq_len:] if x != -100)
        what = f"cut at {seq_len} tokens by the trainer, {length - seq_len} tokens lost" + (
            f", {lost} of them trained (the cut falls inside an assistant turn)" if lost else ", none of them trained")
        in_answer = bool(lost)
    if not _trained_within(parts, seq_len):
        return _Cut(dropped=f"no trained token left within max_seq_length {seq_len}")
    return _Cut(what, in_answer)


def _prompt_len(parts) -> int:
    """Tokens before the first trained one (the templated prompt), over a record's sequences."""
    return min(next((k for k, x in enumerate(lab) if x != -100), len(lab)) for _, _, lab in parts)


# ---------------------------------------------------------------- the pipeline


def _stats(xs: list[int]) -> dict:
    if not xs:
        return {"min": 0, "p50": 0, "p90": 0, "p95": 0, "p99": 0, "max": 0, "mean": 0.0}
    s = sorted(xs)

    def q(p: float) -> int:
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"min": s[0], "p50": q(0.5), "p90": q(0.9), "p95": q(0.95), "p99": q(0.99), "max": s[-1], "mean": round(statistics.fmean(s), 2)}


def _some(locs: list[str], n: int = 8) -> str:
    return ", ".join(locs[:n]) + (f" and {len(locs) - n} more" if len(locs) > n else "")


def _where(origins, i) -> dict:
    f, line, rec = origins[i]
    return {"file": f, "line": line, "record": rec}


def _loc(origins, i) -> str:
    f, line, rec = origins[i]
    return f"{Path(f).name}:{line}" if line else f"{Path(f).name} row {rec}"


def prepare(P: dict) -> dict:
    """The whole pipeline; writes P["out_dir"]/{train,eval}.jsonl and meta.json only when nothing failed."""
    closers: list = []
    try:
        return _prepare(P, closers)
    finally:
        for close in closers:  # forked templating workers never outlive the job, whatever it raised
            close()


def _prepare(P: dict, closers: list) -> dict:
    """load -> validate -> near copies and the collapse guard -> template -> lengths -> split -> pack/decode -> write."""
    validation = P["tables"]["validation"]
    method, seq_len = P["method"], int(P["max_seq_length"])
    _progress(0, "reading the source")
    raw, sink = load_rows(P["source"], validation["listed_per_code"])
    _progress(1, f"validating {len(raw.rows)} records")
    checked, base = _validate(P, raw, sink)
    if sink.errors:
        return {"ok": False, "stage": "validation", **base, **sink.to_dict()}
    records, origins, fmt = checked.records, checked.origins, checked.format

    # Templating starts now (in forked workers for a large set) and overlaps the near-duplicate pass below.
    tp = Templater(P["model_path"], fmt, method, P.get("system_prompt"))
    templating = _Templating(tp, records)
    closers.append(templating.close)

    # Near duplicates first: each cluster goes to one split, so eval never scores a near copy of train.
    _progress(2, "checking near duplicates and the collapse guard")
    near = _near_copies(P, checked, base, sink)
    guard = _collapse_guard(P, checked, base, near, sink)

    # Template each example on its own, then measure, then pack.
    _progress(3, f"applying the chat template to {len(records)} records")
    seqs, template_errors = _template_all(templating, records, origins, sink)
    # Records longer than max_seq_length follow the brief's long_records policy (skill: "Long records").
    lp = apply_length_policy(tp, records, seqs, origins, fmt, seq_len, P.get("long_records") or "drop", sink)
    lengths, trained_counts = _count_tokens(seqs, lp, origins, fmt, seq_len, sink)
    _check_enough_kept(lp, len(records), fmt, seq_len, validation, template_errors, sink)
    train_idx, eval_idx = _split(P, checked, near.clusters, lp["dropped_set"], sink)

    if tp.stop_token_trained is False:
        sink.warn("stop-token", "the chat template leaves the assistant's end-of-turn token outside the loss mask; the model may not learn to stop",
                  field="chat_template")
    token_stats = _token_stats(lengths, trained_counts, lp)
    if P.get("max_seq_length_from") == "default":
        tps = token_stats["record_lengths"]
        sink.warn("max-seq-length-default", f"the brief states no max_seq_length, so the {method} recipe's default {seq_len} applies "
                  f"({P.get('max_seq_length_cite')}); 99% of the templated records fit in {tps['p99']} tokens (the longest has {tps['max']}): "
                  f"state `max_seq_length: {tps['p99']}` under ## Dataset Expectation to train at the data's own length", field="max_seq_length")
    template = _template_info(tp)
    result = {**base, "tokens": token_stats, "template": template, "collapse": guard,
              "near_duplicates": {"records": near.count, "share": round(near.share, 4), "clusters_in_one_split": True}}
    result["counts"].update(train=len(train_idx), eval=len(eval_idx), kept=len(train_idx) + len(eval_idx),
                            dropped_long=len(lp["dropped_set"]), truncated=len(lp["truncated"]))
    result["long_records"] = {k: v for k, v in lp.items() if k != "dropped_set"}
    if sink.errors:
        stage = "templating" if template_errors else "checks"
        return {"ok": False, "stage": stage, **result, **sink.to_dict()}

    pack_info, decoded = _samples(P, tp, checked, seqs, train_idx)
    _progress(5, "writing the splits")
    digests, trainer = _write(P, raw, checked, tp, template, result, train_idx, eval_idx, pack_info)
    _progress(6, "done")
    return {"ok": True, "stage": "done", **result, "packing": pack_info, "decoded_samples": decoded,
            "trainer_settings": trainer, "files_sha256": digests, "meta": "meta.json", **sink.to_dict()}


def _validate(P: dict, raw: R.Raw, sink: R.Sink) -> tuple[R.Checked, dict]:
    """Every record converted and checked (common/records.py); the part of the result that needs nothing else."""
    formats, validation, collapse = (P["tables"][k] for k in ("formats", "validation", "collapse"))
    roots = [Path(r) for r in P.get("allowed_roots") or []]

    def path_ok(p: Path) -> bool:
        return not roots or any(p == r or p.is_relative_to(r) for r in roots)

    checked = R.check_records(raw, sink, method=P["method"], formats=formats, validation=validation, path_ok=path_ok,
                              fill=P.get("fill"), keep_placeholders=bool(P.get("keep_placeholders")),
                              needs_reference=P.get("needs_reference", True), provenance=(P.get("provenance") or {}).get("value"))
    prov = P.get("provenance") or {}
    provenance = prov.get("value") or collapse["provenance"]["default"]
    if prov.get("conflict"):
        sink.warn("provenance-conflict", prov["conflict"], field="provenance")
    base = {
        "shape": checked.shape, "format": checked.format, "conversion": checked.conversion,
        "conversion_report": checked.extra.get("report"), "provenance": {**prov, "value": provenance, "stated": bool(prov.get("value"))},
        "files": raw.files, "ignored_files": raw.ignored, "reference_field": checked.reference_field,
        "counts": {"read": checked.read, "valid": len(checked.records) + checked.dropped["exact-duplicate"],
                   "dropped_exact_duplicates": checked.dropped["exact-duplicate"], "kept": len(checked.records)},
        "labels": checked.extra.get("labels"),
        "duplicates": checked.extra.get("duplicates") or [],
    }
    if len(checked.records) < validation["min_examples"] and not sink.errors:
        sink.error("too-few-records", f"{len(checked.records)} usable records; the skill asks for at least {validation['min_examples']}")
    return checked, base


class _Clusters:
    """Union-find over record indices: near copies join one cluster, and a cluster goes to one split."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def root(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(self, j: int, i: int) -> None:
        self.parent[self.root(j)] = self.root(i)


@dataclass
class _Near:
    """The near-copy pass: its clusters, how many records are near copies, their share, and one example pair."""

    clusters: _Clusters
    count: int
    share: float
    example: str | None


def _near_copies(P: dict, checked: R.Checked, base: dict, sink: R.Sink) -> _Near:
    """Near copies (MinHash), warned one by one; their share fails the set unless the data is curated."""
    collapse, validation = P["tables"]["collapse"], P["tables"]["validation"]
    records, origins, fmt = checked.records, checked.origins, checked.format
    provenance, stated = base["provenance"]["value"], base["provenance"]["stated"]
    match, _ = near_duplicates([R.full_text(r, fmt) for r in records], collapse["minhash"], int(P.get("seed", 0)))
    clusters = _Clusters(len(records))
    n_near = 0
    near_where: list[str] = []
    for j, i in enumerate(match):
        if i is not None:
            n_near += 1
            near_where.append(_loc(origins, j))
            clusters.join(j, i)
            sink.warn("near-duplicate", f"near copy of {_loc(origins, i)} (record {origins[i][2]})", **_where(origins, j), field=R.main_field(fmt))
    near_share = n_near / max(len(records), 1)
    rule = validation["share_rules"]["near-duplicate"]
    if near_share > rule["fail_above"]:
        said = f"{n_near} of {len(records)} records ({near_share:.1%}) are near copies, above the {rule['fail_above']:.0%} the skill allows ({_some(near_where)})"
        if collapse["provenance"][provenance]["on_fail"] == "warning":
            sink.warn("near-duplicate", field=R.main_field(fmt), message=f"{said}; reported, not failing: the data is {provenance}")
        else:
            sink.error("near-duplicate", field=R.main_field(fmt), message=said + ("" if stated else "; " + UNSTATED.format(provenance)))
    first_near = next(((j, i) for j, i in enumerate(match) if i is not None), None)
    example = f"{_loc(origins, first_near[0])} ≈ {_loc(origins, first_near[1])}" if first_near else None
    return _Near(clusters, n_near, near_share, example)


def _collapse_guard(P: dict, checked: R.Checked, base: dict, near: _Near, sink: R.Sink) -> dict:
    """The collapse guard's readings and verdicts over the trained text (what repeats is named only when it matters)."""
    collapse, seed = P["tables"]["collapse"], int(P.get("seed", 0))
    records, origins = checked.records, checked.origins
    provenance, stated = base["provenance"]["value"], base["provenance"]["stated"]
    trained_txt = ["\n".join(R.trained_texts(r, checked.format, checked.reference_field)) for r in records]
    cvals = collapse_metrics(trained_txt, near.share, collapse, seed)
    cvals["_top_where"] = _some([_loc(origins, i) for i in cvals["_top_records"]], 5) + (
        f" and {int(cvals['top-opening-share'] * len(records)) - len(cvals['_top_records'])} more"
        if cvals["top-opening-share"] * len(records) > len(cvals["_top_records"]) else "")
    provisional = judge_collapse(cvals, collapse, len(records), R.Sink(), provenance)
    # Naming what repeats costs a pass over the answers; only a reading worth reporting pays for it.
    repeats = what_repeats(trained_txt, cvals, near.example, seed) if {"warn", "fail"} & set(provisional.values()) else None
    cverdicts = judge_collapse(cvals, collapse, len(records), sink, provenance, repeats, stated=stated)
    return {"values": {k: v for k, v in cvals.items() if not k.startswith("_")},
            "top_opening": cvals["_top_opening"], "sample_words": cvals["_sample_words"],
            "verdicts": cverdicts, "min_records": collapse["min_records"]}


def _template_all(templating: "_Templating", records: list, origins, sink: R.Sink) -> tuple[list, int]:
    """Each record's (part, input_ids, labels) sequences, [] for one the template or the mask check refused."""
    seqs: list[list[tuple[str, list[int], list[int]]]] = []
    tick = max(1, len(records) // 10)
    for i, (kind, out) in enumerate(templating):
        if kind == "job-error":
            raise out
        if kind == "error":  # a template that raises on this record (e.g. its own role checks)
            sink.error("chat-template", f"the chat template failed on this record: {out}", **_where(origins, i))
            seqs.append([])
        elif kind == "mask-error":  # the trained tokens would not be exactly this record's replies
            sink.error("masking", out, **_where(origins, i), field="messages")
            seqs.append([])
        else:
            seqs.append(out)
        if i % tick == tick - 1:
            _progress(3 + (i + 1) / len(records), f"templated {i + 1}/{len(records)}")
    return seqs, sink.counts_of("chat-template") + sink.counts_of("masking")


def _count_tokens(seqs: list, lp: dict, origins, fmt: str, seq_len: int, sink: R.Sink) -> tuple[list[int], list[int]]:
    """Tokens and trained tokens of each kept sequence within seq_len; a sequence that trains nothing is an error."""
    lengths, trained_counts = [], []
    for i, parts in enumerate(seqs):
        if i in lp["dropped_set"]:
            continue
        for part, ids, labels in parts:
            lengths.append(min(len(ids), seq_len))
            if fmt == "grpo":
                continue
            kept = sum(1 for x in labels[:seq_len] if x != -100)
            trained_counts.append(kept)
            if kept == 0 and parts and sum(1 for x in labels if x != -100) == 0:
                sink.error("no-trained-tokens", f"{part + ': ' if part else ''}no token carries loss: the template's mask covers none of its tokens",
                           **_where(origins, i), field=part or ("messages" if fmt in ("messages", "vision") else "completion"))
    return lengths, trained_counts


def _check_enough_kept(lp: dict, n: int, fmt: str, seq_len: int, validation: dict, template_errors: int, sink: R.Sink) -> None:
    dropped_long = lp["dropped_set"]
    kept_n = n - len(dropped_long)
    if kept_n < validation["min_examples"] and dropped_long and not template_errors:
        q = lp["record_lengths"]
        sink.error("too-few-records", field="max_seq_length", message=(
            f"only {kept_n} of {n} records fit max_seq_length {seq_len} once the {len(dropped_long)} longer ones are dropped "
            f"(long_records: {lp['policy']}); the skill asks for at least {validation['min_examples']}: set `max_seq_length: {q['p95']}` "
            f"(keeps 95%) or `max_seq_length: {q['p99']}` (keeps 99%) under ## Dataset Expectation"
            + ("" if lp["policy"] == "truncate" or fmt == "grpo" else ", or `long_records: truncate` to cut them")))


def _split(P: dict, checked: R.Checked, clusters: _Clusters, dropped_long: set[int], sink: R.Sink) -> tuple[list[int], list[int]]:
    """Train and eval indices, by the content hash of each near-copy cluster's first record; a dropped record is in neither."""
    validation, seed = P["tables"]["validation"], int(P.get("seed", 0))
    records = checked.records
    keys = checked.extra.get("keys") or [R.record_key(r) for r in records]
    frac = float(P.get("eval_fraction", 0.05))
    score = [R.split_key(keys[clusters.root(i)], seed) for i in range(len(records))]
    live = [i not in dropped_long for i in range(len(records))]
    is_eval = [s < frac and ok for s, ok in zip(score, live)]
    need = validation["min_eval_examples"] if frac > 0 else 0
    if sum(is_eval) < need:
        for i in sorted((i for i in range(len(records)) if live[i]), key=lambda i: score[i]):
            if sum(is_eval) >= need:
                break
            r0 = clusters.root(i)
            for j in range(len(records)):
                if clusters.root(j) == r0 and live[j]:
                    is_eval[j] = True
    if any(live) and all(e for e, ok in zip(is_eval, live) if ok):
        sink.error("too-few-records", "every record landed in the eval split; lower eval_fraction")
    return ([i for i in range(len(records)) if live[i] and not is_eval[i]],
            [i for i in range(len(records)) if is_eval[i]])


def _token_stats(lengths: list[int], trained_counts: list[int], lp: dict) -> dict:
    return {
        "tokens_per_sequence": _stats(lengths),
        "trained_tokens_per_sequence": _stats(trained_counts) if trained_counts else None,
        "total_tokens": sum(lengths),
        "trained_tokens": sum(trained_counts),
        "record_lengths": lp["record_lengths"],
        "max_seq_length_for": lp["max_seq_length_for"],
        "over_max_seq_length": lp["over"],
        "over_share": lp["over_share"],
        "tokens_cut": lp["tokens_cut"],
        "max_overflow": lp["max_overflow"],
    }


def _template_info(tp: "Templater") -> dict:
    template = {
        "source": tp.template_source, "sha256": tp.template_sha256, "generation_markers": tp.generation_markers,
        "stop_token_trained": tp.stop_token_trained, "assistant_only_loss": tp.assistant_only,
        "eos_token": tp.eos,
    }
    if tp.masking is not None:
        template["masking"] = {"method": tp.masking["plan"]["method"], "plan": tp.masking["plan"],
                               "attempts": tp.masking["attempts"], "rows": tp.masking["rows"],
                               "default_system_prompt": tp.masking["default_system"],
                               "system_prompt": tp.system_prompt, "summary": M.describe(tp.masking)}
    return template


def _samples(P: dict, tp: "Templater", checked: R.Checked, seqs: list, train_idx: list[int]) -> tuple[dict | None, list[str]]:
    """Pack the training split exactly as SFTTrainer does, then decode from what the collator hands the model."""
    dec = P["tables"]["validation"]["decoded_samples"]
    seq_len, fmt = int(P["max_seq_length"]), checked.format
    if _packs(P, fmt):
        _progress(4, f"packing {len(train_idx)} sequences at {seq_len} tokens with TRL bfd")
        return _pack_and_decode(tp, seqs, train_idx, checked.origins, seq_len, dec, P)
    _progress(4, "decoding templated examples (packing off)")
    return None, _decode_unpacked(tp, seqs, train_idx, checked.origins, checked.records, fmt, checked.reference_field, dec)


def _packs(P: dict, fmt: str) -> bool:
    return bool(P.get("packing")) and fmt in ("messages", "prompt-completion", "text")


def _write(P: dict, raw: R.Raw, checked: R.Checked, tp: "Templater", template: dict, result: dict,
           train_idx: list[int], eval_idx: list[int], pack_info: dict | None) -> tuple[dict, dict]:
    """train.jsonl, eval.jsonl, the chat template train.py masks with, and meta.json; returns (digests, trainer settings)."""
    records, origins, fmt, method = checked.records, checked.origins, checked.format, P["method"]
    seq_len = int(P["max_seq_length"])
    out = Path(P["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, idx in (("train.jsonl", train_idx), ("eval.jsonl", eval_idx)):
        digests[name] = _write_jsonl(out / name, [records[i] for i in idx], origins, idx)
    if tp.masking is not None:
        # train.py renders and masks with exactly this template (and common/masking.py copied beside it).
        (out / "chat_template.jinja").write_text(tp.masking["template"], encoding="utf-8")
        template["file"] = "chat_template.jinja"
    packing = _packs(P, fmt)
    weighted = fmt == "messages" and any(m.get("weight") == 0 for r in records for m in r["messages"] if isinstance(m, dict))
    trainer = _trainer_settings(fmt, method, seq_len, packing, checked.reference_field, weighted)
    meta = {
        "name": P.get("name"),
        "experiment": P.get("experiment"),
        "method": method,
        "format": fmt,
        "conversion": checked.conversion,
        "conversion_report": checked.extra.get("report"),
        "provenance": result["provenance"],
        "max_seq_length_from": P.get("max_seq_length_from", "brief"),
        "source": P["source"],
        "source_files": raw.files,
        "source_sha256": R.file_digests([f for f in raw.files if Path(f).exists()]) if P["source"]["kind"] == "path" else {},
        "counts": result["counts"],
        "split": {"rule": "blake2b(seed:record) < eval_fraction; near-duplicate clusters share a split",
                  "seed": int(P.get("seed", 0)), "eval_fraction": float(P.get("eval_fraction", 0.05))},
        "max_seq_length": seq_len,
        "long_records": result["long_records"],
        "exact_duplicates": result["duplicates"],
        "chat_template": template,
        "trainer_settings": trainer,
        "reference_field": checked.reference_field,
        "files": digests,
        "tokens": result["tokens"],
        "packing": pack_info,
        "versions": _versions(),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return digests, trainer


def _trainer_settings(fmt: str, method: str, seq_len: int, packing: bool, ref: str | None, weighted: bool = False) -> dict:
    s: dict[str, Any] = {"max_length": seq_len}
    if method in ("sft-lora", "sft-qlora", "vlm-sft"):
        s.update(packing=packing, packing_strategy="bfd" if packing else None, padding_free=packing,
                 assistant_only_loss=fmt in ("messages", "vision"),
                 completion_only_loss=True if fmt == "prompt-completion" else None)
        if fmt == "text":
            s["dataset_text_field"] = "text"
    if weighted:
        # Assistant messages with "weight": 0 are context, not targets: common/masking.py (here, and copied into
        # train.py) drops their spans; the flag says the records rely on it.
        s["message_weights"] = True
    if method == "grpo":
        s["reference_field"] = ref
    return s


def _versions() -> dict:
    out = {}
    for mod in ("trl", "transformers", "datasets", "tokenizers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    return out


def _write_jsonl(path: Path, rows: list[dict], origins, idx) -> str:
    h = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        for r, i in zip(rows, idx):
            try:
                line = (json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8")
            except (TypeError, ValueError) as e:
                raise JobError(f"a record holds a value that cannot be written as JSON ({e})", kind="BadInput",
                               where=_loc(origins, i), fix="convert binary or non-JSON columns before preparing") from None
            h.update(line)
            fh.write(line)
    os.replace(tmp, path)
    return h.hexdigest()


def _pick(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _pack_and_decode(tp: Templater, seqs, train_idx, origins, seq_len: int, dec: dict, P: dict) -> tuple[dict, list[str]]:
    import datasets
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    ids = [seqs[i][0][1] for i in train_idx]
    labels = [seqs[i][0][2] for i in train_idx]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    packed = pack_dataset(ds, seq_len, "bfd")
    rows = packed.num_rows
    # One Arrow conversion: indexing the lazy column row by row costs a call into datasets per row.
    seq_lengths = packed.data.column("seq_lengths").to_pylist()
    real = sum(sum(s) for s in seq_lengths)
    efficiency = real / (rows * seq_len) if rows else 0.0
    multi = sum(1 for s in seq_lengths if len(s) > 1)

    # Which record each packed sample came from: match the token sequences back.
    by_seq: dict[tuple, list[int]] = {}
    for i in train_idx:
        by_seq.setdefault(tuple(seqs[i][0][1][:seq_len]), []).append(i)

    want = min(dec["max"], rows)
    # Prefer rows that hold several samples: boundaries are what needs inspecting.
    multi_rows = [r for r in range(rows) if len(seq_lengths[r]) > 1]
    pool = multi_rows if len(multi_rows) >= want else list(range(rows))
    chosen = [pool[i] for i in _pick(len(pool), want)]
    batch = [{"input_ids": packed[r]["input_ids"], "labels": packed[r]["labels"], "seq_lengths": seq_lengths[r]} for r in chosen]
    attention = _attention_check(tp, batch)
    # Render from the collator's labels: what the model is trained on, after its own boundary masking.
    coll_labels = attention.pop("_labels", None)
    texts = []
    offset = 0
    for n, (r, ex) in enumerate(zip(chosen, batch)):
        row_ids = ex["input_ids"]
        row_lab = coll_labels[offset:offset + len(row_ids)] if coll_labels is not None else ex["labels"]
        offset += len(row_ids)
        lines = [f"### Packed sequence {n + 1} (row {r} of {rows}): {len(row_ids)}/{seq_len} tokens, {len(ex['seq_lengths'])} samples",
                 f"position_ids restart at 0 for each sample: " + " | ".join(f"0..{L - 1}" for L in ex["seq_lengths"])]
        start = 0
        for k, L in enumerate(ex["seq_lengths"]):
            seg = row_ids[start:start + L]
            cands = by_seq.get(tuple(seg)) or []
            rec = cands.pop(0) if cands else None
            src = f"record {origins[rec][2]} ({_loc(origins, rec)})" if rec is not None else "record unknown"
            lines.append(f"{SAMPLE_RULE} sample {k + 1}: {src}, tokens {start}-{start + L - 1} {SAMPLE_RULE}")
            lines.append(tp.render(seg, row_lab[start:start + L]))
            start += L
        texts.append("\n".join(lines))
    info = {
        "enabled": True,
        "strategy": "bfd",
        "function": "trl.data_utils.pack_dataset",
        "seq_length": seq_len,
        "sequences_in": len(train_idx),
        "rows": rows,
        "rows_with_several_samples": multi,
        "tokens": real,
        "efficiency": round(efficiency, 4),
        "decoded_rows": len(texts),
        "attention": attention,
    }
    return info, texts


def _attention_check(tp: Templater, batch: list[dict]) -> dict:
    """Run TRL's padding-free collator on the rows and check that the segments transformers derives from its
    position_ids are exactly the packed samples."""
    how = ("padding-free: TRL's collator flattens the batch, drops the attention mask, restarts position_ids at 0 "
           "for every sample (from seq_lengths) and passes cu_seq_lens for varlen kernels; transformers builds a "
           "block-diagonal causal mask from the restarts for SDPA/eager attention")
    try:
        from transformers.masking_utils import find_packed_sequence_indices
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        pad = tp.tok.pad_token_id if tp.tok.pad_token_id is not None else (tp.tok.eos_token_id or 0)
        coll = DataCollatorForLanguageModeling(pad_token_id=pad, padding_free=True)
        out = coll(batch)
        pos = out["position_ids"]
        seg = find_packed_sequence_indices(pos)
        expected, s = [], 0
        for ex in batch:
            for L in ex["seq_lengths"]:
                expected.append(s)
                s += L
        starts = [0] + [int(i) for i in range(1, pos.shape[1]) if int(seg[0, i]) != int(seg[0, i - 1])] if seg is not None else [0]
        cu = [int(x) for x in out["cu_seq_lens_q"][:-1]]
        ok = starts == expected and cu == expected and "attention_mask" not in out
        return {"verified": ok, "how": how, "samples": len(expected), "segment_starts_match": starts == expected,
                "cu_seq_lens_match": cu == expected, "attention_mask_dropped": "attention_mask" not in out,
                "_labels": out["labels"][0].tolist()}
    except Exception as e:  # report, never crash the phase on the inspection itself
        return {"verified": False, "how": how, "error": f"{type(e).__name__}: {e}"}


def _decode_unpacked(tp: Templater, seqs, train_idx, origins, records, fmt, ref, dec) -> list[str]:
    out = []
    for n, i in enumerate(train_idx[j] for j in _pick(len(train_idx), dec["max"])):
        lines = [f"### Example {n + 1}: record {origins[i][2]} ({_loc(origins, i)})"]
        for part, ids, labels in seqs[i]:
            if part:
                lines.append(f"{SAMPLE_RULE} {part} ({len(ids)} tokens) {SAMPLE_RULE}")
            else:
                lines.append(f"{SAMPLE_RULE} {len(ids)} tokens {SAMPLE_RULE}")
            lines.append(tp.render(ids, labels))
        if fmt == "grpo":
            lines.append(f"{SAMPLE_RULE} reference answer ({ref}): {records[i].get(ref)!r}")
        if fmt == "kto":
            lines.append(f"{SAMPLE_RULE} label: {records[i]['label']}")
        out.append("\n".join(lines))
    return out


# ---------------------------------------------------------------- entry points


def reproduce(params: dict, out_dir: str | os.PathLike) -> dict:
    """Rebuild a prepared dataset into out_dir (used by data/prepare.py): staging folder, then rename."""
    import shutil
    import tempfile

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".staging-{out_dir.name}-", dir=out_dir.parent))
    try:
        res = prepare({**params, "out_dir": str(stage)})
        if not res["ok"]:
            for p in res["problems"]:
                print(f"{p['severity']}: {p['code']}: {p['message']} ({p.get('file')}:{p.get('line')} {p.get('field') or ''})", file=sys.stderr)
            raise SystemExit(f"dataset not rebuilt: the {res['stage']} stage failed")
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".old-{out_dir.name}-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(stage, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return res
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def _job(params: dict) -> dict:
    return prepare(params)


if __name__ == "__main__":
    code = 0
    try:
        run_main(_job)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    # The result line is flushed; skip the interpreter's slow teardown of torch and friends.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
