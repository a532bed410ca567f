"""prepare_dataset through a real MCP client on the datasets people already have: the public shapes converted and
recorded in the card, a bad row in each named with nothing written, a curated identity set accepted with warnings,
a collapsed synthetic set refused, lengths without a max_seq_length, hub and file sources, the brief documented."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import anyio
import pytest

from conftest import REPO, mcp_session
from finetune_mcp.common import task
from finetune_mcp.domain.brief import example_brief, parse_brief
from finetune_mcp.skills import load_skills

FIX = Path(__file__).parent / "fixtures" / "datasets"
FMT = FIX / "formats"
SPAN = re.compile(r"⟦(.*?)⟧", re.S)
QWEN = "tiny-qwen-template"


@pytest.fixture
def ws(ws_root, tiny_model_dir, monkeypatch):
    """DGX_SPARK_ROOT with the embedded model, the same model carrying TRL's shipped copy of Qwen2.5's chat template
    (it renders tools and tool calls, which the embedded ChatML template does not), and the format fixtures."""
    base = ws_root / "base-models"
    shutil.copytree(tiny_model_dir, base / "finetune-mcp-tiny")
    shutil.copytree(tiny_model_dir, base / QWEN)
    trl_dir = Path(importlib.util.find_spec("trl").origin).parent
    (base / QWEN / "chat_template.jinja").write_text((trl_dir / "chat_templates" / "qwen2_5.jinja").read_text())
    shutil.copytree(FMT, ws_root / "incoming")
    shutil.copy(FIX / "collapsed.jsonl", ws_root / "incoming" / "collapsed.jsonl")
    (ws_root / "briefs").mkdir()
    # Offline by the user's choice: nothing here may try the hub, and the error must say how to download.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(ws_root.parent / "hf"))
    return ws_root


def brief(root: Path, name: str, method: str, *, base: str = "finetune-mcp-tiny", seq: int | None = 256, lines: tuple[str, ...] = ()) -> str:
    # Each brief its own task, so each call opens its own experiment (and card).
    text = task.sample_brief(method).replace(task.TASK_SLUG, name).replace("finetune-mcp-tiny", base).replace("packing: true", "packing: false")
    text = text.replace("max_seq_length: 64\n", f"max_seq_length: {seq}\n" if seq else "")
    text = text.replace("\n## Memory Budget", "".join(f"{ln}\n" for ln in lines) + "\n## Memory Budget")
    (root / "briefs" / f"{name}.md").write_text(text)
    return f"briefs/{name}.md"


def call(s, brief_path: str, source: str, name: str):
    return s.call_tool("prepare_dataset", {"brief_path": brief_path, "source": source, "dataset_name": name})


def ok(r) -> dict:
    assert not r.is_error, r.content[0].text
    sc = r.structured_content
    assert sc["complete"] is True, (sc["summary"], [c for c in sc["checklist"] if not c["ok"]], sc["problems"][:5])
    return sc


def card_of(sc: dict) -> str:
    return (Path(sc["experiment_dir"]) / "data" / "dataset-card.md").read_text()


def rows_of(sc: dict) -> list[dict]:
    return [json.loads(x) for f in ("train.jsonl", "eval.jsonl") for x in (Path(sc["dataset_dir"]) / f).read_text().splitlines()]


def test_curated_identity_set_is_filled_and_accepted_with_warnings_and_a_collapsed_synthetic_set_is_refused(ws):
    default_seq = load_skills().table("lora-qlora-recipes", "recipes").recipes["sft-lora"].params["max_seq_length"].default
    curated = ("provenance: curated",)
    filled = ("fill: name=Ada, author=Example Labs",)

    async def main():
        async with mcp_session() as s:
            unfilled = await call(s, brief(ws, "unfilled", "sft-lora", lines=curated), "incoming/identity.json", "unfilled")
            good = await call(s, brief(ws, "identity", "sft-lora", seq=None, lines=curated + filled), "incoming/identity.json", "identity")
            unstated = await call(s, brief(ws, "unstated", "sft-lora", lines=filled), "incoming/identity.json", "unstated")
            synthetic = await call(s, brief(ws, "synthetic", "sft-lora", seq=128, lines=("provenance: synthetic",)), "incoming/collapsed.jsonl", "synthetic")
            # The data's own card speaks: a provenance key, or the hub's synthetic tag against the brief's word.
            carded = await call(s, brief(ws, "carded", "sft-lora", lines=filled), "incoming/carded/identity.json", "carded")
            tagged = await call(s, brief(ws, "tagged", "sft-lora", lines=curated + filled), "incoming/tagged/identity.json", "tagged")
            return unfilled, good, unstated, synthetic, carded, tagged

    for folder, front in (("carded", "provenance: curated"), ("tagged", "tags:\n- synthetic\n- distilabel")):
        (ws / "incoming" / folder).mkdir()
        shutil.copy(FMT / "identity.json", ws / "incoming" / folder / "identity.json")
        (ws / "incoming" / folder / "README.md").write_text(f"---\nlicense: apache-2.0\n{front}\n---\n# identity\n")
    unfilled, good, unstated, synthetic, carded, tagged = anyio.run(main)
    rows = json.loads((FMT / "identity.json").read_text())
    datasets = ws / "datasets"

    # Placeholders left in: every record named by its line, the fix named, nothing written.
    sc = unfilled.structured_content
    assert sc["complete"] is False and sc["dataset_dir"] is None and not (datasets / "unfilled").exists()
    lines = {p["line"] for p in sc["problems"] if p["code"] == "placeholder" and p["line"]}
    assert lines == {2 + 5 * i for i in range(25)}  # one record every five lines of the JSON array, the first 25 listed
    assert sc["problem_counts"]["placeholder"]["error"] == len(rows) + 2
    assert any("fill: name=<text>" in p["message"] for p in sc["problems"])

    # Filled and curated: accepted; the collapse readings become warnings that name what repeats.
    sc = ok(good)
    assert sc["provenance"] == "curated" and sc["counts"]["train"] + sc["counts"]["eval"] == len(rows)
    warns = {p["code"]: p["message"] for p in sc["problems"] if p["severity"] == "warning" and p["line"] is None}
    assert "share the phrase 'I am Ada, an AI assistant'" in warns["collapse-distinct-2"] and "the data is curated" in warns["collapse-distinct-2"]
    assert re.search(r"\d+% of answers open with 'i am ada'", warns["collapse-top-opening-share"])
    assert "collapse-near-duplicate-share" in warns and "near-duplicate" in warns
    assert all(p["severity"] == "warning" for p in sc["problems"])
    answers = [m["content"] for r in rows_of(sc) for m in r["messages"] if m["role"] == "assistant"]
    assert all("Ada" in a and "Example Labs" in a and "{{" not in a for a in answers)
    # No max_seq_length in the brief: the recipe's default, a warning with the data's p99, the lengths in the card.
    tok = sc["tokens"]["tokens_per_sequence"]
    assert sc["max_seq_length"] == default_seq and sc["tokens"]["over_share"] == 0.0
    assert f"`max_seq_length: {tok['p99']}`" in warns["max-seq-length-default"] and str(default_seq) in warns["max-seq-length-default"]
    card = card_of(sc)
    assert f"p50 {tok['p50']}, p95 {tok['p95']}, p99 {tok['p99']}, max {tok['max']}" in card and "Share over max_seq_length" in card
    assert "- Source format: alpaca (instruction, input, output, system, history), as defined by LLaMA-Factory data/README.md" in card
    assert "- Conversion alpaca-to-messages:" in card and "AlpacaDatasetConverter" in card and "history answers included" in card
    assert "- Placeholder {{name}} filled with 'Ada' (the brief's `fill:`) in 56 records" in card
    assert "- Dropped from the records' content: nothing" in card and "Provenance: curated (stated by the brief's ## Dataset Expectation)" in card

    # The same set with no word on where it came from: the hard guard, and its error says how to declare it curated.
    sc = unstated.structured_content
    assert sc["complete"] is False and not (datasets / "unstated").exists()
    errs = [p for p in sc["problems"] if p["severity"] == "error"]
    assert errs and {p["code"] for p in errs} >= {"collapse-distinct-2", "collapse-top-opening-share"}
    assert all("add `provenance: curated`" in p["message"] for p in errs if p["code"].startswith("collapse-"))

    # A generator stuck on one opening, declared synthetic: refused, nothing written.
    sc = synthetic.structured_content
    assert sc["complete"] is False and sc["provenance"] == "synthetic" and not (datasets / "synthetic").exists()
    err = next(p for p in sc["problems"] if p["code"] == "collapse-top-opening-share")
    assert err["severity"] == "error" and "open with 'sure here is'" in err["message"]
    sc = ok(carded)
    assert sc["provenance"] == "curated" and "Provenance: curated (stated by the dataset card " in card_of(sc)
    sc = tagged.structured_content
    assert sc["complete"] is False and sc["provenance"] == "synthetic"
    conflict = next(p for p in sc["problems"] if p["code"] == "provenance-conflict")
    assert "the brief's ## Dataset Expectation says curated and the dataset card" in conflict["message"] and "the stricter, synthetic, applies" in conflict["message"]
    assert sorted(p.name for p in datasets.iterdir()) == ["carded", "identity"]


def test_openai_chat_weights_and_tool_calls_on_a_template_that_renders_tools(ws):
    async def main():
        async with mcp_session() as s:
            return await call(s, brief(ws, "openai", "sft-lora", base=QWEN, seq=1024), "incoming/openai-chat.jsonl", "openai")

    sc = ok(anyio.run(main))
    meta = json.loads((Path(sc["dataset_dir"]) / "meta.json").read_text())
    assert meta["trainer_settings"]["message_weights"] is True and meta["conversion_report"]["message_weights"] == {"weight 0": 8, "weight 1": 8}
    kept = [r for r in rows_of(sc) if any(m.get("weight") == 0 for m in r["messages"])]
    assert len(kept) == 8 and all(r["messages"][2]["weight"] == 0 for r in kept)  # the weight travels with the record
    weighted = tools = 0
    for text in sc["decoded_samples"]:
        spans = SPAN.findall(text)
        if "Are you sure? Check again." in text:
            # The weight-0 answer is context; only the answer after the user's challenge carries loss.
            wrong = re.search(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>\n<\|im_start\|>user\nAre you sure", text, re.S).group(1)
            assert all(wrong not in s for s in spans) and len(spans) == 1
            weighted += 1
        if "<tool_call>" in text.split("</tools>")[-1]:
            # The call goes into the template's own tool-call format, and is trained like any assistant turn.
            assert any('<tool_call>\n{"name": "lookup_fact", "arguments": {"topic": ' in s for s in spans)
            assert "<tools>" in text and '"name": "lookup_fact"' in text
            tools += 1
    assert weighted and tools, sc["decoded_samples"]
    card = card_of(sc)
    assert "weight 0 on 8, weight 1 on 8; weight 0 messages are context, not trained" in card
    assert "left out of train.jsonl: parallel_tool_calls (7 records)" in card
    assert "tool-call arguments parsed from JSON text into objects" in card


def test_other_families_are_converted_and_the_card_says_how(ws):
    async def main():
        async with mcp_session() as s:
            return (await call(s, brief(ws, "glaive", "sft-lora", base=QWEN, seq=1024), "incoming/sharegpt-tools.json", "glaive"),
                    await call(s, brief(ws, "dpo", "dpo"), "incoming/sharegpt-preference.json", "dpo"),
                    await call(s, brief(ws, "kto", "kto"), "incoming/openai-dpo.jsonl", "kto"))

    glaive, dpo, kto = map(ok, anyio.run(main))
    card = card_of(glaive)
    assert glaive["converted_from"] == "sharegpt" and "- Conversion sharegpt-to-messages:" in card
    assert "function_call turns → assistant tool_calls (the template's tool-call format): 11 records" in card
    assert "system column → system turn: 6 records" in card and "bare function descriptions wrapped" in card
    assert any("<tools>" in t and SPAN.search(t) for t in glaive["decoded_samples"])

    assert dpo["format"] == "preference" and "- Conversion sharegpt-preference-to-preference:" in card_of(dpo)
    pairs = rows_of(dpo)
    assert len(pairs) == 22 and all(len(p["chosen"]) == 1 and p["chosen"][0]["role"] == "assistant" for p in pairs)
    assert sum(p["prompt"][0]["role"] == "system" for p in pairs) == 6

    card = card_of(kto)
    assert kto["conversion"]["steps"] == ["openai-preference-to-preference", "preference-to-kto"]
    assert "as defined by OpenAI direct preference optimization fine-tuning format" in card
    assert "left out of train.jsonl: input.parallel_tool_calls (22 records)" in card
    assert kto["counts"]["kept"] == 44 and sorted({r["label"] for r in rows_of(kto)}) == [False, True]


def test_a_bad_row_in_each_format_is_named_and_nothing_is_written(ws):
    cases = json.loads((FMT / "bad" / "cases.json").read_text())

    async def main():
        out = []
        async with mcp_session() as s:
            for i, c in enumerate(cases):
                b = brief(ws, f"bad{i}", c["method"], lines=("rewards need none",) if c["method"] == "grpo" else ())
                if c["method"] == "grpo":  # prompt-only rows: rewards that need no reference answer
                    p = ws / b
                    p.write_text(p.read_text().replace("exact_match, format", "format"))
                out.append(await call(s, b, f"incoming/bad/{c['file']}", f"bad{i}"))
        return out

    for c, r in zip(cases, anyio.run(main)):
        assert not r.is_error, (c, r.content[0].text)
        sc = r.structured_content
        named = {(p["code"], p["line"], p["field"]) for p in sc["problems"] if p["severity"] == "error"}
        assert (c["code"], c["line"], c["field"]) in named, (c, named)
        assert sc["complete"] is False and sc["dataset_dir"] is None
        assert f"{c['file']}:{c['line']}" in sc["summary"] and "nothing written" in sc["summary"]
        assert not (Path(sc["experiment_dir"]) / "data" / "dataset-card.md").exists()
    assert not (ws / "datasets").exists() or not any((ws / "datasets").iterdir())


def test_parquet_save_to_disk_and_hub_sources(ws):
    import datasets
    from datasets.packaged_modules.json.json import Json

    alpaca = json.loads((FMT / "alpaca.json").read_text())
    flat = [{k: r.get(k, "") for k in ("instruction", "input", "output")} for r in alpaca]
    datasets.Dataset.from_list(flat).to_parquet(str(ws / "incoming" / "alpaca.parquet"))
    kto = json.loads((FMT / "kto-messages.json").read_text())
    datasets.DatasetDict({"train": datasets.Dataset.from_list(kto), "test": datasets.Dataset.from_list(kto[:4])}).save_to_disk(str(ws / "incoming" / "kto-saved"))
    # A hub dataset with a config, as datasets.load_dataset leaves it in the cache: the build of datasets' own JSON
    # builder, at the path a hub load uses (HF_DATASETS_CACHE/<org>___<name>/<config>/<version>/<hash>).
    hf = Path(ws.parent / "hf")
    pairs = (FMT / "trl-preference-standard.jsonl").read_text().splitlines(keepends=True)
    (ws / "test-split.jsonl").write_text("".join(pairs[:18]))
    b = Json(cache_dir=str(hf / "datasets"), dataset_name="formats", config_name="pairs", hash="0123abcd",
             data_files={"train": str(FMT / "trl-preference-standard.jsonl"), "test": str(ws / "test-split.jsonl")})
    b.download_and_prepare()
    built = Path(b.cache_dir)
    (hf / "datasets" / "acme___formats" / "pairs").mkdir(parents=True)
    shutil.move(str(built.parent), str(hf / "datasets" / "acme___formats" / "pairs" / built.parent.name))

    async def main():
        async with mcp_session() as s:
            return (await call(s, brief(ws, "pq", "sft-lora"), "incoming/alpaca.parquet", "pq"),
                    await call(s, brief(ws, "std", "kto"), "incoming/kto-saved", "std"),
                    await call(s, brief(ws, "hub", "dpo"), "acme/formats:pairs:test", "hub"),
                    await call(s, brief(ws, "miss", "dpo"), "acme/missing:cfg:train", "miss"))

    pq, std, hub, miss = anyio.run(main)
    pq, std, hub = ok(pq), ok(std), ok(hub)
    assert pq["converted_from"] == "alpaca" and pq["counts"]["read"] == 22
    assert std["conversion"]["steps"] == ["messages-label-to-kto"] and std["counts"]["read"] == 22  # the train split only
    assert hub["counts"]["read"] == 18 and hub["format"] == "preference"  # the test split, not train's 22
    assert "(HF dataset acme/formats, config pairs, split test, loaded by datasets.load_dataset)" in card_of(hub)
    assert miss.is_error
    text = miss.content[0].text
    assert "'acme/missing' (config 'cfg') is not in the local HF cache" in text
    assert """python -c "import datasets; datasets.load_dataset('acme/missing', 'cfg', split='train')\"""" in text


def test_the_brief_is_documented_over_mcp(ws):
    async def main():
        async with mcp_session() as s:
            res = await s.read_resource("brief://example")
            pref = await s.get_prompt("draft_brief", {"goal": "prefer short factual answers", "base_model": "finetune-mcp-tiny",
                                                      "data_file": "incoming/sharegpt-preference.json"})
            ident = await s.get_prompt("draft_brief", {"goal": "know its own name", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                       "data_file": "incoming/identity.json"})
            return res, pref, ident

    res, pref, ident = anyio.run(main)
    assert res.contents[0].text == example_brief() and example_brief() in (REPO / "README.md").read_text()
    for prompt, method, examples in ((pref, "dpo", 22), (ident, "sft-lora", 56)):
        text = prompt.messages[0].content.text
        draft = text.split("````markdown\n")[1].split("````")[0]
        b = parse_brief(draft, "draft.md")  # the draft is a valid brief as it stands
        assert b.method == method and b.examples == examples and b.base_model in text
        assert "brief://example" in text and example_brief() in text
    assert "fill: author=..., name=..." in ident.messages[0].content.text
