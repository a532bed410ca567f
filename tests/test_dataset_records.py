"""The record reader and validator (stdlib, shared by server and worker), fuzzed; the tool fuzzed end to end."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from conftest import call_tool
from hypothesis import HealthCheck, given, settings, strategies as st

from finetune_mcp.context import PhaseContext
from finetune_mcp.common import task
from finetune_mcp.common.errors import FtError
from finetune_mcp.common import records as R
from finetune_mcp.common.proto import JobError
from finetune_mcp.schemas import PrepareDatasetResult
from finetune_mcp.skills import load_skills
from finetune_mcp.workspace import Workspace

PKG = Path(R.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tables():
    sk = load_skills()
    return {t: sk.table("dataset-curation", t).model_dump(mode="json") for t in ("formats", "validation", "collapse", "card")}


def check(path: Path, tables, method="sft-lora"):
    raw, sink = R.read_text_source(path, tables["validation"]["listed_per_code"])
    return R.check_records(raw, sink, method=method, formats=tables["formats"], validation=tables["validation"]), sink


# ---------------------------------------------------------------- readers


def test_json_array_and_csv_records_carry_their_line_numbers(tmp_path, tables):
    rows = task.sft_conversations(3)
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    c, sink = check(tmp_path / "a.json", tables)
    text = (tmp_path / "a.json").read_text().splitlines()
    assert [text[line - 1].strip() for _, line, _ in c.origins] == ["{", "{", "{"]
    assert [line for _, line, _ in c.origins] == [2, 14, 26] and sink.errors == 0

    (tmp_path / "b.csv").write_text(
        'prompt,completion\n"Say ""hi""",Hi\n"two\nlines",ok\n,empty prompt\n')
    c, sink = check(tmp_path / "b.csv", tables)
    assert [r["prompt"] for r in c.records] == ['Say "hi"', "two\nlines"]
    (err,) = [p for p in sink.listed if p["severity"] == "error"]
    assert (err["code"], err["line"], err["field"]) == ("empty-field", 5, "prompt")

    (tmp_path / "c.csv").write_text('messages\n"[{""role"": ""user"", ""content"": ""hi""}, {""role"": ""assistant""')
    _, sink = check(tmp_path / "c.csv", tables)
    assert [(p["code"], p["line"], p["field"]) for p in sink.listed] == [("malformed-json", 2, "messages")]


def test_a_folder_with_held_out_files_trains_on_train_files_only(tmp_path):
    task.write_jsonl(task.sft_conversations(4), tmp_path / "d" / "train.jsonl")
    task.write_jsonl(task.sft_conversations(2, seed=1), tmp_path / "d" / "test.jsonl")
    kind, files, ignored = R.source_files(tmp_path / "d")
    assert kind == "text" and [f.name for f in files] == ["train.jsonl"] and [f.name for f in ignored] == ["test.jsonl"]
    (tmp_path / "d" / "more.csv").write_text("a\n1\n")
    with pytest.raises(JobError, match="mixes"):
        R.source_files(tmp_path / "d")


def test_conversions_are_lossless(tmp_path, tables):
    implicit = [{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}],
                 "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}]}]
    task.write_jsonl(implicit, tmp_path / "p.jsonl")
    c, _ = check(tmp_path / "p.jsonl", tables, "dpo")
    (r,) = c.records
    assert c.conversion == "implicit-prompt-preference"
    assert r["prompt"] + r["chosen"] == implicit[0]["chosen"] and r["prompt"] + r["rejected"] == implicit[0]["rejected"]

    task.write_jsonl(task.preference_pairs(5), tmp_path / "pairs.jsonl")
    c, _ = check(tmp_path / "pairs.jsonl", tables, "kto")
    assert c.conversion == "preference-to-kto" and len(c.records) == 10
    assert [r["label"] for r in c.records] == [True, False] * 5
    pairs = task.preference_pairs(5)
    assert [r["completion"] for r in c.records[::2]] == [p["chosen"] for p in pairs]

    with pytest.raises(JobError) as e:
        check(tmp_path / "pairs.jsonl", tables, "grpo")
    assert "grpo: prompt" in e.value.message


