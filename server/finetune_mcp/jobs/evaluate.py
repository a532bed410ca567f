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

Generation is batched: left padding, greedy, stopping at the model's end-of-turn ids. The generation
helpers are shared with the export job, so evaluation and the export smoke test produce their
reference outputs the same way (the goldens are one batch in both).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from finetune_mcp.jobs._proto import JobError, emit_progress, run_main

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


def generate_ids(model, tokenizer, ids: list[list[int]], max_new_tokens: int, batch_size: int = DEFAULT_BATCH,
                 on_batch=None) -> list[tuple[str, list[int], int | None]]:
    """Greedy continuations of token-id prompts, batched with left padding: (text, tokens, the end id it stopped on).

    Prompts of similar length share a batch (less padding); the order of the answers is the order asked.
    The tokens exclude the end id; a continuation cut by max_new_tokens has end None. With `on_batch`, the
    per-step logits come back too: on_batch(indices, step_logits [rows, steps, vocab]) after each batch.
    """
    import torch

    eos = stop_ids(tokenizer, model)
    pad = pad_id(tokenizer, eos)
    order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i))
    out: list[tuple[str, list[int], int | None] | None] = [None] * len(ids)
    for s in range(0, len(order), max(1, batch_size)):
        chunk = order[s:s + max(1, batch_size)]
        width = max(len(ids[i]) for i in chunk)
        x = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk], dtype=torch.long, device=model.device)
        att = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk], dtype=torch.long, device=model.device)
        with torch.inference_mode():
            gen = model.generate(input_ids=x, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 eos_token_id=eos or None, pad_token_id=pad, output_logits=on_batch is not None,
                                 return_dict_in_generate=True)
        for row, i in enumerate(chunk):
            new = gen.sequences[row, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in eos), None)
            toks = new if cut is None else new[:cut]
            out[i] = (tokenizer.decode(toks, skip_special_tokens=True), toks, None if cut is None else new[cut])
        if on_batch is not None:
            on_batch(chunk, torch.stack(gen.logits, dim=1))
    return out  # type: ignore[return-value]


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
        x, att = _right_padded([seqs[i] for i in chunk], pad, model.device)
        # Logits only where a scored token is predicted (position j predicts token j + 1): the output layer
        # and the loss skip the prompts, which are most of an eval row's tokens.
        lo0 = min(max(starts[i], 1) - 1 for i in chunk)
        hi0 = max(len(seqs[i]) - 1 for i in chunk)
        if hi0 <= lo0:
            continue
        with torch.inference_mode():
            logits = model(input_ids=x, attention_mask=att, logits_to_keep=torch.arange(lo0, hi0, device=x.device)).logits.float()
            # Flat (rows*positions, vocab): cross_entropy over a transposed (rows, vocab, positions) view is ~4x slower.
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, lo0 + 1:hi0 + 1].reshape(-1),
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


