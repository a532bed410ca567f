"""The Slurm launcher: the run as a batch job of the cluster's own scheduler (sbatch, scontrol, scancel).

For a brief that outgrows one machine (the OOM ladder's multi-node escalation) the run goes to the
scheduler a training cluster already has. The job script, R/slurm.sbatch, is kept with the run like
train.py. Its body runs the same stdlib supervisor as the local launcher (.runwrap.py), so the job
itself writes exit.json into the run directory; one process runs the trainer directly, several run
`srun` + torchrun with the rendezvous on the allocation's first host.

Status comes from the scheduler while it remembers the job (`scontrol show job`), and from what the
job left in the run directory once the controller has purged it (MinJobAge): exit.json, the
scheduler's record the batch script saves as it ends (logs/slurm-job.txt), then accounting (sacct)
where a cluster has it. A run polled days later still reads its true end.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from finetune_mcp.common.errors import BadInput, JobFailed, Refused
from finetune_mcp.launchers.base import STOP_MARKER, WRAPPER_NAME, WRAPPER_SRC, Launcher, RunSpec, Tick, wait_until
from finetune_mcp.workspace import atomic_write_text, read_json_file, utc_now


SBATCH_NAME = "slurm.sbatch"
END_RECORD = "logs/slurm-job.txt"  # the scheduler's view of the job, saved by the batch script as it ends

# Scheduler job states (squeue(1) "JOB STATE CODES") grouped by what poll_progress reports.
STARTING_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "POWER_UP_NODE"}
RUNNING_STATES = {"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING", "UPDATE_DB"}
FAILED_STATES = {"FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"}
ENDED_STATES = FAILED_STATES | {"COMPLETED", "CANCELLED"}

# What each failed end means for triage, in the scheduler's own terms.
STATE_DETAIL = {
    "TIMEOUT": "the scheduler ended the job at its time limit ({limit}); this is not an OOM: resubmit with a longer "
               "time_limit or resume from the last checkpoint",
    "OUT_OF_MEMORY": "the scheduler killed the job for exceeding its memory allocation (OUT_OF_MEMORY): an OOM, climb "
                     "the OOM ladder",
    "NODE_FAIL": "a node of the allocation failed under the job (NODE_FAIL): an environment failure, not the config; "
                 "relaunch, excluding the node if it recurs",
    "BOOT_FAIL": "the allocated node failed to boot (BOOT_FAIL): an environment failure; relaunch",
    "PREEMPTED": "the scheduler preempted the job for a higher-priority one (PREEMPTED); relaunch or resume",
    "DEADLINE": "the job reached its deadline (DEADLINE) before it could finish",
    "FAILED": "the job exited non-zero",
}

# Paths that are private to each node on a cluster: a run directory there is invisible to the
# other nodes, so a multi-node run would write its rank-0 records where nobody else looks.
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/scratch/local", "/local_scratch", "/localscratch",
                       "/lscratch", "/local", "/state/partition1")
NODE_LOCAL_ENV = ("TMPDIR", "SLURM_TMPDIR", "LOCAL_SCRATCH", "LOCALSCRATCH", "TMP", "TEMP")
NODE_LOCAL_FSTYPES = {"tmpfs", "ramfs", "overlay", "devtmpfs"}

_TIME_RE = re.compile(r"\A(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE)\Z", re.I)
_NAME_RE = re.compile(r"\A[A-Za-z0-9_.,@+-]{1,128}\Z")
_KEY_RE = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin:/sbin")


def client_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for sbatch/scontrol: the run's, minus the job variables of any allocation the
    server itself runs in (a nested sbatch would inherit that job's node list and limits)."""
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    exe = _which(argv[0])
    if exe is None:
        raise Refused(f"`{argv[0]}` is not installed on this machine", where="launcher=slurm",
                      fix="run the server on a Slurm login node (slurm-client installed, SLURM_CONF or /etc/slurm/slurm.conf set), or use launcher='local'")
    try:
        return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, env=client_env(env), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise JobFailed(f"`{' '.join(argv)}` did not answer within {timeout:.0f}s", where="launcher=slurm",
                        fix="check that slurmctld is up: `scontrol ping`") from None


