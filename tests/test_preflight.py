"""Preflight: recorded machines replay to the right checks and verdict; the real probe here reports cpu;
env-report.json is written whole; the memory estimate counts parameters exactly; telemetry reads real processes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from finetune_mcp import telemetry
from finetune_mcp.context import PhaseContext
from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.jobs import probe_env
from finetune_mcp.domain import memory
from finetune_mcp.domain import machine as P
from finetune_mcp.domain import recipes
from finetune_mcp.skills import load_skills
from finetune_mcp.workspace import Workspace

from conftest import call_tool  # noqa: E402
from conftest import mcp_session

FIX = Path(__file__).parent / "fixtures"
OBS = FIX / "observations"
LLAMA_8B = FIX / "models" / "llama-3.1-8b" / "config.json"

BRIEF = """\
# Training brief: repeat words
## Task
repeat-words — repeat three words back
## Base Model
finetune-mcp-tiny
## Chosen Method
SFT-LoRA
## Dataset Expectation
format: messages
max_seq_length: 128
## Memory Budget
4 GB
## Deployment Target
transformers (merged-16bit)
"""
EXPERIMENT = "finetune-mcp-tiny-SFT-LoRA-repeat-words"


@pytest.fixture(scope="module")
def skills():
    return load_skills()


def obs(name: str) -> dict:
    return json.loads((OBS / name).read_text())


def tiny_model(tmp_path) -> dict:
    # Not built in tmp_path: the estimate then uses the builder's shape (the built model is checked below).
    return memory.load_model_info(tmp_path, "finetune-mcp-tiny")


def llama_8b() -> dict:
    return {"name": "meta-llama/Llama-3.1-8B", "config": memory.model_shape(json.loads(LLAMA_8B.read_text()))}


TINY_BRIEF = {"base_model": "finetune-mcp-tiny", "method": "sft-lora", "max_seq_length": 128, "memory_budget_gb": 4}


def run(observation: dict, model: dict, skills, brief=TINY_BRIEF) -> dict:
    o = copy.deepcopy(observation)
    o["model"] = model
    r = P.evaluate(o, brief, skills)
    r["by_id"] = {c.id: c for c in r["checks"]}
    r["statuses"] = {c.id: c.status for c in r["checks"]}
    return r


# ---------------------------------------------------------------- replays of recorded / constructed machines

ALL_PASS_G = {**{f"G{i}": "pass" for i in range(1, 8)}, "T1": "pass"}
ALL_PASS_N = {**{f"N{i}": "pass" for i in range(1, 8)}, "T1": "pass"}


@pytest.mark.parametrize(
    "fixture, platform, verdict, statuses",
    [
        ("gb10.json", "dgx-spark", "ready", ALL_PASS_G),
        ("h100.json", "generic-nvidia", "ready", ALL_PASS_N),
        ("t4.json", "generic-nvidia", "ready-with-warnings", {**ALL_PASS_N, "N5": "warn"}),
        ("old-driver.json", "generic-nvidia", "blocked", {**ALL_PASS_N, "N1": "fail", "N2": "fail", "N5": "warn"}),
        ("full-disk.json", "generic-nvidia", "blocked", {**ALL_PASS_N, "N4": "fail"}),
        ("missing-cuda-build.json", "generic-nvidia", "blocked", {**ALL_PASS_N, "N2": "fail", "N6": "warn"}),
        ("cpu-this-machine.json", "cpu", "ready", {"N3": "pass", "N4": "pass", "N6": "pass", "N7": "pass", "C1": "pass", "T1": "pass"}),
    ],
)
def test_replay_gives_platform_checks_and_verdict(fixture, platform, verdict, statuses, skills, tmp_path):
    r = run(obs(fixture), tiny_model(tmp_path), skills)
    assert r["platform"] == platform
    assert r["statuses"] == statuses, {c.id: c.observed for c in r["checks"] if c.status != statuses.get(c.id)}
    assert r["verdict"] == verdict
    for c in r["checks"]:
        assert c.cite.startswith("spark-preflight#") and c.observed and c.threshold
        assert (c.remediation is None) == (c.status == "pass")


def test_replays_are_exact(skills, tmp_path):
    o = obs("gb10.json")
    a = run(o, tiny_model(tmp_path), skills)
    b = run(o, tiny_model(tmp_path), skills)
    assert [c.model_dump() for c in a["checks"]] == [c.model_dump() for c in b["checks"]]
    assert a["memory_estimate"] == b["memory_estimate"]


def test_t4_warns_for_missing_bf16_with_the_fp16_remedy(skills, tmp_path):
    c = run(obs("t4.json"), tiny_model(tmp_path), skills)["by_id"]["N5"]
    assert "no native bf16 (only emulated)" in c.observed and "7.5" in c.observed
    assert "fp16" in c.remediation and c.cite == "spark-preflight#n5"


def test_old_driver_names_the_driver_and_quotes_torch(skills, tmp_path):
    r = run(obs("old-driver.json"), tiny_model(tmp_path), skills)["by_id"]
    assert "driver 470.223.02" in r["N1"].observed and "525" in r["N1"].threshold
    assert "too old (found version 11040)" in r["N2"].observed


def test_missing_cuda_build_says_cpu_only(skills, tmp_path):
    r = run(obs("missing-cuda-build.json"), tiny_model(tmp_path), skills)["by_id"]
    assert "CPU-only" in r["N2"].observed
    assert "CPU-only torch on a GPU machine" in r["N2"].remediation
    assert "unsloth FAILED" in r["N6"].observed and 'backend="trl"' in r["N6"].remediation


def test_full_disk_fails_storage(skills, tmp_path):
    c = run(obs("full-disk.json"), tiny_model(tmp_path), skills)["by_id"]["N4"]
    assert "0.3 GB free" in c.observed and "prune_checkpoints" in c.remediation


# ---------------------------------------------------------------- DGX Spark variations of the GB10 replay


def test_gb10_without_ptxas_override_warns_with_triton_fix(skills, tmp_path):
    o = obs("gb10.json")
    del o["env"]["triton_ptxas"]["env"]["TRITON_PTXAS_PATH"]
    r = run(o, tiny_model(tmp_path), skills)
    assert r["statuses"]["G6"] == "warn" and r["verdict"] == "ready-with-warnings"
    assert "bundled ptxas = CUDA 12.8" in r["by_id"]["G6"].observed
    assert "TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas" in r["by_id"]["G6"].remediation


def test_gb10_with_a_cuda12_torch_is_blocked(skills, tmp_path):
    o = obs("gb10.json")
    o["env"]["torch"].update(version="2.8.0+cu128", cuda_build="12.8", arch_list=["sm_80", "sm_90", "sm_100", "sm_120"])
    r = run(o, tiny_model(tmp_path), skills)
    assert r["statuses"]["G2"] == "fail" and r["verdict"] == "blocked"
    assert "libcudart.so.12" in r["by_id"]["G2"].remediation


def test_gb10_page_cache_warns_with_drop_caches(skills):
    o = obs("gb10.json")
    o["host"]["memory"].update(free_gb=10.0, cached_gb=108.0)
    brief = {"base_model": "meta-llama/Llama-3.1-8B", "method": "sft-lora", "max_seq_length": 2048, "memory_budget_gb": 96}
    r = run(o, llama_8b(), skills, brief)
    g3 = r["by_id"]["G3"]
    assert g3.status == "warn", g3.observed
    assert "drop_caches" in g3.remediation and "MemFree 10.0 GB" in g3.observed


def test_gb10_estimate_above_available_memory_fails(skills):
    o = obs("gb10.json")
    o["host"]["memory"].update(available_gb=12.0, free_gb=12.0)
    brief = {"base_model": "meta-llama/Llama-3.1-8B", "method": "sft-lora", "max_seq_length": 2048, "memory_budget_gb": 96}
    assert run(o, llama_8b(), skills, brief)["statuses"]["G3"] == "fail"


def test_over_budget_warns_on_any_platform(skills):
    brief = {"base_model": "meta-llama/Llama-3.1-8B", "method": "sft-lora", "max_seq_length": 2048, "memory_budget_gb": 8}
    c = run(obs("h100.json"), llama_8b(), skills, brief)["by_id"]["N3"]
    assert c.status == "warn" and "budget" in c.remediation


def test_gb10_without_nvml_fails_g1(skills, tmp_path):
    o = obs("gb10.json")
    o["host"]["nvml"] = {"available": False, "error": "NVMLError_LibraryNotFound: NVML Shared Library Not Found",
                         "driver_version": None, "cuda_driver_version": None, "devices": []}
    r = run(o, tiny_model(tmp_path), skills)
    assert r["platform"] == "dgx-spark"  # torch still sees the integrated sm_121 device
    assert r["statuses"]["G1"] == "fail" and "--gpus all" in r["by_id"]["G1"].remediation


def test_missing_model_blocks(skills):
    r = run(obs("h100.json"), {"name": "org/absent", "error": "base model 'org/absent' is not in the local HF cache"}, skills)
    assert r["statuses"]["N3"] == "fail" and r["verdict"] == "blocked"


def test_cpu_qlora_warns(skills, tmp_path):
    r = run(obs("cpu-this-machine.json"), tiny_model(tmp_path), skills, {**TINY_BRIEF, "method": "sft-qlora"})
    assert r["statuses"]["C1"] == "warn" and "SFT-LoRA" in r["by_id"]["C1"].remediation


SHAPE = {"micro_batch": 2, "grad_accum": 4, "epochs": 3.0, "max_steps": -1, "lora_r": 16, "lora_targets": ["q", "k", "v", "o"],
         "max_seq_length": 512, "tokens_per_sequence": 379, "sequences_per_example": 1, "reference_forward": False,
         "train_rows": 57, "gradient_checkpointing": False}
PROBE = {"device": "cpu", "steps": 3, "first_step_s": 5.0, "s_per_micro_step": 3.5, "batch_shape": [2, 379], "peak_gb": 4.1}


def test_time_estimate_is_steps_times_measured_seconds(skills, tmp_path):
    """3 epochs x ceil(57 / (2 x 4)) = 24 steps of 4 x 3.5 s, plus the first step: 341 s."""
    o = {**obs("cpu-this-machine.json"), "model": tiny_model(tmp_path), "step_probe": PROBE}
    r = P.evaluate(o, {**TINY_BRIEF, "time_budget_s": None}, skills, SHAPE)
    t = r["time_estimate"]
    assert (t["steps"], t["s_per_step"], t["wall_s"]) == (24, 14.0, 24 * 14.0 + 5.0)
    assert next(c for c in r["checks"] if c.id == "T1").status == "pass"
    # The same run against a 5-minute budget warns, and the remedy names the ways to shorten it.
    r = P.evaluate(o, {**TINY_BRIEF, "time_budget_s": 300}, skills, SHAPE)
    t1 = next(c for c in r["checks"] if c.id == "T1")
    assert t1.status == "warn" and "max_steps" in t1.remediation and r["time_estimate"]["within_budget"] is False
    # max_steps caps the run: 10 steps.
    r = P.evaluate(o, {**TINY_BRIEF, "time_budget_s": 300}, skills, {**SHAPE, "max_steps": 10})
    assert r["time_estimate"]["steps"] == 10 and next(c for c in r["checks"] if c.id == "T1").status == "pass"


def test_time_is_read_at_the_average_padded_length(skills, tmp_path):
    """A batch pads to its own longest row: the micro-step is read at the timed average shape, not the longest;
    another shape (generate_config's batch) is read on the line through the two timed shapes."""
    probe = {**PROBE, "expected": {"batch_shape": [2, 120], "s_per_micro_step": 1.5}}
    o = {**obs("cpu-this-machine.json"), "model": tiny_model(tmp_path), "step_probe": probe}
    t = P.evaluate(o, {**TINY_BRIEF, "time_budget_s": None}, skills, {**SHAPE, "time_tokens_per_sequence": 120})["time_estimate"]
    assert (t["tokens_per_sequence"], t["s_per_micro_step"], t["s_per_step"]) == (120, 1.5, 6.0) and "timed at 2 x 120" in t["how"]
    # 8 x 200 = 1600 row-tokens: on the line through (758, 3.5 s) and (240, 1.5 s)
    s8, how = recipes.seconds_per_micro_step(probe, 8, 200)
    assert abs(s8 - (1.5 + (1600 - 240) * 2.0 / 518)) < 1e-9 and "line through" in how
    # one timed shape (a recorded observation from before): proportional to the tokens
    assert recipes.seconds_per_micro_step(PROBE, 2, 190) == (3.5 * 380 / 758, "scaled by tokens from the timed 2 x 379")


def test_average_padded_length_from_the_length_quantiles():
    """E[longest of b random rows] from the quantiles prepare_dataset records, against drawing batches from the rows."""
    import random

    from finetune_mcp.jobs.prepare_data import _stats
    from finetune_mcp.domain.recipes import expected_padded_tokens

    rng = random.Random(7)
    # a chat set's shape: most rows short, a long tail (SmolLM2 identity rows: p50 51, p90 100, max 195)
    lengths = [int(rng.lognormvariate(4.0, 0.45)) + 30 for _ in range(3000)]
    meta = {"tokens": {"tokens_per_sequence": _stats(lengths)}}
    for b in (1, 2, 4, 8, 16):
        drawn = sum(max(rng.choices(lengths, k=b)) for _ in range(20000)) / 20000
        est = expected_padded_tokens(meta, 4096, False, b)
        assert abs(est - drawn) <= 0.1 * drawn, (b, est, drawn)
    assert expected_padded_tokens(meta, 4096, True, 4) == 4096  # packed rows are full
    assert expected_padded_tokens(meta, 64, False, 4) <= 64  # capped at max_seq_length
    assert expected_padded_tokens({}, 512, False, 4) == 512  # no prepared data


def test_memory_estimate_uses_the_shape(skills, tmp_path):
    """The shape's micro batch and the data's longest sequence, not micro batch 1 at max_seq_length."""
    o = {**obs("cpu-this-machine.json"), "model": tiny_model(tmp_path)}
    est = P.evaluate(o, TINY_BRIEF, skills, SHAPE)["memory_estimate"]
    assert (est["micro_batch_size"], est["tokens_per_sequence"], est["lora_r"]) == (2, 379, 16)


# ---------------------------------------------------------------- arch coverage (CUDA binary compatibility)


@pytest.mark.parametrize(
    "arch, cap, how",
    [
        (["sm_80", "sm_90", "sm_100", "sm_110", "sm_120", "compute_120"], (12, 1), "cubin"),
        (["sm_80", "compute_120"], (12, 1), "ptx"),
        (["sm_90a"], (12, 1), "none"),
        (["sm_80", "sm_86", "sm_90"], (7, 5), "none"),
        (["sm_75"], (7, 5), "cubin"),
        (["sm_86"], (8, 0), "none"),
    ],
)
def test_arch_coverage(arch, cap, how):
    assert P.arch_coverage(arch, cap)[0] == how


# ---------------------------------------------------------------- memory estimate


def test_param_counts_match_the_built_tiny_model(tiny_model_dir):
    info = memory.load_model_info(tiny_model_dir.parent, "finetune-mcp-tiny")
    assert info["safetensors_params"] == memory.param_counts(info["config"])["total"]


def test_llama_8b_counts(skills):
    s = llama_8b()["config"]
    assert memory.param_counts(s)["total"] == 8_030_261_248  # the published parameter count
    assert memory.lora_params(s, 16, ["q", "k", "v", "o", "gate", "up", "down"]) == 41_943_040  # PEFT's trainable count
    est = memory.estimate(llama_8b(), "sft-lora", 2048, "dgx-spark", skills.table("spark-preflight", "memory"))
    # 2 bytes x (8 + (2q + 2kv + 4i + the adapted projections' outputs) / h), skill spark-preflight#memory-estimate:
    # q = 4096, kv = 1024, i = 14336; adapted outputs q + k + v + o + gate + up + down = 43008.
    assert est["k_bytes_per_token_hidden_layer"] == 2 * (8 + (2 * 4096 + 2 * 1024 + 4 * 14336 + 43008) / 4096) == 70.0
    assert 16.0 < est["gb"]["weights"] < 16.2  # 2 bytes x 8.03e9


def test_estimate_responds_to_method_precision_and_batch(skills):
    t = skills.table("spark-preflight", "memory")
    m = llama_8b()
    lora = memory.estimate(m, "sft-lora", 2048, "generic-nvidia", t)
    qlora = memory.estimate(m, "sft-qlora", 2048, "generic-nvidia", t)
    dpo = memory.estimate(m, "dpo", 2048, "generic-nvidia", t)
    grpo = memory.estimate(m, "grpo", 2048, "generic-nvidia", t)
    cpu = memory.estimate(m, "sft-lora", 2048, "cpu", t)
    big_batch = memory.estimate(m, "sft-lora", 2048, "generic-nvidia", t, micro_batch_size=4)
    assert qlora["gb"]["weights"] < lora["gb"]["weights"] / 2.5
    assert dpo["gb"]["activations"] == pytest.approx(2 * lora["gb"]["activations"], rel=1e-3)
    assert grpo["gb"]["kv_cache"] > 0 and lora["gb"]["kv_cache"] == 0
    assert cpu["gb"]["weights"] == pytest.approx(2 * lora["gb"]["weights"], rel=1e-3)
    assert not cpu["gradient_checkpointing"] and lora["gradient_checkpointing"]
    assert big_batch["gb"]["activations"] == pytest.approx(4 * lora["gb"]["activations"], rel=1e-3)


def test_qlora_on_a_cpu_counts_the_mapped_checkpoint_and_unsloth_its_stack(skills):
    """4-bit on a CPU keeps the stored projections mapped beside the 4-bit copy; Unsloth's stack is heavier there.
    The figures these terms must reproduce are bench/bench_memory.py's (estimate within ±20 % of the run's peak)."""
    t = skills.table("spark-preflight", "memory")
    m = llama_8b()
    bf16 = {**m, "config": {**m["config"], "checkpoint_dtype": "bfloat16"}}
    fp32 = {**m, "config": {**m["config"], "checkpoint_dtype": "float32"}}
    linear = memory.param_counts(m["config"])["linear"]
    gpu = memory.estimate(bf16, "sft-qlora", 2048, "generic-nvidia", t)
    cpu_bf16 = memory.estimate(bf16, "sft-qlora", 2048, "cpu", t)
    cpu_fp32 = memory.estimate(fp32, "sft-qlora", 2048, "cpu", t)
    cpu_lora = memory.estimate(fp32, "sft-lora", 2048, "cpu", t)
    assert cpu_fp32["gb"]["weights"] - cpu_bf16["gb"]["weights"] == pytest.approx(linear * 2 / 1e9, abs=2e-3)
    assert cpu_bf16["gb"]["weights"] > gpu["gb"]["weights"] + linear * 2 / 1e9 * 0.99  # fp32 rest + the mapped projections
    assert cpu_fp32["gb"]["weights"] < cpu_lora["gb"]["weights"] * 1.2  # never more than the full-precision model, roughly
    unsloth = memory.estimate(fp32, "sft-qlora", 2048, "cpu", t, backend="unsloth")
    assert unsloth["gb"]["overhead"] == t.overhead_gb["cpu_unsloth"] > cpu_fp32["gb"]["overhead"] == t.overhead_gb["cpu"]
    assert memory.estimate(bf16, "sft-qlora", 2048, "generic-nvidia", t, backend="unsloth")["gb"]["overhead"] == t.overhead_gb["cuda"]


def test_model_shape_refuses_configs_without_sizes():
    with pytest.raises(BadInput, match="hidden_size"):
        memory.model_shape({"model_type": "llama", "vocab_size": 10})


# ---------------------------------------------------------------- the recorded format equals what the probe writes


def test_fixture_devices_have_the_probe_keys():
    for f in sorted(OBS.glob("*.json")):
        o = json.loads(f.read_text())
        assert o["format"] == P.OBSERVATION_FORMAT and o["note"], f.name
        for d in o["host"]["nvml"]["devices"]:
            assert tuple(d) == telemetry.NVML_DEVICE_KEYS, f.name
        for d in o["env"]["torch"]["devices"]:
            assert tuple(d) == probe_env.TORCH_DEVICE_KEYS, f.name
        if f.name != "cpu-this-machine.json":
            assert o["note"].startswith("CONSTRUCTED replay"), f.name


def test_an_nvml_that_answers_nothing_still_yields_every_device_key():
    def fail(*_a, **_k):
        raise RuntimeError("NVML query failed")

    nv = SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN=1, NVML_TEMPERATURE_THRESHOLD_SHUTDOWN=0,
        NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2,
        **{n: fail for n in ("nvmlDeviceGetName", "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMemoryInfo",
                             "nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetEnforcedPowerLimit",
                             "nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo",
                             "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetComputeRunningProcesses")},
    )
    d = telemetry._device(nv, 0, object())
    assert tuple(d) == telemetry.NVML_DEVICE_KEYS
    assert d["memory"] == {"supported": False, "error": "RuntimeError: NVML query failed"}


