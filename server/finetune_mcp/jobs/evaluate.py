"""Worker job: runs an eval suite against the base model and base + adapter, and measures eval loss and drift.

Params (JSON on stdin):
  base_model      local folder or HF id (resolved from the local cache only)
  adapter_dir     the run's adapter/ folder
  prompts         [{"prompt": text or messages, "expected": [accepted answers], "scorer": {"name", options}}]
  goldens         [{"prompt": ..., "output": text or null}]   outputs recorded (and compared when given)
  drift           [{"prompt": ...}]   general prompts: KL(base || tuned) on the base model's own greedy continuations
  general_text    text for the perplexity ratio (tuned / base); null skips it
  perplexity_window, perplexity_max_tokens   non-overlapping windows of the text, and how much of it is read
  loss_file       JSONL of eval rows (messages / prompt+completion / prompt+chosen / prompt+answer / text), or null
  loss_rows       the same rows inline (used when loss_file is null)
  max_loss_rows   cap on rows scored for loss (default 256)
  max_new_tokens  for prompts and goldens (default: longest expected answer in tokens + 8)
  drift_max_new_tokens  length of the base model's continuations of the drift prompts (default 32)
  batch_size      prompts generated together (default 64); teacher-forced passes batch by a logits memory budget

Generation is batched and greedy, stopping at the model's end-of-turn ids, with the answers of a left-padded
`model.generate` for less work (see greedy_rows). Every base-model pass runs first, with the adapter
disabled; the adapter is then merged into the weights for the fine-tuned passes. The generation helpers are
shared with the export job, so evaluation and the export smoke test produce their reference outputs the
same way (the goldens are one batch in both).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_mcp.common import scoring
from finetune_mcp.common.proto import JobError, emit_progress, run_main

DEFAULT_BATCH = 64
LOGITS_BUDGET = 256 * 1024 * 1024  # bytes of float32 logits per teacher-forced pass


# ---------------------------------------------------------------- shared with export_model


def as_messages(prompt: Any) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        return prompt
    raise JobError(f"a prompt must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}", kind="BadInput")


def prompt_ids(tokenizer, prompt: Any) -> list[int]:
    """Token ids of a prompt as the model sees it at inference: the chat template with the generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in as_messages(prompt))
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def prompt_text(tokenizer, prompt: Any) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in as_messages(prompt))


def stop_ids(tokenizer, model) -> list[int]:
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for v in (gen_eos, tokenizer.eos_token_id):
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(int(x) for x in v)
    return sorted(set(ids))


def pad_id(tokenizer, eos: list[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)


def generate_ids(model, tokenizer, ids: list[list[int]], max_new_tokens: int | list[int], batch_size: int = DEFAULT_BATCH,
                 on_batch=None, want_logits: list[bool] | None = None, fast: bool = True) -> list[tuple[str, list[int], int | None]]:
    """Greedy continuations of token-id prompts, batched: (text, tokens, the end id it stopped on).

    `max_new_tokens` is one limit or one per prompt. Prompts of similar length share a batch (less padding);
    the order of the answers is the order asked. The tokens exclude the end id; a continuation cut by its
    limit has end None. With `on_batch`, the per-step logits of the rows `want_logits` names (all, when it is
    None) come back: on_batch(indices, [a [steps, vocab] tensor or None per row]) after each batch, a row's
    steps being its tokens plus the end id when it stopped on one; a batch holds no more such rows than
    keep their logits within the logits budget.

    `greedy_rows` decodes where the model's cache allows it (every layer a plain full-attention cache);
    otherwise, or with fast=False, `model.generate` with left padding does, with the same answers.
    """
    limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(ids)
    want = [on_batch is not None and (want_logits is None or bool(want_logits[i])) for i in range(len(ids))]
    vocab = vocab_size(model) if any(want) else 0
    eos = stop_ids(tokenizer, model)
    pad = pad_id(tokenizer, eos)
    chunks: list[list[int]] = []
    held = 0
    for i in sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i)):
        cost = limits[i] * vocab * 4 if want[i] else 0
        if not chunks or len(chunks[-1]) >= max(1, batch_size) or (cost and held + cost > LOGITS_BUDGET):
            chunks.append([])
            held = 0
        chunks[-1].append(i)
        held += cost
    out: list[tuple[str, list[int], int | None] | None] = [None] * len(ids)
    for chunk in chunks:
        rows = greedy_rows(model, [ids[i] for i in chunk], [limits[i] for i in chunk], eos, pad, [want[i] for i in chunk]) if fast else None
        if rows is None:
            fast = False
            # Step logits only where wanted: generate returns them for every row of a call, so two calls.
            by_row = {}
            for keep in (True, False):
                part = [i for i in chunk if want[i] == keep]
                if part:
                    by_row.update(zip(part, _generate_plain(model, [ids[i] for i in part], [limits[i] for i in part], eos, pad, keep)))
            rows = [by_row[i] for i in chunk]
        for (toks, end, _), i in zip(rows, chunk):
            out[i] = (tokenizer.decode(toks, skip_special_tokens=True), toks, end)
        if on_batch is not None:
            on_batch(chunk, [r[2] for r in rows])
    return out  # type: ignore[return-value]


