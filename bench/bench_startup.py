"""Cold start over stdio (spawn -> initialize -> tools/list) and server RSS: finetune-mcp vs a bare MCPServer.

Both servers are measured alternately in one run on the same interpreter; the figures are medians
and the goal is a ratio (<= 1.15x time, <= 1.3x RSS), never an absolute number.
Usage: python bench/bench_startup.py [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import psutil

HERE = Path(__file__).resolve().parent


async def one(cmd: list[str], env: dict) -> tuple[float, int]:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.perf_counter()
    async with stdio_client(StdioServerParameters(command=cmd[0], args=cmd[1:], env=env)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            await s.list_tools()
            dt = time.perf_counter() - t0
            new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            rss = sum(p.memory_info().rss for p in new if p.is_running())
    return dt, rss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-startup-")
    # Both servers start from bytecode, as an installed package does: a sandbox's PYTHONDONTWRITEBYTECODE would
    # otherwise make ours compile its own modules from source at every start while the SDK's come precompiled
    # from site-packages. The .pyc files of both go to one temporary prefix, written by the warm-up starts.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
           "DGX_SPARK_ROOT": root, "PYTHONPYCACHEPREFIX": str(Path(root) / "pycache")}
    exe = Path(sys.executable).parent / "finetune-mcp"
    ours = [str(exe), "serve", "--role", "training-engineer"] if exe.exists() else [sys.executable, "-m", "finetune_mcp", "serve"]
    bare = [sys.executable, str(HERE / "bare_server.py")]
    res = {"ours": [], "bare": []}
    for _ in range(2):  # write the bytecode, and warm the page cache, for both before measuring
        anyio.run(one, bare, env)
        anyio.run(one, ours, env)
    for _ in range(a.rounds):
        for name, cmd in (("bare", bare), ("ours", ours)):
            res[name].append(anyio.run(one, cmd, env))
    med = {k: (statistics.median(t for t, _ in v), statistics.median(r for _, r in v)) for k, v in res.items()}
    out = {
        "cold_start_s": {"finetune-mcp": round(med["ours"][0], 3), "bare MCPServer": round(med["bare"][0], 3)},
        "rss_mb": {"finetune-mcp": round(med["ours"][1] / 2**20, 1), "bare MCPServer": round(med["bare"][1] / 2**20, 1)},
        "time_ratio": round(med["ours"][0] / med["bare"][0], 3),
        "rss_ratio": round(med["ours"][1] / med["bare"][1], 3),
        "goals": {"time_ratio": 1.15, "rss_ratio": 1.3},
        "rounds": a.rounds,
    }
    print("BENCH " + json.dumps({"figure": "cold start stdio (s, median)", "ours": out["cold_start_s"]["finetune-mcp"], "baseline": out["cold_start_s"]["bare MCPServer"], "ratio": out["time_ratio"], "goal": "<= 1.15"}))
    print("BENCH " + json.dumps({"figure": "server RSS (MB)", "ours": out["rss_mb"]["finetune-mcp"], "baseline": out["rss_mb"]["bare MCPServer"], "ratio": out["rss_ratio"], "goal": "<= 1.3"}))
    print(json.dumps(out, indent=2) if a.json else
          f"cold start: finetune-mcp {out['cold_start_s']['finetune-mcp']}s vs bare {out['cold_start_s']['bare MCPServer']}s -> {out['time_ratio']}x (goal <= 1.15x)\n"
          f"RSS: finetune-mcp {out['rss_mb']['finetune-mcp']} MB vs bare {out['rss_mb']['bare MCPServer']} MB -> {out['rss_ratio']}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
