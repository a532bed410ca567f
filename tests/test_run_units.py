"""The run machinery without training: the progress reader and its cursor, run status from files, the
supervisor, the docker line, retention. Real files and real processes; no training stack imported."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import call_tool

from finetune_mcp.context import PhaseContext
from finetune_mcp.digest import folder_digest
from finetune_mcp.common.errors import BadInput, Refused
from finetune_mcp.launchers.base import RunSpec
from finetune_mcp.launchers.docker import DockerLauncher
from finetune_mcp.domain import progress
from finetune_mcp.domain import run_state
from finetune_mcp.domain import run_notes as R
from finetune_mcp.launchers import get_launcher

RUNWRAP = Path(R.__file__).resolve().parent.parent / "launchers" / "runwrap.py"
EXP = "tiny-SFT-LoRA-units"


def rec(step, loss, lr=1e-3, mem=0.5, temp=None, **extra):
    return json.dumps({"step": step, "loss": loss, "lr": lr, "mem_gb": mem, "temp_c": temp, **extra}) + "\n"


@pytest.fixture
def pc(ws_root):
    return PhaseContext.for_role("training-engineer")


def make_run(pc, lines: str | bytes = "", *, run_json: dict | None = None, exit: dict | None = None, name="20250101-0000-t"):
    d = pc.ws.output_root / EXP / name
    (d / "logs").mkdir(parents=True)
    (d / "train.py").write_text("# writes logs/progress.jsonl\n")
    if lines is not None:
        (d / "logs" / "progress.jsonl").write_bytes(lines.encode() if isinstance(lines, str) else lines)
    if run_json is not None:
        (d / "run.json").write_text(json.dumps(run_json))
    if exit is not None:
        (d / "exit.json").write_text(json.dumps(exit))
    return f"{EXP}/{name}", d


def fresh_server():
    """What a newly started server knows about runs: nothing."""
    R.forget()


def me() -> dict:
    p = psutil.Process()
    return {"pid": p.pid, "pgid": os.getpgid(0), "start_time": p.create_time(), "launcher": "local"}


DONE = {"returncode": 0, "signal": None, "ended_at": "2025-01-01T00:00:00+00:00", "stopped_by": None}


# ---------------------------------------------------------------- reader and cursor


def test_records_have_exactly_the_seed_shape_and_cursor_pages_through(pc):
    body = "".join(rec(i, 2.0 - i / 10, epoch=0.1 * i) for i in range(1, 8))
    run_id, _ = make_run(pc, body, exit=DONE)
    seen, cursor = [], 0
    while True:
        r = call_tool("poll_progress", pc, run_id, cursor=cursor, limit=3)
        for x in r.records:
            d = x.model_dump(mode="json")
            assert list(d) == ["step", "loss", "lr", "mem_gb", "temp_c"]
            seen.append(d)
        assert r.cursor == cursor
        if not r.more:
            break
        assert len(r.records) == 3
        cursor = r.next_cursor
    assert [d["step"] for d in seen] == list(range(1, 8))
    assert r.next_cursor == len(body.encode())
    assert r.last.step == 7 and r.status == "succeeded"
    at_end = call_tool("poll_progress", pc, run_id, cursor=r.next_cursor)  # this server followed the run
    fresh_server()
    at_end_cold = call_tool("poll_progress", pc, run_id, cursor=r.next_cursor)
    assert at_end.records == at_end_cold.records == [] and at_end.last == at_end_cold.last == r.last


def test_partial_last_line_is_not_consumed(pc):
    full = rec(1, 1.5) + rec(2, 1.4)
    partial = rec(3, 1.3)[:-9]
    run_id, d = make_run(pc, full + partial, run_json=me())
    r = call_tool("poll_progress", pc, run_id)
    assert [x.step for x in r.records] == [1, 2]
    assert r.next_cursor == len(full.encode())
    with open(d / "logs" / "progress.jsonl", "a") as f:
        f.write(rec(3, 1.3)[-9:])
    r2 = call_tool("poll_progress", pc, run_id, cursor=r.next_cursor)
    assert [x.step for x in r2.records] == [3] and r2.next_cursor == len((full + rec(3, 1.3)).encode())


def test_bad_cursors_are_refused_with_the_fix(pc):
    body = rec(1, 1.0) + rec(2, 0.9)
    run_id, _ = make_run(pc, body, exit=DONE)
    with pytest.raises(BadInput, match="not at a line boundary"):
        call_tool("poll_progress", pc, run_id, cursor=5)
    with pytest.raises(BadInput, match="past the end"):
        call_tool("poll_progress", pc, run_id, cursor=len(body) + 10)


def test_nan_inf_and_spike_anomalies(pc):
    # The spike rule is triage's (dgx-spark-ops failure-signals table), so a poll and a triage agree.
    k = progress.spike_rule(pc.skills).factor
    body = "".join(rec(i, 1.0 + 0.01 * (i % 3)) for i in range(1, 11))
    body += rec(11, float("nan")) + rec(12, float("inf")) + rec(13, 1.5 * k) + rec(14, 1.0) + rec(15, 0.9 * k)
    run_id, _ = make_run(pc, body, exit=DONE)
    r = call_tool("poll_progress", pc, run_id)
    kinds = {(a.kind, a.step) for a in r.anomalies}
    assert kinds == {("nan-loss", 11), ("inf-loss", 12), ("loss-spike", 13)}
    dumped = {x.step: x.model_dump(mode="json")["loss"] for x in r.records}
    assert dumped[11] is None and dumped[12] is None and dumped[13] == 1.5 * k
    json.dumps(r.model_dump(mode="json"), allow_nan=False)  # the structured result is strict JSON


def test_a_new_server_sees_the_same_records_and_anomalies(pc):
    # The spike sits right after the cursor: a server that has not followed the run must look back for the window.
    body_a = "".join(rec(i, 1.0) for i in range(1, 31))
    body_b = rec(31, 2.0 * progress.spike_rule(pc.skills).factor) + "".join(rec(i, 1.0) for i in range(32, 36))
    run_id, _ = make_run(pc, body_a + body_b, exit=DONE)
    first = call_tool("poll_progress", pc, run_id, limit=30)
    warm = call_tool("poll_progress", pc, run_id, cursor=first.next_cursor)
    fresh_server()
    cold = call_tool("poll_progress", pc, run_id, cursor=first.next_cursor)
    assert warm.model_dump() == cold.model_dump()
    assert [a.kind for a in cold.anomalies] == ["loss-spike"]


def test_non_record_lines_are_skipped(pc):
    body = rec(1, 1.0) + "not json\n" + json.dumps({"eval_loss": 0.3}) + "\n\n" + rec(2, 0.9)
    run_id, _ = make_run(pc, body, exit=DONE)
    r = call_tool("poll_progress", pc, run_id)
    assert [x.step for x in r.records] == [1, 2] and r.next_cursor == len(body)


# ---------------------------------------------------------------- status from files


@pytest.mark.parametrize("ex,status,code,sig", [
    (DONE, "succeeded", 0, None),
    ({**DONE, "returncode": 1}, "failed", 1, None),
    ({**DONE, "returncode": 137, "signal": "SIGKILL"}, "failed", 137, "SIGKILL"),
    ({**DONE, "returncode": 143, "stopped_by": "stop_run"}, "stopped", 143, None),
    ({**DONE, "returncode": 137, "signal": "SIGKILL", "stopped_by": "stop_run"}, "stopped", 137, "SIGKILL"),
])
def test_status_from_exit_record(pc, ex, status, code, sig):
    run_id, _ = make_run(pc, rec(1, 1.0), run_json=me(), exit=ex)
    r = call_tool("poll_progress", pc, run_id)
    assert (r.status, r.exit_code, r.signal) == (status, code, sig)
    if sig == "SIGKILL" and status == "failed":
        assert "out-of-memory" in r.detail


def test_live_recycled_and_vanished_supervisors(pc):
    run_id, _ = make_run(pc, rec(1, 1.0), run_json=me(), name="20250101-0000-live")
    assert call_tool("poll_progress", pc, run_id).status == "running"
    run_id2, _ = make_run(pc, "", run_json=me(), name="20250101-0000-young")
    assert call_tool("poll_progress", pc, run_id2).status == "starting"
    # Same pid, other start time: a recycled pid is not the run.
    run_id3, _ = make_run(pc, rec(1, 1.0), run_json={**me(), "start_time": me()["start_time"] - 100}, name="20250101-0000-recycled")
    r = call_tool("poll_progress", pc, run_id3)
    assert r.status == "failed" and "recorded no exit" in r.detail


def test_stall_is_reported_for_a_live_run(pc, monkeypatch):
    run_id, d = make_run(pc, rec(1, 1.0), run_json=me())
    old = time.time() - 300
    os.utime(d / "logs" / "progress.jsonl", (old, old))
    monkeypatch.setenv("FINETUNE_MCP_STALL_MINUTES", "2")
    r = call_tool("poll_progress", pc, run_id)
    assert [a.kind for a in r.anomalies] == ["stalled"] and r.anomalies[0].step == 1
    monkeypatch.setenv("FINETUNE_MCP_STALL_MINUTES", "10")
    assert call_tool("poll_progress", pc, run_id).anomalies == []


def test_roadbook_lines_are_written_once_even_across_servers(pc):
    run_id, d = make_run(pc, rec(1, 1.0) + rec(2, 0.8), run_json=me(), exit=DONE)
    for _ in range(3):
        call_tool("poll_progress", pc, run_id)
        fresh_server()
    text = (d / "roadbook.md").read_text()
    assert text.count("**first-step**") == 1 and text.count("**finished**") == 1


def test_eval_role_polls_without_writing(ws_root):
    pc_eval = PhaseContext.for_role("eval-engineer")
    run_id, d = make_run(pc_eval, rec(1, 1.0), exit=DONE)
    assert call_tool("poll_progress", pc_eval, run_id).status == "succeeded"
    assert not (d / "roadbook.md").exists()


# ---------------------------------------------------------------- the supervisor


def supervise(tmp_path, code: str, *, before=None) -> tuple[dict, Path]:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    p = subprocess.Popen([sys.executable, str(RUNWRAP), "--run-dir", str(run_dir), "--", sys.executable, "-c", code],
                         start_new_session=True)
    if before:
        before(p, run_dir)
    p.wait(timeout=60)
    return json.loads((run_dir / "exit.json").read_text()), run_dir


def wait_for(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_supervisor_records_exit_status_and_output(tmp_path):
    ex, d = supervise(tmp_path, "print('hello from the trainer'); raise SystemExit(3)")
    assert (ex["returncode"], ex["signal"], ex["stopped_by"]) == (3, None, None)
    assert "hello from the trainer" in (d / "logs" / "stdout.log").read_text()


def test_supervisor_records_a_kill_signal(tmp_path):
    ex, _ = supervise(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert (ex["returncode"], ex["signal"]) == (137, "SIGKILL")


TRAPS_TERM = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")


def test_supervisor_forwards_a_sigterm_sent_to_it_alone(tmp_path):
    def term_supervisor_only(p, d):
        wait_for(lambda: "ready" in (d / "logs" / "stdout.log").read_text())
        os.kill(p.pid, signal.SIGTERM)

    ex, _ = supervise(tmp_path, TRAPS_TERM, before=term_supervisor_only)
    assert (ex["returncode"], ex["signal"], ex["stopped_by"]) == (143, None, None)


def test_group_sigterm_with_stop_request_is_recorded_as_stopped(tmp_path):
    def stop_like_stop_run(p, d):
        wait_for(lambda: "ready" in (d / "logs" / "stdout.log").read_text())
        (d / "stop-requested").write_text("{}")
        os.killpg(p.pid, signal.SIGTERM)

    ex, _ = supervise(tmp_path, TRAPS_TERM, before=stop_like_stop_run)
    # Received exactly once (not forwarded a second time), handled, exit 143.
    assert (ex["returncode"], ex["signal"], ex["stopped_by"]) == (143, None, "stop_run")


# ---------------------------------------------------------------- docker line (layout seed, rule 6)


def docker_spec(tmp_path, **kw):
    out = tmp_path / "outputs" / "trainings"
    run_dir = out / EXP / "20250101-0000-t"
    env = {"HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "secret-token", "HF_HUB_OFFLINE": "1"}
    base = dict(run_ref=f"{EXP}/20250101-0000-t", run_dir=run_dir, python="/unused/python", device="cuda", gpus=("all",),
                env=env, mounts={"output_root": out, "datasets": tmp_path / "datasets", "base_models": tmp_path / "base-models"})
    base.update(kw)
    return RunSpec(**base)


def test_docker_line_follows_rule_6(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_MCP_DOCKER_IMAGE", "nvcr.io/nvidia/pytorch:25.11-py3")
    spec = docker_spec(tmp_path)
    argv = DockerLauncher().render(spec)
    line = shlex.join(argv)
    out = spec.mounts["output_root"]
    assert argv[:2] == ["docker", "run"]
    assert f"-v {tmp_path / 'hf'}:/root/.cache/huggingface" in line          # HF cache at the in-container default
    assert f"-v {tmp_path / 'home' / '.triton'}:/root/.triton" in line
    assert f"-v {out}:{out}" in line                                          # same path inside and out
    assert f"-v {tmp_path / 'datasets'}:{tmp_path / 'datasets'}:ro" in line
    assert "--gpus all" in line and "--ipc=host" in line
    assert "--ulimit memlock=-1" in line and "--ulimit stack=67108864" in line
    assert f"-w {spec.run_dir}" in line
    assert argv[-5:] == ["nvcr.io/nvidia/pytorch:25.11-py3", "python", "train.py", "--config", str(spec.run_dir / "config.yaml")]
    assert "secret-token" not in line and "-e HF_TOKEN" in line               # secrets by name only


def test_docker_line_narrows_gpus_and_runs_torchrun_inside(tmp_path):
    argv = DockerLauncher().render(docker_spec(tmp_path, gpus=("1", "2"), nproc=2))
    line = shlex.join(argv)
    assert "--gpus '\"device=1,2\"'" in line
    assert "-m torch.distributed.run --standalone --nnodes 1 --nproc_per_node 2 train.py" in line
    cpu = shlex.join(DockerLauncher().render(docker_spec(tmp_path, device="cpu", gpus=())))
    assert "--gpus" not in cpu


def test_docker_refuses_plainly_without_an_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    with pytest.raises(Refused) as e:
        DockerLauncher().check(docker_spec(tmp_path))
    assert "no Docker engine is reachable" in str(e.value)
    assert "docker run" in e.value.fix and "/root/.cache/huggingface" in e.value.fix


# ---------------------------------------------------------------- retention


def test_prune_refuses_unless_succeeded_and_verified(pc):
    run_id, d = make_run(pc, rec(1, 1.0), run_json=me(), exit={**DONE, "returncode": 1})
    (d / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    (d / "checkpoints" / "checkpoint-1" / "optimizer.pt").write_bytes(b"x" * 5000)
    with pytest.raises(Refused, match="not succeeded"):
        call_tool("prune_checkpoints", pc, run_id)
    (d / "exit.json").write_text(json.dumps(DONE))
    with pytest.raises(Refused, match="no adapter"):
        call_tool("prune_checkpoints", pc, run_id)
    (d / "adapter").mkdir()
    (d / "adapter" / "adapter_model.safetensors").write_bytes(b"w" * 300)
    with pytest.raises(Refused, match="no DIGEST"):
        call_tool("prune_checkpoints", pc, run_id)
    (d / "adapter" / "DIGEST").write_text(folder_digest(d / "adapter") + "\n")
    (d / "adapter" / "adapter_model.safetensors").write_bytes(b"v" * 300)  # changed after the digest
    with pytest.raises(Refused, match="does not match"):
        call_tool("prune_checkpoints", pc, run_id)
    assert (d / "checkpoints" / "checkpoint-1" / "optimizer.pt").exists()
    (d / "adapter" / "DIGEST").write_text(folder_digest(d / "adapter") + "\n")
    r = call_tool("prune_checkpoints", pc, run_id)
    assert r.freed_bytes == 5000 and r.removed == ["checkpoint-1"]
    assert not (d / "checkpoints").exists() and (d / "adapter" / "adapter_model.safetensors").exists()
    assert call_tool("prune_checkpoints", pc, run_id).freed_bytes == 0


def test_prune_refuses_a_symlinked_checkpoints_dir(pc, tmp_path):
    run_id, d = make_run(pc, rec(1, 1.0), exit=DONE)
    (d / "adapter").mkdir()
    (d / "adapter" / "a.bin").write_bytes(b"a")
    (d / "adapter" / "DIGEST").write_text(folder_digest(d / "adapter"))
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("keep")
    (d / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(Refused, match="symbolic link"):
        call_tool("prune_checkpoints", pc, run_id)
    assert (elsewhere / "keep").exists()


def test_slurm_only_arguments_and_nproc_are_checked(pc):
    pc.ws.experiment_dir(EXP, must_exist=False).mkdir(parents=True)
    with pytest.raises(BadInput, match="only to launcher='slurm'"):
        call_tool("launch_run", pc, EXP, "t", partition="gpu")
    with pytest.raises(BadInput, match="torchrun"):
        call_tool("launch_run", pc, EXP, "t", nproc=2)
    # slurm takes them (launchers/slurm.py) and, like every launcher, stops first at the preflight gate
    with pytest.raises(Refused, match="no env-report.json"):
        call_tool("launch_run", pc, EXP, "t", launcher="slurm", partition="gpu")
    with pytest.raises(Refused, match="no env-report.json"):
        call_tool("launch_run", pc, EXP, "t")


def test_supervisor_kills_what_the_trainer_left_behind(tmp_path):
    # A torchrun rank lives in a session of its own; when the agent dies it would linger and hold the GPU.
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
            "open('orphan.pid', 'w').write(str(p.pid))\n")
    ex, d = supervise(tmp_path, code)
    orphan = int((d / "orphan.pid").read_text())
    assert ex["returncode"] == 0 and ex["leftovers_killed"] == [orphan]
    wait_for(lambda: not get_launcher("local").alive(d, {"pid": orphan, "start_time": None}), timeout=10)


def test_a_run_that_never_logs_a_step_is_reported_stalled(pc, monkeypatch):
    run_id, d = make_run(pc, None, run_json=me())
    old = time.time() - 300
    os.utime(d / "run.json", (old, old))
    monkeypatch.setenv("FINETUNE_MCP_STALL_MINUTES", "2")
    r = call_tool("poll_progress", pc, run_id)
    assert r.status == "starting" and [a.kind for a in r.anomalies] == ["stalled"] and "no first step" in r.anomalies[0].message


def test_last_record_never_comes_from_a_line_still_being_written(pc):
    body = rec(1, 1.0) + rec(2, 0.9)
    run_id, d = make_run(pc, body + rec(3, 0.8).rstrip("\n"), run_json=me())
    r = call_tool("poll_progress", pc, run_id, cursor=len(body))
    assert r.records == [] and r.last.step == 2 and r.next_cursor == len(body)
    assert "first record, step 1 loss 1" in (d / "roadbook.md").read_text()
