"""The run supervisor: starts the trainer, keeps its output, and records how it ended in exit.json.

Copied into each run directory as .runwrap.py and started detached by launch_run:

    <python> <run_dir>/.runwrap.py --run-dir <run_dir> -- <trainer argv...>

It outlives the server that started it, so the exit status is written even when no server is
running. Stdlib only: it runs under whatever Python is at hand (the training one, or the host's
for a container run).

exit.json: {"returncode": int, "signal": "SIGKILL" | null, "ended_at": ISO-8601 UTC,
"stopped_by": "stop_run" | null, "pid": trainer pid, "wrapper_pid": int, "leftovers_killed": [pids]}. For a trainer killed by
a signal, returncode follows the shell convention 128 + signal number and `signal` names it; a
trainer that caught SIGTERM and exited 143 by itself has signal null.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import tempfile

STOP_MARKER = "stop-requested"
# Set in the trainer's environment; every process of the run inherits it, even one that left our
# process group or was orphaned (torchrun starts each rank in a session of its own).
RUN_ENV = "FINETUNE_MCP_RUN_DIR"


def run_processes(run_dir: str, exclude: int) -> list[int]:
    """Pids of this user's processes whose environment marks them as part of this run (Linux /proc)."""
    want = f"{RUN_ENV}={run_dir}".encode()
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) == exclude:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def _sweep(run_dir: str) -> list[int]:
    """Kill what is left of the run once its main process has ended (a rank orphaned by a killed torchrun)."""
    left = run_processes(run_dir, os.getpid())
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


MEMORY_LIMIT_ENV = "FINETUNE_MCP_RUN_MEMORY_LIMIT_MB"


def _memory_cap(run_dir: str) -> dict | None:
    """Prepare a memory cap for the trainer (FINETUNE_MCP_RUN_MEMORY_LIMIT_MB), so that running out of
    memory kills this run instead of freezing the machine (a unified-memory DGX Spark can hang whole).

    Prefers a memory cgroup (v2, else v1: the kernel's OOM killer then ends the run with SIGKILL);
    else RLIMIT_AS (allocations fail inside the trainer). Returns what was set up, or None.
    """
    raw = os.environ.get(MEMORY_LIMIT_ENV)
    if not raw:
        return None
    limit = int(float(raw) * 2**20)
    name = "finetune-mcp-" + os.path.basename(run_dir.rstrip("/"))
    for base, ver, knob in (("/sys/fs/cgroup", 2, "memory.max"), ("/sys/fs/cgroup/unified", 2, "memory.max"),
                            ("/sys/fs/cgroup/memory", 1, "memory.limit_in_bytes")):
        try:
            if ver == 2:
                with open(os.path.join(base, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        continue
            elif not os.path.exists(os.path.join(base, knob)):
                continue
            path = os.path.join(base, name)
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, knob), "w") as f:
                f.write(str(limit))
            return {"mb": float(raw), "mechanism": f"cgroup-v{ver}", "path": path}
        except OSError:
            continue
    return {"mb": float(raw), "mechanism": "rlimit-as", "path": None}


