"""The few exception classes whose text is the user-facing message, turned into tool errors in app.py."""

from __future__ import annotations


class FtError(Exception):
    """A failure the caller can act on: what was wrong, where, and the next step."""

    kind = "FtError"

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where
        self.fix = fix

    def __str__(self) -> str:
        parts = [self.message]
        if self.where:
            parts.append(f"Where: {self.where}")
        if self.fix:
            parts.append(f"Next step: {self.fix}")
        return "\n".join(parts)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message, "where": self.where, "fix": self.fix}


class BadInput(FtError):
    """The caller's input (an argument, a file, a record) is malformed or inconsistent."""

    kind = "BadInput"


class NotFound(FtError):
    """Something named by the caller does not exist (experiment, run, model, file)."""

    kind = "NotFound"


class Refused(FtError):
    """The request is well-formed but a lifecycle rule forbids it now (no preflight, uncommitted config, ...)."""

    kind = "Refused"


class Forbidden(FtError):
    """The role's policy forbids this path or action."""

    kind = "Forbidden"


class JobFailed(FtError):
    """A child job (worker or training process) failed; the message carries its own words."""

    kind = "JobFailed"


KINDS = {c.kind: c for c in (FtError, BadInput, NotFound, Refused, Forbidden, JobFailed)}


def from_dict(d: dict) -> FtError:
    cls = KINDS.get(d.get("kind") or "", JobFailed)
    return cls(d.get("message") or "job failed", where=d.get("where"), fix=d.get("fix"))
