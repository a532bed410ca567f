"""A job ends with its server: kill -9 the real server over stdio in the middle of prepare_dataset, and the
warm worker, the job it forked, the job's own workers and every temp folder of theirs are gone soon after."""

from __future__ import annotations

import os
import shutil
import signal
import time

import anyio
import psutil
import pytest

from conftest import mcp_session
from finetune_mcp.common import task

BOUND_S = 10.0  # the watchdog reacts at once (a read that returns at EOF); this leaves room for a loaded box
ROWS = int(os.environ.get("FINETUNE_MCP_TEST_LIFETIME_ROWS", "50000"))


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _cmd(p: psutil.Process) -> str:
    """A process's command line; a process that ended (or is a zombie) between listing and reading has none."""
    try:
        return " ".join(p.cmdline())[:120]
    except psutil.Error:
        return "<ended>"


@pytest.mark.parametrize("warm", ["1", "0"], ids=["forked-from-the-warm-worker", "cold"])
def test_a_server_killed_mid_prepare_dataset_takes_its_job_and_temp_folders_with_it(ws_root, tiny_model_dir, tmp_path, warm):
    shutil.copytree(tiny_model_dir, ws_root / "base-models" / "finetune-mcp-tiny")
    (ws_root / "briefs").mkdir()
    (ws_root / "briefs" / "sft.md").write_text(task.sample_brief("sft-lora"))
    task.write_jsonl(task.sft_conversations(ROWS), ws_root / "incoming" / "sft.jsonl")
    # The server's TMPDIR: the warm worker's folder and the jobs' stderr files. Deep on purpose: the worker's
    # socket path under it is longer than a socket address may be (108 bytes), as under CI's xdist folders.
    tmp = tmp_path / ("server-tmp-" + "d" * 60)
    tmp.mkdir()
    datasets = ws_root / "datasets"
    seen: dict = {}

    async def main():
        messages: list[str] = []

        async def on_progress(done, total, message):
            messages.append(message or "")

        async with mcp_session(env={"TMPDIR": str(tmp), "FINETUNE_MCP_WARM_WORKER": warm}) as s:
            server = next(p for p in psutil.Process().children() if "serve" in p.cmdline())

            async def call():
                try:
                    await s.call_tool("prepare_dataset", {"brief_path": "briefs/sft.md", "source": "incoming/sft.jsonl"},
                                      progress_callback=on_progress)
                except Exception:  # the server is gone: the call cannot end well
                    pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                with anyio.fail_after(600):
                    # The job's own progress (from inside the forked child) says it is templating, with its
                    # pool of forked workers where the box has two cores or more.
                    while not any(m.startswith("templated") for m in messages):
                        await anyio.sleep(0.1)
                tree = _alive(server.children(recursive=True))
                seen["tree"] = [(p.pid, _cmd(p)) for p in tree]
                seen["stages"] = sorted(p.name for p in datasets.glob(".staging-*"))
                seen["tmp"] = sorted(p.name for p in tmp.iterdir())
                os.kill(server.pid, signal.SIGKILL)
                t0 = time.monotonic()
                server.wait(30)
                left = tree
                while left and time.monotonic() - t0 < 120:
                    left = _alive(left)
                    time.sleep(0.05)
                seen["gone_after_s"] = time.monotonic() - t0
                seen["left"] = [(p.pid, _cmd(p)) for p in _alive(tree)]
                tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    except BaseException as e:  # the client's teardown after its server vanished
        if "gone_after_s" not in seen:
            raise
        del e
    print(f"job tree {seen['tree']}: gone {seen['gone_after_s']:.2f}s after kill -9 of the server")
    # Mid-job: the prepare_data job (forked by the warm worker, or started cold) was there, with its folders.
    if warm == "1":
        assert any("_zygote" in cmd for _, cmd in seen["tree"]) and len(seen["tree"]) >= 2, seen["tree"]
        assert any(n.startswith("finetune-mcp-warm-") for n in seen["tmp"]), seen
        assert any(n.startswith("finetune-mcp-job-err-") for n in seen["tmp"]), seen
    else:
        assert any("finetune_mcp.jobs.prepare_data" in cmd for _, cmd in seen["tree"]), seen["tree"]
    assert len(seen["stages"]) == 1 and any(n.startswith("finetune-mcp-job-tmp-") for n in seen["tmp"]), seen
    assert seen["left"] == [], seen["left"]
    assert seen["gone_after_s"] < BOUND_S, seen["gone_after_s"]
    time.sleep(0.5)
    assert sorted(p.name for p in datasets.glob(".staging-*")) == []
    # Kept on purpose: the folder with a link to this package that jobs import it from.
    assert [n.name for n in tmp.iterdir() if not n.name.startswith("finetune-mcp-pkg-")] == []


def test_a_process_the_job_forked_outside_its_group_ends_with_the_server_too(monkeypatch):
    # The job's watcher kills its process group when the lifeline reaches EOF; a pool worker (prepare_data's templating
    # pool starts each with follow_lifeline) watches the lifeline itself, so one that missed that kill - here, one that
    # left the group - still ends. Real processes: a pipe whose write end plays the server, a forked child.
    import multiprocessing as mp

    from finetune_mcp.common import proto

    r, w = os.pipe()
    monkeypatch.setattr(proto, "_lifeline_fd", r)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_forked_helper, args=(w, ready))
    child.start()
    try:
        assert ready.wait(30) and child.is_alive()
        os.close(w)  # the server is gone
        child.join(BOUND_S)
        assert not child.is_alive(), "the forked helper outlived its server"
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()
        os.close(r)


def _forked_helper(w: int, ready) -> None:
    from finetune_mcp.common import proto

    os.close(w)  # only the server holds the write end (a job is exec'd; os.pipe's ends do not pass exec)
    os.setpgid(0, 0)  # out of the group the job's watcher would kill
    proto.follow_lifeline()
    ready.set()
    time.sleep(60)
