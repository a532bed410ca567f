"""What every phase function receives: the workspace, the role's guard, the skills and a progress hook."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from finetune_mcp.guard import Guard, RolePolicy, load_policy
from finetune_mcp.skills import Skills, load_skills
from finetune_mcp.workspace import Workspace

ProgressFn = Callable[[float, "float | None", "str | None"], None]


@dataclass
class PhaseContext:
    ws: Workspace
    guard: Guard
    progress_fn: ProgressFn | None = None
    _skills: Skills | None = field(default=None, repr=False)

    @property
    def role(self) -> str:
        return self.guard.policy.role

    @property
    def policy(self) -> RolePolicy:
        return self.guard.policy

    @property
    def skills(self) -> Skills:
        if self._skills is None:
            self._skills = load_skills()
        return self._skills

    def progress(self, done: float, total: float | None = None, message: str | None = None) -> None:
        if self.progress_fn:
            self.progress_fn(done, total, message)

    def with_progress(self, fn: ProgressFn | None) -> "PhaseContext":
        return PhaseContext(self.ws, self.guard, fn, self._skills)

    @classmethod
    def for_role(cls, role: str, ws: Workspace | None = None, data_dirs: list[Path] | None = None) -> "PhaseContext":
        ws = ws or Workspace.from_env()
        return cls(ws, Guard(load_policy(role), ws, data_dirs))
