"""Resume through the MCP client: a run killed with SIGKILL, resumed, stopped with stop_run, resumed again, ends
exactly where an uninterrupted run with the same seed ends. Real TRL runs of the generated train.py on the tiny model.

The proof is the records: the killed run's records up to its checkpoint, then each resumed run's records,
must be the uninterrupted run's records step for step (same losses, same learning rates: the optimizer,
the schedule and the random state that draws the batches were all restored), with no step missing or
written twice.
"""

from __future__ import annotations

import json
import math
import os
import signal

import anyio
import psutil

from conftest import KEYS, finished, mcp_session, poll_until, refused, run_call, run_dir_of

STEPS, SAVE = 240, 60
CFG = {"max_steps": STEPS, "save_steps": SAVE, "logging_steps": 1}
FIGURES = os.environ.get("FINETUNE_MCP_RESUME_FIGURES")  # where to write the comparison, for the report


def kill_trainer(run_id: str) -> None:
    trainer = psutil.Process(int((run_dir_of(run_id) / ".trainer.pid").read_text()))
    assert "train.py" in trainer.cmdline()
    trainer.send_signal(signal.SIGKILL)


def has_checkpoint(run_id: str, step: int) -> bool:
    return (run_dir_of(run_id) / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").is_file()


def test_kill_9_stop_and_resume_match_an_uninterrupted_run(pipeline, monkeypatch):
    pipeline.use(monkeypatch)
    pipeline.config("whole", **CFG)
    pipeline.config("broken", **CFG)
    pipeline.config("other-lr", **{**CFG, "learning_rate": 5e-4})
    exp = pipeline.experiment
    out: dict = {}

    async def main():
        async with mcp_session() as s:
            whole = (await run_call(s, "launch_run", {"experiment": exp, "tag": "whole", "accept_warnings": True}))["run_id"]
            out["whole"], out["whole_last"] = await poll_until(s, whole, finished, limit=5000)

            broken = (await run_call(s, "launch_run", {"experiment": exp, "tag": "broken", "accept_warnings": True}))["run_id"]
            seen, _ = await poll_until(s, broken, lambda r, seen: has_checkpoint(broken, SAVE) and len(seen) > SAVE + 5)
            out["refused_live"] = await refused(s, "launch_run", {"experiment": exp, "tag": "broken", "resume_from": broken,
                                                                  "accept_warnings": True})
            kill_trainer(broken)
            rest, out["broken_last"] = await poll_until(s, broken, finished, cursor=0, limit=5000)
            out["broken"] = rest
            size_before = (run_dir_of(broken) / "logs" / "progress.jsonl").stat().st_size

            out["refused_config"] = await refused(s, "launch_run", {"experiment": exp, "tag": "other-lr", "resume_from": broken,
                                                                    "accept_warnings": True})
            r1 = await run_call(s, "launch_run", {"experiment": exp, "tag": "broken", "resume_from": "latest", "accept_warnings": True})
            out["r1_launch"] = r1
            r1_id = r1["run_id"]
            seen1, _ = await poll_until(s, r1_id, lambda r, seen: len(seen) >= 40)
            out["stopped"] = await run_call(s, "stop_run", {"run_id": r1_id, "grace_seconds": 120})
            out["r1"], out["r1_last"] = await poll_until(s, r1_id, finished, cursor=0, limit=5000)

            r2 = await run_call(s, "launch_run", {"experiment": exp, "tag": "broken", "resume_from": r1_id, "accept_warnings": True})
            out["r2_launch"] = r2
            out["r2"], out["r2_last"] = await poll_until(s, r2["run_id"], finished, limit=5000)
            out["ids"] = (whole, broken, r1_id, r2["run_id"])
            out["broken_size"] = (size_before, (run_dir_of(broken) / "logs" / "progress.jsonl").stat().st_size)

    anyio.run(main)
    whole, broken, r1_id, r2_id = out["ids"]

    # Refused by name: resuming a live run, and resuming with a setting the checkpoint's state depends on.
    assert "still running" in out["refused_live"] and "stop_run" in out["refused_live"]
    assert "learning_rate" in out["refused_config"] and "loss jump after resume" in out["refused_config"]

    # The killed run: SIGKILL, records past its last checkpoint, files kept as they were.
    assert (out["broken_last"]["status"], out["broken_last"]["signal"]) == ("failed", "SIGKILL")
    assert out["broken_size"][0] == out["broken_size"][1]
    assert has_checkpoint(broken, SAVE)
    assert out["r1_launch"]["resumed_from"] == {"run_id": broken, "checkpoint": f"checkpoint-{SAVE}", "step": SAVE}
    assert r1_id.endswith("-broken-r1") and r2_id.endswith("-broken-r2")

    # stop_run of the first resume saved a checkpoint at the step it stopped; the second resume starts there.
    stop_step = int(os.path.basename(out["stopped"]["checkpoint"]).split("-")[1])
    assert out["r1_last"]["status"] == "stopped" and out["r2_launch"]["resumed_from"]["step"] == stop_step
    assert out["r2_last"]["status"] == "succeeded", out["r2_last"]

    # Records: continue at the right step, none lost or duplicated, and equal to the uninterrupted run's.
    assert out["r1"][0]["step"] == SAVE + 1 and out["r2"][0]["step"] == stop_step + 1
    stitched = [r for r in out["broken"] if r["step"] <= SAVE] + [r for r in out["r1"] if r["step"] <= stop_step] + out["r2"]
    assert [r["step"] for r in stitched] == list(range(1, STEPS + 1))
    assert [r["step"] for r in out["whole"]] == list(range(1, STEPS + 1))
    assert all(list(r) == KEYS for r in stitched)
    assert [r["lr"] for r in stitched] == [r["lr"] for r in out["whole"]]  # the schedule went on where it was
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(stitched, out["whole"])]
    assert max(diffs) <= 1e-4 * max(1.0, max(r["loss"] for r in out["whole"])), max(diffs)
    assert not any(a["kind"] == "loss-jump-after-resume" for a in out["r1_last"]["anomalies"] + out["r2_last"]["anomalies"])

    # The final loss of the product equals the uninterrupted run's.
    m_whole = json.loads((run_dir_of(whole) / "metrics.json").read_text())
    m_r2 = json.loads((run_dir_of(r2_id) / "metrics.json").read_text())
    assert m_r2["global_step"] == m_whole["global_step"] == STEPS
    assert math.isclose(m_r2["final_loss"], m_whole["final_loss"], rel_tol=1e-4, abs_tol=1e-6)

    # The roadbooks say what was resumed, on both sides.
    rb1 = (run_dir_of(r1_id) / "roadbook.md").read_text()
    assert f"resumes {broken} (failed) from checkpoint-{SAVE}" in rb1 and f"continue at step {SAVE + 1}" in rb1
    assert f"{r1_id} continues this run from checkpoint-{SAVE}" in (run_dir_of(broken) / "roadbook.md").read_text()
    assert f"resumes {r1_id} (stopped) from checkpoint-{stop_step}" in (run_dir_of(r2_id) / "roadbook.md").read_text()

    if FIGURES:
        with open(FIGURES, "w") as f:
            json.dump({"steps": STEPS, "save_steps": SAVE, "killed_after_step": out["broken"][-1]["step"], "stop_step": stop_step,
                       "max_abs_loss_diff": max(diffs), "identical_losses": sum(d == 0 for d in diffs),
                       "final_loss": {"uninterrupted": m_whole["final_loss"], "killed+resumed+stopped+resumed": m_r2["final_loss"]},
                       "records": {"uninterrupted": len(out["whole"]), "stitched": len(stitched)}}, f, indent=2)
