"""Worker job: runs an eval suite against base model and base + adapter (greedy), and measures eval loss.

Params (JSON on stdin):
  base_model      local folder or HF id (resolved from the local cache only)
  adapter_dir     the run's adapter/ folder
  prompts         [{"prompt": text or messages, "expected": text}]     task accuracy
  goldens         [{"prompt": ..., "output": text or null}]             outputs recorded (and compared when given)
  drift           [{"prompt": ...}]                                     base vs adapted outputs
  loss_file       JSONL of eval rows (messages / prompt+completion / prompt+chosen / prompt+answer / text), or null
  loss_rows       the same rows inline (used when loss_file is null)
  max_loss_rows   cap on rows scored for loss (default 256)
  max_new_tokens  for prompts and goldens (default: longest expected answer in tokens + 8)
  drift_max_new_tokens  (default 32)
  match           "exact" (whole output, whitespace-normalised) or "first_line"

Generation helpers here are shared with the export job, so evaluation and the export smoke test
produce their reference outputs the same way.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from finetune_mcp.jobs._proto import JobError, emit_progress, run_main


# ---------------------------------------------------------------- shared with export_model


def normalise(text: str) -> str:
    return " ".join(text.split())


def first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return normalise(line)
    return ""


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


def greedy(model, tokenizer, ids: list[int], max_new_tokens: int) -> tuple[str, list[int]]:
    """Greedy decoding of one prompt, unbatched so that no padding can change the numbers."""
    import torch

    x = torch.tensor([ids], dtype=torch.long, device=model.device)
    eos = stop_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=eos or None,
            pad_token_id=pad,
        )
    new = out[0, len(ids):].tolist()
    if eos and new and new[-1] in eos:
        new = new[:-1]
    return tokenizer.decode(new, skip_special_tokens=True), new


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


# ---------------------------------------------------------------- eval loss


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
                return row["prompt"], _assistant_text(row[key])
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
    import torch

    total, count = 0.0, 0
    for prompt, completion in pairs:
        ids, n_prompt = _loss_ids(tokenizer, prompt, completion)
        ids = ids[:max_length]
        if len(ids) - n_prompt < 1 or n_prompt < 0:
            continue
        x = torch.tensor([ids], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=x).logits[0, :-1].float()
        targets = x[0, 1:]
        nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        start = max(n_prompt - 1, 0)
        total += float(nll[start:].sum())
        count += int(nll[start:].numel())
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


# ---------------------------------------------------------------- the job


def evaluate(params: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    base_model, adapter_dir = params["base_model"], params["adapter_dir"]
    prompts = params.get("prompts") or []
    goldens = params.get("goldens") or []
    drift = params.get("drift") or []
    match = params.get("match", "exact")
    norm = first_line if match == "first_line" else normalise
    tok = load_tokenizer(base_model)
    emit_progress(0, None, "loading base model and adapter")
    model = load_adapted(base_model, adapter_dir)
    max_length = int(params.get("max_length") or getattr(tok, "model_max_length", 2048) or 2048)
    max_length = min(max_length, 8192)

    mnt = params.get("max_new_tokens")
    if not mnt:
        lens = [len(tok(str(p.get("expected", "")), add_special_tokens=False)["input_ids"]) for p in prompts]
        lens += [len(tok(g["output"], add_special_tokens=False)["input_ids"]) for g in goldens if g.get("output")]
        mnt = (max(lens) if lens else 24) + 8
    dmnt = int(params.get("drift_max_new_tokens") or 32)
    total = 2 * (len(prompts) + len(drift)) + len(goldens) + 2
    done = 0

    def tick(msg: str) -> None:
        nonlocal done
        done += 1
        if done % 5 == 0 or done == total:
            emit_progress(done, total, msg)

    items = []
    for it in prompts:
        ids = prompt_ids(tok, it["prompt"])
        out, _ = greedy(model, tok, ids, mnt)
        tick("task prompts (adapter)")
        with model.disable_adapter():
            base_out, _ = greedy(model, tok, ids, mnt)
        tick("task prompts (base)")
        exp = norm(str(it["expected"]))
        items.append({"prompt": it["prompt"], "expected": it["expected"], "output": out, "base_output": base_out,
                      "correct": norm(out) == exp, "base_correct": norm(base_out) == exp})

    gold = []
    for g in goldens:
        out, toks = greedy(model, tok, prompt_ids(tok, g["prompt"]), mnt)
        tick("goldens")
        rec = {"prompt": g["prompt"], "output": out, "tokens": toks}
        if g.get("output") is not None:
            rec["golden"] = g["output"]
            rec["match"] = norm(out) == norm(g["output"])
        gold.append(rec)

    drift_items = []
    for d in drift:
        ids = prompt_ids(tok, d["prompt"])
        out, _ = greedy(model, tok, ids, dmnt)
        tick("drift prompts (adapter)")
        with model.disable_adapter():
            base_out, _ = greedy(model, tok, ids, dmnt)
        tick("drift prompts (base)")
        drift_items.append({"prompt": d["prompt"], "output": out, "base_output": base_out, "changed": normalise(out) != normalise(base_out)})

    limit = int(params.get("max_loss_rows") or 256)
    rows = read_rows(params["loss_file"], limit) if params.get("loss_file") else (params.get("loss_rows") or [])[:limit]
    pairs = [p for p in (loss_pair(r) for r in rows) if p is not None]
    emit_progress(total - 2, total, f"eval loss on {len(pairs)} rows")
    eval_loss = mean_loss(model, tok, pairs, max_length) if pairs else None
    with model.disable_adapter():
        base_loss = mean_loss(model, tok, pairs, max_length) if pairs else None
    emit_progress(total, total, "done")

    def share(xs, key):
        return sum(1 for x in xs if x[key]) / len(xs) if xs else None

    import peft
    import transformers

    return {
        "items": items,
        "goldens": gold,
        "drift_items": drift_items,
        "task_accuracy": share(items, "correct"),
        "base_accuracy": share(items, "base_correct"),
        "golden_match": share([g for g in gold if "match" in g], "match"),
        "drift": share(drift_items, "changed"),
        "eval_loss": eval_loss if eval_loss is None or math.isfinite(eval_loss) else None,
        "base_eval_loss": base_loss,
        "loss_rows": len(pairs),
        "max_new_tokens": mnt,
        "drift_max_new_tokens": dmnt,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }


if __name__ == "__main__":
    run_main(evaluate)
