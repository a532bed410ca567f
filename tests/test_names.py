"""Names are matched whole: a trailing newline (which `$` lets through) is refused for every kind of name,
by each pattern and over MCP by each tool that takes one, with an error naming the field."""

from __future__ import annotations

import anyio
import pytest

from conftest import mcp_session
from finetune_mcp import models, workspace
from finetune_mcp.common import task
from finetune_mcp.common.errors import BadInput
from finetune_mcp.launchers import slurm
from finetune_mcp.domain import sources
from finetune_mcp.phases import prepare_dataset as dataset

# Every name pattern, with a name it takes.
PATTERNS = [
    (workspace.TAG_RE, "r16-lr2e4"),
    (workspace.RUN_ID_RE, "20260101-0000-r16"),
    (workspace.EXPERIMENT_RE, "finetune-mcp-tiny-SFT-LoRA-repeat-words"),
    (dataset._NAME, "my.data_set-1"),
    (sources._HF_ID, "org/name:config:train"),
    (sources._HF_NAME, "org/name"),
    (models._HF_ID_RE, "Qwen/Qwen2.5-0.5B-Instruct"),
    (slurm._NAME_RE, "gpu-a100"),
    (slurm._TIME_RE, "1-02:30:00"),
]


@pytest.mark.parametrize("pattern, good", PATTERNS, ids=[p.pattern[:30] for p, _ in PATTERNS])
def test_every_name_pattern_takes_the_name_and_refuses_it_with_a_trailing_newline(pattern, good):
    assert pattern.fullmatch(good)
    for bad in (good + "\n", good + "\n\n", "\n" + good, good + " ", good + "\r"):
        assert not pattern.fullmatch(bad), repr(bad)
        assert not pattern.match(bad), repr(bad)  # the pattern itself, whichever way a caller uses it
    assert pattern.pattern.startswith(r"\A") and pattern.pattern.endswith(r"\Z")


@pytest.mark.parametrize("call, where", [
    (lambda: workspace.validate_tag("inj\n"), "tag"),
    (lambda: workspace.validate_experiment("exp\n"), "experiment"),
    (lambda: workspace.parse_run_ref("exp/20260101-0000-t\n"), "run_id"),
    (lambda: workspace._run_part("20260101-0000-t\n"), "run_id"),
    (lambda: slurm.check_names({"partition": "debug\n"}), "partition"),
    (lambda: slurm.check_names({"account": "lab\n"}), "account"),
    (lambda: slurm.check_names({"time_limit": "01:00:00\n"}), "time_limit"),
])
def test_each_validator_refuses_a_trailing_newline_naming_the_field(call, where):
    with pytest.raises(BadInput) as e:
        call()
    assert e.value.where == where and "\\n" in e.value.message


def test_a_base_model_id_is_matched_whole(tmp_path):
    with pytest.raises(BadInput) as e:
        models.resolve_base_model("org/na\nme", tmp_path)
    assert "neither an embedded model" in e.value.message


def test_names_with_a_trailing_newline_are_refused_over_mcp(ws_root):
    (ws_root / "briefs").mkdir()
    (ws_root / "briefs" / "sft.md").write_text(task.sample_brief("sft-lora"))
    task.write_jsonl(task.sft_conversations(30), ws_root / "incoming" / "sft.jsonl")
    exps = workspace.Workspace.from_env().experiments_dir
    (exps / "exp").mkdir(parents=True)  # launch_run looks the experiment up first

    calls = [
        ("generate_config", {"experiment": "exp", "tag": "inj\n"}, "invalid run tag 'inj\\n'", "Where: tag"),
        ("launch_run", {"experiment": "exp", "tag": "inj\n"}, "invalid run tag 'inj\\n'", "Where: tag"),
        ("generate_config", {"experiment": "exp\n", "tag": "t"}, "invalid experiment name 'exp\\n'", "Where: experiment"),
        ("compare_runs", {"experiment": "exp\n"}, "invalid experiment name 'exp\\n'", "Where: experiment"),
        ("poll_progress", {"run_id": "exp/20260101-0000-t\n"}, "invalid run id '20260101-0000-t\\n'", "Where: run_id"),
        ("prepare_dataset", {"brief_path": "briefs/sft.md", "source": "incoming/sft.jsonl", "dataset_name": "ds\n"},
         "invalid dataset_name 'ds\\n'", "Where: dataset_name"),
        ("prepare_dataset", {"brief_path": "briefs/sft.md", "source": "hf:org/name\n:train"},
         "'org/name\\n:train' is not an HF dataset id", "Where: source"),
        ("launch_run", {"experiment": "exp", "tag": "t", "launcher": "slurm", "partition": "debug\n"},
         "partition 'debug\\n' is not a Slurm partition name", "Where: partition"),
        ("launch_run", {"experiment": "exp", "tag": "t", "launcher": "slurm", "account": "lab\n"},
         "account 'lab\\n' is not a Slurm account name", "Where: account"),
        ("launch_run", {"experiment": "exp", "tag": "t", "launcher": "slurm", "time_limit": "01:00:00\n"},
         "time_limit '01:00:00\\n' is not a Slurm time", "Where: time_limit"),
    ]

    async def main():
        out = []
        async with mcp_session() as s:
            for tool, args, _, _ in calls:
                r = await s.call_tool(tool, args)
                out.append((r.is_error, r.content[0].text))
        return out

    for (tool, args, message, where), (is_error, text) in zip(calls, anyio.run(main)):
        assert is_error, (tool, args, text)
        assert message in text and where in text and "Next step:" in text, (tool, text)
        assert "Traceback" not in text and "YAML" not in text
    # Nothing was made under any of those names.
    assert not (ws_root / "datasets").exists() or not any((ws_root / "datasets").iterdir())
    assert sorted(p.name for p in exps.iterdir() if p.name != ".git") == ["exp"]
