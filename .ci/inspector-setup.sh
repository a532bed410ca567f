#!/usr/bin/env bash
# The MCP Inspector CLI, a client no one here wrote, for tests/test_inspector.py.
# 0.17.2 is the newest release whose CLI has --header and still runs on Node 20 (it declares
# node >= 22.7.5, which npm only warns about; 0.18+ fails there).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v npm >/dev/null || { echo "npm not found"; exit 1; }
npm install --no-audit --no-fund --loglevel=error --prefix .inspector @modelcontextprotocol/inspector@0.17.2
test -x .inspector/node_modules/.bin/mcp-inspector
