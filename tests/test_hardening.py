"""The review's hardening, each proved on the real thing: the tokens file, subprocess time limits, durable writes,
the roadbook lock, and logging_steps refused at launch."""

from __future__ import annotations

import ast
import multiprocessing
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, server_command
from finetune_mcp.app import MIN_TOKEN_CHARS, load_tokens
from finetune_mcp.common.errors import BadInput, FtError

SECRET = "s3cret-" + "9f8e7d6c5b4a3f2e1d0c"
SERVER_SRC = REPO / "server" / "finetune_mcp"


# ---------------------------------------------------------------- the tokens file


def serve_http(tokens_file: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(server_command() + ["serve", "--transport", "http", "--port", "1", "--tokens-file", str(tokens_file)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_a_malformed_tokens_file_is_named_with_its_line_and_never_echoed(tmp_path):
    bad = tmp_path / "tokens.yaml"
    # An unclosed flow sequence: PyYAML's own message quotes this line, secret and all.
    bad.write_text(f"training-engineer: [{SECRET}\neval-engineer: [{SECRET}-eval]\n")
    p = serve_http(bad)
    assert p.returncode == 2
    assert str(bad) in p.stderr and f"{bad}:2:" in p.stderr and "not valid YAML" in p.stderr
    assert SECRET not in p.stderr + p.stdout and "Traceback" not in p.stderr


def test_a_missing_tokens_file_is_a_clean_error(tmp_path):
    p = serve_http(tmp_path / "nope.yaml")
    assert p.returncode == 2 and "does not exist" in p.stderr and str(tmp_path / "nope.yaml") in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("body, words", [
    ("training-engineer: ['']\n", "empty or not a string"),
    ("training-engineer: [~]\n", "empty or not a string"),
    ("training-engineer: [None]\n", "too weak"),
    ("training-engineer: [12345678901234567890]\n", "empty or not a string"),
    ("training-engineer: [short-token]\n", "too weak"),
    (f"training-engineer: ['{SECRET[:8]} {SECRET[8:]}']\n", "too weak"),
    (f"{SECRET}: ''\n", "has no role name"),
])
def test_empty_none_and_weak_tokens_are_refused_without_echo(tmp_path, body, words):
    f = tmp_path / "tokens.yaml"
    f.write_text(body)
    with pytest.raises(BadInput) as e:
        load_tokens(str(f), None)
    assert words in str(e.value) and e.value.where == str(f) and "token #1" in str(e.value)
    assert SECRET not in str(e.value) and SECRET[:8] not in str(e.value)


def test_tokens_from_the_environment_obey_the_same_rules(tmp_path):
    assert load_tokens(None, f"{SECRET}=training-engineer") == {SECRET: "training-engineer"}
    with pytest.raises(BadInput, match="too weak") as e:
        load_tokens(None, "abc=training-engineer")
    assert "abc" not in e.value.message
    with pytest.raises(BadInput, match="two roles"):
        load_tokens(None, f"{SECRET}=training-engineer,{SECRET}=eval-engineer")
    assert len(SECRET) >= MIN_TOKEN_CHARS


# ---------------------------------------------------------------- subprocesses have time limits


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            if node.func.value.id == "subprocess":
                yield node.func.attr, node


# Processes that are meant to outlive the call: the run supervisor (detached), the trainer under it, the
# job worker (killed by a timer at the job's limit: worker.py), a cold job (same timer).
LONG_LIVED = {("launchers/base.py", "Popen"), ("launchers/runwrap.py", "Popen"), ("worker.py", "Popen")}


def test_every_waited_subprocess_has_a_timeout():
    missing, seen = [], set()
    for path in sorted(SERVER_SRC.rglob("*.py")):
        rel = path.relative_to(SERVER_SRC).as_posix()
        if rel.startswith("templates/"):  # train.py pieces, not modules; train.py starts no subprocess
            continue
        for attr, node in _calls(ast.parse(path.read_text())):
            if attr not in ("run", "check_output", "check_call", "call", "Popen"):
                continue
            seen.add(rel)
            if (rel, attr) in LONG_LIVED:
                continue
            if not any(k.arg == "timeout" for k in node.keywords):
                missing.append(f"{rel}:{node.lineno} subprocess.{attr}")
    assert "workspace.py" in seen and "launchers/slurm.py" in seen  # the scan sees the calls it should
    assert missing == [], missing


def test_worker_jobs_always_carry_a_limit():
    from finetune_mcp import worker

    assert worker.JOB_TIMEOUT_DEFAULT_S > 0
    src = (SERVER_SRC / "worker.py").read_text()
    assert "timeout = timeout or JOB_TIMEOUT_DEFAULT_S" in src


def test_a_hanging_git_hook_ends_in_a_clean_error(tmp_path, monkeypatch):
    from finetune_mcp.workspace import commit, ensure_repo

    repo = ensure_repo(tmp_path / "repo")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "pre-commit").write_text("#!/bin/sh\nsleep 120\n")
    (hooks / "pre-commit").chmod(0o755)
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text(f"[core]\n\thooksPath = {hooks}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(gitconfig))
    monkeypatch.setenv("FINETUNE_MCP_GIT_TIMEOUT_S", "2")
    (repo / "a.txt").write_text("x\n")
    t0 = time.monotonic()
    with pytest.raises(FtError) as e:
        commit(repo, [repo / "a.txt"], "add a")
    assert time.monotonic() - t0 < 30
    assert "did not finish within 2s" in e.value.message and "hook" in e.value.fix


# ---------------------------------------------------------------- durable writes


def test_atomic_and_exclusive_writes_fsync_the_file_and_its_directory(tmp_path, monkeypatch, ws_root):
    from finetune_mcp import workspace
    from finetune_mcp.context import PhaseContext

    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    target = tmp_path / "d" / "f.json"
    workspace.atomic_write_json(target, {"a": 1})
    assert any(s.startswith(str(tmp_path / "d" / ".f.json.")) for s in synced)  # the temp file, before the rename
    assert str(tmp_path / "d") in synced  # the directory, after it
    synced.clear()
    pc = PhaseContext.for_role("training-engineer")
    excl = ws_root / "x" / "once.txt"
    pc.guard.create_exclusive(excl, b"hello")
    assert synced == [str(excl), str(excl.parent)]
    with pytest.raises(FileExistsError):
        pc.guard.create_exclusive(excl, b"again")


# ---------------------------------------------------------------- the roadbook lock


def _append_many(root: str, run_dir: str, who: str, n: int, via_gate: bool) -> None:
    os.environ["DGX_SPARK_ROOT"] = root
    os.environ.pop("OUTPUT_ROOT", None)
    from finetune_mcp.context import PhaseContext
    from finetune_mcp.domain import run_facts, run_notes

    pc = PhaseContext.for_role("training-engineer")
    for i in range(n):
        if via_gate:
            run_facts.append_roadbook(pc, Path(run_dir), f"{who} line {i}")
        else:
            run_notes.note(pc, Path(run_dir), f"note-{who}", f"{who} line {i}")


def test_concurrent_roadbook_writers_lose_no_line(ws_root):
    run_dir = ws_root / "outputs" / "trainings" / "exp" / "20250101-0000-t"
    run_dir.mkdir(parents=True)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(ws_root), str(run_dir), who, 40, who == "gate")) for who in ("gate", "run", "run2")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    text = (run_dir / "roadbook.md").read_text()
    for who in ("gate", "run", "run2"):
        assert sum(f"{who} line {i}\n" in text or f"{who} line {i} <!--" in text for i in range(40)) == 40, who
    assert text.count("# Roadbook") == 1
