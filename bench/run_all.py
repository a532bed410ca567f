"""Runs every benchmark in bench/ and writes one markdown report of figures and ratios.

Each bench_*.py measures ours and its baseline side by side in one run. A bench may print lines
`BENCH {"figure": ..., "ours": ..., "baseline": ..., "ratio": ..., "goal": ...}` for the summary
table; everything it prints is kept in the report. Usage: python bench/run_all.py [-o report.md] [--only NAME]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def machine() -> str:
    import psutil

    return (f"{platform.machine()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"Python {platform.python_version()}, {platform.platform()}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default=str(HERE / "results" / "report.md"))
    ap.add_argument("--only", action="append", help="run only benches whose file name contains this")
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    benches = sorted(HERE.glob("bench_*.py"))
    if a.only:
        benches = [b for b in benches if any(o in b.name for o in a.only)]
    rows, sections = [], []
    env = dict(os.environ)
    sdist = HERE.parent / ".ci-cache" / "llama-sdist"  # left by .ci/llamacpp-setup.sh: llama.cpp's converter
    if sdist.is_dir():
        env.setdefault("FINETUNE_MCP_LLAMA_CPP_SDIST", str(sdist))
    for b in benches:
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, str(b)], capture_output=True, text=True, timeout=a.timeout, cwd=HERE.parent, env=env)
            out, rc = p.stdout + (("\n[stderr]\n" + p.stderr[-3000:]) if p.returncode else ""), p.returncode
        except subprocess.TimeoutExpired:
            out, rc = f"timed out after {a.timeout:.0f}s", -1
        took = time.monotonic() - t0
        print(f"{b.name}: exit {rc} in {took:.0f}s", flush=True)
        for line in out.splitlines():
            if line.startswith("BENCH "):
                try:
                    rows.append({"bench": b.stem, **json.loads(line[6:])})
                except json.JSONDecodeError:
                    pass
        sections.append(f"## {b.stem}\n\nexit {rc}, {took:.0f}s\n\n```\n{out.strip()}\n```\n")
    md = [f"# finetune-mcp benchmarks\n\n{dt.datetime.now():%Y-%m-%d %H:%M} on {machine()}\n",
          "| bench | figure | ours | baseline | ratio | goal |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['bench']} | {r.get('figure')} | {r.get('ours')} | {r.get('baseline', '')} | {r.get('ratio', '')} | {r.get('goal', '')} |")
    md.append("")
    md.extend(sections)
    out_path = Path(a.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("\n".join(md))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