def drift_kl(model, tokenizer, prompts: list[Any], max_new_tokens: int, batch_size: int) -> dict[str, Any]:
    """Mean per-token KL(base || tuned) over the base model's own greedy continuations of the prompts.

    The base model (adapter disabled) continues each prompt greedily, and its next-token distributions come
    with the generation; the fine-tuned model then reads prompt + continuation once. At every position that
    predicts a continuation token (the end-of-turn token included, when the base stopped on it)
    KL(p_base || p_tuned) is summed over the vocabulary; the mean is over all those positions. Where the
    fine-tuned model's argmax differs from the base model's at some position, its own greedy answer would
    part from the base answer there: that is the prompt's `first_divergence`, and `changed_share` counts
    such prompts. Prompts go in groups whose step logits fit half the logits budget.
    """
    import torch

    pad = pad_id(tokenizer, stop_ids(tokenizer, model))
    vocab = vocab_size(model)
    all_ids = [prompt_ids(tokenizer, p) for p in prompts]
    group = max(1, min(batch_size, (LOGITS_BUDGET // 2) // max(1, max_new_tokens * vocab * 4)))
    items: list[dict[str, Any]] = [{"prompt": p} for p in prompts]
    kl_sum, kl_n = 0.0, 0
    spent = {"generate": 0.0, "pass": 0.0}
    for g0 in range(0, len(prompts), group):
        idx = list(range(g0, min(g0 + group, len(prompts))))
        base_steps: dict[int, Any] = {}

        def keep(rows, step_logits, idx=idx, base_steps=base_steps):
            for row, j in enumerate(rows):
                base_steps[idx[j]] = step_logits[row]

        t0 = time.perf_counter()
        with model.disable_adapter():
            gens = generate_ids(model, tokenizer, [all_ids[i] for i in idx], max_new_tokens, len(idx), on_batch=keep)
        t1 = time.perf_counter()
        spent["generate"] += t1 - t0
        seqs, starts = [], []
        for i, (text, toks, end) in zip(idx, gens):
            cont = toks + ([end] if end is not None else [])
            seqs.append(all_ids[i] + cont)
            starts.append(len(all_ids[i]))
            items[i].update(base_output=text, tokens=len(cont), kl=None, first_divergence=None)
        for chunk in batches([len(q) for q in seqs], vocab, LOGITS_BUDGET // 2):
            chunk = [c for c in chunk if len(seqs[c]) > starts[c]]
            if not chunk:
                continue
            x, att = _right_padded([seqs[c] for c in chunk], pad, model.device)
            lo0 = min(starts[c] - 1 for c in chunk)  # logits at j predict token j + 1: only the continuations' are needed
            with torch.inference_mode():
                logits = model(input_ids=x, attention_mask=att,
                               logits_to_keep=torch.arange(lo0, max(len(seqs[c]) for c in chunk) - 1, device=x.device)).logits
            for row, c in enumerate(chunk):
                i = idx[c]
                n = len(seqs[c]) - starts[c]
                t = torch.log_softmax(logits[row, starts[c] - 1 - lo0:starts[c] - 1 - lo0 + n].float(), dim=-1)
                b = torch.log_softmax(base_steps[i][:n].float(), dim=-1)
                kl = (b.exp() * (b - t)).sum(-1).clamp_min(0.0)  # clamp: float rounding just below 0
                diverge = (t.argmax(-1) != b.argmax(-1)).nonzero()
                items[i].update(kl=float(kl.mean()), first_divergence=int(diverge[0, 0]) if len(diverge) else None)
                kl_sum += float(kl.sum())
                kl_n += int(kl.numel())
            del logits
        spent["pass"] += time.perf_counter() - t1
    for it in items:
        it["changed"] = it["first_divergence"] is not None
    return {
        "kl": kl_sum / kl_n if kl_n else None,
        "kl_tokens": kl_n,
        "changed_share": sum(1 for it in items if it["changed"]) / len(items) if items else None,
        "items": items,
        "seconds": spent,
    }


def perplexity_pair(model, tokenizer, text: str, window: int, max_tokens: int) -> dict[str, Any]:
    """Perplexity of base and tuned on a text: exp(mean NLL) over non-overlapping windows of `window` tokens.

    Non-overlapping windows give each window's first tokens little context, so the figure is higher
    than a sliding-window one; both models are measured the same way, and the ratio is what is judged.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    seqs = [ids[s:s + window] for s in range(0, len(ids), window)]
    seqs = [q for q in seqs if len(q) >= 2]
    if not seqs:
        return {"base": None, "tuned": None, "ratio": None, "tokens": 0}
    pad = pad_id(tokenizer, stop_ids(tokenizer, model))
    with model.disable_adapter():
        base = nll_sums(model, seqs, [1] * len(seqs), pad)
    tuned = nll_sums(model, seqs, [1] * len(seqs), pad)
    count = sum(c for _, c in base)

    def ppl(sums):
        return math.exp(sum(s for s, _ in sums) / count)

    pb, pt = ppl(base), ppl(tuned)
    return {"base": pb, "tuned": pt, "ratio": pt / pb, "tokens": count}


# ---------------------------------------------------------------- the job


def evaluate(params: dict[str, Any]) -> dict[str, Any]:
    import torch

    from finetune_mcp import scoring

    torch.manual_seed(0)
    base_model, adapter_dir = params["base_model"], params["adapter_dir"]
    prompts = params.get("prompts") or []
    goldens = params.get("goldens") or []
    drift = params.get("drift") or []
    bs = int(params.get("batch_size") or DEFAULT_BATCH)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 3)
        clock = now

    specs = [scoring.parse_spec(it["scorer"], f"prompts[{i}].scorer") for i, it in enumerate(prompts)]
    tok = load_tokenizer(base_model)
    emit_progress(0, None, "loading base model and adapter")
    model = load_adapted(base_model, adapter_dir)
    lap("load")
    max_length = int(params.get("max_length") or getattr(tok, "model_max_length", 2048) or 2048)
    max_length = min(max_length, 8192)

    mnt = params.get("max_new_tokens")
    if not mnt:
        lens = [len(tok(a, add_special_tokens=False)["input_ids"]) for p in prompts for a in scoring.accepted(p["expected"])]
        lens += [len(tok(g["output"], add_special_tokens=False)["input_ids"]) for g in goldens if g.get("output")]
        mnt = (max(lens) if lens else 24) + 8
    dmnt = int(params.get("drift_max_new_tokens") or 32)
    total = 6

    emit_progress(1, total, f"task prompts: {len(prompts)} (fine-tuned)")
    outs = generate_batch(model, tok, [it["prompt"] for it in prompts], mnt, bs)
    lap("generate_tuned")
    emit_progress(2, total, f"task prompts: {len(prompts)} (base)")
    with model.disable_adapter():
        base_outs = generate_batch(model, tok, [it["prompt"] for it in prompts], mnt, bs)
    lap("generate_base")

    items = []
    for it, spec, (out, _), (base_out, _) in zip(prompts, specs, outs, base_outs):
        s, b = scoring.score(spec, out, it["expected"]), scoring.score(spec, base_out, it["expected"])
        change = "improved" if s.correct and not b.correct else "regressed" if b.correct and not s.correct else "unchanged"
        items.append({"prompt": it["prompt"], "expected": it["expected"], "scorer": spec.to_json(), "scorer_label": spec.label(),
                      "output": out, "base_output": base_out, "correct": s.correct, "base_correct": b.correct,
                      "score": s.value, "base_score": b.value, "answer": s.answer, "base_answer": b.answer, "change": change})

    emit_progress(3, total, f"goldens: {len(goldens)}")
    gold = []
    for g, (out, toks) in zip(goldens, generate_golden_batch(model, tok, [g["prompt"] for g in goldens], mnt)):
        rec = {"prompt": g["prompt"], "output": out, "tokens": toks}
        if g.get("output") is not None:
            rec["golden"] = g["output"]
            rec["match"] = scoring.collapse(out) == scoring.collapse(g["output"])
        gold.append(rec)

    lap("goldens")
    emit_progress(4, total, f"drift: KL on {len(drift)} general prompts, perplexity")
    kl = drift_kl(model, tok, [d["prompt"] for d in drift], dmnt, bs) if drift else {"kl": None, "kl_tokens": 0, "changed_share": None, "items": []}
    lap("drift_kl")
    if kl.get("seconds"):
        timings["drift_generate_base"] = round(kl["seconds"]["generate"], 3)
        timings["drift_kl_pass"] = round(kl["seconds"]["pass"], 3)
        timings.pop("drift_kl")
    ppl = {"base": None, "tuned": None, "ratio": None, "tokens": 0}
    if params.get("general_text"):
        ppl = perplexity_pair(model, tok, params["general_text"], int(params.get("perplexity_window") or 512),
                              int(params.get("perplexity_max_tokens") or 4096))

    lap("perplexity")
    limit = int(params.get("max_loss_rows") or 256)
    rows = read_rows(params["loss_file"], limit) if params.get("loss_file") else (params.get("loss_rows") or [])[:limit]
    pairs = [p for p in (loss_pair(r) for r in rows) if p is not None]
    emit_progress(5, total, f"eval loss on {len(pairs)} rows")
    eval_loss = mean_loss(model, tok, pairs, max_length) if pairs else None
    with model.disable_adapter():
        base_loss = mean_loss(model, tok, pairs, max_length) if pairs else None
    lap("eval_loss")
    emit_progress(total, total, "done")

    def share(xs, key):
        return sum(1 for x in xs if x[key]) / len(xs) if xs else None

    import peft
    import transformers

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
        "loss_rows": len(pairs),
        "max_new_tokens": mnt,
        "drift_max_new_tokens": dmnt,
        "batch_size": bs,
        "timings": timings,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }


if __name__ == "__main__":
    run_main(evaluate)
