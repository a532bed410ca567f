"""The training brief parser: tolerant headings and values, every problem named with its section."""

from __future__ import annotations

import pytest

from finetune_mcp.common import task
from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.domain.brief import METHODS, canonical_method, load_brief, load_experiment_brief, parse_brief
from finetune_mcp.workspace import Workspace

GOOD = """\
# Training brief: support replies

## Task
ticket-replies — answer customer tickets in two sentences.

## Base Model
Qwen/Qwen2.5-0.5B-Instruct (instruct variant)

## Chosen Method
**QLoRA** — the memory budget rules out bf16 LoRA.

## Dataset Expectation
Conversations exported from the helpdesk.

- format: conversational
- max_seq_length: 2,048
- packing: yes
- examples: ~12k
- license: CC-BY-4.0

## Memory Budget
96 GiB unified

## Deployment Target
llama.cpp gguf-q4_k_m

## Evaluation
min_accuracy: 85%
max_drift: 0.2
judge: exact match
"""


def test_parses_a_complete_brief_with_tolerant_values():
    b = parse_brief(GOOD, "brief.md")
    assert (b.task_slug, b.base_model, b.method, b.method_label) == ("ticket-replies", "Qwen/Qwen2.5-0.5B-Instruct", "sft-qlora", "SFT-QLoRA")
    assert (b.dataset_format, b.max_seq_length, b.packing, b.examples) == ("messages", 2048, True, 12000)
    assert b.dataset_expectation["license"] == "CC-BY-4.0"
    assert b.memory_budget_gb == pytest.approx(103.079, abs=0.01)
    assert (b.deploy_runtime, b.deploy_format) == ("llama.cpp", "gguf-q4_k_m")
    assert b.evaluation == {"min_accuracy": 0.85, "max_drift": 0.2, "judge": "exact match"}
    assert b.experiment == "Qwen2.5-0.5B-Instruct-SFT-QLoRA-ticket-replies"
    assert b.reward == [] and b.defaults_applied == []


def test_headings_match_whatever_their_case_spacing_and_level():
    text = (GOOD.replace("## Chosen Method", "###   chosen-METHOD:").replace("## Base Model", "##BASE MODEL")
            .replace("## Memory Budget", "## memory  budget"))
    b = parse_brief(text, "brief.md")
    assert (b.method, b.base_model, b.memory_budget_gb) == ("sft-qlora", "Qwen/Qwen2.5-0.5B-Instruct", pytest.approx(103.079, abs=0.01))


@pytest.mark.parametrize("method", METHODS)
def test_every_sample_brief_of_the_embedded_task_parses(method):
    b = parse_brief(task.sample_brief(method), "brief.md")
    assert b.method == method
    assert b.base_model == "finetune-mcp-tiny" and b.task_slug == "repeat-words"
    assert b.max_seq_length == 64
    assert (b.reward != []) == (method == "grpo")


@pytest.mark.parametrize("text,expected", [
    ("SFT-LoRA", "sft-lora"), ("lora", "sft-lora"), ("SFT with QLoRA", "sft-qlora"), ("dpo", "dpo"),
    ("Direct Preference Optimization", "dpo"), ("SimPO (CPO loss)", "simpo"), ("GRPO + RLVR", "grpo"),
    ("VLM SFT", "vlm-sft"), ("kto", "kto"), ("ORPO", "orpo"), ("PPO", None), ("DPO or KTO", None),
])
def test_method_aliases(text, expected):
    assert canonical_method(text) == expected


def test_every_problem_is_named_with_its_section_and_the_accepted_values():
    bad = """# Training brief: x
## task
## Base Model
Qwen/Qwen3-4B
## Chosen Method
PPO
## Dataset Expectation
format: tabular
packing: maybe
## Memory Budget
plenty
## Deployment Target
tensorrt
"""
    with pytest.raises(BadInput) as e:
        parse_brief(bad, "b.md")
    msg = e.value.message
    assert "## Task: section is empty" in msg
    assert "## Chosen Method: unknown method 'PPO'" in msg and "SFT-LoRA, SFT-QLoRA, DPO, ORPO, KTO, SimPO, GRPO, VLM-SFT" in msg
    assert "unknown format 'tabular'" in msg and "messages|text|prompt-completion|preference|kto|grpo|vision" in msg
    assert "max_seq_length" not in msg  # optional: prepare_dataset takes the method recipe's default
    assert "packing: 'maybe' is not true or false" in msg
    assert "## Memory Budget: 'plenty' is not an amount of memory" in msg
    assert "## Deployment Target: 'tensorrt': no known runtime named" in msg and "llama.cpp" in msg
    assert e.value.where == "b.md"


def test_missing_sections_and_contradictions_are_refused():
    with pytest.raises(BadInput) as e:
        parse_brief("# Training brief: x\n## Task\nfoo\n", "b.md")
    for section in ("Base Model", "Chosen Method", "Dataset Expectation", "Memory Budget", "Deployment Target"):
        assert f"## {section}: section missing" in e.value.message
    dpo_with_messages = task.sample_brief("dpo").replace("format: preference", "format: messages")
    with pytest.raises(BadInput, match="format 'messages' does not fit the chosen method DPO"):
        parse_brief(dpo_with_messages, "b.md")
    packed_dpo = task.sample_brief("dpo").replace("packing: false", "packing: true")
    with pytest.raises(BadInput, match="DPO does not pack"):
        parse_brief(packed_dpo, "b.md")
    grpo_no_reward = task.sample_brief("grpo").split("## Reward")[0]
    with pytest.raises(BadInput, match="## Reward: section missing"):
        parse_brief(grpo_no_reward, "b.md")
    gguf_on_vllm = task.sample_brief("sft-lora").replace("transformers (merged-16bit)", "vllm gguf-q8_0")
    with pytest.raises(BadInput, match="gguf-q8_0 is a GGUF file, which vllm does not serve"):
        parse_brief(gguf_on_vllm, "b.md")


def test_defaults_are_applied_and_reported():
    text = task.sample_brief("kto").replace("format: kto\n", "").replace("packing: false\n", "")
    b = parse_brief(text, "b.md")
    assert b.dataset_format == "kto" and b.packing is False
    assert b.defaults_applied == ["format: kto (default for KTO)", "packing: false (not stated)"]


def test_data_lines_provenance_fill_and_placeholders():
    text = task.sample_brief("sft-lora").replace("max_seq_length: 64\n", (
        "provenance: hand-written\n"
        'fill: name=Ada, author="Example Labs, Inc."\n'
        "placeholders: keep\n"
        "<!-- reward: exact_match; max_seq_length: 12 -->\n"))
    b = parse_brief(text, "b.md")
    assert b.max_seq_length is None and any(d.startswith("max_seq_length: not stated") for d in b.defaults_applied)
    assert b.provenance == "curated" and b.fill == {"name": "Ada", "author": "Example Labs, Inc."} and b.keep_placeholders
    assert b.reward == []  # a comment is never a value
    bad = task.sample_brief("sft-lora").replace("packing: true\n", "packing: true\nprovenance: scraped\nfill: just text\nplaceholders: maybe\n")
    with pytest.raises(BadInput) as e:
        parse_brief(bad, "b.md")
    assert "provenance: 'scraped' is not a provenance (accepted: synthetic|curated|mixed)" in e.value.message
    assert "fill: 'just text' is not a list of name=value pairs" in e.value.message
    assert "placeholders: 'maybe' is not a policy (accepted: fail|keep)" in e.value.message


def test_load_brief_from_files(tmp_path, ws_root):
    with pytest.raises(NotFound):
        load_brief(tmp_path / "missing.md")
    p = tmp_path / "latin1.md"
    p.write_bytes(task.sample_brief("sft-lora").replace("—", "-").replace("Repeat", "Répète").encode("latin-1"))
    with pytest.raises(BadInput, match="not UTF-8"):
        load_brief(p)
    ws = Workspace.from_env()
    d = ws.experiments_dir / "finetune-mcp-tiny-DPO-repeat-words"
    d.mkdir(parents=True)
    (d / "training-brief.md").write_text(task.sample_brief("dpo"))
    assert load_experiment_brief(ws, "finetune-mcp-tiny-DPO-repeat-words").method == "dpo"
    with pytest.raises(NotFound):
        load_experiment_brief(ws, "no-such-experiment")
