"""launch_run / poll_progress / stop_run / prune_checkpoints end to end: real TRL runs on the tiny model,
real detached processes, driven through the MCP client over stdio.

The training runs use the experiment the tools themselves make (prepare_dataset, preflight, then
generate_config per test with its own tag), so what runs is the generated train.py. Other tests use
other scripts on purpose: a hand-written TRL script without our callback (stdout fallback), and
trainers that only wait or count signals where what runs does not matter (launch refusals, GPU
sharing, SIGKILL escalation, torchrun signal delivery).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import statistics
import time
from pathlib import Path

import anyio
import psutil
import pytest
import yaml

from conftest import EXP, KEYS, call_tool, finished, mcp_session, poll_until, refused, run_call, run_dir_of
from finetune_mcp.context import PhaseContext
from finetune_mcp.digest import verify_folder
from finetune_mcp.common import task
from finetune_mcp.workspace import Workspace, commit, ensure_repo

SCRIPTS = Path(__file__).parent / "fixtures" / "scripts"

CHECK_OK = {"id": "N3", "name": "memory vs estimate", "status": "pass", "observed": "20 GB free", "threshold": ">= 2 GB",
            "remediation": None, "cite": "spark-preflight#n3"}
CHECK_WARN = {"id": "N7", "name": "thermal", "status": "warn", "observed": "no temperature sensor readable",
              "threshold": "a readable sensor", "remediation": "watch temp_c stays null; nothing to fix on CPU",
              "cite": "spark-preflight#n7"}
CHECK_FAIL = {"id": "N4", "name": "storage", "status": "fail", "observed": "0.2 GB free at OUTPUT_ROOT",
              "threshold": ">= 10 GB", "remediation": "free space under OUTPUT_ROOT", "cite": "spark-preflight#n4"}


# ---------------------------------------------------------------- experiment set-up


def write_env_report(exp_dir: Path, verdict: str, checks: list[dict]) -> None:
    (exp_dir / "env-report.json").write_text(json.dumps({
        "platform": "cpu", "verdict": verdict, "checks": checks, "observed": {},
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(), "host": "test"}, indent=2))


def make_experiment(model_dir: Path, *, script: str = "sft_tiny.py", verdict: str = "ready", checks=None,
                    runs: dict[str, dict] | None = None) -> Path:
    """An experiment as prepare_dataset / preflight / generate_config leave it, with the given train.py and run configs, committed."""
    ws = Workspace.from_env()
    ensure_repo(ws.experiments_repo)
    exp = ws.experiments_dir / EXP
    (exp / "configs").mkdir(parents=True, exist_ok=True)
    (exp / "data").mkdir(exist_ok=True)
    data = ws.datasets_dir / "repeat-words" / "train.jsonl"
    if not data.exists():
        task.write_jsonl(task.sft_conversations(400, seed=0), data)
    (exp / "training-brief.md").write_text(task.sample_brief("sft-lora"))
    (exp / "data" / "dataset-card.md").write_text("# Dataset card\n\nrepeat-words, 400 rows\n")
    (exp / "data" / "validation-report.md").write_text("# Validation report\n\nno problems\n")
    write_env_report(exp, verdict, checks if checks is not None else [CHECK_OK])
    (exp / "configs" / "base.yaml").write_text(yaml.safe_dump({"model": {"path": str(model_dir)}, "data": {"train_file": str(data)}}))
    shutil.copyfile(SCRIPTS / script, exp / "train.py")
    paths = [exp / "configs" / "base.yaml", exp / "train.py"]
    for tag, cfg in (runs or {}).items():
        (exp / "configs" / f"run-{tag}.yaml").write_text(yaml.safe_dump(cfg))
        paths.append(exp / "configs" / f"run-{tag}.yaml")
    commit(ws.experiments_repo, paths, "test experiment")
    return exp


def training(max_steps=12, logging_steps=1, save_steps=10**6, step_sleep=0.0, lr=2e-3):
    return {"training": {"max_steps": max_steps, "learning_rate": lr, "logging_steps": logging_steps, "save_steps": save_steps,
                         "per_device_train_batch_size": 8, "max_length": 64, "seed": 0},
            "fixture": {"step_sleep": step_sleep}}


# No run a test here starts may outlive it (conftest's reaper).
pytestmark = pytest.mark.usefixtures("no_run_outlives_its_test")


# ---------------------------------------------------------------- MCP helpers


def server_pid() -> int:
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "serve" in cmd and "--role" in cmd:
            return p.pid
    raise AssertionError("no finetune-mcp server process found")


def wait_until_second_is_early() -> None:
    # Run ids carry the minute; keep a pair of launches inside one minute.
    while dt.datetime.now().second > 45:
        time.sleep(1)


# ---------------------------------------------------------------- tests


def test_tiny_sft_run_polled_to_completion_across_a_server_restart(pipeline, monkeypatch):
    pipeline.use(monkeypatch)
    pipeline.config("r8-restart", max_steps=160, save_steps=80)
    exp = pipeline.experiment
    state: dict = {}

    async def first_server():
        async with mcp_session() as s:
            launched = await run_call(s, "launch_run", {"experiment": exp, "tag": "r8-restart", "accept_warnings": True})
            state["run_id"] = run_id = launched["run_id"]
            assert launched["commit"] and launched["launcher"] == "local"
            seen, r = await poll_until(s, run_id, lambda r, seen: len(seen) >= 2)
            state["first"], state["cursor"] = seen, r["next_cursor"]
            assert r["status"] == "running"
            os.kill(server_pid(), signal.SIGKILL)
            state["size_at_kill"] = (run_dir_of(run_id) / "logs" / "progress.jsonl").stat().st_size

    try:
        anyio.run(first_server)
    except BaseException:  # the client notices its server died; that is the point here
        if "size_at_kill" not in state:
            raise
    run_id = state["run_id"]
    rd = run_dir_of(run_id)
    # With no server at all, the run goes on writing records.
    end = time.monotonic() + 120
    while (rd / "logs" / "progress.jsonl").stat().st_size == state["size_at_kill"]:
        assert time.monotonic() < end, "no new record after the server died"
        time.sleep(0.2)

    notes: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done, total, message):
        notes.append((done, total, message))

    async def second_server():
        async with mcp_session() as s:
            rest, last = await poll_until(s, run_id, finished, cursor=state["cursor"])
            everything, again = await poll_until(s, run_id, finished, cursor=0, limit=5000)
            with_png = await s.call_tool("poll_progress", {"run_id": run_id, "cursor": again["next_cursor"], "plot": True},
                                         progress_callback=on_progress)
            pruned = await run_call(s, "prune_checkpoints", {"run_id": run_id})
            return rest, last, everything, with_png, pruned

    rest, last, everything, with_png, pruned = anyio.run(second_server)

    # No record lost or duplicated across the restart, and a replay yields the same records.
    assert everything == state["first"] + rest
    assert [r["step"] for r in everything] == list(range(1, 161))
    assert all(list(r) == KEYS for r in everything)
    assert last["status"] == "succeeded" and last["exit_code"] == 0 and last["signal"] is None, last
    assert last["last"] == everything[-1]
    losses = [r["loss"] for r in everything]
    assert all(math.isfinite(x) for x in losses)
    assert statistics.mean(losses[-5:]) < 0.8 * statistics.mean(losses[:5]), losses

    # The product: adapter/ present and verified; checkpoints pruned only now, adapter untouched.
    ok, actual, recorded = verify_folder(rd / "adapter")
    assert ok, (actual, recorded)
    assert pruned["freed_bytes"] > 0 and {"checkpoint-80", "checkpoint-160"} <= set(pruned["removed"])
    assert not (rd / "checkpoints").exists() and verify_folder(rd / "adapter")[0]

    # The run directory as the contract lays it out.
    cfg = yaml.safe_load((rd / "config.yaml").read_text())
    assert cfg["run"]["run_id"] == run_id and len(cfg["run"]["experiment_commit"]) == 40
    for rel in ("env-report.json", "training-brief.md", "data/dataset-card.md", "data/validation-report.md", "train.py"):
        assert (rd / rel).is_file(), rel
    assert (rd / "train.py").read_bytes() == (pipeline.root / "experiments" / "trainings" / exp / "train.py").read_bytes()
    rj = json.loads((rd / "run.json").read_text())
    assert {"pid", "pgid", "start_time", "command"} <= set(rj) and rj["pgid"] == rj["pid"]
    roadbook = (rd / "roadbook.md").read_text()
    for event in ("launched", "first-step", "finished", "pruned"):
        assert roadbook.count(f"**{event}**") == 1, (event, roadbook)

    # Progress notifications and the loss curve (the one train.py drew).
    assert with_png.structured_content["status"] == "succeeded"
    assert notes and notes[-1][:2] == (160, 160) and "loss" in notes[-1][2]
    images = [c for c in with_png.content if c.type == "image"]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data) == (rd / "loss.png").read_bytes()


def test_stop_run_and_kill_9_side_by_side(pipeline, monkeypatch):
    pipeline.use(monkeypatch)
    pipeline.config("long-stop", max_steps=2000)
    pipeline.config("long-kill", max_steps=2000)
    exp = pipeline.experiment

    async def main():
        async with mcp_session(env={"FINETUNE_MCP_MAX_CPU_RUNS": "2"}) as s:
            stop_id = (await run_call(s, "launch_run", {"experiment": exp, "tag": "long-stop", "accept_warnings": True}))["run_id"]
            kill_id = (await run_call(s, "launch_run", {"experiment": exp, "tag": "long-kill", "accept_warnings": True}))["run_id"]
            await poll_until(s, stop_id, lambda r, seen: len(seen) >= 1)
            await poll_until(s, kill_id, lambda r, seen: len(seen) >= 1)

            trainer = psutil.Process(int((run_dir_of(kill_id) / ".trainer.pid").read_text()))
            assert "train.py" in trainer.cmdline()
            # SIGUSR2 asks a training run where it is: every thread's stack, and the run goes on.
            psutil.Process(int((run_dir_of(stop_id) / ".trainer.pid").read_text())).send_signal(signal.SIGUSR2)
            await poll_until(s, stop_id, lambda r, seen: len(seen) >= 2)
            trainer.send_signal(signal.SIGKILL)

            stopped = await run_call(s, "stop_run", {"run_id": stop_id, "grace_seconds": 120})
            _, stop_poll = await poll_until(s, stop_id, finished)
            _, kill_poll = await poll_until(s, kill_id, finished)
            prune_text = await refused(s, "prune_checkpoints", {"run_id": stop_id})
            again = await run_call(s, "stop_run", {"run_id": stop_id})
            return stopped, stop_poll, kill_poll, prune_text, again, stop_id, kill_id

    stopped, stop_poll, kill_poll, prune_text, again, stop_id, kill_id = anyio.run(main)

    # stop_run: SIGTERM was enough; the trainer saved a checkpoint and exited 143; status stopped.
    assert stopped["status"] == "stopped" and stopped["signal_sent"] == ["SIGTERM"], stopped
    assert stopped["checkpoint"] and (Path(stopped["checkpoint"]) / "adapter_model.safetensors").is_file()
    ex = json.loads((run_dir_of(stop_id) / "exit.json").read_text())
    assert (ex["returncode"], ex["signal"], ex["stopped_by"]) == (143, None, "stop_run")
    assert stop_poll["status"] == "stopped"
    out = (run_dir_of(stop_id) / "logs" / "stdout.log").read_text()
    assert re.search(r'Current thread 0x[0-9a-f]+ \(most recent call first\):\n(  File .*\n)*  File ".*train\.py", line \d+ in main',
                     out), out[-3000:]
    assert re.search(r"\nThread 0x[0-9a-f]+ \(most recent call first\):\n(  File .*\n)*  File .*train\.py\", line \d+ in _loop", out)  # telemetry
    assert "not succeeded" in prune_text and Path(stopped["checkpoint"]).is_dir()
    assert again["status"] == "stopped" and again["signal_sent"] == []

    # kill -9 of the trainer: failed with the signal, never mistaken for a stop.
    assert (kill_poll["status"], kill_poll["exit_code"], kill_poll["signal"]) == ("failed", 137, "SIGKILL")
    assert "out-of-memory" in kill_poll["detail"]
    assert "**failed**" in (run_dir_of(kill_id) / "roadbook.md").read_text()
    assert "**stopped**" in (run_dir_of(stop_id) / "roadbook.md").read_text()


def test_torchrun_two_cpu_processes(pipeline, monkeypatch):
    pipeline.use(monkeypatch)
    # End-of-run eval stays on: it is a collective under DDP, so this also proves every rank takes part.
    pipeline.config("ddp2", max_steps=8)
    exp = pipeline.experiment

    async def main():
        async with mcp_session() as s:
            launched = await run_call(s, "launch_run", {"experiment": exp, "tag": "ddp2", "launcher": "torchrun", "nproc": 2,
                                                        "accept_warnings": True})
            assert launched["command"][1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node" in launched["command"]
            sup = psutil.Process(launched["pid"])
            ranks: set[int] = set()

            def watch(r, seen):
                try:
                    for p in sup.children(recursive=True):
                        cmd = p.cmdline()
                        if "train.py" in cmd and "torch.distributed.run" not in cmd:
                            ranks.add(p.pid)
                except psutil.Error:
                    pass
                return finished(r, seen)

            seen, last = await poll_until(s, launched["run_id"], watch)
            return launched, seen, last, ranks

    launched, seen, last, ranks = anyio.run(main)
    assert len(ranks) == 2, ranks  # two worker processes under torchrun
    assert [r["step"] for r in seen] == list(range(1, 9))  # rank 0 alone writes records
    assert last["status"] == "succeeded", (last, (run_dir_of(launched["run_id"]) / "logs" / "stdout.log").read_text()[-3000:])
    assert verify_folder(run_dir_of(launched["run_id"]) / "adapter")[0]


def test_script_without_our_callback_is_read_from_stdout(ws_root, tiny_model_dir):
    make_experiment(tiny_model_dir, script="sft_plain.py", runs={"plain": training(max_steps=6, logging_steps=2)})

    async def main():
        async with mcp_session() as s:
            run_id = (await run_call(s, "launch_run", {"experiment": EXP, "tag": "plain"}))["run_id"]
            seen, last = await poll_until(s, run_id, finished)
            replay, _ = await poll_until(s, run_id, finished, cursor=0)
            # This script draws no loss.png: the curve is rendered from the records on request.
            plotted = await s.call_tool("poll_progress", {"run_id": run_id, "cursor": last["next_cursor"], "plot": True})
            return run_id, seen, last, replay, plotted

    run_id, seen, last, replay, plotted = anyio.run(main)
    images = [c for c in plotted.content if c.type == "image"]
    assert len(images) == 1 and base64.b64decode(images[0].data)[:8] == b"\x89PNG\r\n\x1a\n"
    rd = run_dir_of(run_id)
    assert not (rd / "logs" / "progress.jsonl").exists()
    assert last["status"] == "succeeded"
    assert [r["step"] for r in seen] == [2, 4, 6] and replay == seen
    assert all(list(r) == KEYS and r["mem_gb"] is None and r["lr"] == 2e-3 for r in seen)
    assert last["next_cursor"] <= (rd / "logs" / "stdout.log").stat().st_size


def test_each_refusal(ws_root, tiny_model_dir, tmp_path):
    exp = make_experiment(tiny_model_dir, script="sleeper.py", runs={"a": {"sleeper": {"seconds": 120}},
                                                                    "b": {"sleeper": {"seconds": 120}},
                                                                    "ratio": {"training": {"logging_steps": 0.1}}})
    ws = Workspace.from_env()
    report = (exp / "env-report.json").read_text()

    async def main():
        out = {}
        async with mcp_session(env={"FINETUNE_MCP_MAX_CPU_RUNS": "1", "DOCKER_HOST": f"unix://{tmp_path}/no.sock"}) as s:
            args = {"experiment": EXP, "tag": "a"}
            (exp / "env-report.json").unlink()
            out["a"] = await refused(s, "launch_run", args)
            write_env_report(exp, "blocked", [CHECK_OK, CHECK_FAIL])
            out["b"] = await refused(s, "launch_run", args)
            write_env_report(exp, "ready-with-warnings", [CHECK_OK, CHECK_WARN])
            out["c"] = await refused(s, "launch_run", args)

            (exp / "env-report.json").write_text(report)
            (exp / "configs" / "run-new.yaml").write_text("sleeper: {seconds: 1}\n")
            out["d_untracked"] = await refused(s, "launch_run", {"experiment": EXP, "tag": "new"})
            saved = (exp / "train.py").read_bytes()
            (exp / "train.py").write_bytes(saved + b"\n# edited after the commit\n")
            out["d_modified"] = await refused(s, "launch_run", args)
            (exp / "train.py").write_bytes(saved)

            out["ratio"] = await refused(s, "launch_run", {"experiment": EXP, "tag": "ratio"})
            out["docker"] = await refused(s, "launch_run", {**args, "launcher": "docker"})
            out["docker_left"] = sorted(p.name for p in (ws.output_root / EXP).glob("*")) if (ws.output_root / EXP).exists() else []

            write_env_report(exp, "ready-with-warnings", [CHECK_OK, CHECK_WARN])
            wait_until_second_is_early()
            first = await run_call(s, "launch_run", {**args, "accept_warnings": True})
            out["accepted"] = first
            out["f"] = await refused(s, "launch_run", {**args, "accept_warnings": True})
            out["e"] = await refused(s, "launch_run", {"experiment": EXP, "tag": "b", "accept_warnings": True})
            out["stop"] = await run_call(s, "stop_run", {"run_id": first["run_id"], "grace_seconds": 10})
        return out

    out = anyio.run(main)
    assert "no env-report.json" in out["a"] and "preflight" in out["a"]
    assert "blocked" in out["b"] and "N4 storage" in out["b"] and "re-run preflight" in out["b"]
    assert "N3" not in out["b"]  # only the failing checks are named
    assert "ready-with-warnings" in out["c"] and "N7 thermal" in out["c"] and "accept_warnings=true" in out["c"]
    assert "run-new.yaml is not committed" in out["d_untracked"]
    assert "train.py has changed since its last commit" in out["d_modified"]
    # A logging ratio with no max_steps to take it of: the reader could not number a printed log's records.
    assert "share of the run" in out["ratio"] and "configs/run-ratio.yaml" in out["ratio"] and "max_steps" in out["ratio"]
    assert "no Docker engine is reachable" in out["docker"] and "docker run" in out["docker"]
    assert out["docker_left"] == []  # a refused launch leaves nothing behind
    assert out["accepted"]["warnings_accepted"] and "N7 thermal" in out["accepted"]["warnings_accepted"][0]
    assert "already exists" in out["f"]
    assert "CPU run(s) already live" in out["e"] and out["accepted"]["run_id"] in out["e"]
    assert out["stop"]["status"] == "stopped"


def test_stop_under_torchrun_gives_each_rank_one_sigterm(ws_root, tiny_model_dir):
    # A rank that gets SIGTERM twice exits at once without its checkpoint (train.py's rule), so how
    # the stop reaches the ranks matters; these ranks only count what arrives.
    make_experiment(tiny_model_dir, script="rank_sigterm.py", runs={"ranks": {}})

    async def main():
        async with mcp_session() as s:
            launched = await run_call(s, "launch_run", {"experiment": EXP, "tag": "ranks", "launcher": "torchrun", "nproc": 2})
            log = run_dir_of(launched["run_id"]) / "logs" / "stdout.log"
            end = time.monotonic() + 60
            while not (log.exists() and "rank 0 ready" in log.read_text() and "rank 1 ready" in log.read_text()):
                assert time.monotonic() < end, "ranks never started"
                await anyio.sleep(0.2)
            stopped = await run_call(s, "stop_run", {"run_id": launched["run_id"], "grace_seconds": 60})
            return launched["run_id"], stopped

    run_id, stopped = anyio.run(main)
    rd = run_dir_of(run_id)
    assert stopped["status"] == "stopped" and stopped["signal_sent"] == ["SIGTERM"]
    counts = [json.loads((rd / f"sigterm-rank{r}.json").read_text())["count"] for r in (0, 1)]
    assert counts == [1, 1]


def test_gpu_runs_refuse_to_share_a_device(ws_root, tiny_model_dir, monkeypatch):
    # No GPU here: the env-report is a recorded generic-nvidia observation, and the "GPU run" already
    # live is this test process itself, recorded in a run.json the way launch_run records one.
    from finetune_mcp.common.errors import Refused

    exp = make_experiment(tiny_model_dir, script="sleeper.py", runs={"g0": {"sleeper": {"seconds": 60}},
                                                                    "g1": {"sleeper": {"seconds": 60}}})
    report = json.loads((exp / "env-report.json").read_text())
    (exp / "env-report.json").write_text(json.dumps({**report, "platform": "generic-nvidia"}))
    other = Workspace.from_env().output_root / EXP / "20250101-0000-other"
    other.mkdir(parents=True)
    me = psutil.Process()
    (other / "run.json").write_text(json.dumps({"run_id": f"{EXP}/{other.name}", "pid": me.pid, "pgid": os.getpgid(0),
                                                "start_time": me.create_time(), "launcher": "local", "device": "cuda",
                                                "gpus": ["0"]}))
    pc = PhaseContext.for_role("training-engineer")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(Refused, match=r"is live on GPU\(s\) 0"):
        call_tool("launch_run", pc, EXP, "g0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # nothing narrows it: the run would take every GPU
    with pytest.raises(Refused, match="which this run would share"):
        call_tool("launch_run", pc, EXP, "g0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    launched = call_tool("launch_run", pc, EXP, "g1")
    rj = json.loads((run_dir_of(launched.run_id) / "run.json").read_text())
    assert (rj["device"], rj["gpus"]) == ("cuda", ["1"])
    assert call_tool("stop_run", pc, launched.run_id, grace_seconds=10).status == "stopped"


def test_stop_escalates_to_sigkill_and_is_still_a_stop(ws_root, tiny_model_dir):
    # A trainer that ignores SIGTERM is killed after the grace period; the run is "stopped", never an OOM.

    make_experiment(tiny_model_dir, script="sleeper.py", runs={"deaf": {"sleeper": {"seconds": 120, "ignore_sigterm": True}}})
    pc = PhaseContext.for_role("training-engineer")
    launched = call_tool("launch_run", pc, EXP, "deaf")
    log = run_dir_of(launched.run_id) / "logs" / "stdout.log"
    end = time.monotonic() + 30
    while not (log.exists() and "sleeper ready" in log.read_text()):
        assert time.monotonic() < end
        time.sleep(0.1)
    stopped = call_tool("stop_run", pc, launched.run_id, grace_seconds=1)
    assert stopped.signal_sent == ["SIGTERM", "SIGKILL"] and stopped.status == "stopped"
    polled = call_tool("poll_progress", pc, launched.run_id)
    assert (polled.status, polled.signal, polled.exit_code) == ("stopped", "SIGKILL", 137)
    assert "out-of-memory" not in (polled.detail or "")
