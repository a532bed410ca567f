"""Where a run executes: local (detached subprocess), torchrun, docker; slurm plugs into the same interface (base.Launcher)."""

from __future__ import annotations

LAUNCHERS = ("local", "torchrun", "docker", "slurm")


def get_launcher(name: str):
    """The launcher object for a name; imported lazily so the server starts without any of them."""
    from finetune_mcp.errors import BadInput

    if name == "local":
        from finetune_mcp.launchers.local import LocalLauncher

        return LocalLauncher()
    if name == "torchrun":
        from finetune_mcp.launchers.torchrun import TorchrunLauncher

        return TorchrunLauncher()
    if name == "docker":
        from finetune_mcp.launchers.docker import DockerLauncher

        return DockerLauncher()
    if name == "slurm":
        from finetune_mcp.launchers.slurm import SlurmLauncher

        return SlurmLauncher()
    raise BadInput(f"unknown launcher {name!r}", where="launcher", fix="one of: " + ", ".join(LAUNCHERS))
