"""Builds the MCP server for one role: only that role's tools, resources and prompt; one error boundary."""

from __future__ import annotations

import functools
import hmac
import importlib
import inspect
import json
import logging
import traceback
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import anyio
import yaml
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp_types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import Field

from finetune_mcp import __version__, schemas as S
from finetune_mcp.context import PhaseContext
from finetune_mcp.errors import FtError
from finetune_mcp.guard import Guard, RolePolicy, load_policy
from finetune_mcp.shipped import shipped_dir
from finetune_mcp.workspace import Workspace

log = logging.getLogger("finetune_mcp")

RO = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)


def _ann(*, destructive: bool, idempotent: bool) -> ToolAnnotations:
    return ToolAnnotations(read_only_hint=False, destructive_hint=destructive, idempotent_hint=idempotent, open_world_hint=False)


def _phase(module: str, name: str) -> Callable[..., Any]:
    # Phase modules load on first call (inside the error boundary), so the server starts with only
    # what it needs to list tools.
    def run(*args, **kwargs):
        path = module if module.startswith("finetune_mcp.") else f"finetune_mcp.phases.{module}"
        return getattr(importlib.import_module(path), name)(*args, **kwargs)

    run.__name__ = name
    return run


def render_text(result: S.Result) -> str:
    body = result.text()
    if body == result.summary:
        rest = result.model_dump(mode="json", exclude={"summary"})
        body = result.summary + "\n\n" + yaml.safe_dump(rest, sort_keys=False, allow_unicode=True, width=100).rstrip()
    return body


async def call_phase(pc: PhaseContext, ctx: Context | None, tool: str, fn: Callable[..., S.Result], /, **kwargs) -> CallToolResult:
    """The one error boundary: our errors become tool errors whose text says what, where and what next."""

    def progress(done: float, total: float | None = None, message: str | None = None) -> None:
        if ctx is not None:
            try:
                anyio.from_thread.run(functools.partial(ctx.report_progress, done, total, message))
            except Exception:  # a client that went away must not fail the job
                pass

    try:
        result = await anyio.to_thread.run_sync(functools.partial(fn, pc.with_progress(progress), **kwargs))
    except FtError as e:
        raise ToolError(str(e)) from None
    except Exception as e:
        log.error("tool %s crashed:\n%s", tool, traceback.format_exc())
        raise ToolError(f"internal error in {tool}: {type(e).__name__}: {e}. This is a finetune-mcp bug; the server log has the traceback.") from None
    content: list[Any] = [TextContent(type="text", text=render_text(result))]
    image = getattr(result, "_image_png", None)
    if image:
        import base64

        content.append(ImageContent(type="image", data=base64.b64encode(image).decode(), mime_type="image/png"))
    return CallToolResult(content=content, structured_content=result.model_dump(mode="json"))


