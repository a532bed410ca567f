"""The Slurm launcher against a real one-node cluster (tests/slurm_cluster.py), driven through the MCP client.

The cluster is Debian's slurmctld/slurmd/munge started under a temp dir; without the packages
these tests skip and say so (.ci/slurm-setup.sh installs them). The runs are real TRL SFT + LoRA
runs of the embedded tiny model (tests/fixtures/scripts/sft_tiny.py as train.py). One run is given
a one-minute time limit when the module starts, so the scheduler's TIMEOUT (30-90 s away) is
reached while the other runs are tested; it also holds one of the two cores, which is what leaves
the two-process run PENDING for Resources at first.

The tests at the bottom need no cluster: the job script, the scheduler's records as Slurm 22.05
printed them here, and the node-local storage rule.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import yaml

from conftest import mcp_session
from slurm_cluster import slurm_cluster  # noqa: F401  (session fixture)

from finetune_mcp.digest import verify_folder
from finetune_mcp.embedded import task
from finetune_mcp.launchers.base import RunSpec
from finetune_mcp.launchers.slurm import (
    SlurmLauncher,
    base_state,
    node_local_reason,
    parse_exit_code,
    parse_job_record,
)
from finetune_mcp.workspace import commit, ensure_repo

REPO = Path(__file__).resolve().parent.parent
SFT_SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "sft_tiny.py"
EXP = "finetune-mcp-tiny-SFT-LoRA-repeat-words"
DATASET = "repeat-words-slurm"
TERMINAL = ("succeeded", "failed", "stopped")

# Per-tag overrides of configs/base.yaml. step_sleep slows a run down without burning CPU.
RUNS = {
    "ok": {"training": {"max_steps": 6}},
    "timeout": {"training": {"max_steps": 5000}, "fixture": {"step_sleep": 1.0}},
    "stopme": {"training": {"max_steps": 5000, "save_steps": 1000}, "fixture": {"step_sleep": 0.5}},
    "two": {"training": {"max_steps": 4}},
    "broken": {"data": {"train_file": "/nonexistent/finetune-mcp/train.jsonl"}},
}


# ---------------------------------------------------------------- the world the server sees


def build_world(root: Path, model_dir: Path) -> None:
    """An experiment as generate_config leaves it: brief, committed configs and train.py, a prepared dataset."""
    shutil.copytree(model_dir, root / "base-models" / "finetune-mcp-tiny")
    data = root / "datasets" / DATASET
    task.write_jsonl(task.sft_conversations(64, seed=0), data / "train.jsonl")
    exp = root / "experiments" / "trainings" / EXP
    (exp / "configs").mkdir(parents=True)
    ensure_repo(root / "experiments")
    (exp / "training-brief.md").write_text(task.sample_brief("sft-lora"))
    base = {
        "model": {"path": str(root / "base-models" / "finetune-mcp-tiny")},
        "data": {"train_file": str(data / "train.jsonl")},
        "training": {"max_steps": 6, "learning_rate": 1e-3, "logging_steps": 1, "save_steps": 10**6,
                     "per_device_train_batch_size": 4, "max_length": 64, "seed": 0, "lora_r": 4},
    }
    (exp / "configs" / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    paths = [exp / "training-brief.md", exp / "configs" / "base.yaml", exp / "train.py"]
    shutil.copyfile(SFT_SCRIPT, exp / "train.py")
    for tag, over in RUNS.items():
        p = exp / "configs" / f"run-{tag}.yaml"
        p.write_text(yaml.safe_dump(over, sort_keys=False))
        paths.append(p)
    commit(root / "experiments", paths, "slurm test experiment")


async def call(s, tool: str, **args) -> dict:
    r = await s.call_tool(tool, args)
    text = r.content[0].text if r.content else ""
    if r.is_error:
        raise AssertionError(f"{tool}({args}) failed:\n{text}")
    return r.structured_content


async def poll_until(s, run_id: str, done, timeout: float, every: float = 1.0) -> tuple[dict, list[dict], list[dict]]:
    """Poll until done(result) or timeout; returns the last result, every record seen, every result."""
    cursor, records, seen = 0, [], []
    deadline = time.monotonic() + timeout
    while True:
        r = await call(s, "poll_progress", run_id=run_id, cursor=cursor)
        records += r["records"]
        cursor = r["next_cursor"]
        seen.append(r)
        if done(r) and not r["more"]:
            return r, records, seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{run_id} did not get there in {timeout:.0f}s; last poll: {r}")
        await anyio.sleep(every)


def job_of(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["job_id"]


class World:
    def __init__(self, root: Path, cluster):
        self.root = root
        self.cluster = cluster
        self.env = {**cluster.env, "DGX_SPARK_ROOT": str(root)}
        self.runs: dict[str, str] = {}
        self.timings: dict[str, float] = {}

    def run_dir(self, run_id: str) -> Path:
        exp, rid = run_id.split("/")
        return self.root / "outputs" / "trainings" / exp / rid

    def session(self):
        return mcp_session("training-engineer", env=self.env)

    def launch(self, tag: str, **kw) -> dict:
        async def main():
            async with self.session() as s:
                return await call(s, "launch_run", experiment=EXP, tag=tag, launcher="slurm", accept_warnings=True, **kw)

        r = anyio.run(main)
        self.runs[tag] = r["run_id"]
        return r


@pytest.fixture(scope="module")
def world(slurm_cluster, tiny_model_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("slurm-world") / "dgx-spark"
    root.mkdir()
    build_world(root, tiny_model_dir)
    w = World(root, slurm_cluster)
    w.timings["cluster_start_s"] = slurm_cluster.timings.get("start_s", 0.0)

    async def preflight():
        async with w.session() as s:
            return await call(s, "preflight", experiment=EXP)

    pf = anyio.run(preflight)
    assert pf["verdict"] in ("ready", "ready-with-warnings"), pf["summary"]
    # The time-limit run starts first: Slurm's TIMEOUT needs a minute and more of wall time.
    w.timings["timeout_launched"] = time.monotonic()
    w.launch("timeout", time_limit="1")
    yield w
    print("\nslurm test timings:", json.dumps({k: round(v, 1) for k, v in w.timings.items() if k.endswith("_s")}))


# ---------------------------------------------------------------- through the MCP client


@pytest.mark.slurm
def test_multi_node_run_refused_on_node_local_output_root(world):
    async def main():
        async with world.session() as s:
            r = await s.call_tool("launch_run", {"experiment": EXP, "tag": "ok", "launcher": "slurm", "nodes": 2,
                                                 "accept_warnings": True})
            return r

    r = anyio.run(main)
    text = r.content[0].text
    assert r.is_error
    # pytest's temp dirs live under /tmp: private to each node of a real cluster.
    assert "node-local" in text and "OUTPUT_ROOT" in text and "/tmp" in text, text
    assert "shared filesystem" in text
    runs = world.root / "outputs" / "trainings" / EXP
    assert not runs.exists() or not any(p.name.endswith("-ok") for p in runs.iterdir()), "a refused launch left a run dir"


@pytest.mark.slurm
def test_sft_run_submitted_to_slurm_succeeds_with_records_and_verified_adapter(world):
    t0 = time.monotonic()
    launched = world.launch("ok", time_limit="00:10:00", partition="debug")
    run_id, job_id = launched["run_id"], launched["job_id"]
    R = world.run_dir(run_id)
    assert launched["launcher"] == "slurm" and job_id and job_id.isdigit()
    assert launched["pid"] is None

    # The job script is kept with the run, with the resources asked for and the logs in the run dir.
    sb = (R / "slurm.sbatch").read_text()
    for line in ("#SBATCH --time=00:10:00", "#SBATCH --partition=debug", "#SBATCH --nodes=1", f"#SBATCH --chdir={R}",
                 f"#SBATCH --output={R}/logs/stdout.log", "#SBATCH --no-requeue"):
        assert line in sb
    assert "srun" not in sb and "torch.distributed.run" not in sb, "one process needs no srun/torchrun"
    assert json.loads((R / "run.json").read_text())["job_id"] == job_id
    assert world.cluster.job(job_id).get("JobName", "").startswith("ftmcp-")

    async def main():
        async with world.session() as s:
            return await poll_until(s, run_id, lambda r: r["status"] in TERMINAL, timeout=420)

    last, records, seen = anyio.run(main)
    assert last["status"] == "succeeded", last
    assert last["exit_code"] == 0
    assert records and [list(r) for r in records] == [["step", "loss", "lr", "mem_gb", "temp_c"]] * len(records)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(r["loss"] > 0 for r in records)
    ok, actual, recorded = verify_folder(R / "adapter")
    assert ok and actual == recorded
    assert json.loads((R / "exit.json").read_text())["returncode"] == 0
    # The scheduler agrees, and the job's words are in the run's log.
    rec = world.cluster.job(job_id)
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", rec
    assert f"slurm job {job_id}" in (R / "logs" / "stdout.log").read_text()
    assert "launched" in (R / "roadbook.md").read_text() and f"slurm job {job_id}" in (R / "roadbook.md").read_text()
    world.timings["sft_ok_s"] = time.monotonic() - t0


@pytest.mark.slurm
def test_failing_run_reads_failed_with_exit_code_and_triages(world):
    t0 = time.monotonic()
    launched = world.launch("broken")
    run_id = launched["run_id"]

    async def main():
        async with world.session() as s:
            last, _, _ = await poll_until(s, run_id, lambda r: r["status"] in TERMINAL, timeout=300)
            tri = await call(s, "triage_failure", run_id=run_id)
            return last, tri

    last, tri = anyio.run(main)
    assert last["status"] == "failed" and last["exit_code"] == 1, last
    rec = world.cluster.job(launched["job_id"])
    assert rec["JobState"] == "FAILED" and rec["ExitCode"] == "1:0", rec
    # A missing data file is neither an OOM nor a divergence; triage shows the error, it does not guess.
    assert tri["failure_class"] != "oom", tri
    assert any("nonexistent" in e["text"] or "FileNotFoundError" in e["text"] for e in tri["evidence"]), tri
    world.timings["failing_run_s"] = time.monotonic() - t0


@pytest.mark.slurm
def test_two_process_run_pends_for_resources_then_completes_via_srun_torchrun(world):
    t0 = time.monotonic()
    timeout_job = job_of(world.run_dir(world.runs["timeout"]))
    core_held = world.cluster.job(timeout_job).get("JobState") == "RUNNING"
    launched = world.launch("two", nproc=2)
    run_id, job_id = launched["run_id"], launched["job_id"]
    R = world.run_dir(run_id)
    sb = (R / "slurm.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=2" in sb and "srun --kill-on-bad-exit=1" in sb
    assert "torch.distributed.run" in sb and "--nproc-per-node=2" in sb
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in sb

    async def main():
        async with world.session() as s:
            return await poll_until(s, run_id, lambda r: r["status"] in TERMINAL, timeout=600, every=2.0)

    last, records, seen = anyio.run(main)
    # While the time-limit run held a core, two CPUs were not free: the scheduler said why.
    pending = [r for r in seen if r["status"] == "starting" and "PENDING" in (r["detail"] or "")]
    if core_held:
        assert pending and "(Resources)" in pending[0]["detail"], [r["detail"] for r in seen[:5]]
    assert last["status"] == "succeeded", last
    assert records and records[-1]["step"] == 4
    log = (R / "logs" / "stdout.log").read_text()
    assert "rank 0 of 2" in log and "rank 1 of 2" in log, log[-3000:]
    ok, _, _ = verify_folder(R / "adapter")
    assert ok
    world.timings["two_process_s"] = time.monotonic() - t0


@pytest.mark.slurm
def test_stop_run_scancels_and_the_run_reads_stopped(world):
    t0 = time.monotonic()
    launched = world.launch("stopme")
    run_id, job_id = launched["run_id"], launched["job_id"]
    R = world.run_dir(run_id)

    async def main():
        async with world.session() as s:
            await poll_until(s, run_id, lambda r: r["status"] == "running" and r["last"] is not None, timeout=300)
            stop = await call(s, "stop_run", run_id=run_id, grace_seconds=60)
            last, _, _ = await poll_until(s, run_id, lambda r: r["status"] in TERMINAL, timeout=60)
            tri = await call(s, "triage_failure", run_id=run_id)
            return stop, last, tri

    stop, last, tri = anyio.run(main)
    assert stop["status"] == "stopped" and stop["signal_sent"][0] == "SIGTERM", stop
    assert last["status"] == "stopped", last
    ex = json.loads((R / "exit.json").read_text())
    assert ex["stopped_by"] == "stop_run" and ex["returncode"] == 143, ex
    assert stop["checkpoint"] and Path(stop["checkpoint"]).is_dir(), "the trainer saved on SIGTERM"
    assert world.cluster.job(job_id)["JobState"] in ("CANCELLED", "FAILED", "COMPLETED")
    assert tri["failure_class"] != "oom", tri
    world.timings["stop_s"] = time.monotonic() - t0


@pytest.mark.slurm
def test_time_limit_is_a_failure_triaged_as_environment_not_oom(world):
    run_id = world.runs["timeout"]
    R = world.run_dir(run_id)

    async def main():
        async with world.session() as s:
            last, _, _ = await poll_until(s, run_id, lambda r: r["status"] in TERMINAL, timeout=240, every=3.0)
            tri = await call(s, "triage_failure", run_id=run_id)
            return last, tri

    last, tri = anyio.run(main)
    world.timings["timeout_run_s"] = time.monotonic() - world.timings["timeout_launched"]
    assert last["status"] == "failed", last
    assert "TIMEOUT" in last["detail"] and "not an OOM" in last["detail"], last
    assert last["exit_code"] == 143, last  # the trainer caught the scheduler's SIGTERM and saved
    assert world.cluster.job(job_of(R))["JobState"] == "TIMEOUT"
    assert "DUE TO TIME LIMIT" in (R / "logs" / "stdout.log").read_text()
    assert tri["failure_class"] == "environment", tri
    assert any("DUE TO TIME LIMIT" in e["text"] for e in tri["evidence"]), tri


@pytest.mark.slurm
def test_status_survives_the_scheduler_forgetting_the_jobs(world):
    """After MinJobAge the controller purges finished jobs; a clean controller restart forgets them the
    same way. Every run must still read its true end from what the job wrote into its run dir."""
    want = {"ok": "succeeded", "broken": "failed", "two": "succeeded", "stopme": "stopped", "timeout": "failed"}
    tags = [t for t in want if t in world.runs]
    assert tags, "no runs to check"
    world.cluster.restart_controller(clear_state=True)
    for tag in tags:
        assert world.cluster.job(job_of(world.run_dir(world.runs[tag]))) == {}, "the controller still knows the job"

    async def main():
        async with world.session() as s:
            return {t: await call(s, "poll_progress", run_id=world.runs[t]) for t in tags}

    got = anyio.run(main)
    for tag in tags:
        assert got[tag]["status"] == want[tag], (tag, got[tag])
    if "timeout" in got:
        assert "TIMEOUT" in got["timeout"]["detail"], got["timeout"]
    if "broken" in got:
        assert got["broken"]["exit_code"] == 1


# ---------------------------------------------------------------- no cluster needed


# Recorded from Slurm 22.05 (Debian 12) on the test cluster: the record the batch script saved as a
# one-minute job hit its limit, and the controller's record a moment later.
ENDING_AT_TIME_LIMIT = (
    "JobId=3 JobName=job.sbatch UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901757 Nice=0 Account=(null) "
    "QOS=(null) JobState=COMPLETING Reason=TimeLimit Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 "
    "ExitCode=0:0 RunTime=00:01:15 TimeLimit=00:01:00 TimeMin=N/A SubmitTime=2026-12-02T15:54:16 "
    "NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 "
    "Command=/tmp/h10/job.sbatch 200 0 WorkDir=/tmp/ftmcp-slurm-_22xb95m/timeout Power= "
)
FAILED_RECORD = (
    "JobId=1 UserId=root(0) GroupId=root(0) Name=job.sh JobState=FAILED Partition=debug TimeLimit=UNLIMITED "
    "StartTime=2026-12-02T15:53:11 EndTime=2026-12-02T15:53:13 NodeList=vm NodeCnt=1 ProcCnt=1 "
    "WorkDir=/tmp/ftmcp-slurm-pqdbhs53 ReservationName= Tres=cpu=1,mem=24105M,node=1,billing=1 Account= QOS= WcKey= "
    "Cluster=unknown SubmitTime=2026-12-02T15:53:09 EligibleTime=2026-12-02T15:53:09 DerivedExitCode=0:0 ExitCode=3:0"
)


def test_scheduler_records_parse_with_spaces_in_values():
    rec = parse_job_record(ENDING_AT_TIME_LIMIT)
    assert rec["JobState"] == "COMPLETING" and rec["Reason"] == "TimeLimit" and rec["TimeLimit"] == "00:01:00"
    assert rec["Command"] == "/tmp/h10/job.sbatch 200 0"  # a value with spaces stays whole
    assert rec["ReqB:S:C:T"] == "0:0:*:*" and rec["Power"] == ""
    failed = parse_job_record(FAILED_RECORD)  # the jobcomp/filetxt line has the same shape
    assert failed["JobState"] == "FAILED" and parse_exit_code(failed["ExitCode"]) == (3, 0)
    assert parse_exit_code("0:9") == (0, 9) and parse_exit_code(None) == (None, None)
    # sacct truncates its columns: OUT_OF_ME+ is OUT_OF_MEMORY; scontrol adds "by <uid>" to CANCELLED.
    assert base_state("OUT_OF_ME+") == "OUT_OF_MEMORY" and base_state("CANCELLED by 0") == "CANCELLED"


def test_node_local_output_roots_are_named(tmp_path):
    assert "under /tmp" in node_local_reason(Path("/tmp/x/outputs"), env={})
    assert "/dev/shm" in node_local_reason(Path("/dev/shm/runs"), env={})
    assert "$SLURM_TMPDIR" in node_local_reason(Path("/localdisk/job1/out"), env={"SLURM_TMPDIR": "/localdisk/job1"})
    assert "/tmp" not in (node_local_reason(Path("/tmpdata/shared/outputs"), env={}) or ""), "a prefix is a path, not a string"


def _spec(tmp_path: Path, **options) -> RunSpec:
    run_dir = tmp_path / "out" / EXP / "20260101-0000-t"
    return RunSpec(run_ref=f"{EXP}/20260101-0000-t", run_dir=run_dir, python="/opt/venv/bin/python",
                   nproc=options.pop("nproc", 1), options=options)


def test_job_script_for_several_nodes_uses_srun_torchrun_on_the_first_host(tmp_path):
    sb = SlurmLauncher().render_script(_spec(tmp_path, nodes=2, gpus_per_node=4, account="proj1", time_limit="2-00:00:00"))
    assert "#SBATCH --nodes=2" in sb and "#SBATCH --gpus-per-node=4" in sb and "#SBATCH --account=proj1" in sb
    assert "#SBATCH --time=2-00:00:00" in sb and "--cpus-per-task" not in sb
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in sb
    assert '"--rdzv-endpoint=${MASTER_ADDR}:${MASTER_PORT}"' in sb and "--nnodes=2" in sb and "--nproc-per-node=4" in sb
    assert "/opt/venv/bin/python -m torch.distributed.run" in sb
    # The job runs the same supervisor as a local run, and it writes exit.json into the run dir.
    assert f"/opt/venv/bin/python {tmp_path}/out/{EXP}/20260101-0000-t/.runwrap.py --run-dir" in sb
    # bash -n: the script parses.
    p = subprocess.run(["bash", "-n"], input=sb, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_bad_slurm_arguments_are_refused_before_anything_is_created(tmp_path):
    from finetune_mcp.errors import BadInput

    for opts, field in (({"time_limit": "an hour"}, "time_limit"), ({"partition": "gpu; rm -rf /"}, "partition"),
                        ({"account": "$(id)"}, "account")):
        with pytest.raises(BadInput) as e:
            SlurmLauncher().check(_spec(tmp_path, **opts))
        assert e.value.where == field
    assert not (tmp_path / "out").exists()
