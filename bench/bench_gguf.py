"""Exports one promoted tiny run in every format and prints the smoke-test figures side by side.

    FINETUNE_MCP_LLAMA_CPP_SDIST=/path/to/sdists /work/main/.venv/bin/python bench/bench_gguf.py
    /work/main/.venv/bin/python bench/bench_gguf.py --formats merged-16bit lora     # no llama.cpp needed

The run is made by the product end to end, in a throwaway DGX_SPARK_ROOT: prepare_dataset,
preflight, generate_config, launch_run of the generated train.py (TRL on the CPU), then the eval
engineer's write_eval_file / evaluate_checkpoint / record_verdict, then export per format (the phase
functions, each in the role it belongs to). GGUF needs llama-cpp-python in the training Python and
llama.cpp's converter (see skills/quantized-export, "Converting to GGUF"); the tests run the same
exports under the `llamacpp` marker and skip, loudly, without them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

FORMATS = {  # format -> runtime it is smoke-tested for
    "lora": "transformers",
    "merged-16bit": "transformers",
    "gguf-f16": "llama.cpp",
    "gguf-q8_0": "llama.cpp",
    "gguf-q4_k_m": "ollama",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--rows", type=int, default=2000, help="training rows (repeat-words)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--root", help="DGX_SPARK_ROOT to use (default: a throwaway folder)")
    args = p.parse_args()

    root = Path(args.root or tempfile.mkdtemp(prefix="bench-gguf-"))
    os.environ["DGX_SPARK_ROOT"] = str(root)
    os.environ.pop("OUTPUT_ROOT", None)
    from finetune_mcp.context import PhaseContext
    from finetune_mcp.common import task
    from finetune_mcp.tools import call

    t0 = time.perf_counter()
    train = PhaseContext.for_role("training-engineer")
    inbox = root / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    (inbox / "training-brief.md").write_text(task.sample_brief("sft-lora"))
    task.write_jsonl(task.sft_conversations(args.rows, seed=0), inbox / "data.jsonl")
    prep = call("prepare_dataset", train, brief_path=str(inbox / "training-brief.md"), source=str(inbox / "data.jsonl"))
    exp = prep.experiment
    pf = call("preflight", train, experiment=exp)
    call("generate_config", train, experiment=exp, tag="bench", overrides={"num_train_epochs": args.epochs})
    run = call("launch_run", train, experiment=exp, tag="bench", accept_warnings=pf.verdict == "ready-with-warnings")
    while (st := call("poll_progress", train, run_id=run.run_id, cursor=0, limit=1)).status not in ("succeeded", "failed", "stopped"):
        time.sleep(2)
    if st.status != "succeeded":
        print(f"training run {st.status}: {st.summary}")
        return 1
    t_train = time.perf_counter() - t0

    ev_pc = PhaseContext.for_role("eval-engineer")
    items = task.eval_suite(40, seed=1)
    call("write_eval_file", ev_pc, experiment=exp, relpath="prompts.jsonl", content="".join(json.dumps(i) + "\n" for i in items))
    call("write_eval_file", ev_pc, experiment=exp, relpath="goldens.jsonl", content="".join(json.dumps({"prompt": i["prompt"]}) + "\n" for i in items[:5]))
    ev = call("evaluate_checkpoint", ev_pc, run_id=run.run_id)
    print(ev.summary)
    if not all(ev.passed.values()):
        print("the run did not pass its thresholds; raise --epochs or --rows")
        return 1
    call("record_verdict", ev_pc, run_id=run.run_id, verdict="PROMOTE", evidence=ev.summary)

    rows = []
    for fmt in args.formats:
        t = time.perf_counter()
        try:
            res = call("export", train, run_id=run.run_id, format=fmt, target_runtime=FORMATS[fmt])
        except Exception as e:  # one format failing (no llama.cpp) must not hide the others
            rows.append((fmt, FORMATS[fmt], "-", "-", "-", "-", f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"))
            continue
        secs = time.perf_counter() - t
        items = (res.smoke_test or {}).get("items") or []
        size = sum(_size(Path(a)) for a in res.artifacts)
        rows.append((fmt, FORMATS[fmt], f"{size / 1e6:.2f}", f"{secs:.1f}",
                     f"{sum(i['identical'] for i in items)}/{len(items)}",
                     f"{min((i['similarity'] for i in items), default=float('nan')):.3f}",
                     "done" if res.exported else "NOT done"))

    print(f"\ntraining run {run.run_id}: {t_train:.0f}s (prepare + preflight + config + TRL run)")
    print(f"| {'format':<12} | {'runtime':<12} | MB     | s     | identical | min sim | result |")
    print(f"|{'-' * 14}|{'-' * 14}|--------|-------|-----------|---------|--------|")
    for r in rows:
        print(f"| {r[0]:<12} | {r[1]:<12} | {r[2]:>6} | {r[3]:>5} | {r[4]:>9} | {r[5]:>7} | {r[6]} |")
    print(f"\nreports: {root / 'outputs' / 'trainings' / run.run_id / 'export' / 'export-report.md'}")
    return 0


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


if __name__ == "__main__":
    sys.exit(main())
