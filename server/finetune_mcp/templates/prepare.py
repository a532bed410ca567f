#!/usr/bin/env python3
"""Rebuilds dataset {{NAME_REPR}} from its source, exactly as prepare_dataset did on {{NOW}}.

Run it with the training Python (the one with transformers, trl and datasets):

    python data/prepare.py

It writes $DATASET_DIR, else $DGX_SPARK_ROOT/datasets/{{NAME}}/ (DGX_SPARK_ROOT defaults to ~/dgx-spark):
train.jsonl, eval.jsonl and meta.json, through a staging folder that is renamed into place only when
every check passes. Paths below are absolute; edit SOURCE or MODEL_PATH if the data or model moved.
It needs the finetune_mcp package importable (pip install finetune-mcp, or PYTHONPATH=<checkout>/server).
"""

import json
import os
import sys
from pathlib import Path

PARAMS = json.loads(r"""
{{PARAMS_JSON}}
""")


def main() -> int:
    try:
        from finetune_mcp.jobs.prepare_data import reproduce
    except ImportError:
        print("finetune_mcp is not importable: pip install finetune-mcp into this Python, or set PYTHONPATH to the checkout's server/ folder", file=sys.stderr)
        return 2
    root = Path(os.environ.get("DGX_SPARK_ROOT") or Path.home() / "dgx-spark").expanduser()
    out = Path(os.environ.get("DATASET_DIR") or root / "datasets" / PARAMS["name"])
    res = reproduce(PARAMS, out)
    print(f"wrote {out}: train {res['counts']['train']}, eval {res['counts']['eval']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