def test_every_problem_code_is_stated_in_the_skill(tables):
    """A code the tool can raise but the skill does not explain would be a threshold that lives in code."""
    codes = set()
    for f in ("common/records.py", "common/convert.py", "jobs/prepare_data.py", "phases/prepare_dataset.py", "domain/sources.py", "domain/dataset_docs.py"):
        tree = ast.parse((PKG / f).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("error", "warn", "err") and node.args:
                a = node.args[0]
                if isinstance(a, ast.Constant) and isinstance(a.value, str):
                    codes.add(a.value)
                elif isinstance(a, ast.JoinedStr):
                    codes.add("collapse-*")
    v = tables["validation"]
    stated = set(v["always_fail"]) | set(v["warn_only"]) | set(v["share_rules"])
    assert codes - {"collapse-*"} <= stated, codes - stated - {"collapse-*"}
    assert set(tables["collapse"]["metrics"]) == {"distinct-1", "distinct-2", "near-duplicate-share", "length-cv", "top-opening-share"}


def test_every_conversion_in_the_skill_has_code_and_every_format_a_validator(tables):
    src = (PKG / "common" / "records.py").read_text()
    conv_src = (PKG / "common" / "convert.py").read_text()
    for conv in tables["formats"]["conversions"]:
        assert f'"{conv["id"]}"' in conv_src
    for fmt in tables["formats"]["formats"]:
        assert f'"{fmt}"' in src


# ---------------------------------------------------------------- fuzz


_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=12))
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=10)
_msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "bot", 3]),
                              "content": st.one_of(st.text(max_size=15), st.integers(), st.none(), st.lists(_json, max_size=2))})
_row = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(_msg, max_size=4)}),
    st.fixed_dictionaries({"prompt": _json, "completion": _json}),
    st.fixed_dictionaries({"prompt": _json, "chosen": _json, "rejected": _json}),
    st.fixed_dictionaries({"conversations": st.lists(st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "x"]), "value": _json}), max_size=3)}),
    st.dictionaries(st.text(max_size=8), _json, max_size=4),
)
_good = st.sampled_from([json.dumps(r) for r in task.sft_conversations(40)])
_line = st.one_of(
    _good,
    _row.map(json.dumps),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
    st.text(max_size=40),
)
JSONL = st.lists(st.one_of(_line.map(lambda s: s.encode("utf-8", "surrogatepass")), st.binary(max_size=40)), max_size=30).map(b"\n".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=JSONL, method=st.sampled_from(["sft-lora", "dpo", "kto", "grpo", "vlm-sft"]))
def test_fuzz_records_reader_and_validator(tmp_path, tables, data, method):
    p = tmp_path / "f.jsonl"
    p.write_bytes(data)
    try:
        c, sink = check(p, tables, method)
    except JobError as e:
        assert e.kind == "BadInput" and e.fix
        return
    for prob in sink.listed:
        assert prob["code"] and prob["message"]
        if prob["line"] is not None:
            assert 1 <= prob["line"] <= data.count(b"\n") + 1
    for r in c.records:
        json.dumps(r)  # what survives can be written as JSON lines


@pytest.fixture
def fuzz_ws(ws_root, tiny_model_dir):
    shutil.copytree(tiny_model_dir, ws_root / "base-models" / "finetune-mcp-tiny")
    ws = Workspace.from_env()
    (ws.root / "briefs").mkdir()
    (ws.root / "briefs" / "sft.md").write_text(task.sample_brief("sft-lora"))
    return ws


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=JSONL)
def test_fuzz_the_tool_only_returns_structured_results_or_errors(fuzz_ws, data):
    ws = fuzz_ws
    src = ws.root / "incoming" / "fuzz.jsonl"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(data)
    pc = PhaseContext.for_role("training-engineer", ws)
    try:
        res = call_tool("prepare_dataset", pc, str(ws.root / "briefs" / "sft.md"), str(src))
    except FtError as e:
        assert e.message and type(e) is not FtError
        res = None
    if res is not None:
        assert isinstance(res, PrepareDatasetResult)
        PrepareDatasetResult.model_validate(res.model_dump(mode="json"))
        if not res.complete:
            assert res.dataset_dir is None
            assert all(p.severity in ("error", "warning") for p in res.problems)
    # Whatever happened, no staging folder or partial dataset is left behind: only complete datasets
    # (from an earlier example that passed) may be there.
    leftovers = list(ws.datasets_dir.iterdir()) if ws.datasets_dir.exists() else []
    assert all(not d.name.startswith(".") for d in leftovers)
    assert all(sorted(f.name for f in d.iterdir()) == ["eval.jsonl", "meta.json", "train.jsonl"] for d in leftovers)
