#!/usr/bin/env bash
# {{EXPERIMENT}} ({{LABEL}}, {{BACKEND}}): start one training run by hand.
#
#   RUN_TAG={{TAG}} ./train.sh
#
# finetune-mcp's launch_run takes the same steps (and detaches the run). Paths follow the training
# layout: DGX_SPARK_ROOT and OUTPUT_ROOT come from the environment when set; TRAIN_PYTHON picks the
# training environment (default: $FINETUNE_MCP_TRAIN_PYTHON, else python3).
set -euo pipefail

DGX_SPARK_ROOT="${DGX_SPARK_ROOT:-${HOME}/dgx-spark}"
OUTPUT_ROOT="${OUTPUT_ROOT:-${DGX_SPARK_ROOT}/outputs/trainings}"
EXPERIMENT_DIR="$(cd "$(dirname "$0")" && pwd)"
EXPERIMENT="$(basename "${EXPERIMENT_DIR}")"
RUN_TAG="${RUN_TAG:?set RUN_TAG to the tag of a configs/run-<tag>.yaml, e.g. {{TAG}}}"
RUN_ID="$(date +%Y%m%d-%H%M)-${RUN_TAG}"
RUN_DIR="${OUTPUT_ROOT}/${EXPERIMENT}/${RUN_ID}"
TRAIN_PYTHON="${TRAIN_PYTHON:-${FINETUNE_MCP_TRAIN_PYTHON:-python3}}"
RUN_CONFIG="${EXPERIMENT_DIR}/configs/run-${RUN_TAG}.yaml"

if [ ! -f "${RUN_CONFIG}" ]; then
  echo "no ${RUN_CONFIG}: call generate_config with tag ${RUN_TAG} first" >&2
  exit 2
fi

# A run is reproducible only from a commit: refuse uncommitted changes to the script or its configs.
COMMIT=""
if git -C "${EXPERIMENT_DIR}" rev-parse --git-dir >/dev/null 2>&1; then
  DIRTY="$(git -C "${EXPERIMENT_DIR}" status --porcelain -- train.py masking.py configs/base.yaml "configs/run-${RUN_TAG}.yaml")"
  if [ -n "${DIRTY}" ] && [ "${ALLOW_UNCOMMITTED:-0}" != "1" ]; then
    echo "uncommitted changes to train.py or configs (commit them, or set ALLOW_UNCOMMITTED=1):" >&2
    echo "${DIRTY}" >&2
    exit 2
  fi
  COMMIT="$(git -C "${EXPERIMENT_DIR}" rev-parse HEAD)"
fi

mkdir -p "$(dirname "${RUN_DIR}")"
if ! mkdir "${RUN_DIR}"; then
  echo "${RUN_DIR} already exists; wait a minute or use another RUN_TAG" >&2
  exit 2
fi
mkdir -p "${RUN_DIR}/logs" "${RUN_DIR}/data"

# The fully resolved config, snapshotted before training starts: base.yaml, run-<tag>.yaml merged
# over it, then this run's own facts (the same merge as finetune-mcp's resolve_run_config).
"${TRAIN_PYTHON}" - "${EXPERIMENT_DIR}/configs/base.yaml" "${RUN_CONFIG}" "${RUN_DIR}/config.yaml" \
  "${EXPERIMENT}/${RUN_ID}" "${RUN_DIR}" "${COMMIT}" <<'PY'
import datetime
import sys

import yaml

base_path, run_path, out_path, run_ref, run_dir, commit = sys.argv[1:7]


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


with open(base_path) as f:
    base = yaml.safe_load(f) or {}
with open(run_path) as f:
    run = yaml.safe_load(f) or {}
cfg = merge(base, run)
cfg["run"] = {
    "run_id": run_ref,
    "run_dir": run_dir,
    "experiment_commit": commit or None,
    "launcher": "train.sh",
    "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
}
with open(out_path, "x") as f:
    yaml.safe_dump(cfg, f, sort_keys=False)
PY

cp "${EXPERIMENT_DIR}/train.py" "${RUN_DIR}/train.py"
for f in masking.py env-report.json training-brief.md; do
  if [ -f "${EXPERIMENT_DIR}/${f}" ]; then cp "${EXPERIMENT_DIR}/${f}" "${RUN_DIR}/"; fi
done
for f in dataset-card.md validation-report.md; do
  if [ -f "${EXPERIMENT_DIR}/data/${f}" ]; then cp "${EXPERIMENT_DIR}/data/${f}" "${RUN_DIR}/data/"; fi
done

echo "run ${EXPERIMENT}/${RUN_ID} in ${RUN_DIR}"
cd "${RUN_DIR}"
# exec: a stop signal reaches train.py itself, which saves a checkpoint and exits 143.
exec "${TRAIN_PYTHON}" train.py --config "${RUN_DIR}/config.yaml" > >(tee -a "${RUN_DIR}/logs/stdout.log") 2>&1
