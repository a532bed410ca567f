"""prepare_dataset end to end: the real tiny tokenizer, TRL packing in the worker child, one fixture per bad-input class."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATASET_FIXTURES, call_tool, context, job_params, nothing_in_datasets, source_lines, write_brief

from finetune_mcp.common import task
from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.workspace import Workspace, git

SPAN = re.compile(r"⟦(.*?)⟧", re.S)
SAMPLE_HEAD = re.compile(r"^── sample \d+: record (\d+) \((.+?):(\d+)\), tokens \d+-\d+ ──$", re.M)


# ---------------------------------------------------------------- the good path


def multi_turn_rows() -> list[dict]:
    """Conversations with a system turn and two exchanges: the mask must cover both answers, nothing else."""
    qa = [json.loads(line)["messages"] for line in (DATASET_FIXTURES / "exact-duplicates.jsonl").read_text().splitlines()[:20]]
    rows = []
    for i in range(0, 20, 2):
        a, b = qa[i], qa[i + 1]
        rows.append({"messages": [{"role": "system", "content": "Answer briefly."}, *a, *b]})
    return rows


def test_sft_messages_end_to_end(ws):
    src = ws.root / "incoming" / "sft.jsonl"
    rows = task.sft_conversations(140) + multi_turn_rows()
    task.write_jsonl(rows, src)
    notes: list[tuple] = []
    res = call_tool("prepare_dataset", context(ws, lambda d, t, m: notes.append((d, t, m))), str(write_brief(ws, "sft-lora", seq=128)), str(src))

    assert res.complete, [c for c in res.checklist if not c.ok]
    assert [c.item.split(":")[0] for c in res.checklist] == [
        "brief-read", "format-fits-method", "validation-clean", "template-before-packing", "loss-mask", "packing-inspected",
        "lengths-fit", "collapse-guard", "splits-written", "card-complete", "committed"]
    assert res.experiment == "finetune-mcp-tiny-SFT-LoRA-repeat-words" and res.format == "messages"
    assert res.counts["train"] + res.counts["eval"] == 150 and res.counts["eval"] >= 1
    assert [p for p in res.problems if p.severity == "error"] == []
    # Progress arrived from both sides of the worker and only ever moved forward.
    assert any("chat template" in (m or "") for _, _, m in notes) and any("packing" in (m or "") for _, _, m in notes)
    assert all(b > a for (a, _, _), (b, _, _) in zip(notes, notes[1:]))

    # Packing: TRL bfd at the brief's length, efficiency reported, attention separation checked on real collator output.
    pk = res.packing
    assert pk["function"] == "trl.data_utils.pack_dataset" and pk["strategy"] == "bfd" and pk["seq_length"] == 128
    assert 0.5 < pk["efficiency"] <= 1.0
    assert pk["attention"]["verified"] is True and pk["attention"]["segment_starts_match"] is True
    assert 5 <= len(res.decoded_samples) <= 10 == pk["decoded_rows"]

    # The decoded packed samples' trained spans are exactly the assistant turns (with their end-of-turn token).
    by_line = source_lines(src)
    checked_multi = 0
    for text in res.decoded_samples:
        heads = list(SAMPLE_HEAD.finditer(text))
        assert len(heads) >= 1
        for k, h in enumerate(heads):
            body = text[h.end(): heads[k + 1].start() if k + 1 < len(heads) else len(text)]
            rec = by_line[int(h.group(3))]
            answers = [m["content"] + "<|im_end|>" for m in rec["messages"] if m["role"] == "assistant"]
            assert SPAN.findall(body) == answers, (body, answers)
            untrained = SPAN.sub("", body)
            for m in rec["messages"]:
                if m["role"] != "assistant":
                    assert m["content"] in untrained
            checked_multi += len(answers) > 1
    assert checked_multi >= 1, "no multi-turn sample among the decoded rows"

    # Files: the splits in datasets/<name>, nothing staged left behind; card, report and prepare.py committed.
    dd = Path(res.dataset_dir)
    assert sorted(p.name for p in ws.datasets_dir.iterdir()) == [dd.name]
    meta = json.loads((dd / "meta.json").read_text())
    assert meta["trainer_settings"] == {"max_length": 128, "packing": True, "packing_strategy": "bfd", "padding_free": True,
                                        "assistant_only_loss": True, "completion_only_loss": None}
    train = [json.loads(x) for x in (dd / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (dd / "eval.jsonl").read_text().splitlines()]
    assert len(train) == res.counts["train"] and len(evals) == res.counts["eval"]
    assert sorted(map(json.dumps, train + evals)) == sorted(map(json.dumps, rows))
    exp = Path(res.experiment_dir)
    card = (exp / "data" / "dataset-card.md").read_text()
    for title in ("Source and license", "Format and method fit", "Size and split", "Token length statistics",
                  "Processing — template, masking, packing", "Known limitations and risks"):
        assert f"## {title}\n" in card
    report = (exp / "data" / "validation-report.md").read_text()
    assert report.count("### Packed sequence") == len(res.decoded_samples) and "efficiency" in report
    assert (exp / "training-brief.md").read_text() == task.sample_brief("sft-lora").replace("max_seq_length: 64", "max_seq_length: 128")
    assert git(ws.experiments_repo, "status", "--porcelain").strip() == ""
    tracked = git(ws.experiments_repo, "ls-files").split()
    for f in ("training-brief.md", "data/prepare.py", "data/dataset-card.md", "data/validation-report.md"):
        assert f"trainings/{res.experiment}/{f}" in tracked

    # data/prepare.py rebuilds byte-identical splits from the source.
    out = ws.root / "rebuilt"
    env = {**os.environ, "DATASET_DIR": str(out), "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "server")}
    p = subprocess.run([sys.executable, str(exp / "data" / "prepare.py")], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    for f in ("train.jsonl", "eval.jsonl"):
        assert (out / f).read_bytes() == (dd / f).read_bytes()

    # Running again replaces the dataset whole and stays complete (the tool is idempotent).
    again = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora", seq=128)), str(src))
    assert again.complete and (Path(again.dataset_dir) / "train.jsonl").read_bytes() == (dd / "train.jsonl").read_bytes()
    assert sorted(p.name for p in ws.datasets_dir.iterdir()) == [dd.name]


def test_dpo_pairs_are_templated_with_loss_on_both_completions(ws):
    src = ws.root / "incoming" / "pairs.jsonl"
    rows = task.preference_pairs(120)
    task.write_jsonl(rows, src)
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "dpo")), str(src), dataset_name="pairs-v1", eval_fraction=0.1)
    assert res.complete, [c for c in res.checklist if not c.ok]
    assert res.packing is None and res.dataset_dir.endswith("/datasets/pairs-v1")
    meta = json.loads((Path(res.dataset_dir) / "meta.json").read_text())
    assert (meta["experiment"], meta["name"], meta["format"]) == (res.experiment, "pairs-v1", "preference")
    by_prompt = {r["prompt"][0]["content"]: r for r in rows}
    for text in res.decoded_samples:
        chosen, rejected = text.split("── rejected")
        prompt = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", chosen, re.S).group(1)
        rec = by_prompt[prompt]
        # Loss on the completion: everything after the prompt's generation header.
        assert SPAN.findall(chosen) == [rec["chosen"][0]["content"] + "<|im_end|>\n"]
        assert SPAN.findall(rejected) == [rec["rejected"][0]["content"] + "<|im_end|>\n"]
    assert "packing off" in next(c.evidence for c in res.checklist if c.item.startswith("packing-inspected"))


# ---------------------------------------------------------------- one fixture per bad-input class


LIGHT = [
    # fixture, method, code, line, field (exact-duplicates: the brief states the set synthetic; see the next test for the rest)
    ("malformed-json.jsonl", "sft-lora", "malformed-json", 7, None),
    ("invalid-utf8.jsonl", "sft-lora", "invalid-utf8", 5, None),
    ("missing-field.jsonl", "sft-lora", "missing-field", 9, "messages"),
    ("empty-field.jsonl", "sft-lora", "empty-field", 4, "messages[0].content"),
    ("roles-order.jsonl", "sft-lora", "roles-order", 6, "messages[1].role"),
    ("empty-assistant.jsonl", "sft-lora", "empty-assistant", 8, "messages[1].content"),
    ("non-string-content.jsonl", "sft-lora", "non-string-content", 3, "messages[1].content"),
    ("exact-duplicates.jsonl", "sft-lora", "exact-duplicate", 21, "messages"),
    ("identical-pair.jsonl", "dpo", "identical-pair", 5, "chosen/rejected"),
    ("image-missing/data.jsonl", "vlm-sft", "image-missing", 3, "images[0]"),
]
# These need the tokenizer or the whole set, so they are found in the worker child.
CHILD = [
    ("too-long.jsonl", "sft-lora", 64, "too-long", 21, "messages"),  # long_records: refuse
    ("near-duplicates.jsonl", "sft-lora", 256, "near-duplicate", 28, "messages"),
    ("collapsed.jsonl", "sft-lora", 128, "collapse-top-opening-share", None, "trained text"),
]


def assert_refused(ws: Workspace, res, code: str, line: int | None, field: str | None, fixture: str):
    assert res.complete is False and res.dataset_dir is None
    assert any(p.severity == "error" and p.code == code for p in res.problems), res.problems
    named = [p for p in res.problems if p.code == code and p.line is not None and p.field == field]
    assert named, f"no {code} problem names a line and field {field!r}: {res.problems}"
    if line is not None:
        assert line in {p.line for p in named}
    assert all(Path(p.file).name == Path(fixture).name for p in named)
    assert nothing_in_datasets(ws)
    exp = Path(res.experiment_dir)
    assert not (exp / "data" / "dataset-card.md").exists() and not (exp / "data" / "prepare.py").exists()
    assert code in (exp / "data" / "validation-report.md").read_text()
    assert not next(c for c in res.checklist if c.item.startswith("validation-clean")).ok
    assert res.summary.startswith("Phase 2 NOT complete")


@pytest.mark.parametrize("fixture,method,code,line,field", LIGHT, ids=[c[2] for c in LIGHT])
def test_bad_records_are_refused_before_any_child_starts(ws, fixture, method, code, line, field, monkeypatch):
    import finetune_mcp.worker as worker

    def no_child(*a, **k):
        raise AssertionError("the light pass should have refused these records without starting a worker")

    monkeypatch.setattr(worker, "run_job", no_child)
    extra = "provenance: synthetic" if code == "exact-duplicate" else ""
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, method, extra=extra)), str(DATASET_FIXTURES / fixture))
    assert_refused(ws, res, code, line, field, fixture)


@pytest.mark.parametrize("fixture,method,seq,code,line,field", CHILD, ids=[c[3] for c in CHILD])
def test_bad_sets_found_by_the_worker_leave_nothing_behind(ws, fixture, method, seq, code, line, field):
    extra = "long_records: refuse" if code == "too-long" else ""
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, method, seq=seq, extra=extra)), str(DATASET_FIXTURES / fixture))
    if code.startswith("collapse-"):
        # A set-level verdict: it names where the pattern occurs, not one record.
        err = next(p for p in res.problems if p.code == code and p.severity == "error")
        assert err.field == field and "collapsed.jsonl:1" in err.message and "'sure here is'" in err.message
        assert res.complete is False and res.dataset_dir is None and nothing_in_datasets(ws)
        assert not next(c for c in res.checklist if c.item.startswith("collapse-guard")).ok
        return
    assert_refused(ws, res, code, line, field, fixture)
    if code == "near-duplicate":
        # Lines 28-41 copy line 27 with one word changed, lines 43-56 copy line 42.
        assert {p.line for p in res.problems if p.code == code and p.line} <= set(range(28, 42)) | set(range(43, 57))
        assert res.problem_counts[code] == {"error": 1, "warning": 28}


# ---------------------------------------------------------------- formats, conversions and sources


def test_sharegpt_is_converted_losslessly_and_other_shapes_are_refused_by_name(ws):
    res = call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora")), str(DATASET_FIXTURES / "sharegpt.json"))
    assert res.complete and res.converted_from == "sharegpt" and res.format == "messages"
    src = json.loads((DATASET_FIXTURES / "sharegpt.json").read_text())
    out = [json.loads(x) for p in ("train.jsonl", "eval.jsonl") for x in (Path(res.dataset_dir) / p).read_text().splitlines()]
    assert sorted(json.dumps([(m["role"], m["content"]) for m in r["messages"]]) for r in out) == sorted(
        json.dumps([({"human": "user", "gpt": "assistant"}[t["from"]], t["value"]) for t in r["conversations"]]) for r in src)

    pairs = ws.root / "incoming" / "pairs.jsonl"
    task.write_jsonl(task.preference_pairs(20), pairs)
    with pytest.raises(BadInput) as e:
        call_tool("prepare_dataset", context(ws), str(write_brief(ws, "sft-lora")), str(pairs))
    assert "messages: messages" in e.value.message and "prompt-completion: prompt, completion" in e.value.message
    assert "which answer to learn is a choice" in e.value.message and "train DPO, ORPO, SimPO or KTO" in e.value.fix
    sft_for_dpo = ws.root / "incoming" / "sft.jsonl"
    task.write_jsonl(task.sft_conversations(20), sft_for_dpo)
    with pytest.raises(BadInput, match="preference: prompt, chosen, rejected"):
        call_tool("prepare_dataset", context(ws), str(write_brief(ws, "dpo")), str(sft_for_dpo))
    assert nothing_in_datasets(ws) or [p.name for p in ws.datasets_dir.iterdir()] == [Path(res.dataset_dir).name]


def test_kto_grpo_and_text_prompt_completion_in_the_job(tmp_path, tiny_model_dir):
    """The job's own entry point, in this process: the format-specific templating and masking."""
    from finetune_mcp.jobs.prepare_data import prepare

    # KTO from preference pairs: unpaired losslessly, loss on each completion.
    task.write_jsonl(task.preference_pairs(30), tmp_path / "pairs.jsonl")
    r = prepare(job_params(tmp_path, tmp_path / "pairs.jsonl", "kto", tiny_model_dir))
    assert r["ok"] and r["conversion"] == "preference-to-kto" and r["counts"]["kept"] == 60
    assert r["labels"] == {True: 30, False: 30}
    assert r["trainer_settings"] == {"max_length": 64}
    assert all(len(SPAN.findall(t)) == 1 and "── label: " in t for t in r["decoded_samples"])

    # GRPO: the prompt with the generation header, nothing trained, the reference column kept by name.
    rows = [{"prompt": g["prompt"], "solution": g["answer"]} for g in task.grpo_prompts(20)]
    task.write_jsonl(rows, tmp_path / "grpo.jsonl")
    r = prepare(job_params(tmp_path, tmp_path / "grpo.jsonl", "grpo", tiny_model_dir))
    assert r["ok"] and r["reference_field"] == "solution" and r["trainer_settings"]["reference_field"] == "solution"
    assert r["tokens"]["trained_tokens_per_sequence"] is None
    for t in r["decoded_samples"]:
        prompt, ref = t.split("\n── reference answer (solution): ")
        assert SPAN.findall(t) == [] and prompt.endswith("<|im_start|>assistant\n")
        assert task.reference_answer(re.search(r"user\n(.*?)<\|im_end\|>", prompt, re.S).group(1)) == ref.strip("'")

    # Standard (text) prompt/completion: TRL appends EOS to the completion, and only the completion is trained.
    text_rows = [{"prompt": f"Q: {q}\nA:", "completion": f" {a}"} for q, a in
                 [(m["messages"][0]["content"], m["messages"][1]["content"]) for m in map(json.loads, (DATASET_FIXTURES / "too-long.jsonl").read_text().splitlines()[:20])]]
    task.write_jsonl(text_rows, tmp_path / "text.jsonl")
    r = prepare(job_params(tmp_path, tmp_path / "text.jsonl", "sft-lora", tiny_model_dir, seq=128, packing=True))
    assert r["ok"] and r["trainer_settings"]["completion_only_loss"] is True and r["trainer_settings"]["assistant_only_loss"] is False
    answers = {row["completion"] + r["template"]["eos_token"] for row in text_rows}
    spans = [s for t in r["decoded_samples"] for s in SPAN.findall(t)]
    assert spans and all(s in answers for s in spans)


