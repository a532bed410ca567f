"""The front door end to end: `finetune-mcp demo` runs the whole lifecycle through real MCP sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import server_command

HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "unsloth", "accelerate")


def test_demo_runs_the_whole_lifecycle(tmp_path):
    root = tmp_path / "root"
    mods = tmp_path / "mods"
    mods.mkdir()
    env = {**os.environ, "FINETUNE_MCP_MODULES_REPORT": str(mods / "{pid}.txt")}
    env.pop("DGX_SPARK_ROOT", None)
    p = subprocess.run(server_command() + ["demo", "--root", str(root), "--gguf", "no"], capture_output=True, text=True,
                       env=env, timeout=900)
    out = p.stdout
    assert p.returncode == 0, out[-4000:] + p.stderr[-4000:]
    # each phase showed what happened
    for needle in ("prepare_dataset(", "preflight(", "generate_config(", "launch_run(", "status: succeeded",
                   "triage_failure(", "evaluate_checkpoint(", "record_verdict(", "export(", "Where everything landed"):
        assert needle in out, f"missing {needle!r} in demo output"
    # progress lines are printed exactly as the records
    recs = [json.loads(l.strip()) for l in out.splitlines() if l.strip().startswith('{"step"')]
    assert recs and all(list(r) == ["step", "loss", "lr", "mem_gb", "temp_c"] for r in recs)
    # the absurd learning rate was diagnosed as divergence, learning-rate cause
    assert "divergence" in out and "cause learning-rate: explains" in out
    # the fine-tuned model beats the base model on held-out prompts, and the run was promoted and exported
    assert "record_verdict(" in out and "PROMOTE" in out
    exp_dirs = list((root / "experiments" / "trainings").iterdir())
    assert len(exp_dirs) == 1
    runs = sorted((root / "outputs" / "trainings" / exp_dirs[0].name).iterdir())
    assert len(runs) == 2
    good = [r for r in runs if r.name.endswith("r8-demo")][0]
    assert (good / "adapter" / "DIGEST").is_file() and (good / "promotion-report.md").is_file()
    assert (good / "export" / "export-report.md").is_file() or any(good.glob("export*/export-report.md"))
    # neither server process ever imported the heavy stack
    reports = list(mods.glob("*.txt"))
    assert len(reports) >= 3, reports
    for r in reports:
        loaded = sorted(m for m in r.read_text().split() if m.split(".")[0] in HEAVY)
        assert loaded == [], f"{r.name}: server imported {loaded}"
