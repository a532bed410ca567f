"""triage_failure on a 100 MB log: wall time and peak memory, each measured in a child process of its own.

    .venv/bin/python bench/bench_triage_big.py            # 100 MB streamed, plus the old whole-file read at 10 MB
    .venv/bin/python bench/bench_triage_big.py --mb 20    # another size

The log is built from real lines: the healthy HF Trainer records and tqdm redraws of the corpus
(tests/fixtures/logs), repeated with rising step numbers until the size is reached, then the real
OOM traceback of oom-trl-ci-other-processes.log at its end - so the verdict must come from the tail
while the numeric rules still read the whole curve. Goal (issue 30): <= 10 s and <= 200 MB peak RSS.
The old way - what triage_failure did before, read the whole file and classify the text in memory
(here with today's classifier) - is measured at a tenth of the size, as at 100 MB it took minutes.
Wall time on a shared machine depends on its load; the CPU seconds and the load average are printed
beside it. Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "tests" / "fixtures" / "logs"

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {server!r})
from pathlib import Path
t0 = time.perf_counter()
if {mode!r} == "stream":
    from finetune_mcp.triage import triage_log_file
    res = triage_log_file(Path({path!r}))
    cls, ev = res.failure_class, [(e.line, e.text[:60]) for e in res.evidence[:2]]
else:
    from finetune_mcp.triage import classify_text
    text = Path({path!r}).read_bytes().decode("utf-8", errors="replace")
    res = classify_text(text)
    cls, ev = res.failure_class, [(n, t[:60]) for n, t in res.evidence[:2]]
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"class": cls, "seconds": round(wall, 2), "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 2),
                  "peak_rss_mb": round(ru.ru_maxrss / 1024, 1), "evidence": ev}}))
"""


def build(path: Path, mb: float) -> int:
    """A log of about `mb` MB: healthy records and progress redraws, then a real OOM traceback."""
    healthy = (LOGS / "none-healthy-trl-sft-llama2-loss-decreasing.log").read_text().splitlines()
    records = [ln.rstrip() for ln in healthy if ln.startswith("{")]
    tail = (LOGS / "oom-trl-ci-other-processes.log").read_text()
    target = int(mb * 1e6)
    lines = 0
    with path.open("w", encoding="utf-8") as fh:
        size, step, total = 0, 0, 10**7
        while size < target:
            step += 1
            # The corpus record with its loss moved a little each step (a real run's curve never repeats exactly).
            rec = _jitter(records[step % len(records)], step)
            bar = (f"\r  {step * 100 // total:3d}%|▏         | {step}/{total} [00:{step % 60:02d}<99:00,  3.21it/s]" * 3)
            chunk = bar + "\n" + rec + "\n"
            fh.write(chunk)
            size += len(chunk.encode())
            lines += 2
        fh.write(tail)
        lines += tail.count("\n")
    return lines


def _jitter(rec: str, step: int) -> str:
    """The record with its loss value nudged by a step-dependent amount below its 4th decimal."""
    head, _, rest = rec.partition("'loss': ")
    value, comma, tail = rest.partition(",")
    return f"{head}'loss': {float(value) + step * 1e-9:.9f}{comma}{tail}"


def measure(mode: str, path: Path) -> dict:
    code = CHILD.format(server=str(ROOT / "server"), mode=mode, path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{mode} child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--no-old", action="store_true", help="skip the old whole-file read")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        big = Path(d) / "big.log"
        n = build(big, args.mb)
        mb = big.stat().st_size / 1e6
        new = measure("stream", big)
        load = os.getloadavg()[0]
        print(f"streamed triage_log_file on {mb:.1f} MB ({n} lines): {new['seconds']} s wall, {new['cpu_seconds']} s CPU, "
              f"peak RSS {new['peak_rss_mb']} MB, class {new['class']} (goal <= 10 s, <= 200 MB; load average {load:.1f} "
              f"on {os.cpu_count()} CPUs)")
        out = {"bench": "triage_big", "mb": round(mb, 1), "seconds": new["seconds"], "cpu_seconds": new["cpu_seconds"],
               "peak_rss_mb": new["peak_rss_mb"], "class": new["class"], "load_average": round(load, 1)}
        if not args.no_old:
            small = Path(d) / "small.log"
            build(small, args.mb / 10)
            smb = small.stat().st_size / 1e6
            old, new_small = measure("whole", small), measure("stream", small)
            print(f"at {smb:.1f} MB: old whole-file read {old['seconds']} s ({old['cpu_seconds']} s CPU), {old['peak_rss_mb']} MB "
                  f"({old['class']}); streamed {new_small['seconds']} s ({new_small['cpu_seconds']} s CPU), {new_small['peak_rss_mb']} MB "
                  f"({new_small['class']})")
            out.update(old_small_mb=round(smb, 1), old_seconds=old["seconds"], old_cpu_seconds=old["cpu_seconds"],
                       old_peak_rss_mb=old["peak_rss_mb"], new_small_seconds=new_small["seconds"],
                       new_small_cpu_seconds=new_small["cpu_seconds"], new_small_peak_rss_mb=new_small["peak_rss_mb"])
        print("BENCH " + json.dumps({"figure": f"triage_failure on a {mb:.0f} MB log, wall s (CPU s {new['cpu_seconds']})",
                                     "ours": new["seconds"], "goal": "<= 10"}))
        print("BENCH " + json.dumps({"figure": f"triage_failure on a {mb:.0f} MB log, peak RSS MB", "ours": new["peak_rss_mb"],
                                     "goal": "<= 200"}))
        if "old_seconds" in out:
            print("BENCH " + json.dumps({"figure": f"at {out['old_small_mb']} MB, streamed vs whole-file read, CPU s",
                                         "ours": new_small["cpu_seconds"], "baseline": old["cpu_seconds"],
                                         "ratio": round(new_small["cpu_seconds"] / old["cpu_seconds"], 2)}))
            print("BENCH " + json.dumps({"figure": f"at {out['old_small_mb']} MB, streamed vs whole-file read, peak RSS MB",
                                         "ours": new_small["peak_rss_mb"], "baseline": old["peak_rss_mb"],
                                         "ratio": round(new_small["peak_rss_mb"] / old["peak_rss_mb"], 2)}))
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