def test_vision_sets_need_a_vision_language_model(tmp_path, tiny_model_dir):
    from finetune_mcp.common.proto import JobError
    from finetune_mcp.jobs.prepare_data import prepare

    src = tmp_path / "vis"
    shutil.copytree(DATASET_FIXTURES / "image-missing", src)
    rows = [json.loads(x) for x in (src / "data.jsonl").read_text().splitlines()]
    rows[2]["images"] = ["images/02-blue.png"]
    task.write_jsonl(rows, src / "data.jsonl")
    with pytest.raises(JobError) as e:
        prepare(job_params(tmp_path, src / "data.jsonl", "vlm-sft", tiny_model_dir))
    assert e.value.kind == "Refused" and "no image processor" in e.value.message


def test_parquet_and_save_to_disk_sources_read_the_same_rows(tmp_path):
    import datasets

    from finetune_mcp.jobs.prepare_data import load_rows

    rows = task.sft_conversations(30)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "train.parquet"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "saved"))
    for src in (tmp_path / "train.parquet", tmp_path / "saved"):
        raw, sink = load_rows({"kind": "path", "path": str(src)}, 25)
        assert raw.rows == rows and sink.errors == 0
        assert all(line is None for _, line in raw.origins)  # rows are addressed by record index instead


def test_hf_dataset_from_the_local_cache_only(ws, monkeypatch, tmp_path):
    rows = task.sft_conversations(40)
    # In the hub cache only as downloaded files (a snapshot), never built by datasets.
    hf_home = tmp_path / "hf"
    repo = hf_home / "hub" / "datasets--acme--tiny-sft"
    (repo / "snapshots" / "abc123" / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    task.write_jsonl(rows, repo / "snapshots" / "abc123" / "data" / "train.jsonl")
    monkeypatch.setenv("HF_HOME", str(hf_home))
    brief = str(write_brief(ws, "sft-lora"))
    r = call_tool("prepare_dataset", context(ws), brief, "acme/tiny-sft", dataset_name="hub")
    assert r.complete, (r.summary, [c for c in r.checklist if not c.ok])
    assert r.counts["train"] + r.counts["eval"] == 40
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline by the user's choice: the worker must not try the hub
    with pytest.raises(NotFound) as e:
        call_tool("prepare_dataset", context(ws), brief, "acme/not-cached")
    assert "not in the local HF cache" in e.value.message
    assert "python -c \"import datasets; datasets.load_dataset('acme/not-cached')\"" in e.value.fix


def test_arguments_are_checked(ws):
    brief = str(write_brief(ws, "sft-lora"))
    with pytest.raises(BadInput, match="eval_fraction"):
        call_tool("prepare_dataset", context(ws), brief, str(DATASET_FIXTURES / "sharegpt.json"), eval_fraction=0.7)
    with pytest.raises(BadInput, match="invalid dataset_name"):
        call_tool("prepare_dataset", context(ws), brief, str(DATASET_FIXTURES / "sharegpt.json"), dataset_name="../escape")
    with pytest.raises(NotFound, match="not found"):
        call_tool("prepare_dataset", context(ws), brief, "incoming/nothing-here.jsonl")
    bad_brief = ws.root / "briefs" / "bad.md"
    bad_brief.write_text(task.sample_brief("sft-lora").replace("SFT-LoRA", "PPO"))
    with pytest.raises(BadInput, match="## Chosen Method: unknown method 'PPO'"):
        call_tool("prepare_dataset", context(ws), str(bad_brief), str(DATASET_FIXTURES / "sharegpt.json"))
    assert nothing_in_datasets(ws)


def test_parallel_templating_matches_sequential(tiny_model_dir, monkeypatch):
    """Large sets are templated in forked workers; the sequences must equal the one-process result."""
    from finetune_mcp.jobs import prepare_data as job

    tp = job.Templater(str(tiny_model_dir), "messages", "sft-lora")
    records = task.sft_conversations(job.PARALLEL_MIN_RECORDS + 200, seed=3)
    records[7] = {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}
    started = job._Templating(tp, records)
    assert started.pool is not None  # forked workers took the set
    parallel = list(started)
    monkeypatch.setattr(job, "PARALLEL_MIN_RECORDS", 10**9)
    one = job._Templating(tp, records)
    assert one.pool is None
    sequential = list(one)
    assert [k for k, _ in parallel] == [k for k, _ in sequential]
    assert parallel == sequential
