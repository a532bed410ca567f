"""The torchrun launcher: N trainer processes on this machine (--nproc_per_node), supervised and detached."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from finetune_mcp.launchers.base import RunSpec, SupervisedLauncher


def torchrun_argv(python: str, nproc: int) -> list[str]:
    # `python -m torch.distributed.run` is torchrun itself, and needs no console script on PATH of
    # the training environment. --standalone runs a local rendezvous on a free port, so two runs on
    # one machine never fight over MASTER_PORT. The process-group backend is the script's choice
    # (gloo on CPU, nccl on GPUs); torchrun only starts and watches the ranks.
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc)]


class TorchrunLauncher(SupervisedLauncher):
    name = "torchrun"

    def render(self, spec: RunSpec) -> list[str]:
        return [*torchrun_argv(spec.python, spec.nproc), spec.script, "--config", str(spec.config_path)]

    def terminate(self, run_dir: Path, run_json: dict[str, Any]) -> None:
        # torchrun hands each rank a SIGTERM of its own when it gets one. Signalling the whole group
        # as well would give every rank a second SIGTERM, which train.py takes as "exit now" and so
        # loses the checkpoint; the agent alone is signalled.
        agent = self.trainer_pid(run_dir, run_json)
        if agent is None:
            super().terminate(run_dir, run_json)
        else:
            os.kill(agent, signal.SIGTERM)