def _generate_plain(model, ids: list[list[int]], limits: list[int], eos: list[int], pad: int, keep_logits: bool):
    """`model.generate` over one batch, left-padded: [(tokens, end id or None, step logits or None)] per row."""
    import torch

    width = max(len(q) for q in ids)
    x = torch.tensor([[pad] * (width - len(q)) + q for q in ids], dtype=torch.long, device=model.device)
    att = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in ids], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        gen = model.generate(input_ids=x, attention_mask=att, max_new_tokens=max(limits), do_sample=False, num_beams=1,
                             eos_token_id=eos or None, pad_token_id=pad, output_logits=keep_logits, return_dict_in_generate=True)
    steps = torch.stack(gen.logits, dim=1) if keep_logits else None
    rows = []
    for row, limit in enumerate(limits):
        new = gen.sequences[row, width:width + limit].tolist()  # greedy: a shorter limit is a prefix of the longer run
        cut = next((k for k, t in enumerate(new) if t in eos), None)
        toks, end = (new, None) if cut is None else (new[:cut], new[cut])
        rows.append((toks, end, None if steps is None else steps[row, :len(toks) + (end is not None)].clone()))
    return rows


# ---------------------------------------------------------------- a shared prompt prefix computed once

# Chat prompts share their template's opening (a system prompt, role markers): ~24 of SmolLM2's ~37 prompt
# tokens. Computed once for a batch instead of once per row, a prefix shorter than this is not worth a pass.
MIN_SHARED_PREFIX = 8


