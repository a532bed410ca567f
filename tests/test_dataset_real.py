"""prepare_dataset over MCP on real public files at their real sizes (tests/fixtures/datasets/real/, SOURCES.md), with
the real SmolLM2 tokenizer, at max_seq_length 256 and 512 under the default long_records policy (drop). Each file
completes, or is refused for the reason named here; the file × method × length table is printed (pytest -s)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from conftest import link_model, mcp_session
from finetune_mcp.common import task

REAL = Path(__file__).parent / "fixtures" / "datasets" / "real"
REPO = Path(__file__).resolve().parents[1]
FILL = "fill: name=Ada, author=Example Labs"
# file, method, brief lines, {seq: the refusal expected (code, words in its message)}; absent: it completes.
CASES = [
    ("alpaca_en_demo.json", "sft-lora", (), {}),
    ("alpaca_en_demo.parquet", "sft-lora", (), {}),
    ("dpo_en_demo.json", "dpo", (), {}),
    ("kto_en_demo.json", "kto", (), {}),
    # SmolLM2's chat template writes no tool calls: training on these rows would drop the calls from every answer.
    ("glaive_toolcall_en_demo.json", "sft-lora", (), {s: ("masking", "the chat template does not render tool calls") for s in (256, 512)}),
    ("identity.json", "sft-lora", (FILL,), {}),
    ("c4_demo.jsonl", "sft-lora", (), {}),
    ("v1_sft_demo.jsonl", "sft-lora", (FILL,), {}),
    # FastChat's dummy set is a few identity answers asked many ways: the collapse guard names the phrase they share.
    ("fastchat_dummy_conversation.json", "sft-lora", (), {s: ("collapse-distinct-2", "Large Model Systems Organization") for s in (256, 512)}),
    ("gsm8k_chat_train.jsonl", "sft-lora", (), {}),
    # Orca's prompts carry a long system prompt: at 256 too few pairs fit to train on, and the error says what to set.
    ("orca_dpo_pairs_validation.jsonl", "dpo", (), {256: ("too-few-records", "`long_records: truncate`")}),
    ("orca_dpo_pairs_trl.parquet", "dpo", (), {256: ("too-few-records", "`long_records: truncate`")}),
]
# The fix each length refusal names, applied: the same file then completes with every record keeping trained tokens.
RETRY = [("orca_dpo_pairs_trl.parquet", "dpo", 256), ("dpo_en_demo.json", "dpo", 256)]


@pytest.fixture
def real_root(ws_root, smollm2_dir):
    link_model(ws_root, smollm2_dir)
    shutil.copytree(REAL, ws_root / "incoming")
    (ws_root / "briefs").mkdir()
    return ws_root


def write_brief(root: Path, name: str, method: str, seq: int, lines: tuple[str, ...]) -> str:
    text = task.sample_brief(method).replace(task.TASK_SLUG, name).replace("finetune-mcp-tiny", "SmolLM2-135M-Instruct")
    text = text.replace("packing: true", "packing: false").replace("max_seq_length: 64\n", f"max_seq_length: {seq}\n")
    text = text.replace("\n## Memory Budget", "".join(f"{ln}\n" for ln in lines) + "\n## Memory Budget")
    (root / "briefs" / f"{name}.md").write_text(text)
    return f"briefs/{name}.md"


def row(f: str, method: str, seq: int, policy: str, sc: dict, secs: float) -> dict:
    c = sc.get("counts") or {}
    tok = sc.get("tokens") or {}
    err = next((p for p in sc["problems"] if p["severity"] == "error"), None)
    return {"file": f, "method": method, "seq": seq, "policy": policy, "complete": sc["complete"], "in": c.get("read"),
            "kept": c.get("kept") if sc["complete"] else 0, "dropped": c.get("dropped_long", 0), "truncated": c.get("truncated", 0),
            "dedup": c.get("dropped_exact_duplicates", 0), "trained": tok.get("trained_tokens") if sc["complete"] else 0,
            "s": round(secs, 1), "refused": f"{err['code']}: {err['message'][:90]}" if err and not sc["complete"] else ""}


def table(rows: list[dict]) -> str:
    head = ["file", "method", "seq", "policy", "in", "kept", "dropped", "truncated", "dedup", "trained", "s", "refused"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows])


def check_complete(root: Path, sc: dict, seq: int) -> None:
    c, tok, tr = sc["counts"], sc["tokens"], sc["transformations"]
    files = [Path(sc["dataset_dir"]) / f for f in ("train.jsonl", "eval.jsonl")]
    assert sum(len(p.read_text().splitlines()) for p in files) == c["kept"] == c["train"] + c["eval"]
    assert c["kept"] + c["dropped_long"] == c["valid"] - c["dropped_exact_duplicates"]
    assert len(tr["long_records"]["dropped"]) == c["dropped_long"] and len(tr["exact_duplicates"]) == c["dropped_exact_duplicates"]
    assert all(d["tokens"] > seq for d in tr["long_records"]["dropped"])
    assert tok["tokens_per_sequence"]["max"] <= seq and tok["trained_tokens_per_sequence"]["min"] > 0 and tok["trained_tokens"] > 0
    card = (Path(sc["experiment_dir"]) / "data" / "dataset-card.md").read_text()
    assert f"- Dropped for length: {c['dropped_long']}" in card and f"- Exact duplicates removed: {c['dropped_exact_duplicates']}" in card


def test_real_public_files_complete_or_are_refused_for_a_reason(real_root):
    rows: list[dict] = []

    async def go():
        async with mcp_session() as s:
            for f, method, lines, refused in CASES:
                for seq in (256, 512):
                    name = f"{Path(f).stem.replace('_', '-')}-{Path(f).suffix[1:]}-{seq}"
                    t0 = time.monotonic()
                    r = await s.call_tool("prepare_dataset", {"brief_path": write_brief(real_root, name, method, seq, lines),
                                                              "source": f"incoming/{f}", "dataset_name": name})
                    assert not r.is_error, r.content[0].text
                    sc = r.structured_content
                    rows.append(row(f, method, seq, "drop", sc, time.monotonic() - t0))
                    if seq in refused:
                        code, words = refused[seq]
                        assert not sc["complete"] and sc["dataset_dir"] is None, (f, seq, sc["summary"])
                        assert any(p["code"] == code and p["severity"] == "error" and words in p["message"] for p in sc["problems"]), (
                            f, seq, [p for p in sc["problems"] if p["severity"] == "error"][:3])
                    else:
                        assert sc["complete"], (f, seq, [p for p in sc["problems"] if p["severity"] == "error"][:3])
                        check_complete(real_root, sc, seq)
            for f, method, seq in RETRY:
                name = f"{Path(f).stem.replace('_', '-')}-{seq}-truncate"
                t0 = time.monotonic()
                r = await s.call_tool("prepare_dataset", {"brief_path": write_brief(real_root, name, method, seq, ("long_records: truncate",)),
                                                          "source": f"incoming/{f}", "dataset_name": name})
                sc = r.structured_content
                rows.append(row(f, method, seq, "truncate", sc, time.monotonic() - t0))
                assert sc["complete"], (f, seq, [p for p in sc["problems"] if p["severity"] == "error"][:3])
                check_complete(real_root, sc, seq)
                lr = sc["transformations"]["long_records"]
                assert sc["counts"]["truncated"] == len(lr["truncated"]) > 0
                # The written prompts are the ends of the originals: a preference pair keeps its question and an answer.
                out = [json.loads(x) for p in ("train.jsonl", "eval.jsonl") for x in (Path(sc["dataset_dir"]) / p).read_text().splitlines()]
                assert all(r["prompt"][-1]["role"] == "user" and r["prompt"][-1]["content"].strip() for r in out)
            # The experiment's data/prepare.py rebuilds the cut records byte for byte (last case: dpo_en_demo, truncated).
            rebuilt = real_root / "rebuilt"
            env = {**os.environ, "DATASET_DIR": str(rebuilt), "PYTHONPATH": str(REPO / "server")}
            p = subprocess.run([sys.executable, str(Path(sc["experiment_dir"]) / "data" / "prepare.py")], env=env,
                               capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, p.stderr[-2000:]
            for f in ("train.jsonl", "eval.jsonl", "meta.json"):
                assert (rebuilt / f).read_bytes() == (Path(sc["dataset_dir"]) / f).read_bytes(), f

    t = time.monotonic()
    anyio.run(go)
    print(f"\n{table(rows)}\n({len(rows)} prepare_dataset calls over MCP on SmolLM2 in {time.monotonic() - t:.0f} s)")
