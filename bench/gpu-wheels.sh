#!/usr/bin/env bash
# Downloads the wheels of bench/gpu-wheels.txt (cp312, manylinux x86_64, hash-checked), slims the two
# marked ones, builds finetune-mcp's own wheel, and splits the set into carry bundles for the device tool
# (64 MiB per call, the repo included).
#
#   bash bench/gpu-wheels.sh DIR [--max-mib 56]
#
# Writes DIR/pypi/ (as published), DIR/wheels/ (what gets installed, with manifest.json: file, envs,
# sha256, bytes) and DIR/carry-1..N/ (each at most --max-mib; larger wheels split into .part-NN files,
# every bundle with the manifest). DIR must be inside the repo and ignored by git for the device
# tool's `carry` (.gpu-wheels/ is in .gitignore). bench/README.md says how the bundles are used.
set -euo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
DIR="$1"; shift
MAX_MIB=56
while [ $# -gt 0 ]; do
  case "$1" in
    --max-mib) MAX_MIB="$2"; shift 2 ;;
    *) echo "gpu-wheels.sh: unknown option $1 (only --max-mib N)" >&2; exit 2 ;;
  esac
done
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
# The machine's pip constraints cap torch; they have no say over wheels downloaded for another machine.
export PIP_CONSTRAINT="" PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" "$HERE/gpu_wheels.py" fetch "$DIR"
"$PY" "$HERE/gpu_wheels.py" bundle "$DIR" --max-mib "$MAX_MIB"