def _enter_cap(cap: dict | None):
    """A preexec_fn: put the trainer (and so all its children) under the cap before it execs."""
    if cap is None:
        return None

    def enter():
        if cap["mechanism"] == "rlimit-as":
            import resource

            lim = int(cap["mb"] * 2**20)
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        else:
            with open(os.path.join(cap["path"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    return enter


def _cap_report(cap: dict | None) -> dict | None:
    """After the run: did it hit the cap? Then remove the cgroup."""
    if cap is None:
        return None
    out = dict(cap)
    if cap["path"]:
        for knob, key in (("memory.failcnt", "failcnt"), ("memory.events", "events"), ("memory.max_usage_in_bytes", "max_usage_bytes"),
                          ("memory.peak", "max_usage_bytes")):
            try:
                with open(os.path.join(cap["path"], knob)) as f:
                    text = f.read().strip()
                out[key] = int(text) if text.isdigit() else dict(l.split() for l in text.splitlines() if len(l.split()) == 2)
            except (OSError, ValueError):
                pass
        try:
            os.rmdir(cap["path"])
        except OSError:
            pass
    ev = out.get("events")
    out["oom_killed"] = bool((isinstance(ev, dict) and int(ev.get("oom_kill", 0)) > 0) or out.get("failcnt", 0) > 0)
    return out


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _write_json_atomic(path: str, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".exit.", suffix=".tmp", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself survives a crash only once its directory is on disk
    except OSError:
        pass
    finally:
        os.close(dfd)


def _stopped_by(stop_path: str) -> str | None:
    return "stop_run" if os.path.exists(stop_path) else None


def _handle_signals(child: list[subprocess.Popen], early: list[int], stop_path: str) -> None:
    def on_signal(signum, frame):
        # stop_run signals the whole process group, so the trainer already has it; anyone who
        # signals this supervisor alone (kill <pid> from run.json) means the run, so pass it on.
        if not child:
            early.append(signum)
        elif not os.path.exists(stop_path):
            try:
                child[0].send_signal(signum)
            except ProcessLookupError:
                pass

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    # A closing terminal or a dying server is no reason for the run to end.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _archive_previous_exit(exit_path: str, logs: str) -> None:
    """The run starts again in its own directory (a requeued Slurm job): the end of the attempt before is
    history, not this attempt's status."""
    if os.path.exists(exit_path):
        n = 1
        while os.path.exists(os.path.join(logs, f"exit-attempt-{n}.json")):
            n += 1
        os.replace(exit_path, os.path.join(logs, f"exit-attempt-{n}.json"))


def _record_pid(run_dir: str, pid: int) -> None:
    with open(os.path.join(run_dir, ".trainer.pid.tmp"), "w") as f:
        f.write(f"{pid}\n")
    os.replace(os.path.join(run_dir, ".trainer.pid.tmp"), os.path.join(run_dir, ".trainer.pid"))


def _wait_and_sweep(proc: subprocess.Popen, run_dir: str, cap: dict | None, out) -> tuple[int, list[int], dict | None]:
    """The trainer's return code, then what it left behind (killed) and what the memory cap saw."""
    while True:
        try:
            rc = proc.wait()
            break
        except InterruptedError:
            continue
    leftovers = _sweep(run_dir)
    memory = _cap_report(cap)
    if memory and memory.get("oom_killed"):
        out.write(f"finetune-mcp: the memory cap of {memory['mb']:g} MB was reached ({memory['mechanism']}: "
                  f"{memory.get('events') or ('failcnt ' + str(memory.get('failcnt')))})\n".encode())
    if leftovers:
        out.write(f"finetune-mcp: killed {len(leftovers)} process(es) the trainer left behind: {leftovers}\n".encode())
    return rc, leftovers, memory


def _signal_of(rc: int) -> tuple[int, str | None]:
    """A return code in the shell convention (128 + signal number) and the signal's name, for a killed trainer."""
    if rc >= 0:
        return rc, None
    try:
        sig = signal.Signals(-rc).name
    except ValueError:
        sig = f"SIG{-rc}"
    return 128 - rc, sig


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "--run-dir" or argv[2] != "--":
        print("usage: .runwrap.py --run-dir DIR -- COMMAND...", file=sys.stderr)
        return 2
    run_dir, cmd = os.path.abspath(argv[1]), argv[3:]
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    exit_path = os.path.join(run_dir, "exit.json")
    stop_path = os.path.join(run_dir, STOP_MARKER)
    child: list[subprocess.Popen] = []
    early: list[int] = []
    _handle_signals(child, early, stop_path)
    _archive_previous_exit(exit_path, logs)
    with open(os.path.join(logs, "stdout.log"), "ab", buffering=0) as out:
        if early:  # stopped before the trainer existed: do not start it at all
            _write_json_atomic(exit_path, {"returncode": 128 + early[0], "signal": signal.Signals(early[0]).name,
                                           "ended_at": _utc_now(), "stopped_by": _stopped_by(stop_path),
                                           "pid": None, "wrapper_pid": os.getpid()})
            return 128 + early[0]
        cap = _memory_cap(run_dir)
        if cap:
            out.write(f"finetune-mcp: trainer memory capped at {cap['mb']:g} MB ({cap['mechanism']})\n".encode())
        try:
            child.append(subprocess.Popen(cmd, cwd=run_dir, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          close_fds=True, restore_signals=True, env={**os.environ, RUN_ENV: run_dir},
                                          preexec_fn=_enter_cap(cap)))
        except OSError as e:
            out.write(f"finetune-mcp: cannot start {cmd[0]!r}: {e}\n".encode())
            _write_json_atomic(exit_path, {"returncode": 127, "signal": None, "ended_at": _utc_now(),
                                           "stopped_by": _stopped_by(stop_path),
                                           "pid": None, "wrapper_pid": os.getpid(), "error": str(e)})
            return 127
        proc = child[0]
        if early:
            proc.send_signal(early[0])
        _record_pid(run_dir, proc.pid)
        rc, leftovers, memory = _wait_and_sweep(proc, run_dir, cap, out)

    rc, sig = _signal_of(rc)
    _write_json_atomic(exit_path, {
        "returncode": rc,
        "signal": sig,
        "ended_at": _utc_now(),
        "stopped_by": _stopped_by(stop_path),
        "pid": proc.pid,
        "wrapper_pid": os.getpid(),
        "leftovers_killed": leftovers,
        "memory_limit": memory,
    })
    return rc if rc < 256 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
