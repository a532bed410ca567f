"""Builds the MCP server for one role from the tool table (tools.py): that role's tools, resources and prompt; one error boundary."""

from __future__ import annotations

import functools
import hmac
import inspect
import json
import logging
import traceback
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Annotated, Any, Callable

import anyio
import yaml
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp_types import CallToolResult, ImageContent, TextContent
from pydantic import Field

from finetune_mcp import __version__, schemas as S
from finetune_mcp.context import PhaseContext
from finetune_mcp.common.errors import BadInput, FtError, NotFound
from finetune_mcp.guard import Guard, load_policy
from finetune_mcp.shipped import shipped_dir
from finetune_mcp.tools import Tool, arg_parameters, check_table
from finetune_mcp.workspace import Workspace

log = logging.getLogger("finetune_mcp")

def render_text(result: S.Result) -> str:
    body = result.text()
    if body == result.summary:
        rest = result.model_dump(mode="json", exclude={"summary"})
        body = result.summary + "\n\n" + yaml.safe_dump(rest, sort_keys=False, allow_unicode=True, width=100).rstrip()
    return body


async def call_phase(pc: PhaseContext, ctx: Context | None, tool: Tool, /, **kwargs) -> CallToolResult:
    """The one error boundary: our errors become tool errors whose text says what, where and what next."""

    def progress(done: float, total: float | None = None, message: str | None = None) -> None:
        if ctx is not None:
            try:
                anyio.from_thread.run(functools.partial(ctx.report_progress, done, total, message))
            except Exception:  # a client that went away must not fail the job
                pass

    try:
        fn = tool.function()  # the phase module is imported here, on the tool's first call
        # The SDK validated kwargs against the Args model's own fields (arg_parameters); build it without a second pass.
        args = tool.args.model_construct(**kwargs)
        result = await anyio.to_thread.run_sync(functools.partial(fn, pc.with_progress(progress), args))
    except FtError as e:
        raise ToolError(str(e)) from None
    except Exception as e:
        log.error("tool %s crashed:\n%s", tool.name, traceback.format_exc())
        raise ToolError(f"internal error in {tool.name}: {type(e).__name__}: {e}. This is a finetune-mcp bug; the server log has the traceback.") from None
    content: list[Any] = [TextContent(type="text", text=render_text(result))]
    image = getattr(result, "_image_png", None)
    if image:
        import base64

        content.append(ImageContent(type="image", data=base64.b64encode(image).decode(), mime_type="image/png"))
    return CallToolResult(content=content, structured_content=result.model_dump(mode="json"))


def _mcp_function(pc: PhaseContext, tool: Tool) -> Callable[..., Any]:
    """The coroutine the SDK registers for a row: the row's input model as its keywords, its result as its output."""

    async def call(ctx: Context | None = None, **kwargs):
        return await call_phase(pc, ctx, tool, **kwargs)

    params = arg_parameters(tool.args)
    ret = Annotated[CallToolResult, tool.result]
    call.__signature__ = inspect.Signature(
        params + [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Context)], return_annotation=ret)
    call.__annotations__ = {**{p.name: p.annotation for p in params}, "ctx": Context, "return": ret}
    call.__name__ = call.__qualname__ = tool.name
    return call


def build_server(role: str, ws: Workspace | None = None, data_dirs: list[Path] | None = None) -> MCPServer:
    policy = load_policy(role)
    rows = check_table(role, policy.tools, where=f"roles/{role}.yaml")
    ws = ws or Workspace.from_env()
    pc = PhaseContext(ws, Guard(policy, ws, data_dirs))
    prompt_text = (shipped_dir("roles") / policy.prompt).read_text(encoding="utf-8")
    server = MCPServer(name=f"finetune-mcp-{role}", title=f"finetune-mcp ({role})", version=__version__, instructions=policy.summary)
    for tool in rows:
        server.add_tool(_mcp_function(pc, tool), name=tool.name, title=tool.title, annotations=tool.annotations,
                        description=tool.description)
    _register_resources(server, pc)
    _register_brief_help(server, pc, set(policy.tools))

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

    @server.resource("brief://example", name="brief-example", title="A complete training brief: every section, every accepted value",
                     mime_type="text/markdown")
    def brief_example() -> str:
        from finetune_mcp.domain.brief import example_brief  # imported on use, like every phase module

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

        from finetune_mcp.domain.brief_draft import draft_brief as draft  # imported on first use: the server starts without it

        try:
            return draft(pc, goal=goal, base_model=base_model, data_file=data_file)
        except FtError as e:  # the SDK replaces other exceptions' text with a generic one
            raise MCPError(INVALID_PARAMS, str(e)) from None


def _visible(pc: PhaseContext, path: Path) -> bool:
    try:
        pc.guard.check_read(path)
        return True
    except FtError:
        return False


