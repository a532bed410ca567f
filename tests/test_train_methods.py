"""The rendered train.py, run for real on the embedded model: every TRL method learns, and the run-directory contract holds.

Each method's experiment is prepared from the synthetic task's generators and a real preflight
(replaying this machine's recorded observation), configured by generate_config, snapshotted with
resolve_run_config as launch_run does, and trained as a subprocess in the training Python — two at a
time, one thread each. The learning signal is read back from the run's own logs and checked here,
not taken from train.py's summary: SFT's loss falls, the preference methods' chosen-minus-rejected
margin rises, GRPO's mean reward rises.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import call_tool, prepare_experiment
import yaml

from finetune_mcp import digest
from finetune_mcp.domain import recipes as C
from finetune_mcp.worker import child_env, train_python
from finetune_mcp.workspace import git

# Steps per method: enough for the signal to stand clear of batch noise on the embedded model,
# measured here (the margins need ~100 steps; GRPO's format reward rises within ~40).
STEPS = {"sft-lora": 60, "dpo": 120, "orpo": 120, "kto": 120, "simpo": 120, "grpo": 60}
RUN_ID = "20260101-0000-t"
PROGRESS_KEYS = ["step", "loss", "lr", "mem_gb", "temp_c"]


def start(run_dir: Path, python: str | None = None, threads: int = 1) -> subprocess.Popen:
    env = child_env({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    out = open(run_dir / "logs" / "stdout.log", "ab")
    return subprocess.Popen([python or train_python(), "train.py", "--config", str(run_dir / "config.yaml")],
                            cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def make_run(pc, experiment: str, tag: str, run_id: str = RUN_ID) -> Path:
    """What launch_run does before it starts the process: the run dir, config.yaml, a copy of train.py (and masking.py)."""
    exp_dir = pc.ws.experiments_dir / experiment
    run_dir = pc.ws.output_root / experiment / run_id
    run_dir.mkdir(parents=True)
    meta = {"run_id": f"{experiment}/{run_id}", "run_dir": str(run_dir), "experiment_commit": None,
            "launcher": "test", "created_at": "2026-01-01T00:00:00+00:00"}
    cfg = C.resolve_run_config(exp_dir, tag, meta)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copy2(exp_dir / "train.py", run_dir / "train.py")
    if (exp_dir / "masking.py").is_file():  # the SFT family's declared copy of common/masking.py, beside train.py
        shutil.copy2(exp_dir / "masking.py", run_dir / "masking.py")
    return run_dir


def run_all(jobs: dict[str, Path], parallel: int = 2, timeout: float = 900) -> dict[str, int]:
    pending, running, codes = list(jobs.items()), {}, {}
    deadline = time.monotonic() + timeout
    while pending or running:
        while pending and len(running) < parallel:
            name, run_dir = pending.pop(0)
            running[name] = start(run_dir)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                codes[name] = proc.returncode
                del running[name]
        if time.monotonic() > deadline:
            for proc in running.values():
                os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError(f"runs still going after {timeout}s: {sorted(running)}")
        time.sleep(0.5)
    return codes


def stdout_tail(run_dir: Path, n: int = 3000) -> str:
    p = run_dir / "logs" / "stdout.log"
    return p.read_text(errors="replace")[-n:] if p.exists() else "(no stdout.log)"


def history(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "logs" / "log_history.jsonl").read_text().splitlines() if l.strip()]


def quarters(values: list[float]) -> tuple[float, float]:
    k = max(1, len(values) // 4)
    return sum(values[:k]) / k, sum(values[-k:]) / k


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("train-methods") / "dgx-spark"
    root.mkdir()
    jobs, pcs = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DGX_SPARK_ROOT", str(root))
        mp.delenv("OUTPUT_ROOT", raising=False)
        for method, steps in STEPS.items():
            pc, exp = prepare_experiment(root, tiny_model_dir, method, monkeypatch=mp)
            call_tool("generate_config", pc, exp, "t", overrides={"max_steps": steps, "save_steps": steps, "telemetry_interval_s": 1.0})
            jobs[method] = make_run(pc, exp, "t")
            pcs[method] = (pc, exp)
        started = time.monotonic()
        codes = run_all(jobs)
        print(f"\n[test_train_methods] {len(jobs)} runs in {time.monotonic() - started:.0f}s (2 at a time, 1 thread each)")
    return {m: {"dir": jobs[m], "rc": codes[m], "pc": pcs[m][0], "experiment": pcs[m][1]} for m in jobs}


def _check_contract(r: dict, method: str) -> None:
    run_dir = r["dir"]
    assert r["rc"] == 0, f"{method} exited {r['rc']}:\n{stdout_tail(run_dir)}"
    lines = (run_dir / "logs" / "progress.jsonl").read_text().splitlines()
    records = [json.loads(l) for l in lines]
    assert len(records) == STEPS[method], f"one record per logging step (logging_steps 1), got {len(records)}"
    for rec in records:
        assert list(rec) == PROGRESS_KEYS, rec
        assert isinstance(rec["step"], int) and isinstance(rec["lr"], float) and math.isfinite(rec["loss"])
        assert isinstance(rec["mem_gb"], float) and rec["mem_gb"] > 0
        assert rec["temp_c"] is None or isinstance(rec["temp_c"], float)
    assert [x["step"] for x in records] == list(range(1, STEPS[method] + 1))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "succeeded" and metrics["global_step"] == STEPS[method] and metrics["method"] == method
    ok, actual, recorded = digest.verify_folder(run_dir / "adapter")
    assert ok and metrics["adapter"]["digest"] == actual
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    adapter_cfg = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 8 and sorted(adapter_cfg["modules_to_save"]) == ["embed_tokens", "lm_head"]
    assert not any(p.name in ("optimizer.pt", "scheduler.pt") for p in (run_dir / "adapter").iterdir())
    assert (run_dir / "checkpoints" / f"checkpoint-{STEPS[method]}").is_dir()
    assert list((run_dir / "logs").glob("events.out.tfevents.*")), "TensorBoard events"
    assert (run_dir / "loss.png").stat().st_size > 1000


def test_sft_lora_loss_falls(runs):
    r = runs["sft-lora"]
    _check_contract(r, "sft-lora")
    losses = [json.loads(l)["loss"] for l in (r["dir"] / "logs" / "progress.jsonl").read_text().splitlines()]
    first, last = quarters(losses)
    print(f"SFT-LoRA loss: first quarter {first:.3f} -> last quarter {last:.3f}")
    assert last < 0.7 * first, (first, last)
    ev = json.loads((r["dir"] / "metrics.json").read_text())["eval"]
    assert ev and ev["eval_loss"] < first


@pytest.mark.parametrize("method", ["dpo", "orpo", "kto", "simpo"])
def test_preference_margin_rises(runs, method):
    r = runs[method]
    _check_contract(r, method)
    margins = [h["rewards/margins"] for h in history(r["dir"]) if "rewards/margins" in h and "loss" in h]
    assert len(margins) == STEPS[method]
    first, last = quarters(margins)
    print(f"{method} chosen-minus-rejected margin: first quarter {first:.4f} -> last quarter {last:.4f}")
    assert last > first, (first, last)
    assert json.loads((r["dir"] / "metrics.json").read_text())["signal"]["moved_as_expected"] is True


def test_grpo_mean_reward_rises(runs):
    r = runs["grpo"]
    _check_contract(r, "grpo")
    h = [x for x in history(r["dir"]) if "reward" in x]
    rewards = [x["reward"] for x in h]
    first, last = quarters(rewards)
    print(f"GRPO mean reward: first quarter {first:.3f} -> last quarter {last:.3f}")
    assert last > first + 0.2, (first, last)
    # both of the brief's reward functions ran, under their brief names
    assert "rewards/exact_match/mean" in h[-1] and "rewards/format/mean" in h[-1]


def test_sigterm_saves_a_checkpoint_and_exits_143(runs, tiny_model_dir):
    pc, exp = runs["sft-lora"]["pc"], runs["sft-lora"]["experiment"]
    call_tool("generate_config", pc, exp, "long", overrides={"max_steps": 100000, "save_steps": 100000})
    run_dir = make_run(pc, exp, "long", "20260101-0001-long")
    proc = start(run_dir, threads=2)
    progress = run_dir / "logs" / "progress.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.exists() and len(progress.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before it could be stopped:\n{stdout_tail(run_dir)}"
    os.kill(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=120)
    assert rc == 143, f"exit {rc}:\n{stdout_tail(run_dir)}"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "stopped"
    step = metrics["global_step"]
    ckpt = run_dir / "checkpoints" / f"checkpoint-{step}"
    assert ckpt.is_dir() and (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "optimizer.pt").is_file()
    assert not (run_dir / "adapter").exists(), "a stopped run has no final adapter"
    assert "saving a checkpoint" in stdout_tail(run_dir)


def test_train_sh_snapshots_the_resolved_config_then_trains(runs):
    pc, exp = runs["sft-lora"]["pc"], runs["sft-lora"]["experiment"]
    call_tool("generate_config", pc, exp, "sh", overrides={"max_steps": 4, "save_steps": 4})
    exp_dir = pc.ws.experiments_dir / exp
    out_root = pc.ws.root / "elsewhere"
    env = child_env({"RUN_TAG": "sh", "OUTPUT_ROOT": str(out_root), "TRAIN_PYTHON": train_python(),
                     "DGX_SPARK_ROOT": str(pc.ws.root), "OMP_NUM_THREADS": "2"})
    p = subprocess.run(["bash", str(exp_dir / "train.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (run_dir,) = list((out_root / exp).iterdir())
    assert re.fullmatch(r"\d{8}-\d{4}-sh", run_dir.name)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    meta = cfg["run"]
    assert meta["run_id"] == f"{exp}/{run_dir.name}" and meta["run_dir"] == str(run_dir) and meta["launcher"] == "train.sh"
    assert meta["experiment_commit"] == git(pc.ws.experiments_repo, "rev-parse", "HEAD").strip()
    assert cfg == C.resolve_run_config(exp_dir, "sh", meta), "train.sh and launch_run merge the same way"
    assert (run_dir / "train.py").read_bytes() == (exp_dir / "train.py").read_bytes()
    assert (run_dir / "env-report.json").is_file() and (run_dir / "training-brief.md").is_file()
    assert digest.verify_folder(run_dir / "adapter")[0]
    assert "[train.py] done: step 4" in (run_dir / "logs" / "stdout.log").read_text()
    # A second start with uncommitted changes is refused before anything is created.
    (exp_dir / "train.py").write_text((exp_dir / "train.py").read_text() + "\n# edited\n")
    p = subprocess.run(["bash", str(exp_dir / "train.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "uncommitted changes" in p.stderr
    assert len(list((out_root / exp).iterdir())) == 1
    git(pc.ws.experiments_repo, "checkout", "--", str(exp_dir / "train.py"))


# ---------------------------------------------------------------- Unsloth, in its own training environment

UNSLOTH_PYTHON = os.environ.get("FINETUNE_MCP_UNSLOTH_PYTHON")


@pytest.mark.skipif(not UNSLOTH_PYTHON, reason="SKIPPED LOUDLY: set FINETUNE_MCP_UNSLOTH_PYTHON to the python of an "
                    "Unsloth training environment (bash .ci/unsloth-env.sh builds .venv-unsloth) to run the Unsloth SFT test")
def test_unsloth_sft_lora_runs_in_its_own_environment(ws_root, tiny_model_dir, monkeypatch):
    assert Path(UNSLOTH_PYTHON).exists(), f"FINETUNE_MCP_UNSLOTH_PYTHON={UNSLOTH_PYTHON} does not exist"
    pc, exp = prepare_experiment(ws_root, tiny_model_dir, "sft-lora", monkeypatch=monkeypatch)
    r = call_tool("generate_config", pc, exp, "u", backend="unsloth", overrides={"max_steps": 40, "save_steps": 40})
    assert r.backend == "unsloth"
    run_dir = make_run(pc, exp, "u")
    proc = start(run_dir, python=UNSLOTH_PYTHON, threads=2)
    rc = proc.wait(timeout=900)
    assert rc == 0, stdout_tail(run_dir)
    assert "Unsloth" in stdout_tail(run_dir, 100000)
    losses = [json.loads(l)["loss"] for l in (run_dir / "logs" / "progress.jsonl").read_text().splitlines()]
    first, last = quarters(losses)
    print(f"Unsloth SFT-LoRA loss: first quarter {first:.3f} -> last quarter {last:.3f}")
    assert len(losses) == 40 and last < 0.8 * first
    assert digest.verify_folder(run_dir / "adapter")[0]


# ---------------------------------------------------------------- on a GPU machine

def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="SKIPPED LOUDLY: no NVIDIA GPU here; QLoRA on CUDA runs on a GPU machine (pytest -m gpu)")
@pytest.mark.parametrize("backend", ["trl", "unsloth"])
def test_qlora_on_cuda(ws_root, tiny_model_dir, backend, monkeypatch):
    """A real preflight of this machine, then SFT-QLoRA for 30 steps with bitsandbytes 4-bit weights."""
    from finetune_mcp.context import PhaseContext
    from finetune_mcp.domain import machine as P

    python = UNSLOTH_PYTHON if backend == "unsloth" else train_python()
    if backend == "unsloth" and not python:
        pytest.skip("SKIPPED LOUDLY: FINETUNE_MCP_UNSLOTH_PYTHON is not set")
    if subprocess.run([python, "-c", "import bitsandbytes"], capture_output=True).returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: bitsandbytes does not import in {python}; QLoRA needs it")
    pc, exp = prepare_experiment(ws_root, tiny_model_dir, "sft-qlora", monkeypatch=monkeypatch)
    monkeypatch.delenv(P.REPLAY_ENV, raising=False)
    call_tool("preflight", PhaseContext.for_role("training-engineer"), exp)
    r = call_tool("generate_config", pc, exp, "q", backend=backend, overrides={"max_steps": 30, "save_steps": 30})
    assert r.resolved["load_in_4bit"].value is True
    run_dir = make_run(pc, exp, "q")
    rc = start(run_dir, python=python, threads=4).wait(timeout=900)
    assert rc == 0, stdout_tail(run_dir)
    losses = [json.loads(l)["loss"] for l in (run_dir / "logs" / "progress.jsonl").read_text().splitlines()]
    first, last = quarters(losses)
    assert last < first and digest.verify_folder(run_dir / "adapter")[0]
