"""The server through real MCP clients: stdio per role, HTTP with bearer tokens, and a light process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import anyio
import httpx
import pytest

from conftest import EVAL_TOOLS, REPO, TRAINING_TOOLS, mcp_session

HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "unsloth", "accelerate")


def test_stdio_tools_per_role(ws_root):
    async def main():
        async with mcp_session("training-engineer") as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert set(tools) == TRAINING_TOOLS
            for t in tools.values():
                assert t.annotations is not None and t.annotations.read_only_hint is not None, t.name
                assert t.output_schema and t.output_schema.get("properties", {}).get("summary"), t.name
                assert t.description
            assert tools["poll_progress"].annotations.read_only_hint is True
            assert tools["stop_run"].annotations.destructive_hint is True
            prompts = sorted(p.name for p in (await s.list_prompts()).prompts)
            assert prompts == ["draft_brief", "training-engineer"]
            text = (await s.get_prompt("training-engineer")).messages[0].content.text
            assert "Divergence" in text and "OOM ladder" in text
        async with mcp_session("eval-engineer") as s:
            tools = {t.name for t in (await s.list_tools()).tools}
            assert tools == EVAL_TOOLS
            assert [p.name for p in (await s.list_prompts()).prompts] == ["eval-engineer"]

    anyio.run(main)


def test_stdio_error_path_says_what_and_next_step(ws_root):
    async def main():
        async with mcp_session("training-engineer") as s:
            r = await s.call_tool("poll_progress", {"run_id": "no-slash"})
            assert r.is_error
            text = r.content[0].text
            assert "invalid run id" in text and "<experiment>/<YYYYMMDD-HHMM-tag>" in text
            r = await s.call_tool("preflight", {"experiment": "missing-exp"})
            assert r.is_error and "no experiment named 'missing-exp'" in r.content[0].text
            assert "prepare_dataset" in r.content[0].text
            # the training role cannot call eval tools even by name
            r = await s.call_tool("record_verdict", {"run_id": "a/20260101-0000-x", "verdict": "PROMOTE", "evidence": "x"})
            assert r.is_error

    anyio.run(main)


def test_resources_skills_readable(ws_root):
    async def main():
        async with mcp_session("training-engineer") as s:
            templates = {t.uri_template for t in (await s.list_resource_templates()).resource_templates}
            assert {"skill://{name}", "skill://{name}/tables/{table}", "experiment://{name}", "run://{experiment}/{run_id}"} <= templates
            from finetune_mcp.skills import load_skills

            names = sorted(load_skills().skills)
            assert names, "no skills shipped"
            r = await s.read_resource(f"skill://{names[0]}")
            assert r.contents[0].text.startswith("---")

    anyio.run(main)


def test_server_never_imports_heavy_stack(ws_root, tmp_path):
    report = tmp_path / "modules.txt"
    log = tmp_path / "x.log"
    log.write_text("RuntimeError: CUDA error: no kernel image is available for execution on the device\n")

    async def main():
        async with mcp_session("training-engineer", env={"FINETUNE_MCP_MODULES_REPORT": str(report), "FINETUNE_MCP_DATA_DIRS": str(tmp_path)}) as s:
            await s.call_tool("preflight", {"experiment": "missing"})
            await s.call_tool("triage_failure", {"log_path": str(log)})
            await s.call_tool("poll_progress", {"run_id": "a/20260101-0000-x"})

    anyio.run(main)
    for _ in range(50):
        if report.exists():
            break
        time.sleep(0.1)
    mods = set(report.read_text().split())
    assert "finetune_mcp.app" in mods
    loaded = sorted(m for m in mods if m.split(".")[0] in HEAVY)
    assert loaded == [], f"the server imported {loaded}"


def test_http_bearer_tokens_map_to_roles(http_server):
    url, errlog = http_server
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    import httpx2

    async def tools_for(token):
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as hc:
            async with streamable_http_client(url, http_client=hc) as (r, w, *_):
                async with ClientSession(r, w) as s:
                    await s.initialize()
                    return {t.name for t in (await s.list_tools()).tools}

    async def main():
        assert await tools_for("tok-train-0123456789abcdef") == TRAINING_TOOLS
        assert await tools_for("tok-eval-0123456789abcdef") == EVAL_TOOLS

    anyio.run(main)
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    hdr = {"Accept": "application/json, text/event-stream"}
    assert httpx.post(url, json=body, headers=hdr).status_code == 401
    r = httpx.post(url, json=body, headers={**hdr, "Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "Bearer" in r.headers["www-authenticate"]
    assert "tok-train-0123456789abcdef" not in errlog.read_text() and "tok-eval-0123456789abcdef" not in errlog.read_text()


def test_wheel_ships_roles_and_skills(tmp_path):
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)], check=True)
    whl = next(out.glob("finetune_mcp-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    assert "finetune_mcp/_data/roles/training-engineer.yaml" in names
    assert any(n.startswith("finetune_mcp/_data/skills/") and n.endswith("SKILL.md") for n in names)
    assert not any(n.startswith("server/") for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("from finetune_mcp.shipped import shipped_dir; from finetune_mcp.skills import load_skills; "
            "from finetune_mcp.guard import load_policy; print(shipped_dir('skills')); "
            "print(len(load_skills().skills)); print(load_policy('eval-engineer').role)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    lines = p.stdout.split()
    assert lines[0] == str(site / "finetune_mcp" / "_data" / "skills")
    assert int(lines[1]) >= 1 and lines[2] == "eval-engineer"


def test_every_tool_row_is_one_hop_from_its_phase_function():
    # The start-up check reads sources only (the server imports no phase module before a call); here every
    # module is imported and each function's keywords must be exactly its row's input model.
    import typing

    from finetune_mcp import tools
    from finetune_mcp.guard import load_policy

    assert set(tools.NAMES) == set(load_policy("training-engineer").tools) | set(load_policy("eval-engineer").tools)
    for t in tools.TOOLS:
        fn = t.function()
        assert fn.__module__ == t.module and fn.__name__ == t.name, t
        assert tools.signature_mismatch(t) is None, tools.signature_mismatch(t)
        ret = typing.get_type_hints(fn).get("return")
        assert ret in (None, t.result), (t.name, ret)


def test_a_table_row_that_misses_its_code_stops_the_server_at_start(ws_root, monkeypatch):
    import dataclasses

    from finetune_mcp import tools
    from finetune_mcp.app import build_server
    from finetune_mcp.common.errors import FtError

    bad = [dataclasses.replace(t, name="launch_runn") if t.name == "launch_run" else t for t in tools.TOOLS]
    monkeypatch.setattr(tools, "TOOLS", tuple(bad))
    with pytest.raises(FtError) as e:
        build_server("training-engineer")
    text = str(e.value)
    assert "launch_runn" in text and "defines no top-level `def launch_runn(pc, ...)`" in text
    assert "the policy allows ['launch_run']" in text
    moved = [dataclasses.replace(t, phase="runs") if t.name == "stop_run" else t for t in tools.TOOLS]
    monkeypatch.setattr(tools, "TOOLS", tuple(moved))
    with pytest.raises(FtError, match=r"stop_run: module finetune_mcp.phases.runs does not exist"):
        build_server("training-engineer")
