"""poll_progress latency against the size of progress.jsonl, with the cursor at the end (the steady state of a client
following a run). Goal: p50 <= 10 ms at 10^6 records, and flat in the log size.

    /work/main/.venv/bin/python bench/bench_poll.py [--sizes 1000 100000 1000000] [--calls 300]

For each size it writes a progress.jsonl of N records into a throwaway run directory whose run.json names
this very process (so status comes from a real liveness probe: a live, running run), then times:
  warm  - poll_progress(run_id, cursor=end) repeatedly in one server (the phase function, in process);
  cold  - the same after dropping everything the server remembers, before every call (a freshly
          restarted server polling an old cursor: it looks back a bounded window for spike detection);
  mcp   - the same call through a real MCP client over stdio to `finetune-mcp serve` (JSON-RPC included).
The baseline column is the same call at 10^3 records: ratio = p50(N) / p50(10^3) shows how flat it is.
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

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE.parent / "tests"))

EXP = "bench-SFT-LoRA-poll"


def write_run(root: Path, n: int) -> tuple[str, int]:
    run_dir = root / "outputs" / "trainings" / EXP / f"20250101-0000-n{n}"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "train.py").write_text("# writes logs/progress.jsonl\n")
    (run_dir / "config.yaml").write_text(f"training:\n  max_steps: {n}\n")
    me = psutil.Process()
    (run_dir / "run.json").write_text(json.dumps({"pid": me.pid, "pgid": os.getpgid(0), "start_time": me.create_time(),
                                                  "launcher": "local", "run_id": f"{EXP}/{run_dir.name}"}))
    path = run_dir / "logs" / "progress.jsonl"
    # log_history.jsonl as train.py writes it (every trainer log with its time and token count): a poll reads
    # its tail for tokens/s and the ETA.
    t0 = time.time() - n
    with open(path, "w") as f, open(run_dir / "logs" / "log_history.jsonl", "w") as h:
        chunk, hchunk = [], []
        for i in range(1, n + 1):
            chunk.append(f'{{"step": {i}, "loss": {2.0 / (1 + i / 1000):.6f}, "lr": 0.0002, "mem_gb": 71.2, "temp_c": 68.0}}\n')
            hchunk.append(f'{{"step": {i}, "time": {t0 + i:.3f}, "loss": {2.0 / (1 + i / 1000):.6f}, "learning_rate": 0.0002, '
                          f'"num_tokens": {4096.0 * i}}}\n')
            if len(chunk) == 10000:
                f.write("".join(chunk))
                h.write("".join(hchunk))
                chunk, hchunk = [], []
        f.write("".join(chunk))
        h.write("".join(hchunk))
    return f"{EXP}/{run_dir.name}", path.stat().st_size


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def time_calls(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", type=int, default=[1000, 100_000, 1_000_000])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--mcp-calls", type=int, default=100)
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-poll-") as tmp:
        root = Path(tmp) / "dgx-spark"
        os.environ["DGX_SPARK_ROOT"] = str(root)
        os.environ.pop("OUTPUT_ROOT", None)
        from finetune_mcp.context import PhaseContext
        from finetune_mcp.domain import run_notes
        from finetune_mcp.tools import call

        pc = PhaseContext.for_role("training-engineer")
        runs = {}
        for n in a.sizes:
            t0 = time.perf_counter()
            runs[n] = write_run(root, n)
            print(f"# wrote {n} records ({runs[n][1] / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s", flush=True)

        results: dict[int, dict[str, list[float]]] = {}
        for n, (run_id, size) in runs.items():
            first = call("poll_progress", pc, run_id=run_id, cursor=0, limit=5000)
            assert first.status == "running", first.summary
            end = size
            check = call("poll_progress", pc, run_id=run_id, cursor=end)
            assert check.records == [] and check.last.step == n and check.next_cursor == end, check.summary

            def warm():
                call("poll_progress", pc, run_id=run_id, cursor=end)

            def cold():  # a freshly started server: nothing remembered of the run
                run_notes.forget()
                call("poll_progress", pc, run_id=run_id, cursor=end)

            results[n] = {"warm": time_calls(warm, a.calls), "cold": time_calls(cold, a.calls)}

        import anyio
        from conftest import mcp_session

        async def over_mcp():
            async with mcp_session() as s:
                for n, (run_id, size) in runs.items():
                    args = {"run_id": run_id, "cursor": size}
                    r = await s.call_tool("poll_progress", args)
                    assert not r.is_error and r.structured_content["last"]["step"] == n, r.content
                    ts = []
                    for _ in range(a.mcp_calls):
                        t0 = time.perf_counter()
                        await s.call_tool("poll_progress", args)
                        ts.append((time.perf_counter() - t0) * 1000)
                    results[n]["mcp"] = ts

        anyio.run(over_mcp)

    base = min(a.sizes)
    print()
    print(f"| records | file MB | warm p50 ms | warm p95 ms | cold p50 ms | cold p95 ms | MCP p50 ms | MCP p95 ms |")
    print(f"|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, (run_id, size) in runs.items():
        r = results[n]
        print(f"| {n:,} | {size / 1e6:.1f} | {pct(r['warm'], .5):.3f} | {pct(r['warm'], .95):.3f} | {pct(r['cold'], .5):.3f} | "
              f"{pct(r['cold'], .95):.3f} | {pct(r['mcp'], .5):.2f} | {pct(r['mcp'], .95):.2f} |")
    for kind in ("warm", "cold", "mcp"):
        for n in a.sizes:
            p50 = statistics.median(results[n][kind])
            b50 = statistics.median(results[base][kind])
            print("BENCH " + json.dumps({"figure": f"poll_progress p50 ({kind}), {n:,} records, cursor at end, ms",
                                         "ours": round(p50, 3), "baseline": f"{b50:.3f} at {base:,}",
                                         "ratio": round(p50 / b50, 2), "goal": "<= 10 ms at 10^6, flat"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
