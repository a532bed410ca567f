"""The layer rules of the package (pyproject.toml [tool.importlinter]) hold: import-linter checks every import,
function-level ones included, and names the chain of any that breaks a rule."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def _lint_imports() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        found = shutil.which("lint-imports")
        if not found:
            pytest.fail("lint-imports is not installed: pip install -e '.[dev]' (import-linter is a dev dependency)")
        exe = Path(found)
    return str(exe)


def test_every_layer_contract_is_kept():
    proc = subprocess.run([_lint_imports(), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "0 broken" in out and " kept" in out, out[-2000:]


def test_a_broken_rule_is_caught(tmp_path):
    """The contracts bite: a job that imports the server's workspace module breaks the jobs rule, named."""
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "server" / "finetune_mcp", pkg / "finetune_mcp", ignore=shutil.ignore_patterns("__pycache__"))
    bad = pkg / "finetune_mcp" / "jobs" / "plot_loss.py"
    bad.write_text(bad.read_text() + "\nfrom finetune_mcp import workspace  # noqa: E402\n")
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    env = {"PYTHONPATH": str(pkg), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "finetune_mcp.jobs.plot_loss -> finetune_mcp.workspace" in out, out[-3000:]
