"""Every shipped skill and table loads strictly; walking each table finds nothing unvalidated or uncited."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.shipped import shipped_dir
from finetune_mcp.skills import Skills, load_skills
from finetune_mcp.skilltables import TABLES

EXPECTED = {"dataset-curation", "spark-preflight", "dgx-spark-ops", "lora-qlora-recipes", "preference-optimization",
            "grpo-rlvr-training", "vision-sft", "quantized-export", "eval-gate"}
ANCHOR_RE = re.compile(r"^([a-z0-9-]+)#([A-Za-z0-9_.-]+)$")


def test_all_skills_present_and_valid():
    sk = load_skills()
    assert EXPECTED <= set(sk.skills), f"missing skills: {EXPECTED - set(sk.skills)}"
    for s in sk.skills.values():
        assert s.description and len(s.description) > 20
        assert "sources" in s.anchors, f"{s.name}: SKILL.md needs a '## Sources' section"


def _walk(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, path + (str(k),))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (str(i),))
    else:
        yield path, node


def _get(model_dump, path):
    cur = model_dump
    for p in path:
        cur = cur[int(p)] if isinstance(cur, list) else cur[p]
    return cur


@pytest.mark.parametrize("key", sorted(TABLES), ids=lambda k: f"{k[0]}/{k[1]}")
def test_walk_every_table_recursively(key):
    """Every leaf of the YAML survives validation unchanged, and every skill#anchor it names exists."""
    sk = load_skills()
    skill, table = key
    path = shipped_dir("skills") / skill / "tables" / f"{table}.yaml"
    assert path.is_file(), f"schema registered for a missing table {path}"
    raw = yaml.safe_load(path.read_text())
    dumped = sk.table(skill, table).model_dump(mode="python", by_alias=True)
    leaves = list(_walk(raw))
    assert leaves, f"{path} is empty"
    for p, value in leaves:
        got = _get(dumped, p)
        assert got == value or (isinstance(value, (int, float)) and float(got) == float(value)), f"{path}:{'.'.join(p)}: {value!r} became {got!r}"
        if isinstance(value, str) and ANCHOR_RE.match(value):
            s, a = ANCHOR_RE.match(value).groups()
            if s in sk.skills:
                sk.cite(s, a)  # raises if the heading is missing


def test_every_table_file_has_a_schema():
    root = shipped_dir("skills")
    for tf in root.glob("*/tables/*.yaml"):
        assert (tf.parent.parent.name, tf.stem) in TABLES, f"{tf} has no schema in skilltables.py"


def _mini_skill(tmp_path, table_text):
    from finetune_mcp.skilltables import Strict, table as register

    d = tmp_path / "demo-skill"
    (d / "tables").mkdir(parents=True)
    (d / "SKILL.md").write_text("---\nname: demo-skill\ndescription: a skill used only by this test\n---\n# Demo\n## Knobs {#knobs}\ntext\n## Sources\nnone\n")
    (d / "tables" / "knobs.yaml").write_text(table_text)

    class Knob(Strict):
        learning_rate: float
        lora_rank: int

    class Knobs(Strict):
        knobs: dict[str, Knob]

    register("demo-skill", "knobs")(Knobs)
    return tmp_path


def test_unknown_key_refused_with_did_you_mean(tmp_path):
    root = _mini_skill(tmp_path, "knobs:\n  sft:\n    learning_rate: 0.0002\n    lora_rnak: 16\n")
    try:
        with pytest.raises(BadInput) as e:
            Skills(root)
        msg = str(e.value)
        assert "knobs.yaml" in msg and "lora_rnak" in msg and "did you mean 'lora_rank'" in msg
    finally:
        TABLES.pop(("demo-skill", "knobs"), None)


def test_cite_and_section(tmp_path):
    root = _mini_skill(tmp_path, "knobs:\n  sft:\n    learning_rate: 0.0002\n    lora_rank: 16\n")
    try:
        s = Skills(root)
        assert s.cite("demo-skill", "knobs") == "demo-skill#knobs"
        assert s.get("demo-skill").section("knobs") == "text"
        assert s.table("demo-skill", "knobs").knobs["sft"].lora_rank == 16
        with pytest.raises(NotFound, match="did you mean 'knobs'"):
            s.cite("demo-skill", "knob")
        with pytest.raises(NotFound):
            s.table("demo-skill", "nope")
    finally:
        TABLES.pop(("demo-skill", "knobs"), None)
