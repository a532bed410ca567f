"""compare_runs through the MCP client, for both roles: two real runs of the generated train.py that differ in
their learning rate, compared as a table and one PNG with both loss curves."""

from __future__ import annotations

import base64
import json

import anyio

from conftest import finished, mcp_session, poll_until, run_call, run_dir_of

STEPS = 30


def test_compare_runs_table_and_overlaid_curves_for_both_roles(pipeline, monkeypatch):
    pipeline.use(monkeypatch)
    common = {"max_steps": STEPS, "logging_steps": 1, "save_steps": 10**6}
    pipeline.config("lr-high", **common, learning_rate=2e-3)
    pipeline.config("lr-low", **common, learning_rate=2e-4)
    exp = pipeline.experiment
    out: dict = {}

    async def main():
        async with mcp_session() as s:
            for tag in ("lr-high", "lr-low"):
                run_id = (await run_call(s, "launch_run", {"experiment": exp, "tag": tag, "accept_warnings": True}))["run_id"]
                out[tag] = await poll_until(s, run_id, finished, limit=5000)
            ids = [out["lr-high"][1]["run_id"], out["lr-low"][1]["run_id"]]
            out["train"] = await s.call_tool("compare_runs", {"experiment": exp, "runs": ids})
            out["all"] = await run_call(s, "compare_runs", {"experiment": exp, "plot": False})
        async with mcp_session("eval-engineer") as s:
            out["eval"] = await s.call_tool("compare_runs", {"experiment": exp, "runs": ids[::-1], "plot": False})

    anyio.run(main)
    r = out["train"]
    assert not r.is_error, r.content[0].text
    res = r.structured_content
    high, low = res["runs"]
    assert res["baseline"] == out["lr-high"][1]["run_id"] and res["varied"] == ["hparams.learning_rate"]
    assert high["differs"] == {"hparams.learning_rate": 2e-3} and low["differs"] == {"hparams.learning_rate": 2e-4}
    for row, tag in ((high, "lr-high"), (low, "lr-low")):
        records = out[tag][0]
        rd = run_dir_of(row["run_id"])
        metrics = json.loads((rd / "metrics.json").read_text())
        assert row["status"] == "succeeded" and row["steps"] == STEPS
        assert row["final_loss"] == records[-1]["loss"] == metrics["final_loss"]
        best = min(records, key=lambda x: x["loss"])
        assert (row["best_loss"], row["best_step"]) == (best["loss"], best["step"])
        assert row["wall_s"] == metrics["train_runtime_s"] and row["tokens_per_s"] > 0
        assert row["eval_loss"] == (metrics.get("eval") or {}).get("eval_loss")
    assert high["best_loss"] < low["best_loss"]  # on this task the higher rate learns faster within 30 steps
    text = r.content[0].text
    assert "| run | status | hparams.learning_rate |" in text and "0.002" in text
    images = [c for c in r.content if c.type == "image"]
    assert len(images) == 1 and base64.b64decode(images[0].data)[:8] == b"\x89PNG\r\n\x1a\n"

    # Without run ids: every run of the experiment, oldest first; the eval role compares too.
    assert [x["run_id"] for x in out["all"]["runs"]][-2:] == [high["run_id"], low["run_id"]]
    assert not out["eval"].is_error and out["eval"].structured_content["baseline"] == low["run_id"]