def _nvml_gpus() -> list:
    return telemetry.probe_nvml()["devices"] if telemetry.nvml() is not None else []


def _shape(x):
    """Key structure of a JSON value, lists reduced to their first element's structure."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_shape(x[0])] if x and isinstance(x[0], dict) else []
    return None


# ---------------------------------------------------------------- the real probe on this machine, and the tool


def _experiment(ws_root: Path) -> PhaseContext:
    ws = Workspace.from_env()
    ws.ensure_dirs()
    d = ws.experiments_dir / EXPERIMENT
    d.mkdir(parents=True)
    (d / "training-brief.md").write_text(BRIEF)
    return PhaseContext.for_role("training-engineer", ws)


def test_real_probe_here_reports_cpu_and_records_a_replayable_observation(ws_root, tmp_path, monkeypatch):
    if _nvml_gpus():
        pytest.skip("this machine has an NVIDIA GPU; the cpu expectation below is for GPU-less CI")
    pc = _experiment(ws_root)
    record = tmp_path / "recorded.json"
    monkeypatch.setenv(P.RECORD_ENV, str(record))
    res = call_tool("preflight", pc, EXPERIMENT)

    assert res.platform == "cpu"
    assert [c.id for c in res.checks] == ["N3", "N4", "N6", "N7", "C1", "T1"]
    assert res.verdict == {"pass": "ready", "warn": "ready-with-warnings", "fail": "blocked"}[
        max((c.status for c in res.checks), key=["pass", "warn", "fail"].index)]
    # The training stack of this repository is installed in the training Python, so N6 must pass here.
    assert next(c for c in res.checks if c.id == "N6").status == "pass"
    assert res.memory_estimate["params"] == 205_120 and res.memory_estimate["platform"] == "cpu"

    report = json.loads(Path(res.env_report).read_text())
    for key in ("platform", "verdict", "checks", "observed", "created_at", "host"):
        assert key in report
    assert report["observed"]["host"]["nvml"]["available"] is False
    assert report["observed"]["env"]["torch"]["cuda_build"] is None
    assert not [p for p in Path(res.env_report).parent.iterdir() if p.name.startswith(".env-report")]

    # What the probe recorded has the fixtures' structure, and replays to the same report.
    recorded = P.load_observation(record)
    fixture = obs("cpu-this-machine.json")
    assert _shape(recorded["host"]) == _shape(fixture["host"])
    assert set(recorded["env"]) == set(fixture["env"]) and set(recorded["env"]["torch"]) == set(fixture["env"]["torch"])
    monkeypatch.delenv(P.RECORD_ENV)
    monkeypatch.setenv(P.REPLAY_ENV, str(record))
    again = call_tool("preflight", pc, EXPERIMENT)
    assert [(c.id, c.status, c.observed) for c in again.checks] == [(c.id, c.status, c.observed) for c in res.checks]
    assert json.loads(Path(again.env_report).read_text())["replayed_from"] == str(record)


def test_a_bad_replay_leaves_the_previous_report_intact(ws_root, tmp_path, monkeypatch):
    pc = _experiment(ws_root)
    monkeypatch.setenv(P.REPLAY_ENV, str(OBS / "t4.json"))
    first = call_tool("preflight", pc, EXPERIMENT)
    before = Path(first.env_report).read_bytes()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else", "host": {}, "env": {}}))
    monkeypatch.setenv(P.REPLAY_ENV, str(bad))
    with pytest.raises(BadInput, match="not a preflight observation"):
        call_tool("preflight", pc, EXPERIMENT)
    monkeypatch.setenv(P.REPLAY_ENV, str(tmp_path / "absent.json"))
    with pytest.raises(NotFound):
        call_tool("preflight", pc, EXPERIMENT)
    assert Path(first.env_report).read_bytes() == before


def test_preflight_through_mcp_replays_a_gb10(ws_root):
    _experiment(ws_root)

    async def main():
        async with mcp_session("training-engineer", env={P.REPLAY_ENV: str(OBS / "gb10.json")}) as s:
            return await s.call_tool("preflight", {"experiment": EXPERIMENT})

    res = anyio.run(main)
    assert not res.is_error, res.content[0].text
    sc = res.structured_content
    assert sc["platform"] == "dgx-spark" and sc["verdict"] == "ready"
    assert [c["id"] for c in sc["checks"]] == [f"G{i}" for i in range(1, 8)] + ["T1"]
    assert "spark-preflight#memory-estimate" in sc["citations"]
    text = res.content[0].text
    assert text.startswith("preflight ready on dgx-spark (spark-replay, replayed)") and "[PASS] G2" in text
    report = json.loads((ws_root / "experiments" / "trainings" / EXPERIMENT / "env-report.json").read_text())
    assert report["verdict"] == "ready" and report["host"] == "spark-replay"


@pytest.mark.gpu
def test_real_probe_on_a_gpu_machine(ws_root, tmp_path, skills):
    """On a GPU machine: the real probe sees the GPU. FINETUNE_MCP_RECORD_TO=<path> keeps the observation as a fixture."""
    if not _nvml_gpus():
        pytest.skip("NO NVIDIA GPU HERE: the real GPU probe was not exercised (NVML: %s)" % telemetry.nvml_error())
    ws = Workspace.from_env()
    ws.ensure_dirs()
    o = P.probe(ws)
    if os.environ.get("FINETUNE_MCP_RECORD_TO"):
        Path(os.environ["FINETUNE_MCP_RECORD_TO"]).write_text(json.dumps(o, indent=2) + "\n")
    o["model"] = tiny_model(tmp_path)
    r = P.evaluate(o, TINY_BRIEF, skills)
    assert r["platform"] in ("dgx-spark", "generic-nvidia")
    assert telemetry.mem_gb() is not None and telemetry.temp_c() is not None


# ---------------------------------------------------------------- telemetry on real processes


def test_mem_gb_counts_the_process_tree_without_a_gpu():
    if _nvml_gpus():
        pytest.skip("with a GPU, mem_gb reports GPU memory")
    base = telemetry.mem_gb()
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(300_000_000); time.sleep(30)"])
    try:
        grown = base
        for _ in range(100):
            grown = telemetry.mem_gb()
            if grown - base > 0.25:
                break
            time.sleep(0.05)
        assert grown - base > 0.25
        assert telemetry.mem_gb(pid_tree_root=child.pid) > 0.25
    finally:
        child.kill()
        child.wait()


def test_temp_c_is_a_reading_or_none():
    t = telemetry.temp_c()
    assert t is None or 0 < t < 130
    if telemetry.nvml() is None:
        assert "NVML" in (telemetry.nvml_error() or "") or "pynvml" in (telemetry.nvml_error() or "")


def test_train_py_snippet_runs_standalone_and_agrees(tmp_path):
    """The text templates paste into train.py works without finetune_mcp and measures what telemetry measures."""
    script = tmp_path / "snippet.py"
    script.write_text(telemetry.TRAIN_PY_SNIPPET + "\nimport json, sys\nassert 'finetune_mcp' not in sys.modules\n"
                      "b = bytearray(200_000_000)\nprint(json.dumps({'mem_gb': mem_gb(), 'temp_c': temp_c(), 'pid': os.getpid()}))\n"
                      "sys.stdout.flush()\nsys.stdin.read()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        got = json.loads(p.stdout.readline())
        ours = telemetry.mem_gb(pid_tree_root=got["pid"])
    finally:
        p.communicate("")
    assert p.returncode == 0
    if not _nvml_gpus():  # without a GPU both measure the process tree, which holds the 200 MB buffer
        assert got["mem_gb"] > 0.19
    assert abs(got["mem_gb"] - ours) < 0.05
    assert got["temp_c"] == telemetry.temp_c()


def test_a_brief_without_max_seq_length_is_estimated_at_the_recipe_default(skills):
    """prepare_dataset trains such a brief at the method recipe's max_seq_length; preflight estimates that run."""
    from finetune_mcp.domain.recipes import recipe_params

    default = recipe_params(skills, "sft-lora")["max_seq_length"].default
    brief = {"base_model": "meta-llama/Llama-3.1-8B", "method": "sft-lora", "max_seq_length": None, "memory_budget_gb": 96}
    est = run(obs("h100.json"), llama_8b(), skills, brief)["memory_estimate"]
    stated = run(obs("h100.json"), llama_8b(), skills, {**brief, "max_seq_length": default})["memory_estimate"]
    assert est and est["max_seq_length"] == default and est == stated


def test_step_probe_times_the_average_padded_shape_too(tiny_model_dir):
    """The real probe job: the longest shape (for the peak) and, when clearly shorter, the average padded one."""
    from finetune_mcp.worker import run_job

    params = {"model_path": str(tiny_model_dir), "steps": 3, "micro_batch": 2, "sequences_per_example": 1, "tokens_per_sequence": 256,
              "lora_r": 8, "lora_targets": ["q", "v"]}
    r = run_job("step_probe", {**params, "time_tokens_per_sequence": 64}, timeout=600)
    assert r["batch_shape"] == [2, 256] and r["expected"]["batch_shape"] == [2, 64]
    assert r["s_per_micro_step"] > 0 and r["expected"]["s_per_micro_step"] > 0
    near = run_job("step_probe", {**params, "time_tokens_per_sequence": 240}, timeout=600)
    assert near["expected"] is None  # within a tenth of the longest: one shape is timed
