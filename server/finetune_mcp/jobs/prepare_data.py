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
from collections import Counter
from pathlib import Path
from typing import Any

from finetune_mcp.jobs import _proto, _records as R, masking as M
from finetune_mcp.jobs._proto import JobError

STAGES = 7
# Trained spans in decoded samples; chosen because chat text rarely contains them.
MARK_OPEN, MARK_CLOSE = "⟦", "⟧"
SAMPLE_RULE = "──"


def _progress(done: float, message: str, total: float = STAGES) -> None:
    if _proto._out is not None:
        _proto.emit_progress(done, total, message)
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

        self.pool = mp.get_context("fork").Pool(workers)
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
        self.masking: dict | None = None  # the masking choice for conversations (jobs/masking.py)
        if fmt in ("messages", "vision") and not tpl:
            raise JobError("the base model's tokenizer has no chat template, so conversations cannot be templated", kind="BadInput",
                           where=f"{model_path}/tokenizer_config.json", fix="use a model with a chat template, or prompt/completion text rows")
        if fmt == "messages":
            # Assistant-only loss on any template: the first masking way that verifies (jobs/masking.py).
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


# ---------------------------------------------------------------- near duplicates and the collapse guard


def near_duplicates(texts: list[str], mh: dict, seed: int = 0) -> tuple[list[int | None], int]:
    """For each record the index of an earlier near copy (MinHash Jaccard >= mh["jaccard"]) or None.
    Returns (match, candidate_pairs_checked)."""
    import numpy as np

    n = len(texts)
    k = mh["shingle_words"]
    if n == 0:
        return [], 0
    # Words become ids, shingles k consecutive ids mixed into 32 bits, all in numpy; a record shorter than
    # k words is one shingle of what it has. Ids are assigned in first-seen order, so this is deterministic.
    vocab: dict[str, int] = {}
    ids: list[int] = []
    lens = np.zeros(n, dtype=np.int64)
    for i, t in enumerate(texts):
        w = R.words(t)
        lens[i] = len(w)
        for x in w:
            if x not in vocab:
                vocab[x] = len(vocab) + 1
        ids.extend(map(vocab.__getitem__, w))
    empty = lens == 0
    wid = np.asarray(ids, dtype=np.uint64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    nsh = np.where(lens >= k, lens - k + 1, 1)
    nsh[empty] = 1
    off = np.concatenate(([0], np.cumsum(nsh)[:-1])).astype(np.int64)
    rec_of = np.repeat(np.arange(n), nsh)
    pos = np.arange(int(nsh.sum())) - np.repeat(off, nsh) + np.repeat(starts, nsh)
    mult = (np.uint64(0x9E3779B1), np.uint64(0x85EBCA77), np.uint64(0xC2B2AE3D))
    x = np.zeros(len(pos), dtype=np.uint64)
    for d in range(k):
        p_d = pos + d
        inside = p_d < np.repeat(starts + lens, nsh)
        v = np.where(inside, wid[np.minimum(p_d, max(len(wid) - 1, 0))] if len(wid) else 0, 0).astype(np.uint64)
        x = (x * mult[d % 3] + v + np.uint64(d + 1)) & np.uint64(0xFFFFFFFF)
    x[empty[rec_of]] = (np.uint64(0xFFFFFFFF) - rec_of[empty[rec_of]].astype(np.uint64)) & np.uint64(0xFFFFFFFF)

    rng = np.random.default_rng(seed + 7919)
    perm = mh["num_perm"]
    # Multiply-shift hashing (a odd): (a*x + b) mod 2**64, top 32 bits; one independent hash per permutation.
    a = rng.integers(0, 2**63 - 1, size=perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63 - 1, size=perm, dtype=np.uint64)
    sig = np.empty((perm, n), dtype=np.uint32)
    step = 8
    for s0 in range(0, perm, step):
        vals = ((a[s0:s0 + step, None] * x[None, :] + b[s0:s0 + step, None]) >> np.uint64(32)).astype(np.uint32)
        sig[s0:s0 + step] = np.minimum.reduceat(vals, off, axis=1)
    bands = mh["bands"]
    rows = perm // bands
    thr = mh["jaccard"]
    # Candidates: records that share all rows of some band. Within a bucket each record is compared with
    # the (up to 16) records before it, so a huge bucket (a collapsed set) stays cheap.
    ii, jj = [], []
    for bi in range(bands):
        block = np.ascontiguousarray(sig[bi * rows:(bi + 1) * rows].T)
        keys = block.view(np.dtype((np.void, block.dtype.itemsize * rows))).ravel()
        _, inv = np.unique(keys, return_inverse=True)
        order = np.argsort(inv, kind="stable")
        sinv = inv[order]
        first = np.r_[True, sinv[1:] != sinv[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
        pos = np.arange(n) - start
        for d in range(1, 17):
            ok = pos >= d
            if not ok.any():
                break
            ii.append(order[np.flatnonzero(ok) - d])
            jj.append(order[ok])
    match: list[int | None] = [None] * n
    if not ii:
        return match, 0
    i_all = np.concatenate(ii)
    j_all = np.concatenate(jj)
    lo, hi = np.minimum(i_all, j_all), np.maximum(i_all, j_all)
    # Sort and drop repeats (np.unique's hash path is ~100x slower than a sort on millions of int64).
    pair = np.sort(lo.astype(np.int64) * n + hi)
    pair = pair[np.r_[True, pair[1:] != pair[:-1]]]
    lo, hi = pair // n, pair % n
    keep = ~(empty[lo] | empty[hi])
    lo, hi = lo[keep], hi[keep]
    sim = np.empty(len(lo))
    for c0 in range(0, len(lo), 65536):
        sim[c0:c0 + 65536] = (sig[:, lo[c0:c0 + 65536]] == sig[:, hi[c0:c0 + 65536]]).mean(axis=0)
    # The estimate only shortlists; the exact Jaccard of the shingle sets decides, so estimation noise on
    # thousands of pairs cannot invent near copies.
    cand = np.flatnonzero(sim >= thr - 0.2)
    hit = np.zeros(len(lo), dtype=bool)
    if len(cand):
        # Exact Jaccard of each shortlisted pair, all pairs at once: each record's distinct shingles (sorted),
        # both sides of a pair tagged with the pair's number; a shingle in both sides shows up twice in a row.
        uniq = np.lexsort((x, rec_of))
        xs, rs = x[uniq], rec_of[uniq]
        first = np.r_[True, (xs[1:] != xs[:-1]) | (rs[1:] != rs[:-1])]
        xs, rs = xs[first], rs[first]
        size = np.bincount(rs, minlength=n)
        begin = np.concatenate(([0], np.cumsum(size)[:-1]))
        for c0 in range(0, len(cand), 50_000):
            cc = cand[c0:c0 + 50_000]
            a_rec, b_rec = lo[cc], hi[cc]
            both = np.concatenate((a_rec, b_rec))
            cnt = size[both]
            tag = np.repeat(np.arange(len(both)) % len(cc), cnt).astype(np.uint64)
            at = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(begin[both], cnt)
            key = np.sort((tag << np.uint64(32)) | xs[at])
            dup = np.flatnonzero(key[1:] == key[:-1])
            inter = np.bincount((key[dup] >> np.uint64(32)).astype(np.int64), minlength=len(cc))
            union = size[a_rec] + size[b_rec] - inter
            hit[cc] = inter >= thr * union
    best = np.full(n, n, dtype=np.int64)
    np.minimum.at(best, hi[hit], lo[hit])
    for j in np.flatnonzero(best < n):
        match[int(j)] = int(best[j])
    return match, int(len(lo))


def collapse_metrics(trained: list[str], near_share: float, table: dict, seed: int) -> dict:
    """The collapse guard's readings over the trained text of each record (see the skill's collapse table)."""
    import random

    tw = [R.words(t) for t in trained]
    order = list(range(len(tw)))
    random.Random(f"collapse:{seed}").shuffle(order)
    uni, bi = [], []
    budget = table["sample_words"]
    for i in order:
        w = tw[i]
        if not w:
            continue
        take = w[:budget - len(uni)]
        uni += take
        bi += list(zip(take, take[1:]))
        if len(uni) >= budget:
            break
    lengths = [len(w) for w in tw]
    mean = statistics.fmean(lengths) if lengths else 0.0
    cv = (statistics.pstdev(lengths) / mean) if mean > 0 else 0.0
    k = table["opening_words"]
    opening = [" ".join(w[:k]) if w else None for w in tw]
    counts = Counter(o for o in opening if o is not None)
    top, top_n = (counts.most_common(1)[0] if counts else ("", 0))
    return {
        "distinct-1": round(len(set(uni)) / len(uni), 4) if uni else 0.0,
        "distinct-2": round(len(set(bi)) / len(bi), 4) if bi else 0.0,
        "near-duplicate-share": round(near_share, 4),
        "length-cv": round(cv, 4),
        "top-opening-share": round(top_n / max(sum(counts.values()), 1), 4),
        "_top_opening": top,
        "_top_records": [i for i, o in enumerate(opening) if top and o == top][:5],
        "_sample_words": len(uni),
        "_mean_words": round(mean, 2),
    }


def shared_phrase(texts: list[str], seed: int = 0, max_n: int = 12, sample: int = 1000, head: int = 64) -> tuple[str, float]:
    """(phrase as written, share of texts holding it): the longest word n-gram that nearly as many texts hold as hold
    the most shared word pair. Counted on a fixed sample of texts (their first `head` words); the share is exact."""
    import random
    import re

    order = list(range(len(texts)))
    random.Random(f"phrase:{seed}").shuffle(order)
    tw = [R.words(texts[i])[:head] for i in order[:sample]]
    best: dict[int, tuple[tuple, int]] = {}
    for n in range(2, max_n + 1):
        df: dict[tuple, int] = {}  # insertion order = first seen, which breaks ties the same way on every run
        for w in tw:
            for g in dict.fromkeys(tuple(w[j:j + n]) for j in range(len(w) - n + 1)):
                df[g] = df.get(g, 0) + 1
        if not df:
            break
        top = max(df.values())
        best[n] = next((g, c) for g, c in df.items() if c == top)
    if not best:
        return "", 0.0
    n = max(k for k, (_, c) in best.items() if c >= 0.8 * best[2][1])
    pat = re.compile(r"(?<!\w)" + r"\W+".join(map(re.escape, best[n][0])) + r"(?!\w)", re.I)
    hits = [m for m in map(pat.search, texts) if m]
    return (hits[0].group(0) if hits else " ".join(best[n][0])), len(hits) / max(len(texts), 1)


def what_repeats(trained: list[str], values: dict, near_example: str | None, seed: int) -> dict[str, str]:
    """Per collapse metric, the words that say what repeats (the phrase, the opening, a near-copy pair, the length)."""
    phrase, share = shared_phrase(trained, seed)
    said = f"{share:.0%} of answers share the phrase {phrase!r}" if phrase else "the answers share no phrase"
    sd = values["length-cv"] * values["_mean_words"]
    return {
        "distinct-1": said, "distinct-2": said,
        "near-duplicate-share": f"{values['near-duplicate-share']:.0%} of records are near copies of an earlier one"
        + (f" (e.g. {near_example})" if near_example else ""),
        "length-cv": f"answers run {values['_mean_words']:.0f} ± {sd:.1f} words",
        "top-opening-share": f"{values['top-opening-share']:.0%} of answers open with {values['_top_opening']!r} (e.g. {values.get('_top_where')})",
    }


UNSTATED = ("neither the brief nor the data says where the records came from, so the guard treats them as {}: if people wrote "
            "or chose them on purpose, add `provenance: curated` to the brief's ## Dataset Expectation")


def judge_collapse(values: dict, table: dict, n_records: int, sink: R.Sink, provenance: str = "synthetic",
                   repeats: dict[str, str] | None = None, stated: bool = True) -> dict:
    """Verdict per metric. A fail bound breached by curated data (the collapse table's provenance rules) is reported
    as a warning; every message names what repeats. stated: whether the brief or the data gave the provenance."""
    verdicts = {}
    gated = n_records < table["min_records"]
    rule = table["provenance"][provenance]
    for name, bounds in table["metrics"].items():
        v = values[name]
        verdict = "ok"
        msg = None
        if bounds.get("fail_below") is not None and v < bounds["fail_below"]:
            verdict, msg = "fail", f"{name} {v} is below {bounds['fail_below']}"
        elif bounds.get("fail_above") is not None and v > bounds["fail_above"]:
            verdict, msg = "fail", f"{name} {v} is above {bounds['fail_above']}"
        elif bounds.get("warn_below") is not None and v < bounds["warn_below"]:
            verdict, msg = "warn", f"{name} {v} is below {bounds['warn_below']}"
        elif bounds.get("warn_above") is not None and v > bounds["warn_above"]:
            verdict, msg = "warn", f"{name} {v} is above {bounds['warn_above']}"
        elif all(bounds.get(k) is None for k in ("fail_below", "fail_above", "warn_below", "warn_above")):
            verdict = "info"
        if msg and repeats and repeats.get(name):
            msg += f": {repeats[name]}"
        elif name == "top-opening-share" and msg:
            msg += f" (most common opening: {values['_top_opening']!r}, e.g. {values.get('_top_where')})"
        if verdict == "fail" and gated:
            verdict = "warn"
            msg += f"; not failing: fewer than {table['min_records']} records"
        elif verdict == "fail" and rule["on_fail"] == "warning":
            verdict = "warn"
            msg += f"; reported, not failing: the data is {provenance}"
        elif verdict == "fail" and not stated:
            msg += "; " + UNSTATED.format(provenance)
        verdicts[name] = verdict
        if verdict == "fail":
            sink.error(f"collapse-{name}", f"collapse guard: {msg}", field="trained text")
        elif verdict == "warn":
            sink.warn(f"collapse-{name}", f"collapse guard: {msg}", field="trained text")
    return verdicts


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

    def trained_within(parts) -> bool:
        return all(any(x != -100 for x in lab[:seq_len]) for _, _, lab in parts)

    for i in over_idx:
        parts = seqs[i]
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
        # truncate
        what, in_answer = "", False
        if fmt in ("preference", "kto", "prompt-completion"):
            plen = _prompt_len(parts)
            alen = max(len(ids) - plen for _, ids, _ in parts)
            src, _ = infer_seqlen(plen, alen, seq_len)
            if plen > src:
                new = cut_prompt(tp, records[i], src)
                new_parts = tp.sequences(new)
                if not trained_within(new_parts):
                    drop(i, f"the prompt ({plen} tokens) cannot be cut below {_prompt_len(new_parts)} without losing its last turn, "
                            f"which leaves no answer token within {seq_len}")
                    sink.warn("too-long", f"dropped: {out['dropped'][-1]['why']}", **_where(origins, i), field="prompt")
                    continue
                records[i] = new
                seqs[i] = parts = new_parts
                what = f"prompt cut from {plen} to {_prompt_len(parts)} tokens (its start dropped); "
            after = max(len(p[1]) for p in parts)
            if after > seq_len:
                what += f"answer cut at {seq_len - _prompt_len(parts)} of its {alen} tokens by the trainer"
                in_answer = True
        else:
            lost = sum(1 for _, _, lab in parts for x in lab[seq_len:] if x != -100)
            what = f"cut at {seq_len} tokens by the trainer, {rec_len[i] - seq_len} tokens lost" + (
                f", {lost} of them trained (the cut falls inside an assistant turn)" if lost else ", none of them trained")
            in_answer = bool(lost)
        if not trained_within(parts):
            drop(i, f"no trained token left within max_seq_length {seq_len}")
            sink.warn("too-long", f"dropped: {out['dropped'][-1]['why']}", **_where(origins, i), field=field)
            continue
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
    tables = P["tables"]
    formats, validation, collapse = tables["formats"], tables["validation"], tables["collapse"]
    per_code = validation["listed_per_code"]
    method, seq_len = P["method"], int(P["max_seq_length"])
    seed = int(P.get("seed", 0))
    roots = [Path(r) for r in P.get("allowed_roots") or []]

    def path_ok(p: Path) -> bool:
        return not roots or any(p == r or p.is_relative_to(r) for r in roots)

    _progress(0, "reading the source")
    raw, sink = load_rows(P["source"], per_code)
    _progress(1, f"validating {len(raw.rows)} records")
    checked = R.check_records(raw, sink, method=method, formats=formats, validation=validation, path_ok=path_ok,
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
    if sink.errors:
        return {"ok": False, "stage": "validation", **base, **sink.to_dict()}
    records, origins, fmt = checked.records, checked.origins, checked.format

    # Templating starts now (in forked workers for a large set) and overlaps the near-duplicate pass below.
    tp = Templater(P["model_path"], fmt, method, P.get("system_prompt"))
    templating = _Templating(tp, records)
    closers.append(templating.close)

    # Near duplicates first: each cluster goes to one split, so eval never scores a near copy of train.
    _progress(2, "checking near duplicates and the collapse guard")
    texts = [R.full_text(r, fmt) for r in records]
    match, _ = near_duplicates(texts, collapse["minhash"], seed)
    parent = list(range(len(records)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    n_near = 0
    near_where: list[str] = []
    for j, i in enumerate(match):
        if i is not None:
            n_near += 1
            near_where.append(_loc(origins, j))
            parent[root(j)] = root(i)
            sink.warn("near-duplicate", f"near copy of {_loc(origins, i)} (record {origins[i][2]})", **_where(origins, j), field=R.main_field(fmt))
    near_share = n_near / max(len(records), 1)
    rule = validation["share_rules"]["near-duplicate"]
    if near_share > rule["fail_above"]:
        said = f"{n_near} of {len(records)} records ({near_share:.1%}) are near copies, above the {rule['fail_above']:.0%} the skill allows ({_some(near_where)})"
        if collapse["provenance"][provenance]["on_fail"] == "warning":
            sink.warn("near-duplicate", field=R.main_field(fmt), message=f"{said}; reported, not failing: the data is {provenance}")
        else:
            sink.error("near-duplicate", field=R.main_field(fmt), message=said + ("" if prov.get("value") else "; " + UNSTATED.format(provenance)))
    trained_txt = ["\n".join(R.trained_texts(r, fmt, checked.reference_field)) for r in records]
    cvals = collapse_metrics(trained_txt, near_share, collapse, seed)
    cvals["_top_where"] = _some([_loc(origins, i) for i in cvals["_top_records"]], 5) + (
        f" and {int(cvals['top-opening-share'] * len(records)) - len(cvals['_top_records'])} more"
        if cvals["top-opening-share"] * len(records) > len(cvals["_top_records"]) else "")
    first_near = next(((j, i) for j, i in enumerate(match) if i is not None), None)
    near_example = f"{_loc(origins, first_near[0])} ≈ {_loc(origins, first_near[1])}" if first_near else None
    provisional = judge_collapse(cvals, collapse, len(records), R.Sink(), provenance)
    # Naming what repeats costs a pass over the answers; only a reading worth reporting pays for it.
    repeats = what_repeats(trained_txt, cvals, near_example, seed) if {"warn", "fail"} & set(provisional.values()) else None
    cverdicts = judge_collapse(cvals, collapse, len(records), sink, provenance, repeats, stated=bool(prov.get("value")))

    # Template each example on its own, then measure, then pack.
    _progress(3, f"applying the chat template to {len(records)} records")
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
    template_errors = sink.counts_of("chat-template") + sink.counts_of("masking")

    # Records longer than max_seq_length follow the brief's long_records policy (skill: "Long records").
    lp = apply_length_policy(tp, records, seqs, origins, fmt, seq_len, P.get("long_records") or "drop", sink)
    dropped_long = lp["dropped_set"]
    lengths, trained_counts = [], []
    for i, parts in enumerate(seqs):
        if i in dropped_long:
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
    kept_n = len(records) - len(dropped_long)
    if kept_n < validation["min_examples"] and dropped_long and not template_errors:
        q = lp["record_lengths"]
        sink.error("too-few-records", field="max_seq_length", message=(
            f"only {kept_n} of {len(records)} records fit max_seq_length {seq_len} once the {len(dropped_long)} longer ones are dropped "
            f"(long_records: {lp['policy']}); the skill asks for at least {validation['min_examples']}: set `max_seq_length: {q['p95']}` "
            f"(keeps 95%) or `max_seq_length: {q['p99']}` (keeps 99%) under ## Dataset Expectation"
            + ("" if lp["policy"] == "truncate" or fmt == "grpo" else ", or `long_records: truncate` to cut them")))

    # Split by content hash of each cluster's first record.
    keys = checked.extra.get("keys") or [R.record_key(r) for r in records]
    frac = float(P.get("eval_fraction", 0.05))
    score = [R.split_key(keys[root(i)], seed) for i in range(len(records))]
    # A dropped record is in neither split.
    live = [i not in dropped_long for i in range(len(records))]
    is_eval = [s < frac and ok for s, ok in zip(score, live)]
    need = validation["min_eval_examples"] if frac > 0 else 0
    if sum(is_eval) < need:
        for i in sorted((i for i in range(len(records)) if live[i]), key=lambda i: score[i]):
            if sum(is_eval) >= need:
                break
            r0 = root(i)
            for j in range(len(records)):
                if root(j) == r0 and live[j]:
                    is_eval[j] = True
    if any(live) and all(e for e, ok in zip(is_eval, live) if ok):
        sink.error("too-few-records", "every record landed in the eval split; lower eval_fraction")
    train_idx = [i for i in range(len(records)) if live[i] and not is_eval[i]]
    eval_idx = [i for i in range(len(records)) if is_eval[i]]

    if tp.stop_token_trained is False:
        sink.warn("stop-token", "the chat template leaves the assistant's end-of-turn token outside the loss mask; the model may not learn to stop",
                  field="chat_template")
    token_stats = {
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
    if P.get("max_seq_length_from") == "default":
        tps = token_stats["record_lengths"]
        sink.warn("max-seq-length-default", f"the brief states no max_seq_length, so the {method} recipe's default {seq_len} applies "
                  f"({P.get('max_seq_length_cite')}); 99% of the templated records fit in {tps['p99']} tokens (the longest has {tps['max']}): "
                  f"state `max_seq_length: {tps['p99']}` under ## Dataset Expectation to train at the data's own length", field="max_seq_length")
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
    result = {**base, "tokens": token_stats, "template": template,
              "collapse": {"values": {k: v for k, v in cvals.items() if not k.startswith("_")},
                           "top_opening": cvals["_top_opening"], "sample_words": cvals["_sample_words"],
                           "verdicts": cverdicts, "min_records": collapse["min_records"]},
              "near_duplicates": {"records": n_near, "share": round(near_share, 4), "clusters_in_one_split": True}}
    result["counts"].update(train=len(train_idx), eval=len(eval_idx), kept=len(train_idx) + len(eval_idx),
                            dropped_long=len(dropped_long), truncated=len(lp["truncated"]))
    result["long_records"] = {k: v for k, v in lp.items() if k != "dropped_set"}
    if sink.errors:
        stage = "templating" if template_errors else "checks"
        return {"ok": False, "stage": stage, **result, **sink.to_dict()}

    # Pack the training split exactly as SFTTrainer does, then decode from what the collator hands the model.
    dec = validation["decoded_samples"]
    packing = bool(P.get("packing")) and fmt in ("messages", "prompt-completion", "text")
    pack_info = None
    decoded: list[str] = []
    if packing:
        _progress(4, f"packing {len(train_idx)} sequences at {seq_len} tokens with TRL bfd")
        pack_info, decoded = _pack_and_decode(tp, seqs, train_idx, origins, seq_len, dec, P)
    else:
        _progress(4, "decoding templated examples (packing off)")
        decoded = _decode_unpacked(tp, seqs, train_idx, origins, records, fmt, checked.reference_field, dec)

    _progress(5, "writing the splits")
    out = Path(P["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, idx in (("train.jsonl", train_idx), ("eval.jsonl", eval_idx)):
        digests[name] = _write_jsonl(out / name, [records[i] for i in idx], origins, idx)
    if tp.masking is not None:
        # train.py renders and masks with exactly this template (and jobs/masking.py copied into it).
        (out / "chat_template.jinja").write_text(tp.masking["template"], encoding="utf-8")
        template["file"] = "chat_template.jinja"
    weighted = fmt == "messages" and any(m.get("weight") == 0 for r in records for m in r["messages"] if isinstance(m, dict))
    trainer = _trainer_settings(fmt, method, seq_len, packing, checked.reference_field, weighted)
    meta = {
        "name": P.get("name"),
        "experiment": P.get("experiment"),
        "method": method,
        "format": fmt,
        "conversion": checked.conversion,
        "conversion_report": checked.extra.get("report"),
        "provenance": base["provenance"],
        "max_seq_length_from": P.get("max_seq_length_from", "brief"),
        "source": P["source"],
        "source_files": raw.files,
        "source_sha256": R.file_digests([f for f in raw.files if Path(f).exists()]) if P["source"]["kind"] == "path" else {},
        "counts": result["counts"],
        "split": {"rule": "blake2b(seed:record) < eval_fraction; near-duplicate clusters share a split",
                  "seed": seed, "eval_fraction": frac},
        "max_seq_length": seq_len,
        "long_records": result["long_records"],
        "exact_duplicates": base["duplicates"],
        "chat_template": template,
        "trainer_settings": trainer,
        "reference_field": checked.reference_field,
        "files": digests,
        "tokens": token_stats,
        "packing": pack_info,
        "versions": _versions(),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    _progress(6, "done")
    return {"ok": True, "stage": "done", **result, "packing": pack_info, "decoded_samples": decoded,
            "trainer_settings": trainer, "files_sha256": digests, "meta": "meta.json", **sink.to_dict()}


def _trainer_settings(fmt: str, method: str, seq_len: int, packing: bool, ref: str | None, weighted: bool = False) -> dict:
    s: dict[str, Any] = {"max_length": seq_len}
    if method in ("sft-lora", "sft-qlora", "vlm-sft"):
        s.update(packing=packing, packing_strategy="bfd" if packing else None, padding_free=packing,
                 assistant_only_loss=fmt in ("messages", "vision"),
                 completion_only_loss=True if fmt == "prompt-completion" else None)
        if fmt == "text":
            s["dataset_text_field"] = "text"
    if weighted:
        # Assistant messages with "weight": 0 are context, not targets: jobs/masking.py (here, and copied into
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
        _proto.run_main(_job)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    # The result line is flushed; skip the interpreter's slow teardown of torch and friends.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
