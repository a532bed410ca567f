"""Records longer than max_seq_length and exact duplicates: the brief's long_records policy, what the card and the
result say about each record removed or cut, and data/prepare.py rebuilding exactly the prepared files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATASET_FIXTURES, call_tool, context, job_params, nothing_in_datasets, source_lines, write_brief

from finetune_mcp.common import task

REPO = Path(__file__).resolve().parents[1]


def written(res) -> list[dict]:
    return [json.loads(x) for p in ("train.jsonl", "eval.jsonl") for x in (Path(res.dataset_dir) / p).read_text().splitlines()]


def card(res) -> str:
    return (Path(res.experiment_dir) / "data" / "dataset-card.md").read_text()


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_long_records_are_dropped_by_default_counted_and_rebuilt_by_prepare_py(ws, tmp_path):
    src = DATASET_FIXTURES / "too-long.jsonl"
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora", seq=64)), str(src))
    assert res.complete, res.summary
    lr = res.transformations["long_records"]
    # Lines 21-23 run far past 64 tokens (fixtures README); they, and only they, are left out.
    assert lr["policy"] == "drop" and sorted(d["where"] for d in lr["dropped"]) == [f"too-long.jsonl:{n}" for n in (21, 22, 23)]
    assert res.counts["dropped_long"] == 3 and res.counts["kept"] == res.counts["train"] + res.counts["eval"] == len(source_lines(src)) - 3
    long_rows = [source_lines(src)[n]["messages"] for n in (21, 22, 23)]
    assert not [r for r in written(res) if r["messages"] in long_rows]
    assert all(d["tokens"] > 64 for d in lr["dropped"])
    q = res.tokens["record_lengths"]
    assert res.tokens["max_seq_length_for"] == {"95%": q["p95"], "99%": q["p99"], "100%": q["max"]} and q["max"] > 64
    assert res.tokens["tokens_per_sequence"]["max"] <= 64
    summary = next(p for p in res.problems if p.code == "long-records")
    assert "3 of 23 records (13.0%) are longer than max_seq_length 64: dropped 3" in summary.message
    assert f"`max_seq_length: {q['p95']}` keeps 95%" in summary.message
    assert "3 of 23 records longer than 64 tokens dropped" in res.summary
    lengths = next(c for c in res.checklist if c.item.startswith("lengths-fit"))
    assert lengths.ok and "3 dropped, 0 truncated" in lengths.evidence and f"max_seq_length {q['p95']} keeps 95%" in lengths.evidence
    text = card(res)
    assert "- Dropped for length: 3: too-long.jsonl:21 (" in text and "too-long.jsonl:23" in text and "dropped for length 3" in text

    # data/prepare.py rebuilds the very same files.
    out = tmp_path / "rebuilt"
    env = {**os.environ, "DATASET_DIR": str(out), "PYTHONPATH": str(REPO / "server")}
    p = subprocess.run([sys.executable, str(Path(res.experiment_dir) / "data" / "prepare.py")], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    for f in ("train.jsonl", "eval.jsonl", "meta.json"):
        assert sha(out / f) == sha(Path(res.dataset_dir) / f), f
    meta = json.loads((out / "meta.json").read_text())
    assert meta["long_records"]["policy"] == "drop" and len(meta["long_records"]["dropped"]) == 3


def test_refuse_and_too_few_left(ws):
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora", seq=64, extra="long_records: refuse")), str(DATASET_FIXTURES / "too-long.jsonl"))
    assert not res.complete and nothing_in_datasets(ws)
    assert sorted(p.line for p in res.problems if p.code == "too-long" and p.severity == "error") == [21, 22, 23]

    # At 20 tokens almost nothing fits: dropping would leave too few to train on, and the error says what to set.
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora", seq=20)), str(DATASET_FIXTURES / "too-long.jsonl"))
    err = next(p for p in res.problems if p.code == "too-few-records")
    assert not res.complete and nothing_in_datasets(ws)
    assert "fit max_seq_length 20 once the" in err.message and "`long_records: truncate`" in err.message
    assert "(keeps 95%)" in err.message and err.field == "max_seq_length"


def test_truncate_cuts_conversations_in_the_trainer_and_drops_what_has_no_answer_left(ws):
    src = DATASET_FIXTURES / "no-trained-tokens.jsonl"  # line 12: the question alone fills 64 tokens
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora", seq=64, extra="long_records: truncate")), str(src))
    assert res.complete, res.summary
    lr = res.transformations["long_records"]
    assert [d["where"] for d in lr["dropped"]] == ["no-trained-tokens.jsonl:12"]
    assert "no trained token left within max_seq_length 64" in lr["dropped"][0]["why"]
    assert res.tokens["trained_tokens_per_sequence"]["min"] > 0
    assert "- Dropped for length: 1: no-trained-tokens.jsonl:12" in card(res)


def test_exact_duplicates_are_removed_with_a_warning_unless_a_synthetic_set_collapses(ws):
    src = DATASET_FIXTURES / "exact-duplicates.jsonl"  # lines 21-24 repeat lines 1-4
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora")), str(src))
    assert res.complete, res.summary
    dups = res.transformations["exact_duplicates"]
    assert [(d["where"], d["same_as"]) for d in dups] == [(f"exact-duplicates.jsonl:{20 + n}", f"exact-duplicates.jsonl:{n}") for n in (1, 2, 3, 4)]
    w = next(p for p in res.problems if p.code == "duplicates-removed")
    assert w.severity == "warning" and w.message.startswith("4 of 24 records (16.7%) are exact duplicates of an earlier record (exact-duplicates.jsonl:21")
    assert res.counts["dropped_exact_duplicates"] == 4 and len(written(res)) == 20
    assert "- Exact duplicates removed: 4: exact-duplicates.jsonl:21 (same as exact-duplicates.jsonl:1)" in card(res)
    # The same copies in a set the brief calls synthetic: the generator collapse the guard exists for.
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora", extra="provenance: synthetic")), str(src))
    err = next(p for p in res.problems if p.code == "exact-duplicate" and p.severity == "error")
    assert not res.complete and "in a synthetic set" in err.message and "provenance: curated" in err.message


# LLaMA-Factory's own cases: tests/data/processor/test_processor_utils.py, test_infer_seqlen.
@pytest.mark.parametrize("given,want", [
    ((3000, 2000, 1000), (600, 400)), ((2000, 3000, 1000), (400, 600)), ((1000, 100, 1000), (900, 100)),
    ((100, 1000, 1000), (100, 900)), ((100, 500, 1000), (100, 500)), ((500, 100, 1000), (500, 100)), ((10, 10, 1000), (10, 10)),
])
def test_prompt_and_answer_budgets_are_llama_factorys(given, want):
    from finetune_mcp.jobs.prepare_data import infer_seqlen

    assert infer_seqlen(*given) == want


def test_preference_truncation_keeps_the_prompts_end_and_a_trained_answer(tmp_path, tiny_model_dir):
    """DPO pairs with long prompts (plain text and conversational): each kept pair's prompt is the end of the original,
    its answers are as written, and both answers keep trained tokens within max_seq_length."""
    from finetune_mcp.jobs.prepare_data import Templater, infer_seqlen, prepare

    pairs = task.preference_pairs(40)
    rows = []
    for n, r in enumerate(pairs):
        words = " ".join(f"{n}x{i * 7 + n}" for i in range(60))
        question, chosen, rejected = r["prompt"][-1]["content"], r["chosen"][0]["content"], r["rejected"][0]["content"]
        if n % 2:
            rows.append({"prompt": f"Context {words}. {question}\n", "chosen": chosen, "rejected": rejected})
        else:
            rows.append({"prompt": [{"role": "user", "content": f"Context {words}. {question}"}],
                         "chosen": [{"role": "assistant", "content": chosen}], "rejected": [{"role": "assistant", "content": rejected}]})
    for name, shape in (("text", [r for r in rows if isinstance(r["prompt"], str)]), ("chat", [r for r in rows if isinstance(r["prompt"], list)])):
        task.write_jsonl(shape, tmp_path / f"{name}.jsonl")
        P = {**job_params(tmp_path, tmp_path / f"{name}.jsonl", "dpo", tiny_model_dir, seq=64), "long_records": "truncate", "out_dir": str(tmp_path / name)}
        r = prepare(P)
        assert r["ok"], [p for p in r["problems"] if p["severity"] == "error"]
        assert r["counts"]["truncated"] == len(shape) and r["counts"]["dropped_long"] == 0
        out = [json.loads(x) for f in ("train.jsonl", "eval.jsonl") for x in (tmp_path / name / f).read_text().splitlines()]
        assert len(out) == len(shape)
        tp = Templater(str(tiny_model_dir), "preference", "dpo")
        for w in out:
            orig = next(o for o in shape if o["chosen"] == w["chosen"] and o["rejected"] == w["rejected"])
            text = (lambda p: p if isinstance(p, str) else p[-1]["content"])
            assert text(orig["prompt"]).endswith(text(w["prompt"])) and len(text(w["prompt"])) < len(text(orig["prompt"]))
            seqs = tp.sequences(w)
            assert all(any(x != -100 for x in lab[:64]) for _, _, lab in seqs)
            o_seqs = tp.sequences(orig)
            plen = min(next(k for k, x in enumerate(lab) if x != -100) for _, _, lab in o_seqs)
            alen = max(len(ids) - plen for _, ids, _ in o_seqs)
            budget, _ = infer_seqlen(plen, alen, 64)
            new_plen = min(next(k for k, x in enumerate(lab) if x != -100) for _, _, lab in seqs)
            assert new_plen <= budget, (new_plen, budget)