def build_server(role: str, ws: Workspace | None = None, data_dirs: list[Path] | None = None) -> MCPServer:
    policy = load_policy(role)
    ws = ws or Workspace.from_env()
    pc = PhaseContext(ws, Guard(policy, ws, data_dirs))
    roles_dir = shipped_dir("roles")
    prompt_text = (roles_dir / policy.prompt).read_text(encoding="utf-8")
    server = MCPServer(
        name=f"finetune-mcp-{role}",
        title=f"finetune-mcp ({role})",
        version=__version__,
        instructions=policy.summary,
    )
    allowed = set(policy.tools)

    def tool(name: str, annotations: ToolAnnotations, title: str):
        def deco(fn):
            if name in allowed:
                server.add_tool(fn, name=name, title=title, annotations=annotations, description=inspect.cleandoc(fn.__doc__ or ""))
            return fn

        return deco

    # ---------------------------------------------------------------- training-engineer tools

    @tool("prepare_dataset", _ann(destructive=False, idempotent=True), "Phase 2: prepare and validate the dataset")
    async def prepare_dataset(
        brief_path: Annotated[str, Field(description="the training-brief.md to execute")],
        source: Annotated[str, Field(description="JSONL/JSON/Parquet/CSV file or folder, a save_to_disk folder, or an HF dataset id: org/name, org/name:split or org/name:config:split")],
        dataset_name: Annotated[str | None, Field(description="name under $DGX_SPARK_ROOT/datasets/ (default: from the experiment)")] = None,
        eval_fraction: Annotated[float, Field(ge=0.0, lt=0.5)] = 0.05,
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.PrepareDatasetResult]:
        """Open the experiment from a training brief, then load, validate, template, pack and describe its dataset.

        Applies the chat template before packing, decodes packed samples with the trained spans
        marked, writes the dataset card and validation report, runs the collapse guard, and walks
        the Phase 2 exit checklist (`complete` is false unless every item holds)."""
        return await call_phase(pc, ctx, "prepare_dataset", _phase("dataset", "prepare_dataset"),
                                brief_path=brief_path, source=source, dataset_name=dataset_name, eval_fraction=eval_fraction)

    @tool("preflight", _ann(destructive=False, idempotent=True), "Phase 3: check the machine")
    async def preflight(
        experiment: Annotated[str, Field(description="experiment name returned by prepare_dataset")],
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.PreflightResult]:
        """Probe driver, GPU, memory, disk, thermals and the training stack; write env-report.json with
        verdict ready / ready-with-warnings / blocked (DGX Spark G-checks, else the generic fallback)."""
        return await call_phase(pc, ctx, "preflight", _phase("preflight", "preflight"), experiment=experiment)

    @tool("generate_config", _ann(destructive=False, idempotent=False), "Phase 4: resolve the config and train.py, commit them")
    async def generate_config(
        experiment: str,
        tag: Annotated[str, Field(description="what this run varies, e.g. r16-lr2e4; names configs/run-<tag>.yaml and the run id")],
        backend: Literal["auto", "unsloth", "trl"] = "auto",
        overrides: Annotated[dict[str, Any], Field(description="values for keys of the chosen method's recipe only")] = {},
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.GenerateConfigResult]:
        """Resolve the chosen method's recipe with the brief and memory budget (every value says where it came
        from), render train.py for the backend (Unsloth first, TRL+PEFT escape hatch) and commit config + script."""
        return await call_phase(pc, ctx, "generate_config", _phase("config", "generate_config"),
                                experiment=experiment, tag=tag, backend=backend, overrides=overrides)

    @tool("launch_run", _ann(destructive=False, idempotent=False), "Phase 4: launch training in the background")
    async def launch_run(
        experiment: str,
        tag: str,
        accept_warnings: Annotated[bool, Field(description="launch despite a ready-with-warnings preflight (the caller's decision)")] = False,
        launcher: Literal["local", "torchrun", "docker", "slurm"] = "local",
        nproc: Annotated[int, Field(ge=1, le=64)] = 1,
        nodes: Annotated[int, Field(ge=1, le=64)] = 1,
        gpus_per_node: int | None = None,
        partition: str | None = None,
        time_limit: Annotated[str | None, Field(description="Slurm time limit, e.g. 01:00:00")] = None,
        account: str | None = None,
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.LaunchResult]:
        """Start the committed config as a detached run that outlives this server. Refuses without a preflight,
        on blocked, on unaccepted warnings, on an uncommitted or changed config, on a busy GPU, on an existing run id."""
        return await call_phase(pc, ctx, "launch_run", _phase("run", "launch_run"),
                                experiment=experiment, tag=tag, accept_warnings=accept_warnings, launcher=launcher, nproc=nproc,
                                nodes=nodes, gpus_per_node=gpus_per_node, partition=partition, time_limit=time_limit, account=account)

    @tool("poll_progress", RO, "Poll a run's progress")
    async def poll_progress(
        run_id: Annotated[str, Field(description="<experiment>/<YYYYMMDD-HHMM-tag>")],
        cursor: Annotated[int, Field(ge=0, description="next_cursor of the previous call, unchanged; 0 from the start")] = 0,
        limit: Annotated[int, Field(ge=1, le=5000)] = 200,
        plot: Annotated[bool, Field(description="also return the loss curve as a PNG image")] = False,
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.PollResult]:
        """Records since the cursor, each exactly {step, loss, lr, mem_gb, temp_c}; the run status with exit
        code or signal; anomalies (NaN/inf loss, spikes, stalls); and the next cursor.

        The cursor is a byte offset into the run's record log (logs/progress.jsonl; logs/stdout.log for a
        script without our progress callback), always at a line boundary: a poll reads only what was written
        after it, and the same cursor gives the same records from any server, also after a restart. Keep
        polling with next_cursor; `more` says records are waiting past `limit`. A client that sends a
        progress token gets a notification with the latest step and loss."""
        return await call_phase(pc, ctx, "poll_progress", _phase("run", "poll_progress"), run_id=run_id, cursor=cursor, limit=limit, plot=plot)

    @tool("stop_run", _ann(destructive=True, idempotent=True), "Stop a run cleanly")
    async def stop_run(
        run_id: str,
        grace_seconds: Annotated[float, Field(ge=0, le=600)] = 30.0,
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.StopResult]:
        """SIGTERM to the run's process group (the trainer saves a checkpoint), then SIGKILL after the grace period."""
        return await call_phase(pc, ctx, "stop_run", _phase("run", "stop_run"), run_id=run_id, grace_seconds=grace_seconds)

    @tool("prune_checkpoints", _ann(destructive=True, idempotent=True), "Delete a succeeded run's checkpoints")
    async def prune_checkpoints(run_id: str, ctx: Context = None) -> Annotated[CallToolResult, S.PruneResult]:
        """Delete checkpoints/ of a run that succeeded and whose adapter/ verifies against its digest. adapter/ is never touched."""
        return await call_phase(pc, ctx, "prune_checkpoints", _phase("run", "prune_checkpoints"), run_id=run_id)

    @tool("triage_failure", RO, "Classify a failed run or log")
    async def triage_failure(
        run_id: Annotated[str | None, Field(description="a run of ours")] = None,
        log_path: Annotated[str | None, Field(description="any training log file")] = None,
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.TriageResult]:
        """Diagnose the failure class (environment / divergence / oom / none) with verbatim evidence lines, then the
        response: the preflight check to re-run, the ordered divergence causes, or the next OOM-ladder rung."""
        return await call_phase(pc, ctx, "triage_failure", _phase("finetune_mcp.triage", "triage_failure"), run_id=run_id, log_path=log_path)

    @tool("export", _ann(destructive=False, idempotent=True), "Phase 6: export a promoted run")
    async def export(
        run_id: str,
        format: Literal["lora", "merged-16bit", "gguf-f16", "gguf-q8_0", "gguf-q4_k_m"] | None = None,
        target_runtime: Literal["transformers", "vllm", "llama.cpp", "ollama"] | None = None,
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.ExportResult]:
        """Export only under a valid signed PROMOTE for this run's adapter; always smoke-tests the artifact in its
        target runtime against 3-5 golden outputs. A REJECT is passed along with its evidence and remediation."""
        return await call_phase(pc, ctx, "export", _phase("export", "export"), run_id=run_id, format=format, target_runtime=target_runtime)

    # ---------------------------------------------------------------- eval-engineer tools

    @tool("evaluate_checkpoint", _ann(destructive=False, idempotent=True), "Phase 5: evaluate a run")
    async def evaluate_checkpoint(run_id: str, ctx: Context = None) -> Annotated[CallToolResult, S.EvalResult]:
        """Run the experiment's eval/ suite (expected answers, goldens, drift prompts) against the run's adapter and
        the base model; report task accuracy, eval loss and drift against the brief's thresholds."""
        return await call_phase(pc, ctx, "evaluate_checkpoint", _phase("gate", "evaluate_checkpoint"), run_id=run_id)

    @tool("record_verdict", _ann(destructive=False, idempotent=False), "Phase 5: sign PROMOTE or REJECT")
    async def record_verdict(
        run_id: str,
        verdict: Literal["PROMOTE", "REJECT"],
        evidence: Annotated[str, Field(min_length=1, description="what the verdict rests on (figures, eval report)")],
        top_remediation: Annotated[str, Field(description="for REJECT: the one change to try first")] = "",
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.VerdictResult]:
        """Write the run's promotion-report.md, signed (Ed25519) over run id, adapter digest, verdict and evidence digest."""
        return await call_phase(pc, ctx, "record_verdict", _phase("gate", "record_verdict"),
                                run_id=run_id, verdict=verdict, evidence=evidence, top_remediation=top_remediation)

    @tool("write_eval_file", _ann(destructive=True, idempotent=True), "Write a file of an experiment's eval/ suite")
    async def write_eval_file(
        experiment: str,
        relpath: Annotated[str, Field(description="path inside eval/, e.g. prompts.jsonl, goldens.jsonl, drift.jsonl, eval.yaml")],
        content: str,
        ctx: Context = None,
    ) -> Annotated[CallToolResult, S.WriteEvalFileResult]:
        """Create or replace a file under the experiment's eval/ (eval-engineer only)."""
        return await call_phase(pc, ctx, "write_eval_file", _phase("gate", "write_eval_file"), experiment=experiment, relpath=relpath, content=content)

    _register_resources(server, pc)
    _register_brief_help(server, pc, allowed)

    @server.prompt(name=role, title=f"{role} agent prompt", description=policy.summary)
    def role_prompt() -> str:
        return prompt_text

    return server