# ---------------------------------------------------------------- HTTP: bearer token -> role


MIN_TOKEN_CHARS = 16  # a bearer token is a password: shorter ones are guessable (generate: `openssl rand -hex 24`)


def _check_token(token: Any, role: Any, where: str, n: int) -> tuple[str, str]:
    """A token and its role, or BadInput that says which entry (by position, never by content) is wrong."""
    what = f"token #{n}"
    if not isinstance(role, str) or not role.strip():
        raise BadInput(f"{what} has no role name", where=where, fix="map each token to training-engineer or eval-engineer")
    if token is None or token == "" or isinstance(token, (bool, int, float)):
        raise BadInput(f"{what} (role {role}) is empty or not a string", where=where,
                       fix=f"give each token as a quoted string of at least {MIN_TOKEN_CHARS} characters, e.g. from `openssl rand -hex 24`")
    if not isinstance(token, str) or len(token.strip()) < MIN_TOKEN_CHARS or any(c.isspace() for c in token) or token.lower() in ("none", "null"):
        raise BadInput(f"{what} (role {role}) is too weak: under {MIN_TOKEN_CHARS} characters, blank inside, or a placeholder",
                       where=where, fix=f"use a random token of at least {MIN_TOKEN_CHARS} characters, e.g. `openssl rand -hex 24`")
    return token, role.strip()


def load_tokens(tokens_file: str | None, env_value: str | None) -> dict[str, str]:
    """token -> role, from a YAML/JSON file {role: [tokens]} or {token: role}, or 'token=role,...' in the env.

    Errors name the file and the line or entry number, never the file's content: a parse error of the
    YAML library quotes the offending line, which may hold a secret.
    """
    pairs: list[tuple[Any, Any, str]] = []
    if tokens_file:
        path = Path(tokens_file)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise NotFound(f"tokens file {path} does not exist", where=str(path),
                           fix="pass --tokens-file with the path of a YAML file {role: [token, ...]}, or set FINETUNE_MCP_TOKENS") from None
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"tokens file {path} cannot be read ({type(e).__name__})", where=str(path),
                           fix="make it a readable UTF-8 YAML file {role: [token, ...]}") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            raise BadInput(f"tokens file is not valid YAML ({getattr(e, 'problem', None) or 'parse error'})", where=at,
                           fix="write it as `training-engineer: [\"<token>\"]` lines, one role per line") from None
        if not isinstance(raw, dict):
            raise BadInput("tokens file must map roles to token lists (or tokens to roles)", where=str(path))
        for k, v in raw.items():
            if isinstance(v, list):
                pairs += [(t, k, str(path)) for t in v]
            else:
                pairs.append((k, v, str(path)))
    if env_value:
        for pair in env_value.split(","):
            if pair.strip():
                tok, _, role = pair.strip().partition("=")
                if not role:
                    raise BadInput("FINETUNE_MCP_TOKENS entries are token=role, comma-separated", where="FINETUNE_MCP_TOKENS",
                                   fix="e.g. FINETUNE_MCP_TOKENS=<token1>=training-engineer,<token2>=eval-engineer")
                pairs.append((tok, role, "FINETUNE_MCP_TOKENS"))
    tokens: dict[str, str] = {}
    for n, (tok, role, where) in enumerate(pairs, 1):
        tok, role = _check_token(tok, role, where, n)
        if tokens.get(tok, role) != role:
            raise BadInput(f"token #{n} is given to two roles", where=where, fix="give each role its own token")
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


HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0


def bounded_http_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S):
    """uvicorn's HTTP protocol with a deadline on receiving each request, token or not.

    uvicorn times out only an idle keep-alive connection, and any byte that arrives cancels that: a client
    that trickles a request head, or a body after valid headers, holds its connection (and for a body, a task)
    for ever. Here a request's head must be complete within header_timeout_s of the connection opening or of
    the previous response ending, and its body within body_timeout_s of its head; else the server answers
    408 (unless a response has started) and closes the connection. Responses themselves are not bounded:
    a GET's event stream lasts as long as the session.
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    body = b"request not received in time\n"
    late = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)

    class BoundedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _deadline = None
        _waiting_for = None  # "head" or "body"

        def _arm(self, what: str) -> None:
            self._disarm()
            self._waiting_for = what
            self._deadline = self.loop.call_later(header_timeout_s if what == "head" else body_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self._waiting_for = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete or not cycle.response_started:
                self.transport.write(late)
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm("head")

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            cycle = self.cycle
            if self.transport.is_closing():
                self._disarm()
            elif cycle is not None and cycle is not before:  # a new request's head is in
                self._arm("body") if cycle.more_body else self._disarm()
            elif self._waiting_for == "body" and cycle is not None and not cycle.more_body:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm("head")

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedHTTPProtocol
