"""The embedded default: the tiny-model builder, the repeat-words task, and base-model resolution."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from finetune_mcp import models
from finetune_mcp.common import task
from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.domain.brief import METHODS, parse_brief


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="session")
def second_build(tmp_path_factory) -> Path:
    """A second build with the same seed, in this process (the conftest one runs as a worker job)."""
    from finetune_mcp.jobs.build_tiny_model import build

    target = tmp_path_factory.mktemp("second") / "base-models" / "finetune-mcp-tiny"
    assert build(target, seed=0)["built"] is True
    return target


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ---------------------------------------------------------------- the builder


def test_builds_are_byte_identical(tiny_model_dir, second_build):
    a, b = _digests(tiny_model_dir), _digests(second_build)
    assert {"model.safetensors", "tokenizer.json", "config.json", models.BUILD_STAMP} <= set(a)
    assert a == b


def test_build_is_idempotent_and_replaces_another_seed(tmp_path, second_build):
    from finetune_mcp.jobs.build_tiny_model import build

    target = tmp_path / "finetune-mcp-tiny"
    shutil.copytree(second_build, target)
    before = _digests(target)
    assert build(target, seed=0)["built"] is False
    assert _digests(target) == before

    other = build(target, seed=1)
    assert other["built"] is True and other["seed"] == 1
    after = _digests(target)
    assert after["model.safetensors"] != before["model.safetensors"]
    # Same tokenizer whatever the seed: the seed only draws the weights.
    assert after["tokenizer.json"] == before["tokenizer.json"]
    assert not [p.name for p in tmp_path.iterdir() if p.name != "finetune-mcp-tiny"], "temporary folders left behind"


def test_build_refuses_a_folder_it_did_not_write(tmp_path):
    from finetune_mcp.common.proto import JobError
    from finetune_mcp.jobs.build_tiny_model import build

    target = tmp_path / "finetune-mcp-tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(JobError) as e:
        build(target, seed=0)
    assert e.value.kind == "Refused" and str(target) in e.value.message
    assert (target / "config.json").read_text() == "{}"


def test_loads_back_and_runs(tiny_model_dir, tokenizer):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert len(tokenizer) == config["vocab_size"]

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in ["Repeat:\napple river stone", "Any text at all: ünïcode 🙂, tabs\tand 123.", "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tokenizer(text)["input_ids"]
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids) == text

    ids = torch.tensor([tokenizer(task.make_prompt(["apple", "river", "stone"]))["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_every_task_word_is_one_token(tokenizer):
    split = {v: tokenizer.tokenize(v) for w in task.WORDS for v in (w, " " + w) if len(tokenizer.tokenize(v)) != 1}
    assert not split
    # In context too: after the prompt's newline and after a space.
    prompt = task.make_prompt(task.WORDS[:3])
    assert tokenizer.tokenize(prompt)[-3:] == [task.WORDS[0], "Ġ" + task.WORDS[1], "Ġ" + task.WORDS[2]]


def test_assistant_mask_covers_exactly_the_assistant_turns(tokenizer):
    conv = task.sft_conversations(2, seed=0)
    messages = conv[0]["messages"] + conv[1]["messages"]
    out = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True, tokenize=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(r) for r in runs] == expected
    # Everything else, the user turns and the assistant headers, stays out of the loss.
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert unmasked.count("<|im_start|>assistant\n") == 2 and conv[0]["messages"][0]["content"] in unmasked


def test_generation_prompt_ends_with_the_assistant_header(tokenizer):
    text = tokenizer.apply_chat_template(task.user_messages("Repeat:\napple river stone"), add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nRepeat:\napple river stone<|im_end|>\n<|im_start|>assistant\n"


def test_stamp_names_agree():
    from finetune_mcp.jobs import build_tiny_model

    assert build_tiny_model.STAMP_NAME == models.BUILD_STAMP
    assert build_tiny_model.MODEL_NAME in models.EMBEDDED_MODELS


# ---------------------------------------------------------------- the task


def test_generators_are_deterministic_and_seeded():
    for gen in (task.sft_conversations, task.sft_prompt_completion, task.preference_pairs, task.kto_rows, task.grpo_prompts, task.eval_suite):
        assert gen(20, seed=3) == gen(20, seed=3), gen.__name__
        assert gen(20, seed=3) != gen(20, seed=4), gen.__name__


def _prompt_text(row) -> str:
    if "messages" in row:
        return row["messages"][0]["content"]
    return row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]


def test_heldout_prompts_never_appear_in_training_rows():
    heldout = {item["prompt"] for seed in range(3) for item in task.eval_suite(500, seed=seed)}
    assert len(heldout) > 1000
    for gen in (task.sft_conversations, task.sft_prompt_completion, task.preference_pairs, task.kto_rows, task.grpo_prompts):
        for seed in range(3):
            rows = gen(2000, seed=seed)
            prompts = [_prompt_text(r) for r in rows]
            assert len(set(prompts)) == len(prompts), f"{gen.__name__} repeats prompts"
            assert not heldout & set(prompts), gen.__name__
    train, held = task.train_triples(50000), task.heldout_triples(5000)
    assert not set(train) & set(held)
    with pytest.raises(ValueError):
        task.heldout_triples(10**6)


def test_rows_have_the_trl_shapes():
    row = task.sft_conversations(1)[0]
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["messages"][1]["content"] == task.reference_answer(row["messages"][0]["content"])
    pc = task.sft_prompt_completion(1)[0]
    assert pc["prompt"][0]["role"] == "user" and pc["completion"][0]["role"] == "assistant"
    g = task.grpo_prompts(1)[0]
    assert g["answer"] == task.reference_answer(g["prompt"])


def test_dialogues_are_distinct_multi_turn_task_conversations_free_of_heldout_triples(tokenizer):
    rows = task.sft_dialogues(3000, seed=1)
    assert rows == task.sft_dialogues(3000, seed=1) and rows != task.sft_dialogues(3000, seed=2)
    assert len({json.dumps(r) for r in rows}) == len(rows)
    heldout = {tuple(item["expected"].split()) for item in task.eval_suite(5000)}
    turns, sizes = Counter(), Counter()
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and 2 <= len(roles) <= 8
        turns[len(roles) // 2] += 1
        for user, reply in zip(r["messages"][::2], r["messages"][1::2]):
            assert reply["content"] == task.reference_answer(user["content"])
            run = reply["content"].split()
            sizes[len(run)] += 1
            assert not any(tuple(run[k:k + 3]) in heldout for k in range(len(run) - 2)), run
    assert sorted(turns) == [1, 2, 3, 4] and min(turns.values()) > 500
    assert sorted(sizes) == [2, 3, 4, 5]
    # Lengths spread (what packing is judged on), unlike single-turn rows, which all have one length.
    def n_tokens(r):
        return len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])

    assert len({n_tokens(r) for r in rows[:300]}) > 10
    assert len({n_tokens(r) for r in task.sft_conversations(300)}) == 1
    with pytest.raises(ValueError):
        task.sft_dialogues(1, max_exchanges=0)


def test_preference_rejected_is_a_wrong_but_plausible_answer():
    for row in task.preference_pairs(500, seed=1):
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen == task.reference_answer(row["prompt"])
        assert rejected != chosen
        assert task.well_formed(rejected) and not task.score(row["prompt"], rejected)


def test_kto_rows_are_balanced_and_labelled_right():
    rows = task.kto_rows(101, seed=2)
    labels = [r["label"] for r in rows]
    assert abs(labels.count(True) - labels.count(False)) <= 1
    for r in rows:
        assert task.score(r["prompt"], r["completion"]) is r["label"]


def test_score():
    prompt = task.make_prompt(["apple", "river", "stone"])
    assert task.reference_answer(prompt) == "apple river stone"
    assert task.score(prompt, "apple river stone")
    assert task.score(prompt, "  apple   river stone \nanything after")
    assert task.score(prompt, "apple river stone<|im_end|>")
    assert task.score(task.user_messages(prompt), [{"role": "assistant", "content": "apple river stone"}])
    assert not task.score(prompt, "river apple stone")
    assert not task.score(prompt, "apple river")
    assert not task.score(prompt, "apple river stone tiger")
    assert not task.score(prompt, "")
    with pytest.raises(ValueError):
        task.reference_answer("What is two plus two?")
    with pytest.raises(ValueError):
        task.make_prompt(["apple", "banana"])


def test_drift_prompts_are_not_task_prompts():
    prompts = task.drift_prompts()
    assert len(prompts) >= 3
    for p in prompts:
        with pytest.raises(ValueError):
            task.reference_answer(p)


@pytest.mark.parametrize("method", METHODS)
def test_sample_briefs_parse(method):
    brief = parse_brief(task.sample_brief(method), "training-brief.md")
    assert brief.method == method
    assert brief.base_model == "finetune-mcp-tiny" and brief.task_slug == task.TASK_SLUG
    assert brief.evaluation.get("min_accuracy") == 0.8
    assert brief.packing is method.startswith("sft-")
    assert 64 <= brief.max_seq_length <= 128
    if method == "grpo":
        assert brief.reward == ["exact_match", "format"]


def test_write_jsonl_round_trips(tmp_path):
    rows = task.preference_pairs(5)
    path = task.write_jsonl(rows, tmp_path / "d" / "pairs.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    assert [p.name for p in path.parent.iterdir()] == ["pairs.jsonl"]


# ---------------------------------------------------------------- base-model resolution


def test_embedded_model_resolves_to_base_models(tmp_path, tiny_model_dir):
    ref = models.resolve_base_model("finetune-mcp-tiny", tmp_path)
    assert ref.embedded and not ref.exists and ref.hf_id is None
    assert ref.path == tmp_path / "finetune-mcp-tiny"

    built = models.resolve_base_model(" finetune-mcp-tiny ", tiny_model_dir.parent)
    assert built.embedded and built.exists and built.path == tiny_model_dir


def _fake_cache(hf_home: Path, hf_id: str, config: Path, revision: str = "0123abcd") -> Path:
    repo = hf_home / "hub" / ("models--" + hf_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    shutil.copy(config, snap / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap


def test_cached_hf_id_resolves_to_its_snapshot(tmp_path, tiny_model_dir, monkeypatch):
    hf_home = tmp_path / "hf"
    snap = _fake_cache(hf_home, "some-org/tiny-llama", tiny_model_dir / "config.json")
    # An older snapshot without refs/main pointing at it must not win.
    old = snap.parent / "ffff0000"
    old.mkdir()
    shutil.copy(tiny_model_dir / "config.json", old / "config.json")

    ref = models.resolve_base_model("some-org/tiny-llama", tmp_path / "base-models", hf_home)
    assert (ref.path, ref.hf_id, ref.embedded, ref.exists) == (snap, "some-org/tiny-llama", False, True)
    assert json.loads((ref.path / "config.json").read_text())["model_type"] == "llama"

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    assert models.resolve_base_model("some-org/tiny-llama", tmp_path / "base-models").path == snap


def test_missing_hf_id_says_how_to_get_it(tmp_path):
    with pytest.raises(NotFound) as e:
        models.resolve_base_model("some-org/not-downloaded", tmp_path / "base-models", tmp_path / "hf")
    text = str(e.value)
    assert "not in the local HF cache" in text
    assert "finetune-mcp models pull some-org/not-downloaded" in text and "HF_HUB_OFFLINE" in text


def test_local_folder_under_base_models(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "my-model")
    ref = models.resolve_base_model("my-model", tmp_path, tmp_path / "hf")
    assert (ref.path, ref.hf_id, ref.embedded, ref.exists) == (tmp_path / "my-model", None, False, True)


@pytest.mark.parametrize("name", ["", "  ", "../etc", "a b/c", "org/name/extra"])
def test_unusable_names_are_bad_input(tmp_path, name):
    with pytest.raises(BadInput):
        models.resolve_base_model(name, tmp_path, tmp_path / "hf")
