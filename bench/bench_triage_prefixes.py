"""Triage reads a log the same whatever its writers put before each line.

    .venv/bin/python bench/bench_triage_prefixes.py                       # every prefix, dev + held-out logs
    .venv/bin/python bench/bench_triage_prefixes.py --server ../old/server # another checkout's classifier, same logs
    .venv/bin/python bench/bench_triage_prefixes.py --prefix journald      # one prefix, and the logs it changes

Each prefix of tests/fixtures/log-prefixes.yaml (a logger's timestamp, level and name; a launcher's rank or task
number; a collector's stream tag; colour escapes) is put before every line of every development and held-out
log of the corpus, and the log is read again. The figure is the share of verdicts (class) that stay the same;
the goal is all of them. The blind parts are not read: what changes there would be a look at blind logs.
Prints one JSON line at the end (`--json` prints only that).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "tests" / "fixtures" / "logs"
PREFIXES = ROOT / "tests" / "fixtures" / "log-prefixes.yaml"


def wrap(text: str, fmt: str) -> str:
    return "\n".join(fmt.format(line=ln, ss=f"{i % 60:02d}") if ln else ln for i, ln in enumerate(text.split("\n")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", metavar="DIR", type=Path, default=ROOT / "server",
                    help="the server folder whose classifier to run (a worktree of an older commit, for a before/after)")
    ap.add_argument("--prefix", action="append", help="only these prefixes (by name); lists the logs they change")
    ap.add_argument("--json", action="store_true", help="print only the summary line")
    args = ap.parse_args()
    sys.path.insert(0, str(args.server.resolve()))
    from finetune_mcp.triage import classify_text
    from finetune_mcp.triage.parse import decode_log

    prefixes = [p for p in yaml.safe_load(PREFIXES.read_text(encoding="utf-8"))["prefixes"]
                if not args.prefix or p["name"] in args.prefix]
    cases = [c for c in yaml.safe_load((LOGS / "index.yaml").read_text(encoding="utf-8"))["cases"] if c["split"] in ("dev", "heldout")]
    t0 = time.perf_counter()
    changed: Counter = Counter()
    listed: list[str] = []
    for c in cases:
        text = decode_log((LOGS / c["file"]).read_bytes())
        kw = {"exit_info": c.get("exit_info"), "platform": c.get("platform")}
        plain = classify_text(text, **kw).failure_class
        for p in prefixes:
            said = classify_text(wrap(text, p["format"]), **kw).failure_class
            if said != plain:
                changed[p["name"]] += 1
                listed.append(f"  {p['name']}: {c['file']} {plain} -> {said}")
    total = len(cases) * len(prefixes)
    same = total - sum(changed.values())
    if not args.json:
        for p in prefixes:
            n = changed[p["name"]]
            print(f"{p['name']:24} {len(cases) - n}/{len(cases)} verdicts unchanged")
        if args.prefix:
            print("\n".join(listed))
        print(f"\n{len(cases)} logs x {len(prefixes)} prefixes read in {time.perf_counter() - t0:.1f} s")
        print("BENCH " + json.dumps({"figure": f"triage verdicts unchanged under {len(prefixes)} line prefixes ({len(cases)} dev+heldout logs)",
                                     "ours": round(same / total, 4), "goal": "1.0"}))
    print(json.dumps({"bench": "triage_prefixes", "logs": len(cases), "prefixes": len(prefixes), "unchanged": same, "readings": total,
                      "share_unchanged": round(same / total, 4), "classifier": str(args.server.resolve()),
                      "changed_per_prefix": dict(changed)}))


if __name__ == "__main__":
    main()
