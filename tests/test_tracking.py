"""The brief's report_to picks the tracker: each real trainer integration writes to its local store under the run's
logs/, and the values read back from that store are the run's own losses.

One experiment, opened through the MCP client; for each tracker the brief's Tracking section is edited,
generate_config re-resolves (base.yaml's `tracking`) and a short real run of the generated train.py reports
to it. TensorBoard is the default; trackio, MLflow (file store) and W&B (offline) come with the `tracking`
extra. A tracker that cannot be imported here is skipped loudly, by name.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
from pathlib import Path

import anyio
import pytest

from conftest import finished, mcp_session, poll_until, run_call, run_dir_of
from finetune_mcp.common import task

TRACKERS = ("tensorboard", "trackio", "mlflow", "wandb")
STEPS = 6


def close(a: list[float], b: list[float]) -> bool:
    # TensorBoard keeps float32; the others keep what the trainer logged.
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b))


# ---------------------------------------------------------------- reading each store back


def tensorboard_losses(logs: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(logs.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard events under {logs}"
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    return [e.value for e in acc.Scalars("train/loss")]


def trackio_losses(logs: Path, project: str, run: str) -> list[float]:
    os.environ["TRACKIO_DIR"] = str(logs / "trackio")  # read before trackio is imported: where its SQLite store lies
    from trackio.sqlite_storage import SQLiteStorage

    assert run in SQLiteStorage.get_runs(project)
    return [r["train/loss"] for r in SQLiteStorage.get_logs(project, run) if "train/loss" in r]


def mlflow_losses(logs: Path, project: str, run: str) -> list[float]:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(logs / "mlruns").as_uri())
    exp = client.get_experiment_by_name(project)
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_name for r in runs] == [run]
    return [m.value for m in sorted(client.get_metric_history(runs[0].info.run_id, "loss"), key=lambda m: m.step)]


def wandb_losses(logs: Path) -> list[float]:
    """History records of the offline run file: LevelDB's log format (32 KiB blocks of CRC-length-type chunks)
    after W&B's 7-byte header, each record a wandb_internal Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    paths = glob.glob(str(logs / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(paths) == 1, paths
    data = Path(paths[0]).read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                if "train/loss" in items:
                    out.append(float(json.loads(items["train/loss"])))
    return out


# ---------------------------------------------------------------- the test


def test_each_tracker_logs_the_runs_losses_to_its_local_store(tmp_path, monkeypatch, tiny_model_dir):
    root = tmp_path / "dgx-spark"
    root.mkdir()
    monkeypatch.setenv("DGX_SPARK_ROOT", str(root))
    monkeypatch.delenv("OUTPUT_ROOT", raising=False)
    inbox = root / "inbox"
    inbox.mkdir()
    brief = task.sample_brief("sft-lora")
    (inbox / "training-brief.md").write_text(brief)
    task.write_jsonl(task.sft_conversations(200, seed=0), inbox / "repeat-words.jsonl")
    missing = [t for t in TRACKERS if importlib.util.find_spec(t if t != "mlflow" else "mlflow") is None]
    results: dict[str, dict] = {}

    async def main():
        async with mcp_session() as s:
            prep = await run_call(s, "prepare_dataset", {"brief_path": str(inbox / "training-brief.md"),
                                                         "source": str(inbox / "repeat-words.jsonl")})
            exp = prep["experiment"]
            await run_call(s, "preflight", {"experiment": exp})
            for tracker in TRACKERS:
                if tracker in missing:
                    continue
                section = "" if tracker == "tensorboard" else f"\n## Tracking\nreport_to: {tracker}\nproject: tiny-{tracker}\n"
                (Path(prep["experiment_dir"]) / "training-brief.md").write_text(brief + section)
                await run_call(s, "generate_config", {"experiment": exp, "tag": tracker,
                                                      "overrides": {"max_steps": STEPS, "logging_steps": 1, "per_device_train_batch_size": 4,
                                                                    "gradient_accumulation_steps": 1}})
                run_id = (await run_call(s, "launch_run", {"experiment": exp, "tag": tracker, "accept_warnings": True}))["run_id"]
                records, last = await poll_until(s, run_id, finished)
                results[tracker] = {"run_id": run_id, "records": records, "last": last, "experiment": exp}

    anyio.run(main)
    for tracker, r in results.items():
        rd = run_dir_of(r["run_id"])
        assert r["last"]["status"] == "succeeded", (tracker, (rd / "logs" / "stdout.log").read_text()[-3000:])
        cfg_tracking = json.loads(json.dumps(__import__("yaml").safe_load((rd / "config.yaml").read_text())["tracking"]))
        assert cfg_tracking["report_to"] == tracker
        want = [x["loss"] for x in r["records"]]
        assert len(want) == STEPS
        logs = rd / "logs"
        run_name = r["run_id"]
        got = {"tensorboard": lambda: tensorboard_losses(logs),
               "trackio": lambda: trackio_losses(logs, "tiny-trackio", run_name),
               "mlflow": lambda: mlflow_losses(logs, "tiny-mlflow", run_name),
               "wandb": lambda: wandb_losses(logs)}[tracker]()
        assert close(got, want), (tracker, got, want)
    # Only the chosen tracker writes: a TensorBoard event file appears in the TensorBoard run alone.
    for tracker, r in results.items():
        has_events = any((run_dir_of(r["run_id"]) / "logs").rglob("events.out.tfevents.*"))
        assert has_events == (tracker == "tensorboard"), tracker
    if missing:
        pytest.skip(f"SKIPPED LOUDLY: {', '.join(missing)} not installed in the training environment "
                    "(pip install 'finetune-mcp[tracking]'); the other trackers passed")