# --- scheduler records --------------------------------------------------------------------------


def parse_job_record(text: str) -> dict[str, str]:
    """One `scontrol show job -o` line as key -> value. Values may hold spaces (Command=, Reason=)."""
    line = next((ln for ln in text.splitlines() if "JobId=" in ln), "")
    keys = list(_KEY_RE.finditer(line))
    rec = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        rec[m.group(1)] = line[m.end():end].strip()
    return rec


def parse_exit_code(value: str | None) -> tuple[int | None, int | None]:
    """Slurm's ExitCode "rc:signal" -> (rc, signal)."""
    if not value or ":" not in value:
        return None, None
    rc, _, sig = value.partition(":")
    try:
        return int(rc), int(sig)
    except ValueError:
        return None, None


def base_state(state: str | None) -> str:
    # "CANCELLED by 0", "COMPLETING+", "OUT_OF_ME+" (sacct truncation) all reduce to the state word.
    s = (state or "").split()[0].rstrip("+") if state else ""
    return "OUT_OF_MEMORY" if s.startswith("OUT_OF_ME") else s


def query_job(job_id: str, env: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """("known", record) while slurmctld remembers the job; ("forgotten", {}) once it has purged it;
    ("unreachable", {"error": ...}) when the controller does not answer."""
    try:
        p = _run(["scontrol", "show", "job", "-o", str(job_id)], env, timeout=20)
    except (Refused, JobFailed) as e:
        return "unreachable", {"error": e.message}
    if p.returncode == 0:
        rec = parse_job_record(p.stdout)
        if rec.get("JobState"):
            return "known", rec
    err = (p.stderr or p.stdout).strip()
    if "Invalid job id" in err:
        return "forgotten", {}
    return "unreachable", {"error": err or f"scontrol exited {p.returncode}"}


def accounting_record(job_id: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """State and ExitCode from accounting (slurmdbd), else from the job-completion log (sacct -c); {} when neither."""
    for extra in ([], ["-c"]):
        try:
            p = _run(["sacct", *extra, "-n", "-P", "-X", "-j", str(job_id), "-o", "JobID,State,ExitCode"], env, timeout=15)
        except (Refused, JobFailed):
            return {}
        if p.returncode != 0:
            continue
        for line in p.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 3 and parts[0].split(".")[0] == str(job_id):
                return {"JobState": base_state(parts[1]), "ExitCode": parts[2], "source": "sacct -c" if extra else "sacct"}
    return {}


def read_end_record(run_dir: Path) -> dict[str, str]:
    """The scheduler's record the batch script saved as the job ended ({} when there is none)."""
    try:
        return parse_job_record((run_dir / END_RECORD).read_text(errors="replace"))
    except OSError:
        return {}


# --- where the run directory lives --------------------------------------------------------------


def _mount_of(path: Path) -> tuple[str, str] | None:
    """(mount point, fs type) of the mount holding path, from /proc/self/mounts; None off Linux."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best = None
    p = str(path)
    for ln in lines:
        parts = ln.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if p == mnt or p.startswith(mnt.rstrip("/") + "/") or mnt == "/":
            if best is None or len(mnt) > len(best[0]):
                best = (mnt, parts[2])
    return best


def node_local_reason(path: Path, env: dict[str, str] | None = None) -> str | None:
    """Why `path` is private to one node (a temp path, the job's scratch, a RAM disk), or None."""
    env = os.environ if env is None else env
    resolved = Path(os.path.realpath(path))
    for var in NODE_LOCAL_ENV:
        val = env.get(var)
        if val and val not in ("/", "") and resolved.is_relative_to(Path(os.path.realpath(val))):
            return f"it is under ${var} ({val}), a node-local temporary directory"
    for pre in NODE_LOCAL_PREFIXES:
        if resolved.is_relative_to(pre):
            return f"it is under {pre}, which every node has its own copy of"
    m = _mount_of(resolved)
    if m and m[1] in NODE_LOCAL_FSTYPES:
        return f"it lives on a {m[1]} mount ({m[0]}), which exists on this node only"
    return None


# --- the launcher -------------------------------------------------------------------------------


def _options(spec: RunSpec) -> dict[str, Any]:
    o = dict(spec.options)
    nodes = int(o.get("nodes") or 1)
    gpn = o.get("gpus_per_node")
    return {
        "nodes": nodes,
        "gpus_per_node": int(gpn) if gpn else None,
        "partition": o.get("partition") or None,
        "time_limit": o.get("time_limit") or None,
        "account": o.get("account") or None,
    }


def procs_per_node(spec: RunSpec) -> int:
    """Trainer processes per node: one per GPU asked for, else the `nproc` of the launch."""
    return _options(spec)["gpus_per_node"] or max(1, spec.nproc)


def _sh(arg: str) -> str:
    # Scheduler variables expand inside the job; everything else is quoted literally.
    if "${" in arg:
        if re.search(r'["`\\]|\$\(', arg.replace("${", "")):
            raise BadInput(f"argument {arg!r} cannot be placed in the job script safely", where="slurm.sbatch")
        return f'"{arg}"'
    return shlex.quote(arg)


# sbatch reads SBATCH_<OPTION> variables and lets them outrank #SBATCH lines. These would move the
# job's log out of the run directory or undo what the script asks for, so they are dropped; the
# others (SBATCH_QOS, SBATCH_RESERVATION, SBATCH_CONSTRAINT ...) are a site's defaults and stay.
_SBATCH_OWNED = ("SBATCH_OUTPUT", "SBATCH_ERROR", "SBATCH_OPEN_MODE", "SBATCH_EXPORT", "SBATCH_JOB_NAME",
                 "SBATCH_REQUEUE", "SBATCH_NO_REQUEUE", "SBATCH_INPUT", "SBATCH_WAIT", "SBATCH_ARRAY_INX")
_SBATCH_BY_OPTION = {"partition": "SBATCH_PARTITION", "time_limit": "SBATCH_TIMELIMIT", "account": "SBATCH_ACCOUNT",
                     "gpus_per_node": "SBATCH_GPUS_PER_NODE"}


def submit_env(spec: RunSpec) -> tuple[dict[str, str], dict[str, str]]:
    """The environment sbatch runs with, and the SBATCH_* site defaults it still carries (for run.json)."""
    env = client_env(dict(spec.env) or None)
    o = _options(spec)
    drop = set(_SBATCH_OWNED) | {var for key, var in _SBATCH_BY_OPTION.items() if o.get(key)}
    env = {k: v for k, v in env.items() if k not in drop}
    return env, {k: v for k, v in sorted(env.items()) if k.startswith("SBATCH_")}


def check_names(options: dict[str, Any]) -> None:
    """The partition, account and time limit go into #SBATCH lines: each must be all name, to its last character."""
    if options.get("time_limit") and not _TIME_RE.fullmatch(str(options["time_limit"])):
        raise BadInput(f"time_limit {options['time_limit']!r} is not a Slurm time", where="time_limit",
                       fix="use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 01:30:00")
    for key in ("partition", "account"):
        if options.get(key) and not _NAME_RE.fullmatch(str(options[key])):
            raise BadInput(f"{key} {options[key]!r} is not a Slurm {key} name", where=key,
                           fix=f"give the {key} as `sinfo`/`sacctmgr` print it: letters, digits, '_', '.', '-'")


class SlurmLauncher(Launcher):
    name = "slurm"

    # -- check: before anything is created --

    def check(self, spec: RunSpec) -> None:
        o = _options(spec)
        if o["nodes"] < 1:
            raise BadInput(f"nodes must be at least 1, got {o['nodes']}", where="nodes", fix="pass nodes=1 or more")
        if o["gpus_per_node"] is not None and o["gpus_per_node"] < 1:
            raise BadInput(f"gpus_per_node must be at least 1, got {o['gpus_per_node']}", where="gpus_per_node",
                           fix="leave gpus_per_node unset for a CPU run")
        check_names(o)
        if o["nodes"] > 1:
            out_root = Path(spec.mounts.get("output_root") or spec.run_dir.parent.parent)
            why = node_local_reason(out_root, spec.env or None)
            if why:
                raise Refused(
                    f"OUTPUT_ROOT {out_root} is node-local storage: {why}. A {o['nodes']}-node run needs its run directory "
                    "on storage every node sees; nothing was launched",
                    where="OUTPUT_ROOT",
                    fix="set OUTPUT_ROOT to a shared filesystem (NFS, Lustre, GPFS, BeeGFS home or project space) that "
                        "all nodes mount at the same path, restart the server, and launch again",
                )
        missing = [b for b in ("sbatch", "scontrol", "scancel") if _which(b) is None]
        if missing:
            raise Refused(f"the Slurm client commands are not installed here (missing: {', '.join(missing)}); nothing was launched",
                          where="launcher=slurm",
                          fix="run the server on a Slurm login node (Debian/Ubuntu: apt-get install slurm-client), or use launcher='local'")
        p = _run(["scontrol", "ping"], dict(spec.env) or None, timeout=20)
        if p.returncode != 0 or "UP" not in p.stdout:
            msg = (p.stdout + p.stderr).strip().splitlines()
            raise Refused(
                "the Slurm controller does not answer (" + (msg[-1] if msg else f"scontrol ping exited {p.returncode}") + "); nothing was launched",
                where="launcher=slurm",
                fix="check SLURM_CONF (or /etc/slurm/slurm.conf) and that slurmctld and munged are running: `scontrol ping`",
            )

    # -- render: the trainer command and the job script --

    def render(self, spec: RunSpec) -> list[str]:
        o = _options(spec)
        ppn = procs_per_node(spec)
        train = [spec.script, "--config", str(spec.config_path)]
        if o["nodes"] == 1 and ppn == 1:
            return [spec.python, *train]
        # One srun task per node, each a torchrun that starts that node's ranks; the c10d rendezvous
        # on the first host of the allocation numbers them. --kill-on-bad-exit: a rank that dies
        # (OOM on one node) ends the whole step instead of leaving the others hung in a collective.
        # Since Slurm 22.05 srun does not inherit the job's --cpus-per-task: ask again, or both CPU
        # ranks of a node would share one core.
        cpus = [] if o["gpus_per_node"] else [f"--cpus-per-task={ppn}"]
        return [
            "srun", "--kill-on-bad-exit=1", f"--nodes={o['nodes']}", f"--ntasks={o['nodes']}", "--ntasks-per-node=1", *cpus,
            spec.python, "-m", "torch.distributed.run",
            f"--nnodes={o['nodes']}", f"--nproc-per-node={ppn}",
            "--rdzv-backend=c10d", "--rdzv-endpoint=${MASTER_ADDR}:${MASTER_PORT}", "--rdzv-id=${SLURM_JOB_ID}",
            *train,
        ]

    def render_script(self, spec: RunSpec) -> str:
        o = _options(spec)
        ppn = procs_per_node(spec)
        multi = o["nodes"] > 1 or ppn > 1
        R = spec.run_dir
        out = R / "logs" / "stdout.log"
        job_name = re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.run_ref)[-100:]
        lines = [
            "#!/bin/bash",
            f"# finetune-mcp run {spec.run_ref}: the batch job launch_run submitted with `sbatch --parsable --export=ALL {SBATCH_NAME}`.",
            "# Kept with the run, like train.py, so the exact job can be read (and resubmitted) later.",
            f"#SBATCH --job-name=ftmcp-{job_name}",
            f"#SBATCH --chdir={R}",
            # Slurm's own words (CANCELLED ... DUE TO TIME LIMIT, oom-kill events) land in the same
            # log as the trainer's, where triage reads.
            f"#SBATCH --output={out}",
            f"#SBATCH --error={out}",
            "#SBATCH --open-mode=append",
            f"#SBATCH --nodes={o['nodes']}",
            "#SBATCH --ntasks-per-node=1",
            # A requeued job (preemption, a node failure, `scontrol requeue`) runs this script again in the same
            # run directory: train.py resumes from the run's own newest checkpoint and appends only new records.
            "#SBATCH --requeue",
        ]
        if o["gpus_per_node"]:
            lines.append(f"#SBATCH --gpus-per-node={o['gpus_per_node']}")
        elif ppn > 1:
            lines.append(f"#SBATCH --cpus-per-task={ppn}")
        if o["partition"]:
            lines.append(f"#SBATCH --partition={o['partition']}")
        if o["time_limit"]:
            lines.append(f"#SBATCH --time={o['time_limit']}")
        if o["account"]:
            lines.append(f"#SBATCH --account={o['account']}")
        lines += ["", "set -u", f"cd {shlex.quote(str(R))} || exit 1"]
        if multi:
            lines += [
                "# The rendezvous host is the allocation's first node; the port is derived from the job id so",
                "# two jobs sharing a node do not collide.",
                'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                "MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
                "export MASTER_ADDR MASTER_PORT",
            ]
        lines.append('echo "finetune-mcp: slurm job $SLURM_JOB_ID on ${SLURM_JOB_NODELIST:-?} started $(date -u +%FT%TZ)'
                     ' (restart ${SLURM_RESTART_COUNT:-0})"')
        wrapper = [spec.python, str(R / WRAPPER_NAME), "--run-dir", str(R), "--"]
        cmd = " ".join(_sh(a) for a in wrapper + self.render(spec))
        lines += [
            "",
            "# The supervisor runs in the background so this shell survives scancel's SIGTERM and lets the",
            "# trainer save before the job ends; it writes exit.json itself.",
            f"{cmd} &",
            "child=$!",
            "trap 'kill -TERM \"$child\" 2>/dev/null' TERM INT",
            "while :; do",
            '  wait "$child"; rc=$?',
            '  kill -0 "$child" 2>/dev/null || break',
            "done",
            "# The scheduler's view as the job ends (TIMEOUT, CANCELLED ...), for when it has forgotten the job.",
            f'scontrol show job -o "$SLURM_JOB_ID" > {shlex.quote(str(R / END_RECORD))} 2>/dev/null || true',
            'exit "$rc"',
            "",
        ]
        return "\n".join(lines)

    # -- start: submit --

    def start(self, spec: RunSpec) -> dict[str, Any]:
        R = spec.run_dir
        (R / "logs").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(WRAPPER_SRC, R / WRAPPER_NAME)
        script = R / SBATCH_NAME
        _atomic_write(script, self.render_script(spec), 0o755)
        # --export=ALL on the command line: the job gets the run's environment (as a local run does)
        # even where a site sets SBATCH_EXPORT=NONE, which would outrank the script's own lines.
        argv = ["sbatch", "--parsable", "--export=ALL", str(script)]
        env, kept = submit_env(spec)
        p = _run(argv, env, timeout=60)
        # --parsable prints "jobid" or "jobid;cluster".
        m = re.match(r"^\s*(\d+)(?:;(\S+))?\s*$", p.stdout or "")
        if p.returncode != 0 or not m:
            err = (p.stderr or p.stdout).strip()
            raise JobFailed(f"sbatch refused the job: {err or f'exit {p.returncode}'}", where=str(script),
                            fix="check partition, account, time_limit and the resources asked for against `sinfo` and your "
                                "association; the job script stays in the run directory for reading")
        job_id, cluster = m.group(1), m.group(2)
        with open(R / "logs" / "supervisor.log", "a") as f:
            f.write(f"submitted {shlex.join(argv)} -> job {job_id}\n")
        return {"pid": None, "pgid": None, "start_time": None, "command": self.render(spec),
                "submit": argv, "sbatch_env": kept, "job_id": job_id, "cluster": cluster, "sbatch": str(script),
                **_options(spec)}

    # -- status --

    def state(self, run_dir: Path, run_json: dict[str, Any]) -> dict[str, Any]:
        """The run's status in poll_progress's words, from the scheduler while it knows the job, else
        from what the job wrote: {status, detail, exit_code, signal, scheduler_state, source}."""
        job_id = str(run_json.get("job_id") or "")
        exit_info = read_json_file(run_dir / "exit.json")
        stop_asked = (run_dir / STOP_MARKER).exists()
        known, rec = query_job(job_id) if job_id else ("forgotten", {})
        source = "scontrol"
        if known != "known":
            end = read_end_record(run_dir)
            if end.get("JobState") and base_state(end["JobState"]) not in ("RUNNING",):
                rec, source = end, END_RECORD
            elif exit_info is None and known == "forgotten" and job_id:
                acct = accounting_record(job_id)
                rec, source = (acct, acct.get("source", "sacct")) if acct else ({}, "")
            else:
                rec, source = ({}, "")
        state = base_state(rec.get("JobState"))
        reason = rec.get("Reason")
        rc_sched, sig_sched = parse_exit_code(rec.get("ExitCode"))
        exit_code = exit_info.get("returncode") if exit_info else rc_sched
        signal = exit_info.get("signal") if exit_info else None
        out = {"scheduler_state": state or None, "reason": reason, "source": source or None,
               "exit_code": exit_code, "signal": signal, "job_id": job_id}

        # A job still in the scheduler's hands and not yet ended.
        if known == "known" and state in STARTING_STATES:
            why = f" ({reason})" if reason and reason != "None" else ""
            if stop_asked:
                return {**out, "status": "stopped", "detail": f"stop requested while job {job_id} was {state}{why}"}
            return {**out, "status": "starting", "detail": f"slurm job {job_id} is {state}{why}"}
        # COMPLETING: the script has ended but the scheduler has not settled the end state yet (a
        # moment); only a time limit is already final then.
        if known == "known" and state in RUNNING_STATES and not (state == "COMPLETING" and reason == "TimeLimit"):
            extra = f"; {reason}" if reason and reason not in ("None", "") else ""
            return {**out, "status": "running", "detail": f"slurm job {job_id} is {state} on {rec.get('NodeList') or '?'}{extra}"}
        if known == "unreachable" and exit_info is None:
            return {**out, "status": "running",
                    "detail": f"the scheduler does not answer about job {job_id} ({rec.get('error') or 'no reply'}) and the run has not written exit.json yet"}

        # Ended: the job's own exit status first, the scheduler's end state for why.
        where = "" if source in ("scontrol", None, "") else f" (scheduler state from {source})"
        if stop_asked or (exit_info and exit_info.get("stopped_by")):
            return {**out, "status": "stopped", "detail": f"stopped by stop_run (scancel of job {job_id})"}
        if state == "TIMEOUT" or reason == "TimeLimit":
            limit = rec.get("TimeLimit") or run_json.get("time_limit") or "?"
            return {**out, "status": "failed", "scheduler_state": "TIMEOUT",
                    "detail": f"slurm job {job_id} TIMEOUT: " + STATE_DETAIL["TIMEOUT"].format(limit=limit) + where}
        if state in FAILED_STATES and state != "FAILED":
            return {**out, "status": "failed", "detail": f"slurm job {job_id} {state}: {STATE_DETAIL.get(state, state)}{where}"}
        if state == "CANCELLED" and not (exit_info and exit_info.get("returncode") == 0):
            return {**out, "status": "stopped",
                    "detail": f"slurm job {job_id} was CANCELLED outside stop_run (scancel by a user or an administrator){where}"}
        if exit_info is not None:
            rc = exit_info.get("returncode")
            if rc == 0:
                return {**out, "status": "succeeded", "detail": f"slurm job {job_id} {state or 'ended'}, exit status 0{where}"}
            sig = f", signal {signal}" if signal else ""
            return {**out, "status": "failed", "detail": f"slurm job {job_id} {state or 'ended'}: the trainer exited {rc}{sig}{where}"}
        if state == "COMPLETED":
            return {**out, "status": "succeeded", "detail": f"slurm job {job_id} COMPLETED{where}"}
        if state == "FAILED":
            return {**out, "status": "failed",
                    "detail": f"slurm job {job_id} FAILED with exit code {rc_sched} before the supervisor could record it{where}"}
        return {**out, "status": "failed",
                "detail": f"the scheduler no longer knows job {job_id} and the run left no exit status (no exit.json, no "
                          f"{END_RECORD}); read logs/stdout.log"}

    def alive(self, run_dir: Path, run_json: dict[str, Any]) -> bool:
        return self.state(run_dir, run_json)["status"] in ("starting", "running")

    # -- stop: scancel --

    def stop(self, run_dir: Path, run_json: dict[str, Any], grace: float, tick: Tick | None = None) -> list[str]:
        """SIGTERM to every step and the batch shell (the trainer saves a checkpoint), then, after
        `grace`, scancel proper (the scheduler's SIGTERM and, KillWait later, SIGKILL). A job still
        pending is simply cancelled."""
        job_id = str(run_json.get("job_id") or "")
        if not job_id:
            return []
        known, rec = query_job(job_id)
        state = base_state(rec.get("JobState")) if known == "known" else ""
        if known == "known" and state in ENDED_STATES:
            return []
        if known == "known" and state in STARTING_STATES:
            self._scancel([job_id])
            wait_until(lambda: not self._running(job_id), 15.0, tick, "waiting for the scheduler to cancel the pending job")
            if not (run_dir / "exit.json").exists():
                # The trainer never started, so no supervisor will record an exit: say so here.
                _atomic_write(run_dir / "exit.json", json.dumps({
                    "returncode": None, "signal": None, "ended_at": utc_now(), "stopped_by": "stop_run", "pid": None,
                    "wrapper_pid": None, "note": f"slurm job {job_id} was cancelled while {state}; the trainer never started"},
                    indent=2) + "\n", 0o644)
            return ["scancel (pending)"]
        sent = []
        if self._scancel(["--signal=TERM", "--full", job_id], allow_fail=True):
            sent.append("SIGTERM")
        if wait_until(lambda: not self._running(job_id), grace, tick, "waiting for the trainer to save and exit"):
            return sent
        # scancel proper: the scheduler's own SIGTERM, then SIGKILL after the cluster's KillWait.
        self._scancel([job_id])
        sent.append("scancel")
        wait_until(lambda: not self._running(job_id), 60.0, tick, "waiting for the scheduler to end the job")
        return sent

    def _running(self, job_id: str) -> bool:
        known, rec = query_job(job_id)
        if known == "unreachable":
            return True
        return known == "known" and base_state(rec.get("JobState")) not in ENDED_STATES

    def _scancel(self, args: list[str], allow_fail: bool = False) -> bool:
        p = _run(["scancel", *args], timeout=30)
        if p.returncode != 0 and not allow_fail:
            raise JobFailed(f"scancel {' '.join(args)} failed: {(p.stderr or p.stdout).strip()}", where="launcher=slurm",
                            fix="check the job with `scontrol show job`; cancel it by hand if it is still there")
        return p.returncode == 0


def _atomic_write(path: Path, text: str, mode: int) -> None:
    atomic_write_text(path, text, mode)