def _register_resources(server: MCPServer, pc: PhaseContext) -> None:
    from finetune_mcp.skills import load_skills

    @server.resource("skill://{name}", name="skill", title="A skill's SKILL.md", mime_type="text/markdown")
    def skill_doc(name: str) -> str:
        try:
            return (load_skills().get(name).path / "SKILL.md").read_text(encoding="utf-8")
        except FtError as e:
            raise ResourceError(str(e)) from None

    @server.resource("skill://{name}/tables/{table}", name="skill-table", title="A skill's data table (validated)", mime_type="application/json")
    def skill_table(name: str, table: str) -> str:
        try:
            return load_skills().table(name, table).model_dump_json(indent=2)
        except FtError as e:
            raise ResourceError(str(e)) from None

    @server.resource("experiment://{name}", name="experiment", title="An experiment: files and runs", mime_type="application/json")
    def experiment_res(name: str) -> str:
        try:
            d = pc.ws.experiment_dir(name)
            files = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and ".git" not in p.parts)
            files = [f for f in files if _visible(pc, d / f)]
            runs_dir = pc.ws.output_root / name
            runs = sorted(p.name for p in runs_dir.iterdir() if p.is_dir()) if runs_dir.is_dir() else []
            return json.dumps({"experiment": name, "dir": str(d), "files": files, "runs": [f"{name}/{r}" for r in runs]}, indent=2)
        except FtError as e:
            raise ResourceError(str(e)) from None

    @server.resource("run://{experiment}/{run_id}", name="run", title="A run: its files and state", mime_type="application/json")
    def run_res(experiment: str, run_id: str) -> str:
        try:
            d = pc.ws.run_dir(f"{experiment}/{run_id}")
            files = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and "checkpoints" not in p.parts)
            state = {}
            for name in ("run.json", "exit.json"):
                if (d / name).is_file():
                    state[name] = json.loads((d / name).read_text())
            return json.dumps({"run_id": f"{experiment}/{run_id}", "dir": str(d), "files": files, **state}, indent=2)
        except FtError as e:
            raise ResourceError(str(e)) from None


