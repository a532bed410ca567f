"""Triage reads a log the same however a tool handed it over.

    .venv/bin/python bench/bench_triage_captures.py                        # every capture form, dev + held-out logs
    .venv/bin/python bench/bench_triage_captures.py --server ../old/server # another checkout's classifier, same logs
    .venv/bin/python bench/bench_triage_captures.py --form wrap80 --list   # one form, and the logs it changes

The forms are what tools really do to a log on its way to a reader:
- `cr-as-lf`: tqdm's carriage returns turned into line ends (a CI runner's log view, a notebook export);
- `cr-dropped`: the carriage returns dropped, so a bar's redraws glue end to end (a copy from a web page, GitHub's
  file view, an API that returns text without them);
- `wrap80`, `wrap120`: a terminal's capture (tmux, screen, a copy from a terminal window), every line longer than the
  window broken into pieces of its width.
The carriage-return forms are applied to the development and held-out logs that hold carriage returns, the wraps to
those that hold none. The figure is the share of verdicts (class) that stay what the log as written reads, and how
many moved away from the log's label and toward it. The blind parts are not read: what changes there would be a look
at blind logs. Prints one JSON line at the end (`--json` prints only that).
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


def _wrap(width: int):
    def apply(text: str) -> str:
        return "\n".join(ln[i:i + width] for ln in text.split("\n") for i in range(0, max(len(ln), 1), width))
    return apply


# name: (applies to logs with carriage returns?, the transformation)
FORMS = {
    "cr-as-lf": (True, lambda t: t.replace("\r", "\n")),
    "cr-dropped": (True, lambda t: t.replace("\r", "")),
    "wrap80": (False, _wrap(80)),
    "wrap120": (False, _wrap(120)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", metavar="DIR", type=Path, default=ROOT / "server",
                    help="the server folder whose classifier to run (a worktree of an older commit, for a before/after)")
    ap.add_argument("--form", action="append", choices=sorted(FORMS), help="only these forms")
    ap.add_argument("--list", action="store_true", help="list the logs whose verdict a form changes")
    ap.add_argument("--json", action="store_true", help="print only the summary line")
    args = ap.parse_args()
    sys.path.insert(0, str(args.server.resolve()))
    from finetune_mcp.triage.classify import classify_text

    cases = [c for c in yaml.safe_load((LOGS / "index.yaml").read_text())["cases"]]
    started = time.perf_counter()
    summary: dict = {"bench": "triage_captures", "server": str(args.server)}
    for name in args.form or FORMS:
        with_cr, form = FORMS[name]
        tally: Counter = Counter()
        moved = []
        for c in cases:
            text = (LOGS / c["file"]).read_bytes().decode("utf-8", "replace").replace("\r\n", "\n")
            if ("\r" in text) != with_cr:
                continue
            as_written = classify_text(text).failure_class
            handed = classify_text(form(text)).failure_class
            tally["logs"] += 1
            if handed == as_written:
                tally["same"] += 1
                continue
            tally["worse" if as_written == c["class"] else "better" if handed == c["class"] else "other"] += 1
            moved.append((c["file"], c["class"], as_written, handed))
        share = round(tally["same"] / tally["logs"], 4) if tally["logs"] else None
        summary[name] = {"logs": tally["logs"], "same": share, "worse": tally["worse"], "better": tally["better"],
                         "other": tally["other"]}
        if not args.json:
            print(f"{name:10s} {tally['same']}/{tally['logs']} the same ({share}); moved away from the label "
                  f"{tally['worse']}, toward it {tally['better']}, between wrong classes {tally['other']}")
            if args.list:
                for f, label, a, b in moved:
                    print(f"    {f}: label {label}, as written {a}, handed over {b}")
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
