"""Child job for triage's third divergence cause: re-decode packed samples and check boundaries and masks.

Templates the run's own training rows with the run's tokenizer, packs them with TRL's own packing
(the function training uses) and checks that every packed segment is exactly one templated sample
with its own loss mask: nothing cut, nothing merged, no mask shifted onto a neighbour.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune_mcp.common.proto import JobError, run_main

MAX_ROWS = 256


def _messages(row: dict) -> list[dict] | None:
    if isinstance(row.get("messages"), list):
        return row["messages"]
    p, c = row.get("prompt"), row.get("completion")
    if isinstance(p, list) and isinstance(c, list):
        return p + c
    if isinstance(p, str) and isinstance(c, str):
        return [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
    return None


def check(params: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.data_utils import pack_dataset

    cfg = params["config"]
    model = (cfg.get("model") or {}).get("path") or (cfg.get("model") or {}).get("name")
    data = cfg.get("data") or {}
    train = Path(data.get("dir", "")) / data.get("train", "train.jsonl")
    seq = int((cfg.get("hparams") or {}).get("max_seq_length") or 512)
    if not train.is_file():
        raise JobError(f"the run's training data is gone: {train}", kind="NotFound", where=str(train))
    tok = AutoTokenizer.from_pretrained(model)
    samples = []
    with open(train, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if len(samples) >= MAX_ROWS:
                break
            msgs = _messages(json.loads(line))
            if msgs is None:
                return {"ok": True, "why": "the dataset format is not packed for training (no conversational SFT rows)"}
            enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = list(enc["input_ids"])[:seq], list(enc["assistant_masks"])[:seq]
            samples.append((ids, mask))
    if not samples:
        raise JobError("the run's training split is empty", where=str(train))
    ds = Dataset.from_dict({"input_ids": [s[0] for s in samples], "assistant_masks": [s[1] for s in samples]})
    packed = pack_dataset(ds, seq, strategy="bfd")
    index = {}
    for ids, mask in samples:
        index.setdefault(tuple(ids), []).append(mask)
    problems, n_segments = [], 0
    for k, row in enumerate(packed):
        ids, mask, lens = row["input_ids"], row["assistant_masks"], row["seq_lengths"]
        if sum(lens) != len(ids) or len(mask) != len(ids):
            problems.append(f"packed sequence {k}: segment lengths {lens} do not add up to {len(ids)} tokens")
            continue
        pos = 0
        for n in lens:
            seg_ids, seg_mask = tuple(ids[pos:pos + n]), mask[pos:pos + n]
            pos += n
            n_segments += 1
            if seg_ids not in index:
                problems.append(f"packed sequence {k}: a segment of {n} tokens is not one whole sample: {tok.decode(seg_ids)[:80]!r}")
            elif seg_mask not in index[seg_ids]:
                problems.append(f"packed sequence {k}: a segment's loss mask differs from its sample's")
            elif not any(seg_mask):
                problems.append(f"packed sequence {k}: a segment has no trained token")
    if problems:
        return {"ok": False, "why": f"{len(problems)} problem(s) in {len(packed)} packed sequences: " + "; ".join(problems[:3])}
    return {"ok": True, "why": f"re-decoded {len(packed)} packed sequences ({n_segments} samples, seq {seq}, TRL bfd packing): "
                                "every segment is one whole sample with its own assistant-only loss mask"}


if __name__ == "__main__":
    run_main(check)