def _register_brief_help(server: MCPServer, pc: PhaseContext, allowed: set[str]) -> None:
    """The brief, documented where an agent looks: a complete example as a resource, and a prompt that drafts one."""
    from finetune_mcp.phases.brief import example_brief

    @server.resource("brief://example", name="brief-example", title="A complete training brief: every section, every accepted value",
                     mime_type="text/markdown")
    def brief_example() -> str:
        return example_brief()

    if "prepare_dataset" not in allowed:
        return

    @server.prompt(name="draft_brief", title="Draft a training brief",
                   description="A draft training-brief.md for a one-line goal, a base model and a data file, with the values to confirm marked")
    def draft_brief(
        goal: Annotated[str, Field(description="one line: what the tuned model should do")],
        base_model: Annotated[str, Field(description="an HF id, a base-models/ folder name, or finetune-mcp-tiny")],
        data_file: Annotated[str, Field(description="the data file or folder prepare_dataset will read")],
    ) -> str:
        from mcp.shared.exceptions import MCPError
        from mcp_types import INVALID_PARAMS

        try:
            return _phase("dataset", "draft_brief")(pc, goal=goal, base_model=base_model, data_file=data_file)
        except FtError as e:  # the SDK replaces other exceptions' text with a generic one
            raise MCPError(INVALID_PARAMS, str(e)) from None


