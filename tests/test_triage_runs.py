"""Real failures on the tiny model, launched through the server and then triaged through it.

Divergence: an absurd learning rate. OOM: a memory cap on the run (FINETUNE_MCP_RUN_MEMORY_LIMIT_MB)
that a huge batch crosses. Environment: a training Python without torch (a missing module), and
an output folder that turns read-only under the trainer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from conftest import TERMINAL, finished, mcp_session, poll_until, run_dir_of
from conftest import run_call as call

# No run a test here starts may outlive it (conftest's reaper, as in test_run.py).
pytestmark = pytest.mark.usefixtures("no_run_outlives_its_test")


def _triage_evidence_is_verbatim(tri: dict) -> None:
    assert tri["evidence"], tri["summary"]
    for e in tri["evidence"]:
        lines = Path(e["file"]).read_bytes().decode(errors="replace").split("\n")  # numbered as grep -n does
        assert lines[e["line"] - 1] == e["text"], f"{e['file']}:{e['line']} is not verbatim"


def test_absurd_learning_rate_is_divergence_with_the_lr_cause(pipeline, monkeypatch):
    pipeline.use(monkeypatch)
    pipeline.config("lr50", learning_rate=50.0, max_steps=60, save_steps=1000)

    async def main():
        async with mcp_session() as s:
            run = await call(s, "launch_run", {"experiment": pipeline.experiment, "tag": "lr50", "accept_warnings": True})
            nonfinite = lambda r, seen: finished(r, seen) or any(a["kind"] in ("nan-loss", "inf-loss", "loss-spike") for a in r["anomalies"])
            _, r = await poll_until(s, run["run_id"], nonfinite, timeout=300)
            if r["status"] not in TERMINAL:  # the seed's response to divergence: halt the run
                await call(s, "stop_run", {"run_id": run["run_id"], "grace_seconds": 30})
            return await call(s, "triage_failure", {"run_id": run["run_id"]})

    tri = anyio.run(main)
    assert tri["failure_class"] == "divergence", tri["summary"]
    assert [c["cause"] for c in tri["causes"]] == ["precision", "learning-rate", "packing"]
    assert [c["verdict"] for c in tri["causes"]] == ["cleared", "explains", "not-checked"]
    assert "50" in tri["causes"][1]["why"] and tri["halt_run"] is True
    _triage_evidence_is_verbatim(tri)


def test_memory_cap_crossed_is_oom_with_flush_first(pipeline, monkeypatch):
    pipeline.use(monkeypatch)
    # A batch of long packed sequences (eager attention is quadratic in length) needs gigabytes.
    pipeline.config("huge", max_seq_length=4096, per_device_train_batch_size=16, max_steps=5)

    async def main():
        async with mcp_session(env={"FINETUNE_MCP_RUN_MEMORY_LIMIT_MB": "1200"}) as s:
            run = await call(s, "launch_run", {"experiment": pipeline.experiment, "tag": "huge", "accept_warnings": True})
            _, r = await poll_until(s, run["run_id"], finished, timeout=300)
            return run, r, await call(s, "triage_failure", {"run_id": run["run_id"]})

    run, r, tri = anyio.run(main)
    exit_info = (run_dir_of(run["run_id"]) / "exit.json").read_text()
    assert r["status"] == "failed", (r["summary"], exit_info)
    assert tri["failure_class"] == "oom", (tri["summary"], exit_info)
    assert tri["next_rung"] == "flush"  # never reduce the batch first
    assert "dgx-spark-ops#oom-ladder" in tri["citations"]


def _python_without_torch() -> str | None:
    for cand in (Path(sys.base_prefix) / "bin" / "python3", Path("/usr/bin/python3")):
        if cand.exists() and subprocess.run([str(cand), "-c", "import torch"], capture_output=True).returncode != 0:
            return str(cand)
    return None


def test_missing_module_is_environment_n6(pipeline, monkeypatch):
    py = _python_without_torch()
    if py is None:
        pytest.skip("SKIPPED LOUDLY: every Python on this machine has torch; no missing-module run to make")
    pipeline.use(monkeypatch)
    pipeline.config("nostack", max_steps=5)

    async def main():
        async with mcp_session(env={"FINETUNE_MCP_TRAIN_PYTHON": py}) as s:
            run = await call(s, "launch_run", {"experiment": pipeline.experiment, "tag": "nostack", "accept_warnings": True})
            _, r = await poll_until(s, run["run_id"], finished, timeout=120)
            return r, await call(s, "triage_failure", {"run_id": run["run_id"]})

    r, tri = anyio.run(main)
    assert r["status"] == "failed"
    assert tri["failure_class"] == "environment" and tri["check_id"] == "N6", tri["summary"]
    assert "preflight" in tri["next_step"] and "N6" in tri["next_step"]
    assert any("No module named" in e["text"] for e in tri["evidence"])
    _triage_evidence_is_verbatim(tri)


def test_output_dir_turning_read_only_is_environment_n4(pipeline, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: mounting a read-only folder under the run needs root")
    pipeline.use(monkeypatch)
    pipeline.config("rofs", max_steps=400, save_steps=40)
    mounted: list[Path] = []

    async def main():
        async with mcp_session() as s:
            run = await call(s, "launch_run", {"experiment": pipeline.experiment, "tag": "rofs", "accept_warnings": True})
            await poll_until(s, run["run_id"], lambda r, seen: bool(seen) or finished(r, seen), timeout=120)
            ckpt = run_dir_of(run["run_id"]) / "checkpoints"
            ckpt.mkdir(exist_ok=True)
            p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ckpt)], capture_output=True, text=True)
            if p.returncode != 0:
                await call(s, "stop_run", {"run_id": run["run_id"], "grace_seconds": 5})
                pytest.skip(f"SKIPPED LOUDLY: cannot mount a read-only tmpfs here: {p.stderr.strip()}")
            mounted.append(ckpt)
            _, r = await poll_until(s, run["run_id"], finished, timeout=300)
            return r, await call(s, "triage_failure", {"run_id": run["run_id"]})

    try:
        r, tri = anyio.run(main)
    finally:
        for m in mounted:
            subprocess.run(["umount", str(m)], capture_output=True)
    assert r["status"] == "failed"
    assert tri["failure_class"] == "environment" and tri["check_id"] == "N4", tri["summary"]
    assert any("Read-only file system" in e["text"] for e in tri["evidence"])
    _triage_evidence_is_verbatim(tri)
