"""Where a run executes: local (detached subprocess), torchrun, docker; slurm plugs into the same interface (base.Launcher)."""

from __future__ import annotations

from finetune_mcp.common.errors import BadInput
from finetune_mcp.launchers.docker import DockerLauncher
from finetune_mcp.launchers.local import LocalLauncher
from finetune_mcp.launchers.slurm import SlurmLauncher
from finetune_mcp.launchers.torchrun import TorchrunLauncher

LAUNCHERS = ("local", "torchrun", "docker", "slurm")
_CLASSES = {"local": LocalLauncher, "torchrun": TorchrunLauncher, "docker": DockerLauncher, "slurm": SlurmLauncher}


def get_launcher(name: str):
    """The launcher object for a name (the server imports this package on a run tool's first call, not at start)."""
    if name not in _CLASSES:
        raise BadInput(f"unknown launcher {name!r}", where="launcher", fix="one of: " + ", ".join(LAUNCHERS))
    return _CLASSES[name]()
