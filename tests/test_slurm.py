"""The Slurm launcher against a real one-node cluster (tests/slurm_cluster.py), driven through the MCP client.

The cluster is Debian's slurmctld/slurmd/munge started under a temp dir; without the packages
these tests skip and say so (.ci/slurm-setup.sh installs them). The experiment is opened the way an
agent opens it (prepare_dataset, preflight, generate_config through the client), so the main runs
execute the generated train.py: real TRL SFT + LoRA on the embedded tiny model. A second experiment
runs tests/fixtures/scripts/sft_tiny.py for the two runs that need a trainer which idles (the
one-minute time limit) or a dataset that is gone (the failing run).

The time-limit run is submitted first, so Slurm's TIMEOUT (60-90 s away) arrives while the other
runs are tested; it also holds one of the two cores, which is what leaves the two-process run
PENDING for Resources at first. The tests at the bottom need no cluster: the job script, the
scheduler's records as Slurm 22.05 printed them here, the environment sbatch gets, and the
node-local storage rule.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import anyio
import psutil
import pytest
import yaml

from conftest import mcp_session
from slurm_cluster import slurm_cluster  # noqa: F401  (session fixture)

from finetune_mcp.digest import verify_folder
from finetune_mcp.common import task
from finetune_mcp.launchers.base import RunSpec
from finetune_mcp.launchers.slurm import (
    SlurmLauncher,
    base_state,
    node_local_reason,
    parse_exit_code,
    parse_job_record,
    submit_env,
)
from finetune_mcp.workspace import commit

REPO = Path(__file__).resolve().parent.parent
SFT_SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "sft_tiny.py"
EXP = "finetune-mcp-tiny-SFT-LoRA-repeat-words"  # opened by prepare_dataset from the sample brief
FX = "finetune-mcp-tiny-SFT-LoRA-slurm-fixture"  # runs tests/fixtures/scripts/sft_tiny.py
TERMINAL = ("succeeded", "failed", "stopped")

# generate_config overrides per tag of the real experiment (its own train.py).
FAST = {"gradient_accumulation_steps": 1, "per_device_train_batch_size": 4, "logging_steps": 1}
CONFIGS = {
    "ok": {**FAST, "max_steps": 6},
    # end-of-run eval on: a DDP collective, so every rank must take part
    "two": {**FAST, "max_steps": 4},
    "stopme": {**FAST, "max_steps": 2000, "save_steps": 1000},
    "held": {**FAST, "max_steps": 2},
    "queued": {**FAST, "max_steps": 2},
    "requeue": {**FAST, "max_steps": 160, "save_steps": 40},
}
# The fixture experiment's run configs: step_sleep keeps a run alive without using the CPU, and a
# data file that does not exist makes a run fail the way a lost dataset does.
FX_RUNS = {
    "timeout": {"training": {"max_steps": 5000}, "fixture": {"step_sleep": 1.0}},
    "broken": {"data": {"train_file": "/nonexistent/finetune-mcp/train.jsonl"}},
}


# ---------------------------------------------------------------- the world the server sees


def build_fixture_experiment(root: Path, train_file: Path, env_report: Path) -> None:
    """A second experiment whose train.py is the fixture script, committed as generate_config would."""
    exp = root / "experiments" / "trainings" / FX
    (exp / "configs").mkdir(parents=True)
    (exp / "training-brief.md").write_text(task.sample_brief("sft-lora"))
    shutil.copyfile(env_report, exp / "env-report.json")  # the same machine, preflighted a moment ago
    base = {
        "model": {"path": str(root / "base-models" / "finetune-mcp-tiny")},
        "data": {"train_file": str(train_file)},
        "training": {"max_steps": 6, "learning_rate": 1e-3, "logging_steps": 1, "save_steps": 10**6,
                     "per_device_train_batch_size": 4, "max_length": 64, "seed": 0, "lora_r": 4},
    }
    (exp / "configs" / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    shutil.copyfile(SFT_SCRIPT, exp / "train.py")
    paths = [exp / "training-brief.md", exp / "configs" / "base.yaml", exp / "train.py"]
    for tag, over in FX_RUNS.items():
        p = exp / "configs" / f"run-{tag}.yaml"
        p.write_text(yaml.safe_dump(over, sort_keys=False))
        paths.append(p)
    commit(root / "experiments", paths, "slurm test fixture experiment")


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
        self.notes: dict[str, str] = {}

    def run_dir(self, run_id: str) -> Path:
        exp, rid = run_id.split("/")
        return self.root / "outputs" / "trainings" / exp / rid

    def session(self, **env):
        return mcp_session("training-engineer", env={**self.env, **env})

    def launch(self, tag: str, env: dict | None = None, experiment: str = EXP, **kw) -> dict:
        async def main():
            async with self.session(**(env or {})) as s:
                return await call(s, "launch_run", experiment=experiment, tag=tag, launcher="slurm", accept_warnings=True, **kw)

        r = anyio.run(main)
        self.runs[tag] = r["run_id"]
        return r


@pytest.fixture(scope="module")
def world(slurm_cluster, tiny_model_dir, tmp_path_factory):  # noqa: F811
    """prepare_dataset, preflight and generate_config through the MCP client, as an agent would; then
    the one-minute time-limit run is submitted first, since Slurm needs a minute and more to end it."""
    t0 = time.monotonic()
    root = tmp_path_factory.mktemp("slurm-world") / "dgx-spark"
    shutil.copytree(tiny_model_dir, root / "base-models" / "finetune-mcp-tiny")
    inbox = root / "inbox"  # inside DGX_SPARK_ROOT: the role may read it
    inbox.mkdir()
    (inbox / "training-brief.md").write_text(task.sample_brief("sft-lora"))
    task.write_jsonl(task.sft_conversations(400, seed=0), inbox / "repeat-words.jsonl")
    w = World(root, slurm_cluster)
    w.timings["cluster_start_s"] = slurm_cluster.timings.get("start_s", 0.0)

    async def setup():
        async with w.session() as s:
            prep = await call(s, "prepare_dataset", brief_path=str(inbox / "training-brief.md"),
                              source=str(inbox / "repeat-words.jsonl"))
            assert prep["experiment"] == EXP and prep["complete"], prep["summary"]
            pf = await call(s, "preflight", experiment=EXP)
            assert pf["verdict"] in ("ready", "ready-with-warnings"), pf["summary"]
            for tag, over in CONFIGS.items():
                await call(s, "generate_config", experiment=EXP, tag=tag, overrides=over)
            return prep

    prep = anyio.run(setup)
    exp = root / "experiments" / "trainings" / EXP
    build_fixture_experiment(root, Path(prep["dataset_dir"]) / "train.jsonl", exp / "env-report.json")
    w.timings["setup_s"] = time.monotonic() - t0
    w.timings["timeout_launched"] = time.monotonic()
    w.launch("timeout", experiment=FX, time_limit="1")
    yield w
    print("\nslurm test timings:", json.dumps({k: round(v, 1) for k, v in w.timings.items() if k.endswith("_s")}))
    print("slurm test notes:", json.dumps(w.notes, indent=1))


# ---------------------------------------------------------------- through the MCP client


@pytest.mark.slurm
def test_multi_node_run_refused_on_node_local_output_root(world):
    async def main():
        # The server's TMPDIR holds OUTPUT_ROOT, as when a run directory is put in the job's scratch space.
        async with world.session(TMPDIR=str(world.root)) as s:
            r = await s.call_tool("launch_run", {"experiment": EXP, "tag": "ok", "launcher": "slurm", "nodes": 2,
                                                 "accept_warnings": True})
            return r

    r = anyio.run(main)
    text = r.content[0].text
    assert r.is_error
    assert "node-local" in text and "OUTPUT_ROOT" in text and "$TMPDIR" in text, text
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
                 f"#SBATCH --output={R}/logs/stdout.log", "#SBATCH --requeue"):
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
    launched = world.launch("broken", experiment=FX)
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

    ranks: set[int] = set()
    config = str(R / "config.yaml")

    def watch(r) -> bool:
        # The trainer processes of this run (not torchrun itself), wherever Slurm started them.
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmd = proc.info["cmdline"] or []
            if "train.py" in cmd and config in cmd and "torch.distributed.run" not in cmd:
                ranks.add(proc.info["pid"])
        return r["status"] in TERMINAL

    async def main():
        async with world.session() as s:
            return await poll_until(s, run_id, watch, timeout=600, every=1.0)

    last, records, seen = anyio.run(main)
    # While the time-limit run held a core, two CPUs were not free: the scheduler said why.
    pending = [r for r in seen if r["status"] == "starting" and "PENDING" in (r["detail"] or "")]
    world.notes["two_process_first_detail"] = seen[0]["detail"]
    if core_held:
        assert any("(Resources)" in r["detail"] for r in pending), [r["detail"] for r in seen[:5]]
    assert last["status"] == "succeeded", last
    assert records and records[-1]["step"] == 4
    assert len(ranks) == 2, ranks  # torchrun started two ranks inside the srun step
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # rank 0 alone writes records
    ok, _, _ = verify_folder(R / "adapter")
    assert ok
    world.timings["two_process_s"] = time.monotonic() - t0


@pytest.mark.slurm
def test_held_job_reads_starting_with_the_reason_and_an_outside_scancel_reads_stopped(world):
    # The test cluster's "held" partition is DOWN: it queues jobs and starts none, so the job stays
    # PENDING for as long as this test needs.
    launched = world.launch("held", partition="held")
    run_id, job_id = launched["run_id"], launched["job_id"]
    R = world.run_dir(run_id)

    async def first():
        async with world.session() as s:
            return await call(s, "poll_progress", run_id=run_id)

    r = anyio.run(first)
    assert r["status"] == "starting" and r["records"] == [], r
    assert f"slurm job {job_id} is PENDING" in r["detail"], r

    async def reason():
        async with world.session() as s:
            # The scheduler names its reason on its next pass.
            return await poll_until(s, run_id, lambda r: "(PartitionDown)" in (r["detail"] or ""), timeout=30)

    r, _, _ = anyio.run(reason)
    assert r["status"] == "starting", r
    world.notes["held_detail"] = r["detail"]
    # An administrator (not stop_run) cancels it before it ever ran: no exit.json will come.
    assert world.cluster.client("scancel", job_id).returncode == 0

    async def then():
        async with world.session() as s:
            last, _, _ = await poll_until(s, run_id, lambda r: r["status"] in TERMINAL, timeout=60)
            return last

    last = anyio.run(then)
    assert last["status"] == "stopped" and "CANCELLED outside stop_run" in last["detail"], last
    assert not (R / "exit.json").exists() and not (R / "logs" / "stdout.log").exists()
    world.runs["held"] = run_id


@pytest.mark.slurm
def test_stop_run_of_a_pending_job_cancels_it_and_it_reads_stopped(world):
    launched = world.launch("queued", partition="held")
    run_id, job_id = launched["run_id"], launched["job_id"]
    R = world.run_dir(run_id)

    async def main():
        async with world.session() as s:
            first = await call(s, "poll_progress", run_id=run_id)
            stop = await call(s, "stop_run", run_id=run_id, grace_seconds=5)
            last = await call(s, "poll_progress", run_id=run_id)
            return first, stop, last

    first, stop, last = anyio.run(main)
    assert first["status"] == "starting", first
    assert stop["status"] == "stopped" and stop["signal_sent"] == ["scancel (pending)"], stop
    assert last["status"] == "stopped", last
    assert world.cluster.job(job_id)["JobState"] == "CANCELLED"
    ex = json.loads((R / "exit.json").read_text())
    assert ex["stopped_by"] == "stop_run" and ex["returncode"] is None and "never started" in ex["note"], ex
    world.runs["queued"] = run_id


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
def test_a_requeued_job_resumes_from_its_checkpoint_without_losing_or_repeating_a_record(world):
    # `scontrol requeue` ends the running job and queues it again, as preemption or a node failure does; the
    # same batch script runs again in the same run directory.
    t0 = time.monotonic()
    launched = world.launch("requeue")
    run_id, job_id = launched["run_id"], launched["job_id"]
    R = world.run_dir(run_id)
    assert "#SBATCH --requeue" in (R / "slurm.sbatch").read_text()

    async def main():
        async with world.session() as s:
            def past_checkpoint(r):
                return (R / "checkpoints" / "checkpoint-40" / "trainer_state.json").is_file() and (r["last"] or {}).get("step", 0) > 45

            await poll_until(s, run_id, past_checkpoint, timeout=300, every=0.5)
            p = world.cluster.client("scontrol", "requeue", job_id)
            assert p.returncode == 0, p.stderr
            # Slurm holds a requeued job back for a while (its begin time moves ahead); the test need not wait it out.
            end = time.monotonic() + 60
            while world.cluster.job(job_id).get("JobState") not in ("PENDING", "REQUEUED") and time.monotonic() < end:
                await anyio.sleep(0.5)
            world.notes["requeue_pending"] = world.cluster.job(job_id).get("Reason", "?")
            world.cluster.client("scontrol", "update", f"JobId={job_id}", "StartTime=now")
            last, records, seen = await poll_until(s, run_id, lambda r: r["status"] in TERMINAL, timeout=600)
            return last, records, seen

    last, records, seen = anyio.run(main)
    assert last["status"] == "succeeded", (last, (R / "logs" / "stdout.log").read_text()[-3000:])
    assert [r["step"] for r in records] == list(range(1, 161))  # none lost, none written twice
    resumes = [json.loads(l) for l in (R / "logs" / "resumes.jsonl").read_text().splitlines()]
    assert len(resumes) == 1 and resumes[0]["step"] >= 40 and resumes[0]["attempt"] >= 1, resumes
    assert (R / "logs" / "exit-attempt-1.json").is_file()  # the first attempt's end, kept as history
    assert json.loads((R / "exit.json").read_text())["returncode"] == 0
    assert "**requeued-1**" in (R / "roadbook.md").read_text()
    world.timings["requeue_s"] = time.monotonic() - t0


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
    want = {"ok": "succeeded", "broken": "failed", "two": "succeeded", "stopme": "stopped", "timeout": "failed",
            "held": "stopped", "queued": "stopped"}
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    tags = [t for t in want if t in world.runs
            and world.cluster.job(job_of(world.run_dir(world.runs[t]))).get("JobState") in ended]
    assert tags, "no ended runs to check"
    world.notes["forgotten_runs"] = ", ".join(tags)
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
    if "held" in got:
        # It never ran, so it wrote nothing: its end comes from the job-completion log (sacct -c).
        assert "CANCELLED outside stop_run" in got["held"]["detail"] and "sacct -c" in got["held"]["detail"], got["held"]
    world.notes["after_forgetting"] = json.dumps({t: got[t]["detail"] for t in tags})


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
    from finetune_mcp.common.errors import BadInput

    for opts, field in (({"time_limit": "an hour"}, "time_limit"), ({"partition": "gpu; rm -rf /"}, "partition"),
                        ({"account": "$(id)"}, "account")):
        with pytest.raises(BadInput) as e:
            SlurmLauncher().check(_spec(tmp_path, **opts))
        assert e.value.where == field
    assert not (tmp_path / "out").exists()


def test_submit_env_keeps_site_defaults_but_not_what_the_script_decides(tmp_path):
    env = {"PATH": "/usr/bin", "SLURM_CONF": "/etc/slurm/x.conf", "SLURM_JOB_ID": "77", "SLURM_CPUS_PER_TASK": "8",
           "SBATCH_OUTPUT": "/home/me/slurm-%j.out", "SBATCH_EXPORT": "NONE", "SBATCH_QOS": "normal",
           "SBATCH_PARTITION": "gpu", "SBATCH_ACCOUNT": "proj0"}
    spec = RunSpec(run_ref=f"{EXP}/20260101-0000-t", run_dir=tmp_path, python="python", env=env,
                   options={"account": "proj1"})
    got, kept = submit_env(spec)
    # The server's own allocation (if it runs inside one) must not leak into the new job.
    assert "SLURM_JOB_ID" not in got and "SLURM_CPUS_PER_TASK" not in got and got["SLURM_CONF"] == "/etc/slurm/x.conf"
    # The log location and the environment export are the script's; an explicit account beats the default.
    assert "SBATCH_OUTPUT" not in got and "SBATCH_EXPORT" not in got and "SBATCH_ACCOUNT" not in got
    assert kept == {"SBATCH_PARTITION": "gpu", "SBATCH_QOS": "normal"}
