#!/usr/bin/env bash
# Installs Debian's Slurm daemons, client and munge for tests/test_slurm.py; idempotent, and never
# fails the CI run: without the packages the Slurm tests skip and say so.
set -u

need="munged slurmctld slurmd sbatch scontrol sinfo scancel srun"
missing() {
  local m=""
  for b in $need; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$b" >/dev/null 2>&1 || m="$m $b"
  done
  echo "$m"
}

notice() {
  echo "=================================================================="
  echo "SLURM NOT INSTALLED: $1"
  echo "The Slurm launcher tests (pytest -m slurm) will SKIP in this run."
  echo "=================================================================="
}

if [ -z "$(missing)" ]; then
  echo "slurm-setup: Slurm and munge already installed ($(PATH="$PATH:/usr/sbin" slurmctld -V 2>/dev/null))"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  notice "no apt-get on this machine (Debian/Ubuntu packages slurmctld slurmd slurm-client munge are needed)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    notice "not root and no passwordless sudo; cannot apt-get install"
    exit 0
  fi
fi

start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
# The packages try to start their services; on a machine without systemd that is refused
# (policy-rc.d) and harmless: the tests start their own daemons with their own config.
if $SUDO apt-get update -qq >/tmp/slurm-setup-apt.log 2>&1 &&
   $SUDO apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >>/tmp/slurm-setup-apt.log 2>&1; then
  :
else
  tail -n 20 /tmp/slurm-setup-apt.log
  notice "apt-get install slurmctld slurmd slurm-client munge failed (log above)"
  exit 0
fi

left="$(missing)"
if [ -n "$left" ]; then
  notice "installed, but still missing:$left"
  exit 0
fi
echo "slurm-setup: installed $(PATH="$PATH:/usr/sbin" slurmctld -V 2>/dev/null) in $(( $(date +%s) - start )) s"
