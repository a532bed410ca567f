"""run_state.py alone: status from a run's files, the resolved config, logging_steps read in one place, checkpoints."""

from __future__ import annotations

import json

import pytest
import yaml

from finetune_mcp.common.errors import BadInput
from finetune_mcp.domain import run_state as RS


def run_dir_with(tmp_path, config: dict | None = None, exit: dict | None = None):
    d = tmp_path / "exp" / "20250101-0000-t"
    (d / "logs").mkdir(parents=True)
    if config is not None:
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    if exit is not None:
        (d / "exit.json").write_text(json.dumps(exit))
    RS.forget()
    return d


@pytest.mark.parametrize("value, max_steps, every", [(None, 50, 1), (1, 50, 1), (10, 50, 10), (0.1, 30, 3), (0.1, 25, 3),
                                                      (0.5, 3, 2), (5.0, None, 5)])
def test_logging_every_counts_steps_as_the_trainer_does(tmp_path, value, max_steps, every):
    # transformers' Trainer: logging_steps < 1 is a share of max_steps, rounded up.
    trainer = {"max_steps": max_steps} if max_steps else {}
    if value is not None:
        trainer["logging_steps"] = value
    d = run_dir_with(tmp_path, {"calls": {"trainer": trainer}})
    assert RS.logging_every(d) == every
    assert RS.logging_every({"calls": {"trainer": trainer}}) == every


@pytest.mark.parametrize("value, words", [(0, "not a positive number"), (-2, "not a positive number"), ("ten", "not a positive number"),
                                          (True, "not a positive number"), (2.5, "neither a whole number"),
                                          (0.1, "sets no max_steps")])
def test_bad_logging_steps_are_refused_naming_the_file_and_the_fix(tmp_path, value, words):
    d = run_dir_with(tmp_path, {"training": {"logging_steps": value}})
    with pytest.raises(BadInput) as e:
        RS.logging_every(d)
    assert words in e.value.message and str(d / "config.yaml") in e.value.where and e.value.fix


def test_config_value_prefers_the_trainer_call(tmp_path):
    d = run_dir_with(tmp_path, {"hparams": {"max_steps": 5}, "calls": {"trainer": {"max_steps": 7}}})
    assert RS.config_value(d, "max_steps") == 7
    assert RS.config_value(run_dir_with(tmp_path / "b", {"hparams": {"max_steps": 5}}), "max_steps") == 5


def test_status_from_exit_and_without_run_json(tmp_path):
    d = run_dir_with(tmp_path, exit={"returncode": 137, "signal": "SIGKILL", "stopped_by": None})
    st = RS.run_state(d, None, has_records=True)
    assert (st.status, st.exit_code, st.signal) == ("failed", 137, "SIGKILL") and "out-of-memory" in st.detail
    assert RS.run_state(run_dir_with(tmp_path / "b"), None, has_records=False).status == "starting"


def test_checkpoints_sort_by_step_not_by_name(tmp_path):
    d = run_dir_with(tmp_path)
    for n in (9, 10, 100, 2):
        (d / "checkpoints" / f"checkpoint-{n}").mkdir(parents=True)
    (d / "checkpoints" / "checkpoint-x").mkdir()
    assert [s for s, _ in RS.checkpoints(d)] == [2, 9, 10, 100]
    assert RS.latest_checkpoint(d).endswith("checkpoint-100")
