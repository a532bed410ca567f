"""A warm worker: imports the training stack once, then forks one fresh child per job.

Started by finetune_mcp.worker in the training Python as `python -m finetune_mcp.jobs._zygote SOCKET`.
Importing torch, transformers, datasets, peft and trl costs a training Python several seconds of CPU
for every job; a forked child inherits them already imported and is otherwise a clean process,
exactly as if it had been started with `python -m finetune_mcp.jobs.<job>`:

  * the parent connects to SOCKET and sends one JSON line: {"job", "params", "env", "cwd", "stderr"};
  * the zygote forks; the child starts its own session (so the parent can kill it and whatever it
    spawned as one group), sends {"event": "pid"}, points stdout at the connection and stderr at the
    parent's file, and runs the job module as __main__ (its JSON lines go to the connection);
  * when the child has exited the zygote sends {"event": "exit", "rc": ...} (negative: killed by that
    signal) and closes the connection, so the parent always learns how the job ended.

The zygote itself runs no job code and touches no tokenizer, tensor or thread pool before forking: a
child starts from freshly imported libraries, the state torch's own fork-started DataLoader workers start
from (the imports leave two native helper threads, torch's and pyarrow's jemalloc, both fork-aware). It exits when its parent goes away (stdin
reaches EOF), when told to (a line "exit" on stdin), or after FINETUNE_MCP_WORKER_IDLE_S seconds
with no job running (default 900), giving its memory back; the folder worker.py made for SOCKET goes with it
(nobody else is left to remove it when the parent was killed). A job it forked lives on until it ends or the
server is gone (worker.py's lifeline, which every child inherits: common/proto.py watches it).

Stdlib only (the preloads are optional): this runs in the training Python.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import sys
import time
import traceback

# The packages' lazy submodules the jobs reach for too (prepare_data's masking and packing check, evaluate's and
# the step probe's model loading): without them every job paid ~3 s of imports a warm worker exists to save.
PRELOAD = ("torch", "transformers", "datasets", "peft", "trl", "trl.data_utils",
           "transformers.modeling_utils", "trl.chat_template_utils", "trl.trainer.sft_trainer")


def _preload() -> tuple[list[str], dict[str, str]]:
    loaded, missing = [], {}
    for name in PRELOAD:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as e:  # a job that needs it reports the same error itself
            missing[name] = f"{type(e).__name__}: {e}"[:300]
    return loaded, missing


def _send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.sendall((json.dumps(obj) + "\n").encode())
    except OSError:
        pass


def _read_request(conn: socket.socket) -> dict:
    conn.settimeout(30)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
    conn.settimeout(None)
    return json.loads(buf.decode("utf-8"))


def _child(conn: socket.socket, req: dict, keep: list) -> None:
    """In the forked child: become the job. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        for obj in keep:
            obj.close()
        _send(conn, {"event": "pid", "pid": os.getpid()})
        err = os.open(req["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(err, 2)
        os.close(err)
        os.dup2(conn.fileno(), 1)
        conn.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        import io

        sys.stdin = io.StringIO(json.dumps(req.get("params") or {}))
        if req.get("env") is not None:  # exactly the environment a cold start would have had
            os.environ.clear()
            os.environ.update(req["env"])
            if "tempfile" in sys.modules:  # the job's own TMPDIR, not the one the preloads cached
                sys.modules["tempfile"].tempdir = None
        if req.get("cwd"):
            os.chdir(req["cwd"])
        code = 0
        runpy.run_module(f"finetune_mcp.jobs.{req['job']}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes on Linux, with its NUL


def _bind(listener: socket.socket, path: str) -> None:
    """Bind to `path`, also when it is longer than a socket address may be (a deep TMPDIR, a pytest folder):
    then bind to its base name from inside its folder. This process has no other thread yet, and every job
    it forks changes to its caller's folder first. The parent connects through /proc/self/fd (worker.py)."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        listener.bind(path)
        return
    here = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(path)))
    try:
        listener.bind(os.path.basename(path))
    finally:
        os.chdir(here)


def main() -> None:
    path = sys.argv[1]
    idle_s = float(os.environ.get("FINETUNE_MCP_WORKER_IDLE_S") or 900)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library chatter stays off the control channel
    loaded, missing = _preload()

    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _bind(listener, path)
    listener.listen(16)
    out.write(json.dumps({"event": "ready", "pid": os.getpid(), "preloaded": loaded, "missing": missing}) + "\n")

    running: dict[int, socket.socket] = {}
    last_busy = time.monotonic()
    stdin_open = True
    try:
        while True:
            watch = [listener, rfd] + ([sys.stdin] if stdin_open else [])
            ready, _, _ = select.select(watch, [], [], 1.0)
            if rfd in ready:
                os.read(rfd, 4096)
            if stdin_open and sys.stdin in ready:
                line = sys.stdin.readline()
                if not line or line.strip() == "exit":
                    stdin_open = False
                    break
            if listener in ready:
                conn, _ = listener.accept()
                try:
                    req = _read_request(conn)
                except (OSError, ValueError) as e:
                    _send(conn, {"event": "exit", "rc": 1, "error": f"bad request: {e}"})
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(conn, req, [listener, *running.values(), out])
                running[pid] = conn
            while running:  # reap every finished child and tell its parent how it ended
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = running.pop(pid, None)
                if conn is not None:
                    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                    _send(conn, {"event": "exit", "rc": rc})
                    conn.close()
            if running:
                last_busy = time.monotonic()
            elif time.monotonic() - last_busy > idle_s:
                break
    finally:
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.basename(folder).startswith("finetune-mcp-warm-"):
            shutil.rmtree(folder, ignore_errors=True)
        # Jobs still running belong to the parent now (each has its own session); their connections
        # close with us, which the parent reads as an ending without an exit record.
        os._exit(0)


if __name__ == "__main__":
    main()
