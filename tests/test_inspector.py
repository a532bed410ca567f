"""A client no one here wrote: the MCP Inspector CLI, over stdio and over streamable HTTP with a bearer token."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import EVAL_TOOLS, REPO, TRAINING_TOOLS, server_command

INSPECTOR = REPO / ".inspector" / "node_modules" / ".bin" / "mcp-inspector"

pytestmark = pytest.mark.skipif(
    not INSPECTOR.exists(),
    reason="SKIPPED LOUDLY: the MCP Inspector CLI is not installed; run .ci/inspector-setup.sh (needs npm)",
)


def inspector(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(INSPECTOR), "--cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_stdio_tools_list_and_call(ws_root, tmp_path):
    for role, expected in (("training-engineer", TRAINING_TOOLS), ("eval-engineer", EVAL_TOOLS)):
        p = inspector(*server_command(), "serve", "--role", role, "--method", "tools/list")
        assert p.returncode == 0, p.stderr
        assert {t["name"] for t in json.loads(p.stdout)["tools"]} == expected
    log = tmp_path / "train.log"
    log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.55 GiB\n")
    p = inspector(*server_command(), "serve", "--role", "training-engineer", "--data-dir", str(tmp_path),
                  "--method", "tools/call", "--tool-name", "triage_failure", "--tool-arg", f"log_path={log}")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["structuredContent"]["failure_class"] == "oom"
    assert out["content"][0]["text"].splitlines()[0] == out["structuredContent"]["summary"]


def test_http_with_and_without_token(http_server):
    url, _ = http_server
    p = inspector(url, "--transport", "http", "--method", "tools/list", "--header", "Authorization: Bearer tok-eval-0123456789abcdef")
    assert p.returncode == 0, p.stderr
    assert {t["name"] for t in json.loads(p.stdout)["tools"]} == EVAL_TOOLS
    p = inspector(url, "--transport", "http", "--method", "tools/list")
    assert p.returncode != 0
    assert "unauthorized" in (p.stdout + p.stderr)