def _visible(pc: PhaseContext, path: Path) -> bool:
    try:
        pc.guard.check_read(path)
        return True
    except FtError:
        return False


# ---------------------------------------------------------------- HTTP: bearer token -> role


def load_tokens(tokens_file: str | None, env_value: str | None) -> dict[str, str]:
    """token -> role, from a YAML/JSON file {role: [tokens]} or {token: role}, or 'token=role,...' in the env."""
    tokens: dict[str, str] = {}
    if tokens_file:
        raw = yaml.safe_load(Path(tokens_file).read_text(encoding="utf-8")) or {}
        if not isinstance(raw, dict):
            raise FtError("tokens file must map roles to token lists (or tokens to roles)", where=tokens_file)
        for k, v in raw.items():
            if isinstance(v, list):
                tokens.update({str(t): str(k) for t in v})
            else:
                tokens[str(k)] = str(v)
    if env_value:
        for pair in env_value.split(","):
            if pair.strip():
                tok, _, role = pair.strip().partition("=")
                if not role:
                    raise FtError("FINETUNE_MCP_TOKENS entries are token=role, comma-separated", where="FINETUNE_MCP_TOKENS")
                tokens[tok] = role
    return tokens


def build_http_app(tokens: dict[str, str], ws: Workspace | None = None, data_dirs: list[Path] | None = None):
    """One ASGI app: the bearer token picks the role's MCP app; no or unknown token gets 401."""
    from starlette.responses import JSONResponse

    roles = sorted(set(tokens.values()))
    apps = {r: build_server(r, ws, data_dirs).streamable_http_app() for r in roles}
    secrets = [(t.encode(), r) for t, r in tokens.items()]

    def role_for(header: bytes | None) -> str | None:
        if not header or not header.lower().startswith(b"bearer "):
            return None
        given = header[7:].strip()
        found = None
        for tok, role in secrets:  # compare against every token in constant time
            if hmac.compare_digest(given, tok):
                found = role
        return found

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            async with AsyncExitStack() as stack:
                for a in apps.values():
                    await stack.enter_async_context(a.router.lifespan_context(a))
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                msg = await receive()
                await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        headers = dict(scope.get("headers") or [])
        role = role_for(headers.get(b"authorization"))
        if role is None:
            resp = JSONResponse({"error": "unauthorized", "error_description": "send Authorization: Bearer <token> for a configured role"},
                                status_code=401, headers={"WWW-Authenticate": 'Bearer realm="finetune-mcp"'})
            await resp(scope, receive, send)
            return
        await apps[role](scope, receive, send)

    return app