def _core(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(_core(model).forward).parameters else "past_key_values"


def shared_prefix(seqs: list[list[int]], limit: int) -> int:
    """Length of the rows' common leading tokens, at most `limit`."""
    first, n = seqs[0], min([limit] + [len(q) for q in seqs])
    k = 0
    while k < n and all(q[k] == first[k] for q in seqs):
        k += 1
    return k


def prefix_cache(model, rows: list[list[int]], limit: int):
    """(p, cache): the rows' shared prefix of p tokens (at most `limit`; 0 when shorter than MIN_SHARED_PREFIX) run
    once and held in a key/value cache for every row, or (0, None) where this model's cache is not a plain
    full-attention one (sliding-window, hybrid or recurrent layers; prompt-learning adapters), whose rows could
    not take padding after a shared prefix or be dropped one by one."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    core = _core(model)
    peft_cfg = getattr(model, "peft_config", None)
    if getattr(core.config, "is_encoder_decoder", False) or (peft_cfg and any(getattr(c, "is_prompt_learning", False) for c in peft_cfg.values())):
        return 0, None
    cache = DynamicCache(config=core.config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return 0, None
    p = shared_prefix(rows, limit)
    if p < MIN_SHARED_PREFIX:
        return 0, cache
    with torch.inference_mode():
        model(input_ids=torch.tensor([rows[0][:p]], device=model.device), use_cache=True, logits_to_keep=1, **{_cache_kwarg(model): cache})
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return 0, None
    cache.batch_repeat_interleave(len(rows))
    return p, cache


def greedy_rows(model, ids: list[list[int]], limits: list[int], eos: list[int], pad: int, keep_logits: list[bool]):
    """Greedy decoding of one batch: [(tokens, end id or None, step logits or None)] per row, each row up to its
    own limit, or None where `prefix_cache` declines the model.

    Same answers as `model.generate(do_sample=False)` with left padding, for less work: the rows' shared prefix
    is computed once (padding goes between it and each row's own tokens; masks and position ids keep every
    token where it would be), the prompt pass computes logits for the last position only, and a row that
    stopped leaves the batch instead of decoding padding to the end.
    """
    import torch

    dev = model.device
    p, cache = prefix_cache(model, ids, min(len(q) for q in ids) - 1)  # every row keeps a token for the prompt pass
    if cache is None:
        return None
    kw = {_cache_kwarg(model): cache, "use_cache": True}
    rest = [q[p:] for q in ids]
    width = max(len(r) for r in rest)
    x = torch.tensor([[pad] * (width - len(r)) + r for r in rest], dtype=torch.long, device=dev)
    mask = torch.tensor([[1] * p + [0] * (width - len(r)) + [1] * len(r) for r in rest], dtype=torch.long, device=dev)
    pos = torch.tensor([[0] * (width - len(r)) + list(range(p, p + len(r))) for r in rest], dtype=torch.long, device=dev)
    toks: list[list[int]] = [[] for _ in ids]
    ends: list[int | None] = [None] * len(ids)
    steps: list[list] = [[] for _ in ids]
    eos_set = set(eos)
    alive = [r for r in range(len(ids)) if limits[r] > 0]
    with torch.inference_mode():
        logits = model(input_ids=x, attention_mask=mask, position_ids=pos, logits_to_keep=1, **kw).logits[:, -1, :]
        last = pos[:, -1]
        if len(alive) < len(ids):
            keep = torch.tensor(alive, dtype=torch.long, device=dev)
            cache.batch_select_indices(keep)
            logits, mask, last = logits[keep], mask[keep], last[keep]
        while alive:
            nxt = logits.argmax(-1)
            wanted = [j for j, r in enumerate(alive) if keep_logits[r]]
            if wanted:  # a copy of the wanted rows: the step's whole logits tensor is not held on to
                for r, row in zip((alive[j] for j in wanted), logits[wanted]):
                    steps[r].append(row)
            stay = []
            for j, (r, t) in enumerate(zip(alive, nxt.tolist())):
                if t in eos_set:
                    ends[r] = t
                else:
                    toks[r].append(t)
                    if len(toks[r]) < limits[r]:
                        stay.append(j)
            if not stay:
                break
            if len(stay) < len(alive):
                keep = torch.tensor(stay, dtype=torch.long, device=dev)
                cache.batch_select_indices(keep)
                alive = [alive[j] for j in stay]
                nxt, mask, last = nxt[keep], mask[keep], last[keep]
            last = last + 1
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None], **kw).logits[:, -1, :]
    return [(toks[i], ends[i], torch.stack(steps[i]) if keep_logits[i] and steps[i] else None) for i in range(len(ids))]


def generate_batch(model, tokenizer, prompts: list[Any], max_new_tokens: int, batch_size: int = DEFAULT_BATCH) -> list[tuple[str, list[int]]]:
    """Greedy answers to prompts as the model sees them at inference (chat template, generation prompt)."""
    res = generate_ids(model, tokenizer, [prompt_ids(tokenizer, p) for p in prompts], max_new_tokens, batch_size)
    return [(text, toks) for text, toks, _ in res]


def generate_golden_batch(model, tokenizer, prompts: list[Any], max_new_tokens: int) -> list[tuple[str, list[int]]]:
    """The golden prompts (3-5) as one batch: evaluation records them so and export's smoke test replays them so,
    because the padding a batch adds can move the last bits of a logit and so, rarely, a greedy token."""
    return generate_batch(model, tokenizer, prompts, max_new_tokens, max(1, len(prompts))) if prompts else []


def resolve_model(name: str) -> str:
    p = Path(name).expanduser()
    if p.is_dir():
        return str(p)
    root = Path(os.environ.get("DGX_SPARK_ROOT") or Path.home() / "dgx-spark").expanduser()
    if (root / "base-models" / name).is_dir():
        return str(root / "base-models" / name)
    return name  # an HF id: HF_HUB_OFFLINE is set by the worker, so only the local cache answers


def load_tokenizer(base_model: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_model(base_model))
    except OSError as e:
        raise JobError(f"cannot load the tokenizer of {base_model!r}: {e}", kind="NotFound", where=base_model,
                       fix="the base model must be a local folder, a base-models/ name, or an HF id already in the local cache") from None


def load_model(path: str, dtype: str = "float32"):
    """A causal LM for reference outputs: float32 (the most faithful rendering of the weights), on the GPU when there is one."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(resolve_model(path), dtype=getattr(torch, dtype) if dtype != "auto" else "auto")
    except OSError as e:
        raise JobError(f"cannot load model {path!r}: {e}", kind="NotFound", where=path,
                       fix="the base model must be a local folder, a base-models/ name, or an HF id already in the local cache") from None
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model.eval()


def load_adapted(base_model: str, adapter_dir: str, dtype: str = "float32"):
    from peft import PeftModel

    base = load_model(base_model, dtype)
    if not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise JobError("the adapter folder holds no adapter_config.json", kind="NotFound", where=adapter_dir)
    return PeftModel.from_pretrained(base, adapter_dir).eval()




# ---------------------------------------------------------------- teacher-forced passes (right padding)


def _right_padded(seqs: list[list[int]], pad: int, device):
    import torch

    width = max(len(x) for x in seqs)
    x = torch.tensor([q + [pad] * (width - len(q)) for q in seqs], dtype=torch.long, device=device)
    att = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs], dtype=torch.long, device=device)
    return x, att


