"""How long a prepare_dataset job outlives its server after a kill -9, and what it leaves in the temp folder.

A real `finetune-mcp serve` over stdio prepares ROWS conversations for the embedded tiny model; when the job
reports templating, the server is killed with SIGKILL. Printed: the job's process tree, how long each of its
processes lived on (up to --wait seconds), their peak RSS meanwhile, and the temp and staging folders left.

    .venv/bin/python bench/bench_job_lifetime.py [--rows 50000] [--wait 300]
(Set PYTHONPATH to another checkout's server/ to measure that one.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import anyio
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import mcp_session  # noqa: E402


def _role(p: psutil.Process, server_pid: int) -> str:
    try:
        cmd, ppid = " ".join(p.cmdline()), p.ppid()
    except psutil.NoSuchProcess:
        return "gone"
    if "_zygote" in cmd and ppid == server_pid:
        return "warm worker"
    if "_zygote" in cmd:
        try:
            parent_cmd = " ".join(psutil.Process(ppid).cmdline())
        except psutil.NoSuchProcess:
            parent_cmd = ""
        return "prepare_data job (forked)" if ppid != server_pid and "_zygote" in parent_cmd and \
            psutil.Process(ppid).ppid() == server_pid else "job's forked worker"
    return cmd[:60]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=50000)
    ap.add_argument("--wait", type=float, default=300.0)
    a = ap.parse_args()
    from finetune_mcp.common import task
    from finetune_mcp.worker import run_job

    base = Path(tempfile.mkdtemp(prefix="bench-lifetime-"))
    root, tmp = base / "root", base / "tmp"
    tmp.mkdir(parents=True)
    os.environ["DGX_SPARK_ROOT"] = str(root)
    run_job("build_tiny_model", {"target_dir": str(root / "base-models" / "finetune-mcp-tiny"), "seed": 0}, timeout=900)
    (root / "briefs").mkdir()
    (root / "briefs" / "sft.md").write_text(task.sample_brief("sft-lora"))
    task.write_jsonl(task.sft_conversations(a.rows), root / "incoming" / "sft.jsonl")
    out: dict = {}

    async def go():
        messages: list[str] = []

        async def on_progress(done, total, message):
            messages.append(message or "")

        async with mcp_session(env={"TMPDIR": str(tmp), "FINETUNE_MCP_WARM_WORKER": "1"}) as s:
            server = next(p for p in psutil.Process().children() if "serve" in p.cmdline())

            async def call():
                try:
                    await s.call_tool("prepare_dataset", {"brief_path": "briefs/sft.md", "source": "incoming/sft.jsonl"},
                                      progress_callback=on_progress)
                except Exception:
                    pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                t_call = time.monotonic()
                while not any(m.startswith("templated") for m in messages):
                    await anyio.sleep(0.1)
                tree = server.children(recursive=True)
                out["who"] = {p.pid: _role(p, server.pid) for p in tree}
                out["before"] = sorted(p.name for p in tmp.iterdir()) + sorted(p.name for p in (root / "datasets").glob(".*"))
                out["call_to_kill_s"] = time.monotonic() - t_call
                os.kill(server.pid, signal.SIGKILL)
                t0 = time.monotonic()
                lived, peak = {}, {}
                while time.monotonic() - t0 < a.wait:
                    alive = 0
                    for p in tree:
                        try:
                            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                                alive += 1
                                lived[p.pid] = time.monotonic() - t0
                                peak[p.pid] = max(peak.get(p.pid, 0), p.memory_info().rss)
                        except psutil.NoSuchProcess:
                            pass
                    if not alive:
                        break
                    time.sleep(0.05)
                out["tree"] = [(p.pid, lived.get(p.pid, 0.0), peak.get(p.pid, 0)) for p in tree]
                out["cut"] = time.monotonic() - t0 >= a.wait
                for p in tree:  # whatever is left after --wait
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                tg.cancel_scope.cancel()

    try:
        anyio.run(go)
    except BaseException:
        if "tree" not in out:
            raise
    time.sleep(0.5)
    print(f"rows {a.rows}: kill -9 of the server {out['call_to_kill_s']:.1f}s into prepare_dataset (templating)")
    for pid, lived, rss in out["tree"]:
        print(f"  {out['who'][pid]} (pid {pid}): lived on {lived:.2f}s after the kill, peak RSS meanwhile {rss / 2**20:.0f} MiB")
    if out["cut"]:
        print(f"  still running after --wait {a.wait:.0f}s: killed by this script")
    print(f"  temp/staging before the kill: {out['before']}")
    left = sorted(p.name for p in tmp.iterdir()) + sorted(p.name for p in (root / "datasets").glob(".*"))
    print(f"  temp/staging after: {left}")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
