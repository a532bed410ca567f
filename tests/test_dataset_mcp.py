"""prepare_dataset through a real MCP session: structured result, progress notifications, tool errors."""

from __future__ import annotations

import shutil

import anyio

from conftest import mcp_session
from finetune_mcp.common import task
from finetune_mcp.workspace import Workspace


def test_prepare_dataset_over_mcp(ws_root, tiny_model_dir):
    shutil.copytree(tiny_model_dir, ws_root / "base-models" / "finetune-mcp-tiny")
    ws = Workspace.from_env()
    brief = ws.root / "briefs" / "sft.md"
    brief.parent.mkdir()
    brief.write_text(task.sample_brief("sft-lora"))
    task.write_jsonl(task.sft_conversations(300), ws.root / "incoming" / "sft.jsonl")
    bad = ws.root / "briefs" / "bad.md"
    bad.write_text(task.sample_brief("sft-lora").replace("4 GB", "a lot"))
    notes: list[tuple] = []

    async def on_progress(done, total, message):
        notes.append((done, total, message))

    async def main():
        async with mcp_session() as s:
            ok = await s.call_tool("prepare_dataset", {"brief_path": "briefs/sft.md", "source": "incoming/sft.jsonl"},
                                   progress_callback=on_progress)
            refused = await s.call_tool("prepare_dataset", {"brief_path": str(bad), "source": "incoming/sft.jsonl"})
            return ok, refused

    ok, refused = anyio.run(main)
    assert not ok.is_error, ok.content
    sc = ok.structured_content
    assert sc["complete"] is True and sc["experiment"] == "finetune-mcp-tiny-SFT-LoRA-repeat-words"
    assert sc["counts"]["train"] + sc["counts"]["eval"] == 300
    assert all(item["ok"] for item in sc["checklist"]) and len(sc["checklist"]) == 11
    assert "dataset-curation#packing" in sc["citations"] and 5 <= len(sc["decoded_samples"]) <= 10
    assert sc["packing"]["attention"]["verified"] is True
    text = ok.content[0].text
    assert text.splitlines()[0] == sc["summary"] and "Phase 2 complete" in text
    # Progress notifications reached the client, from the server and from inside the worker child.
    messages = [m for _, _, m in notes]
    assert notes and all(t == 10.0 for _, t, _ in notes)
    assert any("applying the chat template" in (m or "") for m in messages)
    assert any("packing" in (m or "") for m in messages)
    assert refused.is_error
    assert "## Memory Budget: 'a lot' is not an amount of memory" in refused.content[0].text
