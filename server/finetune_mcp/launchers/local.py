"""The local launcher: one trainer process on this machine, supervised and detached."""

from __future__ import annotations

from finetune_mcp.launchers.base import RunSpec, SupervisedLauncher


class LocalLauncher(SupervisedLauncher):
    name = "local"

    def render(self, spec: RunSpec) -> list[str]:
        return [spec.python, spec.script, "--config", str(spec.config_path)]
