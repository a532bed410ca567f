"""The job worker: cold starts and the warm worker (a zygote that forks one fresh child per job).

Real processes throughout: the training Python, the zygote, its forked jobs, their process groups.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from finetune_mcp import worker
from finetune_mcp.common.errors import JobFailed, NotFound


@pytest.fixture
def warm(monkeypatch):
    """Warm worker on, a clean slate before and after."""
    monkeypatch.setenv("FINETUNE_MCP_WARM_WORKER", "1")
    worker.release_warm()
    yield
    worker.release_warm()


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _wait_gone(pid: int, within: float = 30.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_a_warm_job_is_a_fresh_child_of_the_zygote_and_matches_a_cold_one(warm, tmp_path, monkeypatch):
    seen: list[list[int]] = []

    def progress(done, total, message):
        # Whoever reports this is a child of the zygote, not of the caller.
        seen.append([c.pid for c in psutil.Process(worker._warm.proc.pid).children()])
        assert not [c for c in psutil.Process().children() if c.pid in seen[-1]]

    res_warm = worker.run_job("build_tiny_model", {"target_dir": str(tmp_path / "warm" / "m"), "seed": 0}, progress=progress)
    z = worker._warm
    assert z is not None and z.alive() and "torch" in z.info["preloaded"] and "trl" in z.info["preloaded"]
    assert seen and all(len(pids) == 1 for pids in seen) and len({p for pids in seen for p in pids}) == 1
    monkeypatch.setenv("FINETUNE_MCP_WARM_WORKER", "0")
    res_cold = worker.run_job("build_tiny_model", {"target_dir": str(tmp_path / "cold" / "m"), "seed": 0})
    assert _digests(tmp_path / "warm" / "m") == _digests(tmp_path / "cold" / "m")
    assert {k: v for k, v in res_warm.items() if "path" not in k and "dir" not in k} == \
           {k: v for k, v in res_cold.items() if "path" not in k and "dir" not in k}
    assert worker._warm is z  # turning it off for a call does not stop it


def test_the_job_gets_the_callers_environment(warm, tmp_path, monkeypatch):
    # probe_env reports the environment variables that matter to training; set one and see it arrive.
    monkeypatch.chdir(tmp_path)
    worker.run_job("probe_env", {})
    z = worker._warm
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "something else")  # volatile: the same worker
    a = worker.run_job("probe_env", {})
    assert worker._warm is z
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import by huggingface_hub: a new worker
    b = worker.run_job("probe_env", {})
    assert worker._warm is not z and z.proc.returncode is not None
    assert "HF_HUB_CACHE" not in a["env"] and b["env"]["HF_HUB_CACHE"] == str(tmp_path / "hub")


def test_bad_input_from_a_warm_job_is_the_same_error_as_cold(warm, tmp_path, monkeypatch):
    params = {"points": [], "out": str(tmp_path / "loss.png")}
    with pytest.raises(Exception) as warm_err:
        worker.run_job("plot_loss", params)
    monkeypatch.setenv("FINETUNE_MCP_WARM_WORKER", "0")
    with pytest.raises(Exception) as cold_err:
        worker.run_job("plot_loss", params)
    assert type(warm_err.value) is type(cold_err.value)
    assert str(warm_err.value) == str(cold_err.value)
    assert isinstance(warm_err.value, NotFound) and "no loss records" in str(warm_err.value)


def _job_of(z) -> psutil.Process:
    return next(iter(psutil.Process(z.proc.pid).children()))


def test_a_timeout_kills_the_job_and_the_worker_goes_on(warm, tmp_path):
    worker.run_job("probe_env", {})  # warm up, so the limit below is the job's own
    z = worker._warm
    frozen: list[int] = []

    def progress(done, total, message):
        if not frozen:  # freeze the job, so only the limit can end it
            job = _job_of(z)
            frozen.append(job.pid)
            job.suspend()

    with pytest.raises(JobFailed, match=r"killed by signal 9 .*timeout 2s"):
        worker.run_job("build_tiny_model", {"target_dir": str(tmp_path / "m"), "seed": 0}, progress=progress, timeout=2)
    assert frozen and _wait_gone(frozen[0])
    end = time.monotonic() + 10
    while psutil.Process(z.proc.pid).children() and time.monotonic() < end:
        time.sleep(0.1)
    assert psutil.Process(z.proc.pid).children() == []  # reaped, nothing left behind
    assert z.alive() and worker.run_job("probe_env", {}).get("error") is None
    assert not (tmp_path / "m").exists()


def test_a_job_that_dies_by_a_signal_is_reported_with_that_signal(warm, tmp_path):
    worker.run_job("probe_env", {})
    z = worker._warm
    killed: list[int] = []

    def progress(done, total, message):
        if not killed:
            job = _job_of(z)
            killed.append(job.pid)
            job.send_signal(signal.SIGSEGV)

    with pytest.raises(JobFailed, match="killed by signal 11"):
        worker.run_job("build_tiny_model", {"target_dir": str(tmp_path / "m"), "seed": 0}, progress=progress)
    assert killed and z.alive()


def test_the_zygote_goes_when_its_parent_is_killed(tmp_path):
    script = (
        "import os, sys\n"
        "from finetune_mcp import worker\n"
        "worker.run_job('probe_env', {})\n"
        "print(worker._warm.proc.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    env = {**os.environ, "FINETUNE_MCP_WARM_WORKER": "1"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == -9, p.stderr[-2000:]
    zpid = int(p.stdout.split()[0])
    assert _wait_gone(zpid), "the zygote outlived its parent"


def test_an_idle_zygote_gives_its_memory_back_and_a_new_one_comes_when_needed(warm, monkeypatch):
    monkeypatch.setenv("FINETUNE_MCP_WORKER_IDLE_S", "1")
    worker.run_job("probe_env", {})
    z = worker._warm
    assert z.proc.wait(timeout=60) == 0
    assert worker.run_job("probe_env", {}).get("error") is None
    assert worker._warm is not z and worker._warm.alive()


def test_release_and_disable(warm, monkeypatch):
    worker.prewarm()
    z = worker._warm
    assert z is not None
    worker.release_warm()  # also while it is still importing
    assert worker._warm is None and z.proc.returncode is not None
    assert not Path(z.dir).exists()
    monkeypatch.setenv("FINETUNE_MCP_WARM_WORKER", "0")
    worker.prewarm()
    assert worker._warm is None
    assert worker.run_job("probe_env", {}).get("error") is None and worker._warm is None


def test_a_one_off_python_runs_cold_and_keeps_the_worker(warm):
    worker.run_job("probe_env", {})
    z = worker._warm
    # The same venv's interpreter by another name: another Python as far as the worker can tell.
    bindir = Path(sys.executable).parent
    other = next(str(bindir / n) for n in (f"python{sys.version_info[0]}.{sys.version_info[1]}", "python3", "python")
                 if (bindir / n).exists() and str(bindir / n) != sys.executable)
    assert worker.run_job("probe_env", {}, python=other).get("error") is None
    assert worker._warm is z and z.alive()


def test_a_job_in_flight_finishes_when_its_worker_is_released(warm, tmp_path):
    # launch_run releases the worker; a job another client started a moment before must still finish.
    worker.run_job("probe_env", {})
    z = worker._warm
    released: list[bool] = []

    def progress(done, total, message):
        if not released:
            worker.release_warm()
            released.append(True)

    res = worker.run_job("build_tiny_model", {"target_dir": str(tmp_path / "m"), "seed": 0}, progress=progress)
    assert released and z.proc.returncode is not None and worker._warm is None
    assert res["built"] is True and (tmp_path / "m" / "config.json").is_file()