def logits_at(model, rows: list[list[int]], pad: int, lo: int, hi: int):
    """Logits of right-padded `rows` at positions lo..hi-1 (position j predicts token j + 1).

    The rows' shared prefix, up to `lo`, goes through the model once for all rows, where the model's cache
    allows (see prefix_cache): on an eval set of chat rows that is most of each row's prompt.
    """
    import torch

    p, cache = prefix_cache(model, rows, lo)
    cache = cache if p else None
    x, att = _right_padded([q[p:] for q in rows], pad, model.device)
    kw = {_cache_kwarg(model): cache, "use_cache": True} if cache is not None else {"use_cache": False}
    if p:
        att = torch.cat([att.new_ones(att.shape[0], p), att], dim=1)
    with torch.inference_mode():
        return model(input_ids=x, attention_mask=att, logits_to_keep=torch.arange(lo - p, hi - p, device=x.device), **kw).logits


def vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def batches(lengths: list[int], vocab: int, budget: int = LOGITS_BUDGET) -> list[list[int]]:
    """Index batches of similar lengths (less padding), as many rows as keep one float32 logits tensor
    (rows x longest x vocabulary) within `budget` bytes: a forward pass's memory is its logits, and on a CPU
    its time is its tokens, so bigger batches would buy nothing."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    real = 0
    for i in order:
        # A row joins the batch while the logits fit and padding stays under a fifth of the batch's tokens:
        # padded positions cost as much as real ones.
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] * vocab * 4 <= budget \
                and (len(out[-1]) + 1) * lengths[out[-1][0]] * 0.8 <= real + lengths[i]:
            out[-1].append(i)
            real += lengths[i]
        else:
            out.append([i])
            real = lengths[i]
    return out


def nll_sums(model, seqs: list[list[int]], starts: list[int], pad: int) -> list[tuple[float, int]]:
    """Per sequence: (summed negative log-likelihood, count) of the tokens from index `start` on, given what precedes them.

    Right padding keeps every real token at its own position, so no position ids are needed.
    """
    import torch

    out: list[tuple[float, int]] = [(0.0, 0)] * len(seqs)
    for chunk in batches([len(q) for q in seqs], vocab_size(model)):
        # Logits only where a scored token is predicted (position j predicts token j + 1): the output layer
        # and the loss skip the prompts, which are most of an eval row's tokens.
        lo0 = min(max(starts[i], 1) - 1 for i in chunk)
        hi0 = max(len(seqs[i]) - 1 for i in chunk)
        if hi0 <= lo0:
            continue
        rows = [seqs[i] for i in chunk]
        with torch.inference_mode():
            logits = logits_at(model, rows, pad, lo0, hi0).float()
            target = torch.tensor([(q + [pad] * (hi0 + 1 - len(q)))[lo0 + 1:hi0 + 1] for q in rows], device=logits.device)
            # Flat (rows*positions, vocab): cross_entropy over a transposed (rows, vocab, positions) view is ~4x slower.
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                    reduction="none").view(len(chunk), hi0 - lo0)
        for row, i in enumerate(chunk):
            lo, hi = max(starts[i], 1) - 1, len(seqs[i]) - 1
            out[i] = (float(nll[row, lo - lo0:hi - lo0].sum()), max(hi - lo, 0))
    return out


def _assistant_text(x: Any) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        return "".join(m.get("content", "") for m in x if isinstance(m, dict) and m.get("role", "assistant") == "assistant")
    raise ValueError("completion must be text or messages")


def loss_pair(row: dict) -> tuple[Any, str] | None:
    """(prompt, completion) of an eval row in any of the prepared formats; None to skip the row."""
    if "messages" in row:
        msgs = row["messages"]
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=None)
        if last is None or last == 0:
            return None
        return msgs[:last], msgs[last].get("content", "")
    if "prompt" in row:
        if row.get("label") is False:
            return None  # an undesirable KTO completion is not what the model should say
        for key in ("completion", "chosen", "answer", "expected"):
            if key in row:
                v = row[key]
                if isinstance(v, list) and v and all(isinstance(a, str) for a in v):
                    v = v[0]  # several accepted answers: the first is the reference
                return row["prompt"], _assistant_text(v)
        return None
    if "text" in row:
        return "", row["text"]
    return None


def _loss_ids(tokenizer, prompt: Any, completion: str) -> tuple[list[int], int]:
    """Token ids of prompt + completion, and how many leading ids are prompt (not scored)."""
    if prompt == "":
        return tokenizer(completion, add_special_tokens=True)["input_ids"], 0
    p = prompt_ids(tokenizer, prompt)
    if getattr(tokenizer, "chat_template", None):
        full_text = tokenizer.apply_chat_template(as_messages(prompt) + [{"role": "assistant", "content": completion}], tokenize=False)
        full = tokenizer(full_text, add_special_tokens=False)["input_ids"]
        if full[: len(p)] == p:
            # Trailing template text after the end-of-turn marker (a newline) is not the model's answer.
            eos = tokenizer.eos_token_id
            if eos in full[len(p):]:
                full = full[: len(p) + full[len(p):].index(eos) + 1]
            return full, len(p)
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        c = c + [tokenizer.eos_token_id]
    return p + c, len(p)


def mean_loss(model, tokenizer, pairs: list[tuple[Any, str]], max_length: int) -> float | None:
    """Token-weighted mean NLL of the completions given their prompts."""
    seqs, starts = [], []
    for prompt, completion in pairs:
        ids, n_prompt = _loss_ids(tokenizer, prompt, completion)
        ids = ids[:max_length]
        if len(ids) - n_prompt >= 1 and len(ids) >= 2:
            seqs.append(ids)
            starts.append(max(n_prompt, 1))
    if not seqs:
        return None
    sums = nll_sums(model, seqs, starts, pad_id(tokenizer, stop_ids(tokenizer, model)))
    total, count = sum(s for s, _ in sums), sum(c for _, c in sums)
    return total / count if count else None


def read_rows(path: str, limit: int) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise JobError(f"eval data line {i} is not JSON: {e.msg}", kind="BadInput", where=f"{path}:{i}") from None
            if len(rows) >= limit:
                break
    return rows


# ---------------------------------------------------------------- drift: KL and perplexity


class StepStore:
    """The base model's step logits on the drift prompts, kept from the base pass for the fine-tuned pass: in
    memory up to `budget` bytes, the rest in files under a temporary folder (a big drift set on a big
    vocabulary does not have to fit in memory)."""

    def __init__(self, budget: int = 2 * LOGITS_BUDGET):
        self.budget, self.used = budget, 0
        self.mem: dict[int, Any] = {}
        self.files: dict[int, str] = {}
        self._dir = None

    def put(self, key: int, steps) -> None:
        import torch

        size = steps.numel() * steps.element_size()
        if self.used + size <= self.budget:
            self.mem[key] = steps
            self.used += size
            return
        if self._dir is None:
            import tempfile

            self._dir = tempfile.TemporaryDirectory(prefix="ftmcp-drift-")
        self.files[key] = os.path.join(self._dir.name, f"{key}.pt")
        torch.save(steps.cpu(), self.files[key])

    def get(self, key: int):
        import torch

        return self.mem[key] if key in self.mem else torch.load(self.files[key])

    def close(self) -> None:
        self.mem.clear()
        if self._dir is not None:
            self._dir.cleanup()


def drift_kl(model, tokenizer, ids: list[list[int]], gens: list[tuple[str, list[int], int | None]], base_steps: StepStore,
             prompts: list[Any]) -> dict[str, Any]:
    """Mean per-token KL(base || tuned) over the base model's own greedy continuations of the general prompts.

    The base model (adapter disabled) continued each prompt greedily in the base pass (`gens`), and its
    next-token distributions came with the generation (`base_steps`); the fine-tuned model now reads prompt +
    continuation once. At every position that predicts a continuation token (the end-of-turn token included,
    when the base stopped on it) KL(p_base || p_tuned) is summed over the vocabulary; the mean is over all those
    positions. Where the fine-tuned model's argmax differs from the base model's at some position, its own
    greedy answer would part from the base answer there: that is the prompt's `first_divergence`, and
    `changed_share` counts such prompts.
    """
    import torch

    pad = pad_id(tokenizer, stop_ids(tokenizer, model))
    items: list[dict[str, Any]] = [{"prompt": p} for p in prompts]
    kl_sum, kl_n = 0.0, 0
    seqs, starts = [], []
    for i, (text, toks, end) in enumerate(gens):
        cont = toks + ([end] if end is not None else [])
        seqs.append(ids[i] + cont)
        starts.append(len(ids[i]))
        items[i].update(base_output=text, tokens=len(cont), kl=None, first_divergence=None)
    for chunk in batches([len(q) for q in seqs], vocab_size(model), LOGITS_BUDGET // 2):
        chunk = [c for c in chunk if len(seqs[c]) > starts[c]]
        if not chunk:
            continue
        lo0 = min(starts[c] - 1 for c in chunk)  # logits at j predict token j + 1: only the continuations' are needed
        logits = logits_at(model, [seqs[c] for c in chunk], pad, lo0, max(len(seqs[c]) for c in chunk) - 1)
        with torch.inference_mode():
            for row, c in enumerate(chunk):
                n = len(seqs[c]) - starts[c]
                t = torch.log_softmax(logits[row, starts[c] - 1 - lo0:starts[c] - 1 - lo0 + n].float(), dim=-1)
                b = torch.log_softmax(base_steps.get(c)[:n].float().to(t.device), dim=-1)
                kl = (b.exp() * (b - t)).sum(-1).clamp_min(0.0)  # clamp: float rounding just below 0
                diverge = (t.argmax(-1) != b.argmax(-1)).nonzero()
                items[c].update(kl=float(kl.mean()), first_divergence=int(diverge[0, 0]) if len(diverge) else None)
                kl_sum += float(kl.sum())
                kl_n += int(kl.numel())
        del logits
    for it in items:
        it["changed"] = it["first_divergence"] is not None
    return {
        "kl": kl_sum / kl_n if kl_n else None,
        "kl_tokens": kl_n,
        "changed_share": sum(1 for it in items if it["changed"]) / len(items) if items else None,
        "items": items,
    }


def text_windows(tokenizer, text: str, window: int, max_tokens: int) -> list[list[int]]:
    """Non-overlapping windows of `window` tokens over the first `max_tokens` tokens of a text, for perplexity.

    Non-overlapping windows give each window's first tokens little context, so the figure is higher than a
    sliding-window one; both models are measured the same way, and the ratio is what is judged.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    return [q for q in (ids[s:s + window] for s in range(0, len(ids), window)) if len(q) >= 2]


