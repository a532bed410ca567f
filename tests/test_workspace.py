"""Workspace paths, naming, run ids, atomic writes and the experiments git."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from pathlib import Path

import pytest

from finetune_mcp import workspace as W
from finetune_mcp.common.errors import BadInput, NotFound


def test_paths_from_env(tmp_path):
    ws = W.Workspace.from_env({"DGX_SPARK_ROOT": str(tmp_path / "r")})
    assert ws.output_root == tmp_path / "r" / "outputs" / "trainings"
    assert ws.experiments_dir == tmp_path / "r" / "experiments" / "trainings"
    ws2 = W.Workspace.from_env({"DGX_SPARK_ROOT": str(tmp_path / "r"), "OUTPUT_ROOT": str(tmp_path / "o")})
    assert ws2.output_root == tmp_path / "o"
    assert W.Workspace.from_env({}).root == Path.home() / "dgx-spark"


def test_experiment_name_sanitised():
    assert W.experiment_name("Qwen/Qwen3-4B", "QLoRA", "alpaca") == "Qwen3-4B-QLoRA-alpaca"
    assert W.experiment_name("m", "SFT LoRA", "a/b c") == "m-SFT-LoRA-a-b-c"
    with pytest.raises(BadInput):
        W.experiment_name("m", "SFT", "///")


def test_run_ids():
    assert W.new_run_id("r16-lr2e4", dt.datetime(2026, 7, 20, 9, 30)) == "20260720-0930-r16-lr2e4"
    for bad in ("", "-x", "a b", "a/b", "x" * 49, "..", "é"):
        with pytest.raises(BadInput, match="tag"):
            W.new_run_id(bad)
    assert W.parse_run_ref("exp-a/20260720-0930-r16") == ("exp-a", "20260720-0930-r16")
    for bad in ("exp", "a/b/c", "../20260720-0930-x", "exp/2026-x", "exp/20260720-0930-"):
        with pytest.raises(BadInput):
            W.parse_run_ref(bad)


def test_missing_experiment_and_run(tmp_path):
    ws = W.Workspace(tmp_path, tmp_path / "out")
    with pytest.raises(NotFound, match="prepare_dataset"):
        ws.experiment_dir("nope")
    with pytest.raises(NotFound, match="launch_run"):
        ws.run_dir("nope/20260720-0930-x")


def test_atomic_write_leaves_nothing_partial(tmp_path, monkeypatch):
    p = tmp_path / "a" / "f.json"
    W.atomic_write_json(p, {"x": 1})
    assert p.read_text().startswith("{")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        W.atomic_write_text(p, "new")
    assert p.read_text().startswith("{")
    assert [x.name for x in p.parent.iterdir()] == ["f.json"]


def test_git_commit_and_state(tmp_path):
    repo = tmp_path / "experiments"
    W.ensure_repo(repo)
    f = repo / "trainings" / "e" / "configs" / "run-a.yaml"
    f.parent.mkdir(parents=True)
    assert W.file_state(repo, f) == "untracked"
    f.write_text("lr: 1\n")
    sha = W.commit(repo, [f], "config a")
    assert len(sha) == 40
    assert subprocess.run(["git", "-C", str(repo), "cat-file", "-t", sha], capture_output=True, text=True).stdout.strip() == "commit"
    assert W.file_state(repo, f) == "clean"
    assert W.last_commit_of(repo, f) == sha
    f.write_text("lr: 2\n")
    assert W.file_state(repo, f) == "modified"
    assert W.commit(repo, [f], "config a2") != sha
    # committing unchanged files returns HEAD without a new commit
    head = W.commit(repo, [f], "noop")
    assert head == W.git(repo, "rev-parse", "HEAD").strip()
