"""The one table of tools: each tool's phase function, input and output model, roles, annotations and title.

A tool's code is one hop from its name: the row for `launch_run` says `phase="launch_run"`, and
`finetune_mcp/phases/launch_run.py` defines `def launch_run(pc, args: LaunchRunArgs)`, taking the row's input
model (validated by the MCP layer, or by `call` below). `check_table` proves that when a server starts, so a
typo stops the server instead of surfacing at the first call. The phase modules themselves are imported on a
tool's first call, not at start: with all of them imported the server answered its first request in 1.5x the
bare SDK server's time (bench/bench_startup.py; the goal is 1.15x); the check therefore reads each module's
source for the function instead of importing it, and tests/test_server.py imports every one and compares its
signature with its row.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Callable

from mcp_types import ToolAnnotations

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import FtError

TRAINING = ("training-engineer",)
EVAL = ("eval-engineer",)
BOTH = TRAINING + EVAL

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
WRITES_ANEW = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
DELETES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)


@dataclass(frozen=True)
class Tool:
    name: str
    phase: str  # finetune_mcp.phases.<phase> (or this dotted module) defines `def <name>(pc, args: <its Args model>)`
    args: type[S.Args]
    result: type[S.Result]
    roles: tuple[str, ...]
    annotations: ToolAnnotations
    title: str

    @property
    def module(self) -> str:
        return self.phase if "." in self.phase else f"finetune_mcp.phases.{self.phase}"

    @property
    def description(self) -> str:
        import inspect

        return inspect.cleandoc(self.args.__doc__ or "")

    def function(self) -> Callable[..., S.Result]:
        """The phase function (its module is imported on first use)."""
        return _function(self.module, self.name)


@cache
def _function(module: str, name: str) -> Callable[..., S.Result]:
    return getattr(importlib.import_module(module), name)


TOOLS: tuple[Tool, ...] = (
    Tool("prepare_dataset", "prepare_dataset", S.PrepareDatasetArgs, S.PrepareDatasetResult, TRAINING, WRITES,
         "Phase 2: prepare and validate the dataset"),
    Tool("preflight", "preflight", S.PreflightArgs, S.PreflightResult, TRAINING, WRITES, "Phase 3: check the machine"),
    Tool("generate_config", "generate_config", S.GenerateConfigArgs, S.GenerateConfigResult, TRAINING, WRITES_ANEW,
         "Phase 4: resolve the config and train.py, commit them"),
    Tool("launch_run", "launch_run", S.LaunchRunArgs, S.LaunchResult, TRAINING, WRITES_ANEW, "Phase 4: launch training in the background"),
    Tool("poll_progress", "poll_progress", S.PollProgressArgs, S.PollResult, BOTH, READ_ONLY, "Poll a run's progress"),
    Tool("stop_run", "stop_run", S.StopRunArgs, S.StopResult, TRAINING, DELETES, "Stop a run cleanly"),
    Tool("compare_runs", "compare_runs", S.CompareRunsArgs, S.CompareResult, BOTH, READ_ONLY, "Compare an experiment's runs"),
    Tool("prune_checkpoints", "prune_checkpoints", S.PruneCheckpointsArgs, S.PruneResult, TRAINING, DELETES, "Delete a succeeded run's checkpoints"),
    Tool("triage_failure", "triage_failure", S.TriageFailureArgs, S.TriageResult, TRAINING, READ_ONLY, "Classify a failed run or log"),
    Tool("export", "export", S.ExportArgs, S.ExportResult, TRAINING, WRITES, "Phase 6: export a promoted run"),
    Tool("evaluate_checkpoint", "evaluate_checkpoint", S.EvaluateCheckpointArgs, S.EvalResult, EVAL, WRITES, "Phase 5: evaluate a run"),
    Tool("record_verdict", "record_verdict", S.RecordVerdictArgs, S.VerdictResult, EVAL, WRITES_ANEW, "Phase 5: sign PROMOTE or REJECT"),
    Tool("write_eval_file", "write_eval_file", S.WriteEvalFileArgs, S.WriteEvalFileResult, EVAL, DELETES,
         "Write a file of an experiment's eval/ suite"),
)

BY_NAME: dict[str, Tool] = {t.name: t for t in TOOLS}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def for_role(role: str) -> list[Tool]:
    return [t for t in TOOLS if role in t.roles]


def check_table(role: str, allowed: list[str], where: str) -> list[Tool]:
    """The rows a server for `role` exposes, after checking the table against the role's policy and the code.

    Raises FtError naming every problem: a policy tool without a row (or the reverse), a row whose phase
    module does not exist or does not define the function, a row without description, title or annotations.
    """
    problems = []
    if len(BY_NAME) != len(TOOLS):
        problems.append("two rows share a name")
    rows = for_role(role)
    mine = {t.name for t in rows}
    for t in sorted(set(allowed) - set(BY_NAME)):  # the role file's tool names are checked here, the table being above the guard
        near = difflib.get_close_matches(t, NAMES, n=1)
        problems.append(f"the policy lists unknown tool {t!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if set(allowed) & set(BY_NAME) - mine:
        problems.append(f"the policy allows {sorted(set(allowed) & set(BY_NAME) - mine)}, which the table gives no {role} row")
    if mine - set(allowed):
        problems.append(f"the table gives {role} {sorted(mine - set(allowed))}, which the policy does not allow")
    for t in rows:
        if not t.description:
            problems.append(f"{t.name}: {t.args.__name__} has no docstring (it is the tool's description)")
        if not t.title:
            problems.append(f"{t.name}: no title")
        if t.annotations.read_only_hint is None or t.annotations.destructive_hint is None:
            problems.append(f"{t.name}: annotations must say read-only and destructive")
        why = _missing_function(t.module, t.name)
        if why:
            problems.append(f"{t.name}: {why}")
    if problems:
        raise FtError("the tool table does not match the code: " + "; ".join(problems), where=where,
                      fix="correct the row in finetune_mcp/tools.py, the phase function, or the role's tools list")
    return [t for t in rows if t.name in allowed]


@cache
def _missing_function(module: str, name: str) -> str | None:
    # The file is found from the dotted name, not with importlib.util.find_spec, which imports every parent
    # package on the way (finetune_mcp.triage's __init__ pulls in the whole classifier).
    parts = module.split(".")
    if parts[0] != "finetune_mcp":
        return f"module {module} is not part of finetune_mcp"
    base = Path(__file__).resolve().parent.joinpath(*parts[1:])
    path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if not path.is_file():
        if importlib.util.find_spec(module) is None:
            return f"module {module} does not exist"
        # installed without sources (bytecode only): import it after all
        return None if callable(getattr(importlib.import_module(module), name, None)) else f"{module} defines no {name}"
    source = path.read_text(encoding="utf-8")
    if not re.search(rf"^def {re.escape(name)}\(\s*pc\b", source, re.M):
        return f"{module} defines no top-level `def {name}(pc, ...)`"
    return None


def call(name: str, pc, /, **kwargs) -> S.Result:
    """Call a tool's phase function in this process, as the server does (its Args model validated from the
    keywords), without MCP: for benchmarks, the CLI and tests."""
    tool = BY_NAME[name]
    return tool.function()(pc, tool.args.model_validate(kwargs))


def signature_mismatch(tool: Tool) -> str | None:
    """How the phase function differs from `def <tool>(pc, args: <Args model>)` (imports the module), or None."""
    import inspect

    params = list(inspect.signature(tool.function()).parameters.values())
    if [p.name for p in params] != ["pc", "args"]:
        return f"{tool.name}: takes ({', '.join(p.name for p in params)}), not (pc, args)"
    ann = params[1].annotation
    if not (ann is tool.args or ann in (tool.args.__name__, f"S.{tool.args.__name__}")):
        return f"{tool.name}: takes args: {ann}, the row says {tool.args.__name__}"
    return None


def arg_parameters(args: type[S.Args]) -> list[Any]:
    """The input model's fields as keyword-only parameters (annotation with limits and description, default)."""
    import inspect
    from typing import Annotated

    from pydantic import Field

    out = []
    for name, f in args.model_fields.items():
        meta = [*f.metadata] + ([Field(description=f.description)] if f.description else [])
        ann = Annotated[(f.annotation, *meta)] if meta else f.annotation
        default = inspect.Parameter.empty if f.is_required() else f.get_default(call_default_factory=True)
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann))
    return out
