"""compare_runs on 100 runs: one call against the way an agent compared runs before it (one poll_progress per run).

    .venv/bin/python bench/bench_compare.py [--runs 100] [--records 1000] [--rounds 5]

Writes an experiment of N finished runs into a throwaway DGX_SPARK_ROOT: each a config.yaml whose
learning rate and LoRA rank vary, progress.jsonl with R records, log_history.jsonl with times and token
counts, metrics.json, run.json and exit.json. Then times, in one process, side by side:
  table  - compare_runs(plot=False), the phase function in process;
  plot   - compare_runs(plot=True): the same plus the PNG drawn in the plot job (a child process);
  mcp    - compare_runs(plot=True) through a real MCP client over stdio;
  polls  - the baseline: poll_progress(cursor=0, limit=5000) once per run through the same client.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE.parent / "tests"))

EXP = "bench-SFT-LoRA-compare"


def write_runs(root: Path, n: int, records: int) -> list[str]:
    import yaml

    ids = []
    now = time.time()
    for i in range(n):
        rid = f"20250101-{i // 60:02d}{i % 60:02d}-r{i}"
        d = root / "outputs" / "trainings" / EXP / rid
        (d / "logs").mkdir(parents=True)
        lr, r = [2e-4, 5e-4, 1e-3, 2e-3][i % 4], [8, 16][i % 2]
        cfg = {"experiment": EXP, "method": "sft-lora", "backend": "trl", "tag": f"r{i}",
               "hparams": {"learning_rate": lr, "lora_r": r, "max_steps": records, "seed": 3407},
               "calls": {"trainer": {"learning_rate": lr, "max_steps": records, "logging_steps": 1}},
               "run": {"run_id": f"{EXP}/{rid}"}}
        (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        (d / "train.py").write_text("# writes logs/progress.jsonl\n")
        with open(d / "logs" / "progress.jsonl", "w") as f, open(d / "logs" / "log_history.jsonl", "w") as h:
            for s in range(1, records + 1):
                loss = 2.0 / (1 + s * lr * 10) + 0.01 * (s % 7)
                f.write(json.dumps({"step": s, "loss": round(loss, 6), "lr": lr, "mem_gb": 1.2, "temp_c": None}) + "\n")
                h.write(json.dumps({"step": s, "time": now - 1000 + s * 0.5, "loss": loss, "learning_rate": lr,
                                    "num_tokens": 2048.0 * s}) + "\n")
        (d / "metrics.json").write_text(json.dumps({"status": "succeeded", "train_runtime_s": records * 0.5, "final_loss": loss,
                                                    "eval": {"eval_loss": loss * 1.1}}))
        (d / "run.json").write_text(json.dumps({"run_id": f"{EXP}/{rid}", "pid": None, "launcher": "local", "start_time": now - 1000}))
        (d / "exit.json").write_text(json.dumps({"returncode": 0, "signal": None, "stopped_by": None}))
        ids.append(f"{EXP}/{rid}")
    return ids


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        root = Path(tmp) / "dgx-spark"
        os.environ["DGX_SPARK_ROOT"] = str(root)
        os.environ.pop("OUTPUT_ROOT", None)
        ids = write_runs(root, a.runs, a.records)
        from finetune_mcp.context import PhaseContext
        from finetune_mcp.domain import run_notes
        from finetune_mcp.tools import call

        pc = PhaseContext.for_role("training-engineer")
        res: dict[str, list[float]] = {"table": [], "plot": [], "mcp": [], "polls": []}
        for _ in range(a.rounds):
            run_notes.forget()
            t0 = time.perf_counter()
            r = call("compare_runs", pc, experiment=EXP, plot=False)
            res["table"].append(time.perf_counter() - t0)
            assert len(r.runs) == a.runs and r.varied == ["hparams.learning_rate", "hparams.lora_r"], r.varied
            t0 = time.perf_counter()
            r = call("compare_runs", pc, experiment=EXP, plot=True)
            res["plot"].append(time.perf_counter() - t0)
            assert r._image_png[:4] == b"\x89PNG"

        import anyio
        from conftest import mcp_session

        async def over_mcp():
            async with mcp_session() as s:
                for _ in range(a.rounds):
                    t0 = time.perf_counter()
                    r = await s.call_tool("compare_runs", {"experiment": EXP})
                    res["mcp"].append(time.perf_counter() - t0)
                    assert not r.is_error and len(r.structured_content["runs"]) == a.runs
                    t0 = time.perf_counter()
                    for rid in ids:
                        p = await s.call_tool("poll_progress", {"run_id": rid, "limit": 5000})
                        assert not p.is_error and len(p.structured_content["records"]) == a.records
                    res["polls"].append(time.perf_counter() - t0)

        anyio.run(over_mcp)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{a.runs} runs x {a.records} records, median of {a.rounds}:")
    for k, v in med.items():
        print(f"  {k:6s} {v:7.3f} s")
    print("BENCH " + json.dumps({"figure": f"compare_runs on {a.runs} runs ({a.records} records each), s, median",
                                 "ours": round(med["mcp"], 3), "baseline": f"{med['polls']:.3f} ({a.runs} poll_progress calls)",
                                 "ratio": round(med["mcp"] / med["polls"], 3), "goal": "< 1 (one call beats reading every run)"}))
    print("BENCH " + json.dumps({"figure": f"compare_runs table only, in process, {a.runs} runs, s", "ours": round(med["table"], 3),
                                 "baseline": f"{med['plot']:.3f} with the PNG", "ratio": round(med["table"] / med["plot"], 3), "goal": "-"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
