#!/usr/bin/env bash
# CI: install everything from scratch on a clean clone, then run the README's test command.
# Optional pieces (Unsloth venv, llama.cpp, Slurm, MCP Inspector) are installed when the registries
# allow; where one cannot be, its tests skip loudly and this script says so up front.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
t0=$(date +%s)
stamp() { echo "[ci +$(( $(date +%s) - t0 ))s] $*"; }

stamp "server + training environment (.venv)"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch first and pinned: this exact version is the local CPU wheel; any other spec pulls CUDA builds.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[train,dev]"

notices=()
# llama.cpp compiles for 10-20 minutes: build it in the background while the rest installs.
stamp "llama.cpp (llama-cpp-python build + converter sdist), in the background"
bash .ci/llamacpp-setup.sh > .ci-llamacpp.log 2>&1 &
llama_pid=$!
stamp "Unsloth training environment (.venv-unsloth)"
if [ -f .ci/unsloth-env.sh ]; then bash .ci/unsloth-env.sh || notices+=("the Unsloth venv could not be built: Unsloth tests skip"); fi
stamp "Slurm packages"
bash .ci/slurm-setup.sh || notices+=("Slurm could not be installed: Slurm tests skip")
stamp "MCP Inspector CLI"
bash .ci/inspector-setup.sh || notices+=("the MCP Inspector could not be installed: its tests skip")
stamp "waiting for llama.cpp"
if ! wait "$llama_pid"; then
  tail -20 .ci-llamacpp.log
  notices+=("llama.cpp could not be set up: GGUF tests skip")
fi
for n in "${notices[@]+"${notices[@]}"}"; do echo "NOTICE: $n"; done

