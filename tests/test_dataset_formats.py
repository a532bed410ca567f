"""The converters, unit by unit (stdlib, no worker): every public shape against every method, one record of each as
read and as converted, a bad row in each format named by line and field, and the rules behind the conversions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune_mcp.common import convert as C
from finetune_mcp.common import records as R
from finetune_mcp.common.proto import JobError
from finetune_mcp.skills import load_skills

FMT = Path(__file__).parent / "fixtures" / "datasets" / "formats"
METHODS = ("sft-lora", "dpo", "orpo", "simpo", "kto", "grpo", "vlm-sft")
PREF = {"dpo", "orpo", "simpo", "kto"}
# Which methods each public shape must be accepted for; every other method must be refused with a reason.
ACCEPTED = {
    "alpaca.json": {"sft-lora"}, "alpaca.csv": {"sft-lora"}, "identity.json": {"sft-lora"},
    "alpaca-preference.json": PREF, "alpaca-kto.json": {"kto"},
    "sharegpt-tools.json": {"sft-lora"}, "sharegpt-preference.json": PREF, "sharegpt-kto.json": {"kto"},
    "kto-messages.json": {"kto"}, "openai-chat.jsonl": {"sft-lora"}, "openai-dpo.jsonl": PREF,
    "content-parts.jsonl": {"sft-lora"}, "v1-dpo.jsonl": PREF, "preference-message-objects.jsonl": PREF,
    "trl-language-modeling-standard.jsonl": {"sft-lora"}, "trl-language-modeling-conversational.jsonl": {"sft-lora"},
    "trl-prompt-only-standard.jsonl": {"grpo"}, "trl-prompt-only-conversational.jsonl": {"grpo"},
    "trl-prompt-completion-standard.jsonl": {"sft-lora"}, "trl-prompt-completion-conversational.jsonl": {"sft-lora"},
    "trl-preference-standard.jsonl": PREF, "trl-preference-conversational.jsonl": PREF,
    "trl-implicit-preference-standard.jsonl": PREF, "trl-implicit-preference-conversational.jsonl": PREF,
    "trl-unpaired-preference-standard.jsonl": {"kto"}, "trl-unpaired-preference-conversational.jsonl": {"kto"},
    "trl-stepwise-supervision.jsonl": set(),
}
FILL = {"name": "Ada", "author": "Example Labs"}


@pytest.fixture(scope="module")
def tables():
    sk = load_skills()
    return {t: sk.table("dataset-curation", t).model_dump(mode="json") for t in ("formats", "validation")}


def check(path: Path, tables, method: str, **kw):
    raw, sink = R.read_text_source(path)
    return raw, R.check_records(raw, sink, method=method, formats=tables["formats"], validation=tables["validation"], **kw), sink


def test_every_public_shape_against_every_method(tables):
    files = sorted(p.name for p in FMT.iterdir() if p.suffix in (".json", ".jsonl", ".csv"))
    assert files == sorted(ACCEPTED), "a fixture without an expectation, or the reverse"
    for name in files:
        for method in METHODS:
            try:
                _, c, sink = check(FMT / name, tables, method, fill=FILL, needs_reference=False)
            except JobError as e:
                assert method not in ACCEPTED[name], f"{name} refused for {method}: {e.message}"
                # A refusal names the shape, where it is defined, why, and what to do instead.
                assert e.kind == "BadInput" and "cannot train on" in e.message and e.fix and "It expects" in e.message, (name, method)
                continue
            assert method in ACCEPTED[name], f"{name} accepted for {method}"
            assert sink.errors == 0 and len(c.records) >= 22 * (2 if method == "kto" and c.conversion and "preference-to-kto" in c.conversion else 1), (name, method, sink.listed[:3])


def test_refusals_name_the_choices(tables):
    with pytest.raises(JobError) as e:
        check(FMT / "sharegpt-preference.json", tables, "sft-lora")
    assert "sharegpt-preference shape" in e.value.message and "LLaMA-Factory data/README.md" in e.value.message
    assert "which answer to learn is a choice" in e.value.message and "train DPO, ORPO, SimPO or KTO" in e.value.fix
    with pytest.raises(JobError) as e:
        check(FMT / "kto-messages.json", tables, "dpo")
    assert "cannot be paired back" in e.value.message and "train KTO" in e.value.fix
    with pytest.raises(JobError) as e:
        check(FMT / "trl-stepwise-supervision.jsonl", tables, "sft-lora")
    assert "process reward model" in e.value.message
    with pytest.raises(JobError) as e:  # GRPO whose rewards compare with a reference answer the prompts lack
        check(FMT / "trl-prompt-only-conversational.jsonl", tables, "grpo", needs_reference=True)
    assert "rewards compare each sample with a reference answer" in e.value.message and "format" in e.value.fix


def first(path: Path, tables, method: str, index: int = 0, **kw):
    raw, c, sink = check(path, tables, method, **kw)
    assert sink.errors == 0, sink.listed[:3]
    return raw.rows[c.origins[index][2]], c.records[index], c


def test_alpaca_joins_as_llamafactory_does(tables):
    """src/llamafactory/data/converter.py AlpacaDatasetConverter: history first, then "\\n".join of the non-empty
    instruction and input as one user turn, output as the answer; system becomes a system turn."""
    rows = json.loads((FMT / "alpaca.json").read_text())
    _, c, _ = check(FMT / "alpaca.json", tables, "sft-lora")
    assert c.conversion == "alpaca-to-messages" and len(c.records) == len(rows)
    for src, rec in zip(rows, c.records):
        want = [{"role": "system", "content": src["system"]}] if src.get("system") else []
        for q, a in src.get("history") or []:
            want += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        want += [{"role": "user", "content": "\n".join(x for x in (src["instruction"], src["input"]) if x)},
                 {"role": "assistant", "content": src["output"]}]
        assert rec == {"messages": want}
    notes = c.extra["report"]["notes"]
    assert notes['instruction + "\\n" + input → one user turn'] == sum(1 for r in rows if r["input"])
    assert notes["empty or absent input skipped: the instruction alone is the user turn"] == sum(1 for r in rows if not r["input"])
    assert c.extra["report"]["left_out_columns"] == {}
    # The CSV holds the same rows without system/history: the same conversion, from a CSV line.
    _, c2, _ = check(FMT / "alpaca.csv", tables, "sft-lora")
    assert [r["messages"][-2:] for r in c2.records] == [r["messages"][-2:] for r in c.records]


def test_one_record_of_each_shape_as_read_and_as_converted(tables):
    # OpenAI chat: tool_calls arguments parsed to objects, tools kept as JSON text, weights kept, parallel_tool_calls left out.
    read, conv, c = first(FMT / "openai-chat.jsonl", tables, "sft-lora", 1)
    assert read["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"topic": "How many legs does a spider have"}'
    assert conv["messages"][2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                                  "function": {"name": "lookup_fact", "arguments": {"topic": "How many legs does a spider have"}}}]
    assert json.loads(conv["tools"]) == read["tools"] and "parallel_tool_calls" not in conv
    assert c.extra["report"]["left_out_columns"] == {"parallel_tool_calls": 7}
    _, weighted, _ = first(FMT / "openai-chat.jsonl", tables, "sft-lora", 0)
    assert [m.get("weight") for m in weighted["messages"] if m["role"] == "assistant"] == [0, 1]

    # ShareGPT with tools: function_call → assistant tool_calls, observation → tool, bare functions wrapped, system column first.
    read, conv, c = first(FMT / "sharegpt-tools.json", tables, "sft-lora", 1)
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant"] and conv["messages"][0]["content"] == read["system"]
    read, conv, c = first(FMT / "sharegpt-tools.json", tables, "sft-lora", 0)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "tool", "assistant"]
    call = json.loads(read["conversations"][1]["value"])
    assert conv["messages"][1]["tool_calls"] == [{"type": "function", "function": call}]
    assert conv["messages"][2]["content"] == read["conversations"][2]["value"]
    assert json.loads(conv["tools"]) == [{"type": "function", "function": f} for f in json.loads(read["tools"])]

    # ShareGPT preference: conversation (system turn included) → prompt, message objects → one-turn answers.
    read, conv, _ = first(FMT / "sharegpt-preference.json", tables, "dpo", 0)
    assert conv == {"prompt": [{"role": "system", "content": "Be accurate."}, {"role": "user", "content": read["conversations"][1]["value"]},
                               {"role": "assistant", "content": read["conversations"][2]["value"]}, {"role": "user", "content": read["conversations"][3]["value"]}],
                    "chosen": [{"role": "assistant", "content": read["chosen"]["value"]}], "rejected": [{"role": "assistant", "content": read["rejected"]["value"]}]}

    # KTO: messages + label (LLaMA-Factory kto_en_demo), ShareGPT + kto_tag, Alpaca + kto_tag, all to prompt/completion/label.
    for name in ("kto-messages.json", "sharegpt-kto.json", "alpaca-kto.json"):
        read, conv, _ = first(FMT / name, tables, "kto", 0)
        assert conv == {"prompt": [{"role": "user", "content": "What is the capital of France?"}],
                        "completion": [{"role": "assistant", "content": "Lyon, the largest city."}], "label": False}, name

    # OpenAI DPO for KTO: two conversions in a row, each pair two rows.
    _, c, _ = check(FMT / "openai-dpo.jsonl", tables, "kto")
    assert c.conversion == "openai-preference-to-preference → preference-to-kto" and len(c.records) == 44
    assert c.records[0]["label"] is True and c.records[1]["label"] is False and c.records[0]["prompt"] == c.records[1]["prompt"]

    # Content parts (LLaMA-Factory v1 "value" and OpenAI "text") flattened; loss_weight read as weight.
    read, conv, _ = first(FMT / "content-parts.jsonl", tables, "sft-lora", 0)
    assert conv == {"messages": [{"role": "user", "content": read["messages"][0]["content"][0]["value"]},
                                 {"role": "assistant", "content": read["messages"][1]["content"][0]["value"], "weight": 1}]}
    # v1 DPO: full conversations → implicit prompt → explicit prompt; answer weights of 1 are the default and go.
    read, conv, c = first(FMT / "v1-dpo.jsonl", tables, "dpo", 0)
    assert c.conversion == "paired-messages-to-implicit → implicit-prompt-preference"
    assert conv == {"prompt": [{"role": "user", "content": "What is the capital of France?"}],
                    "chosen": [{"role": "assistant", "content": "Paris."}], "rejected": [{"role": "assistant", "content": "Lyon, the largest city."}]}
    # A text prompt beside message objects: the objects become lists, the text a user turn.
    read, conv, _ = first(FMT / "preference-message-objects.jsonl", tables, "dpo", 0)
    assert conv == {"prompt": [{"role": "user", "content": read["prompt"]}], "chosen": [read["chosen"]], "rejected": [read["rejected"]]}
    # TRL standard language modelling: kept as text, trained whole.
    read, conv, c = first(FMT / "trl-language-modeling-standard.jsonl", tables, "sft-lora", 0)
    assert c.format == "text" and conv == read
    # TRL implicit-prompt preference, standard: the shared leading text is the prompt, the rest the answers.
    read, conv, _ = first(FMT / "trl-implicit-preference-standard.jsonl", tables, "dpo", 0)
    assert conv["prompt"] + conv["chosen"] == read["chosen"] and conv["prompt"] + conv["rejected"] == read["rejected"]


def test_a_bad_row_in_each_format_is_named_by_line_and_field(tables):
    cases = json.loads((FMT / "bad" / "cases.json").read_text())
    assert {c["file"] for c in cases} >= {n for n in ACCEPTED if n not in ("identity.json", "trl-stepwise-supervision.jsonl")} - {
        "trl-language-modeling-conversational.jsonl", "trl-preference-conversational.jsonl", "trl-implicit-preference-standard.jsonl",
        "trl-unpaired-preference-conversational.jsonl", "trl-prompt-only-standard.jsonl", "trl-prompt-completion-standard.jsonl"}
    for case in cases:
        _, c, sink = check(FMT / "bad" / case["file"], tables, case["method"], needs_reference=False)
        errors = [p for p in sink.listed if p["severity"] == "error"]
        assert (case["code"], case["line"], case["field"]) in {(p["code"], p["line"], p["field"]) for p in errors}, (case, errors)
        assert {p["line"] for p in errors} == {case["line"]}, (case, errors)  # the one bad row, nothing else
        assert all(Path(p["file"]).name == case["file"] for p in errors)


def test_placeholders_are_reported_with_their_lines_and_filled_from_the_brief(tables):
    _, c, sink = check(FMT / "identity.json", tables, "sft-lora")
    rows = json.loads((FMT / "identity.json").read_text())
    per_record = [p for p in sink.listed if p["code"] == "placeholder" and p["line"]]
    assert len(per_record) == min(len(rows), 25) and per_record[0]["field"] == "messages[1].content"
    summary = {p["message"].split(" ")[0]: p for p in sink.listed if p["code"] == "placeholder" and p["line"] is None}
    assert set(summary) == {"{{name}}", "{{author}}"} and "identity.json:2, identity.json:7" in summary["{{name}}"]["message"]
    assert "fill: name=<text>" in summary["{{name}}"]["message"] and sink.counts["placeholder"]["error"] == len(rows) + 2
    assert c.records == []

    _, c, sink = check(FMT / "identity.json", tables, "sft-lora", fill={**FILL, "team": "x"})
    assert sink.errors == 0 and len(c.records) == len(rows)
    assert all("{{" not in m["content"] for r in c.records for m in r["messages"])
    assert c.records[0]["messages"][1]["content"] == "Hello! I am Ada, an AI assistant developed by Example Labs. How can I help you today?"
    assert c.extra["report"]["filled"] == {"name": {"value": "Ada", "records": len(rows)}, "author": {"value": "Example Labs", "records": len(rows)}}
    assert [p["message"] for p in sink.listed if p["code"] == "fill-unused"] == ["the brief fills {{team}}, but no record holds it"]

    _, c, sink = check(FMT / "identity.json", tables, "sft-lora", keep_placeholders=True)
    assert sink.errors == 0 and "{{name}}" in c.records[0]["messages"][1]["content"]


def test_every_assistant_turn_weighted_0_trains_nothing(tables, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}", "weight": 0}]} for i in range(3)]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, _, sink = check(tmp_path / "w.jsonl", tables, "sft-lora")
    assert [(p["code"], p["line"], p["field"]) for p in sink.listed if p["severity"] == "error"] == [("no-trained-tokens", i, "messages") for i in (1, 2, 3)]


def test_shared_phrase_names_what_repeats():
    from finetune_mcp.jobs.collapse_guard import shared_phrase

    texts = [f"Hello! I am Ada, an AI assistant developed by Example Labs. Ask me about {t}." for t in ("cats", "maps", "tea", "rain")]
    texts += ["Something else entirely.", "Another answer here."]
    phrase, share = shared_phrase(texts)
    # The longest run of words (up to 12) nearly as many answers share as share the commonest pair, as written.
    assert phrase == "Hello! I am Ada, an AI assistant developed by Example Labs. Ask" and share == pytest.approx(4 / 6)
