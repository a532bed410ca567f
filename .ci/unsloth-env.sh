#!/usr/bin/env bash
# Builds the Unsloth training environment, .venv-unsloth, beside the server's .venv.
#
# Unsloth 2026.10 pins an older stack than the server's training extra (transformers <= 5.17,
# trl <= 1.15, datasets < 5), so it gets its own interpreter; finetune-mcp drives it through
# FINETUNE_MCP_TRAIN_PYTHON (runs) and the tests find it through FINETUNE_MCP_UNSLOTH_PYTHON.
#   bash .ci/unsloth-env.sh [VENV_DIR]      (default .venv-unsloth; prints the export line at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-unsloth}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

if [ -x "${VENV}/bin/python" ] && "${VENV}/bin/python" -c "import unsloth" >/dev/null 2>&1; then
  echo "${VENV}: unsloth already imports"
else
  python3 -m venv "${VENV}"
  "${VENV}/bin/pip" install -q --upgrade pip
  # torch pinned: this exact version is the local CPU wheel; any other spec pulls gigabytes of CUDA wheels.
  # tensorboard and matplotlib: train.py writes TensorBoard events and loss.png when they import.
  "${VENV}/bin/pip" install -q torch==2.13.0 unsloth tensorboard matplotlib
  # unsloth brings torchvision, whose CPU operators fail to load against this torch; text training never uses it.
  "${VENV}/bin/pip" uninstall -y -q torchvision
fi

"${VENV}/bin/python" - <<'PY'
import importlib.metadata as md

import unsloth  # noqa: F401  (the import is the check: it patches transformers and TRL or fails)

print("unsloth", md.version("unsloth"), "| torch", md.version("torch"), "| transformers", md.version("transformers"),
      "| trl", md.version("trl"), "| peft", md.version("peft"), "| datasets", md.version("datasets"))
PY
echo "export FINETUNE_MCP_UNSLOTH_PYTHON=${PWD}/${VENV}/bin/python"