def perplexity(sums: list[tuple[float, int]]) -> float | None:
    count = sum(c for _, c in sums)
    return math.exp(sum(s for s, _ in sums) / count) if count else None


def merge_adapter(model) -> str | None:
    """Folds the adapter into the weights for the fine-tuned passes, which run after every base pass: the same
    model without the adapter's extra work in every layer at every decoding step. None when merged, else why not
    (the passes then run unmerged, as PEFT applies the adapter)."""
    try:
        model.merge_adapter()
    except (ValueError, TypeError, NotImplementedError, AttributeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------- the job


class _Clock:
    """Seconds per named stage, summed when a stage comes back (timings in the result)."""

    def __init__(self):
        self.timings: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(self.timings.get(name, 0.0) + now - self.t, 3)
        self.t = now


@dataclass
class _Inputs:
    """What every pass needs: the model (base + adapter), the tokenized prompts and the decoding limits."""

    tok: Any
    model: Any
    prompts: list
    goldens: list
    drift: list
    specs: list
    task_ids: list
    drift_ids: list
    windows: list
    pairs: list
    pad: int
    max_length: int
    mnt: int
    dmnt: int
    bs: int


@dataclass
class _Base:
    """The base model's answers, general-prompt continuations (their step logits kept for the KL), perplexity and loss."""

    outs: list
    drift_gens: list
    steps: "StepStore"
    ppl_nll: list
    loss: float | None


TOTAL = 6


def evaluate(params: dict[str, Any]) -> dict[str, Any]:
    """load -> base passes (adapter disabled) -> merge -> fine-tuned passes -> report."""
    import torch

    torch.manual_seed(0)
    clock = _Clock()
    emit_progress(0, None, "loading base model and adapter")
    inp = _load(params)
    clock.lap("load")
    base = _base_passes(inp, clock)
    unmerged = merge_adapter(inp.model)
    clock.lap("merge")
    items, gold = _tuned_answers(inp, base, clock)
    kl, ppl, eval_loss = _tuned_measures(inp, base, clock)
    emit_progress(TOTAL, TOTAL, "done")
    return _report(inp, items, gold, kl, ppl, eval_loss, base.loss, unmerged, clock.timings)


def _load(params: dict[str, Any]) -> _Inputs:
    base_model, adapter_dir = params["base_model"], params["adapter_dir"]
    prompts = params.get("prompts") or []
    goldens = params.get("goldens") or []
    drift = params.get("drift") or []
    specs = [scoring.parse_spec(it["scorer"], f"prompts[{i}].scorer") for i, it in enumerate(prompts)]
    tok = load_tokenizer(base_model)
    model = load_adapted(base_model, adapter_dir)
    max_length = int(params.get("max_length") or getattr(tok, "model_max_length", 2048) or 2048)
    max_length = min(max_length, 8192)

    mnt = params.get("max_new_tokens")
    if not mnt:
        lens = [len(tok(a, add_special_tokens=False)["input_ids"]) for p in prompts for a in scoring.accepted(p["expected"])]
        lens += [len(tok(g["output"], add_special_tokens=False)["input_ids"]) for g in goldens if g.get("output")]
        mnt = (max(lens) if lens else 24) + 8
    windows = text_windows(tok, params["general_text"], int(params.get("perplexity_window") or 512),
                           int(params.get("perplexity_max_tokens") or 4096)) if params.get("general_text") else []
    limit = int(params.get("max_loss_rows") or 256)
    rows = read_rows(params["loss_file"], limit) if params.get("loss_file") else (params.get("loss_rows") or [])[:limit]
    return _Inputs(
        tok=tok, model=model, prompts=prompts, goldens=goldens, drift=drift, specs=specs,
        task_ids=[prompt_ids(tok, it["prompt"]) for it in prompts], drift_ids=[prompt_ids(tok, d["prompt"]) for d in drift],
        windows=windows, pairs=[p for p in (loss_pair(r) for r in rows) if p is not None], pad=pad_id(tok, stop_ids(tok, model)),
        max_length=max_length, mnt=int(mnt), dmnt=int(params.get("drift_max_new_tokens") or 32),
        bs=int(params.get("batch_size") or DEFAULT_BATCH))


def _base_passes(inp: _Inputs, clock: _Clock) -> _Base:
    """Every base pass first, with the adapter disabled; then the adapter is merged for the fine-tuned passes (no
    base pass follows, so the base weights are never un-merged with rounding). The base model answers the task
    prompts and continues the general prompts in one set of batches (fewer decoding steps), keeping its step
    logits on the general prompts for the KL."""
    model, tok, n_task = inp.model, inp.tok, len(inp.task_ids)
    steps = StepStore()

    def keep(rows, step_logits):
        for j, t in zip(rows, step_logits):
            if t is not None:
                steps.put(j - n_task, t)

    emit_progress(1, TOTAL, f"base model: {len(inp.prompts)} task prompts, {len(inp.drift)} general prompts")
    with model.disable_adapter():
        gens = generate_ids(model, tok, inp.task_ids + inp.drift_ids, [inp.mnt] * n_task + [inp.dmnt] * len(inp.drift_ids), inp.bs,
                            on_batch=keep, want_logits=[False] * n_task + [True] * len(inp.drift_ids))
        clock.lap("generate_base")
        emit_progress(2, TOTAL, f"base model: perplexity, eval loss on {len(inp.pairs)} rows")
        ppl_base = nll_sums(model, inp.windows, [1] * len(inp.windows), inp.pad) if inp.windows else []
        clock.lap("perplexity")
        base_loss = mean_loss(model, tok, inp.pairs, inp.max_length) if inp.pairs else None
        clock.lap("eval_loss")
    return _Base(gens[:n_task], gens[n_task:], steps, ppl_base, base_loss)


def _tuned_answers(inp: _Inputs, base: _Base, clock: _Clock) -> tuple[list[dict], list[dict]]:
    """The fine-tuned model's answers scored beside the base model's, and its golden outputs."""
    model, tok = inp.model, inp.tok
    emit_progress(3, TOTAL, f"fine-tuned model: {len(inp.prompts)} task prompts, {len(inp.goldens)} goldens")
    outs = generate_ids(model, tok, inp.task_ids, inp.mnt, inp.bs)
    clock.lap("generate_tuned")
    items = []
    for it, spec, (out, _, _), (base_out, _, _) in zip(inp.prompts, inp.specs, outs, base.outs):
        s, b = scoring.score(spec, out, it["expected"]), scoring.score(spec, base_out, it["expected"])
        change = "improved" if s.correct and not b.correct else "regressed" if b.correct and not s.correct else "unchanged"
        items.append({"prompt": it["prompt"], "expected": it["expected"], "scorer": spec.to_json(), "scorer_label": spec.label(),
                      "output": out, "base_output": base_out, "correct": s.correct, "base_correct": b.correct,
                      "score": s.value, "base_score": b.value, "answer": s.answer, "base_answer": b.answer, "change": change})
    gold = []
    for g, (out, toks) in zip(inp.goldens, generate_golden_batch(model, tok, [g["prompt"] for g in inp.goldens], inp.mnt)):
        rec = {"prompt": g["prompt"], "output": out, "tokens": toks}
        if g.get("output") is not None:
            rec["golden"] = g["output"]
            rec["match"] = scoring.collapse(out) == scoring.collapse(g["output"])
        gold.append(rec)
    clock.lap("goldens")
    return items, gold


def _tuned_measures(inp: _Inputs, base: _Base, clock: _Clock) -> tuple[dict, dict, float | None]:
    """KL to the base model on the general prompts, the perplexity ratio and the eval loss, fine-tuned."""
    model, tok = inp.model, inp.tok
    emit_progress(4, TOTAL, f"fine-tuned model: KL on {len(inp.drift)} general prompts, perplexity")
    kl = drift_kl(model, tok, inp.drift_ids, base.drift_gens, base.steps, [d["prompt"] for d in inp.drift]) if inp.drift else \
        {"kl": None, "kl_tokens": 0, "changed_share": None, "items": []}
    base.steps.close()
    clock.lap("drift_kl_pass")
    ppl = {"base": None, "tuned": None, "ratio": None, "tokens": 0}
    if inp.windows:
        pb, pt = perplexity(base.ppl_nll), perplexity(nll_sums(model, inp.windows, [1] * len(inp.windows), inp.pad))
        ppl = {"base": pb, "tuned": pt, "ratio": pt / pb, "tokens": sum(c for _, c in base.ppl_nll)}
    clock.lap("perplexity")
    emit_progress(5, TOTAL, f"fine-tuned model: eval loss on {len(inp.pairs)} rows")
    eval_loss = mean_loss(model, tok, inp.pairs, inp.max_length) if inp.pairs else None
    clock.lap("eval_loss")
    return kl, ppl, eval_loss


def _report(inp: _Inputs, items, gold, kl, ppl, eval_loss, base_loss, unmerged, timings) -> dict[str, Any]:
    import peft
    import torch
    import transformers

    def share(xs, key):
        return sum(1 for x in xs if x[key]) / len(xs) if xs else None

    return {
        "items": items,
        "goldens": gold,
        "drift_items": kl["items"],
        "task_accuracy": share(items, "correct"),
        "base_accuracy": share(items, "base_correct"),
        "side_by_side": {k: sum(1 for it in items if it["change"] == k) for k in ("improved", "regressed", "unchanged")},
        "golden_match": share([g for g in gold if "match" in g], "match"),
        "kl": kl["kl"],
        "kl_tokens": kl["kl_tokens"],
        "changed_share": kl["changed_share"],
        "perplexity": ppl,
        "eval_loss": eval_loss if eval_loss is None or math.isfinite(eval_loss) else None,
        "base_eval_loss": base_loss,
        "loss_rows": len(inp.pairs),
        "max_new_tokens": inp.mnt,
        "drift_max_new_tokens": inp.dmnt,
        "batch_size": inp.bs,
        "adapter_merged": unmerged is None,
        **({"unmerged_because": unmerged} if unmerged else {}),
        "timings": timings,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }


if __name__ == "__main__":
    run_main(evaluate)
