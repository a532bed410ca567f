"""Role policy and the path guard: every path a tool reads or writes passes through here."""

from __future__ import annotations

import difflib
import fnmatch
import os
import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from finetune_mcp.common.errors import BadInput, FtError, Forbidden
from finetune_mcp.shipped import shipped_dir
from finetune_mcp.workspace import Workspace, atomic_write_bytes, fsync_dir

MAX_PATH = 4096
MAX_COMPONENT = 255



class RolePolicy(BaseModel):
    """roles/<name>.yaml. Deny patterns are globs over the path relative to an allowed root
    ('**' spans any number of parts), matched after symlinks are resolved."""

    model_config = ConfigDict(extra="forbid")

    role: str
    summary: str
    prompt: str = Field(description="file name of the agent prompt beside the YAML")
    tools: list[str]
    deny: list[str] = Field(default_factory=list, description="neither read nor written")
    write_deny: list[str] = Field(default_factory=list, description="readable, never written")
    write_only: list[str] | None = Field(default=None, description="if set, writes must match one of these")
    may_sign_verdicts: bool = False


def _did_you_mean(word: str, options) -> str:
    m = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def load_policy(role: str, roles_dir: Path | None = None) -> RolePolicy:
    roles_dir = roles_dir or shipped_dir("roles")
    path = roles_dir / f"{role}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in roles_dir.glob("*.yaml"))
        raise BadInput(f"unknown role {role!r}{_did_you_mean(role, known)}", where="--role", fix=f"use one of: {', '.join(known)}")
    try:
        # The C loader where libyaml is present (a server start reads this file): the same safe subset.
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        policy = RolePolicy.model_validate(raw)
    except yaml.YAMLError as e:
        raise BadInput(f"role policy is not valid YAML: {e}", where=str(path)) from None
    except ValidationError as e:
        raise BadInput(_explain_validation(e, RolePolicy), where=str(path), fix="correct the role policy") from None
    if policy.role != role:
        raise BadInput(f"role file {path.name} declares role {policy.role!r}", where=f"{path}: role", fix=f"set role: {role}")
    return policy


def _explain_validation(e: ValidationError, model: type[BaseModel]) -> str:
    msgs = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            key = str(err["loc"][-1])
            msgs.append(f"unknown key {loc!r}{_did_you_mean(key, model.model_fields)}")
        else:
            msgs.append(f"{loc}: {err['msg']}")
    return "; ".join(msgs)


def glob_match(rel_parts: tuple[str, ...], pattern: str) -> bool:
    pat = tuple(p for p in pattern.split("/") if p)

    def rec(i: int, j: int) -> bool:
        if j == len(pat):
            return i == len(rel_parts)
        if pat[j] == "**":
            return any(rec(k, j + 1) for k in range(i, len(rel_parts) + 1))
        return i < len(rel_parts) and fnmatch.fnmatchcase(rel_parts[i], pat[j]) and rec(i + 1, j + 1)

    return rec(0, 0)


class Guard:
    def __init__(self, policy: RolePolicy, ws: Workspace, data_dirs: list[Path] | None = None):
        self.policy = policy
        self.ws = ws
        # Roots are resolved once: a later symlink swap of a root itself is the operator's doing.
        self.write_roots = [self._resolve_root(ws.root), self._resolve_root(ws.output_root)]
        self.read_roots = self.write_roots + [self._resolve_root(Path(d)) for d in (data_dirs or [])]

    @staticmethod
    def _resolve_root(p: Path) -> Path:
        p = Path(p).expanduser().absolute()
        p.mkdir(parents=True, exist_ok=True)
        return p.resolve()

    def _real(self, path: Any, what: str) -> Path:
        if isinstance(path, Path):
            s = str(path)
        elif isinstance(path, str):
            s = path
        else:
            raise BadInput(f"{what} must be a path string, got {type(path).__name__}", where=what)
        if "\x00" in s:
            raise BadInput(f"{what} contains a NUL byte", where=what, fix="pass a plain file path")
        if not s.strip():
            raise BadInput(f"{what} is empty", where=what)
        if len(s.encode()) > MAX_PATH or any(len(c.encode()) > MAX_COMPONENT for c in Path(s).parts):
            raise BadInput(f"{what} is longer than the file system allows", where=what, fix="use a shorter path")
        p = Path(s).expanduser()
        if not p.is_absolute():
            p = self.ws.root / p
        # Judge a path that does not exist yet by its nearest existing parent, resolved.
        existing, rest = p, []
        while not os.path.lexists(existing):
            rest.append(existing.name)
            if existing.parent == existing:
                break
            existing = existing.parent
        try:
            real = existing.resolve(strict=True)
        except (OSError, RuntimeError) as e:
            raise Forbidden(f"{what} cannot be resolved ({e.__class__.__name__}: {e})", where=s) from None
        for part in reversed(rest):
            if part in ("..", "."):
                raise Forbidden(f"{what} climbs out through '..' below a missing directory", where=s)
            real = real / part
        return real

    def _root_of(self, real: Path, roots: list[Path]) -> Path | None:
        for r in roots:
            if real == r or real.is_relative_to(r):
                return r
        return None

    def _deny_hit(self, real: Path, root: Path, patterns: list[str]) -> str | None:
        rel = real.relative_to(root).parts
        for pat in patterns:
            if glob_match(rel, pat):
                return pat
        return None

    def check_read(self, path: Any, what: str = "path") -> Path:
        real = self._real(path, what)
        root = self._root_of(real, self.read_roots)
        if root is None:
            raise Forbidden(
                f"{what} {str(path)!r} is outside the allowed roots",
                where=str(real),
                fix="put the file under DGX_SPARK_ROOT, or start the server with --data-dir DIR (or FINETUNE_MCP_DATA_DIRS) naming the folder that holds it",
            )
        hit = self._deny_hit(real, root, self.policy.deny)
        if hit:
            raise Forbidden(f"the {self.policy.role} role may not access {str(path)!r} (policy: {hit})", where=str(real), fix=self._deny_fix())
        self._refuse_hard_links(real, path, what, tree=True)
        return real

    def check_write(self, path: Any, what: str = "path") -> Path:
        real = self._real(path, what)
        root = self._root_of(real, self.write_roots)
        if root is None:
            raise Forbidden(
                f"{what} {str(path)!r} is not writable: writes stay under DGX_SPARK_ROOT / OUTPUT_ROOT (data dirs are read-only)",
                where=str(real),
            )
        hit = self._deny_hit(real, root, self.policy.deny + self.policy.write_deny)
        if hit:
            raise Forbidden(f"the {self.policy.role} role may not write {str(path)!r} (policy: {hit})", where=str(real), fix=self._deny_fix())
        if self.policy.write_only is not None and not any(glob_match(real.relative_to(root).parts, p) for p in self.policy.write_only):
            raise Forbidden(f"the {self.policy.role} role writes only {', '.join(self.policy.write_only)}", where=str(real))
        self._refuse_hard_links(real, path, what, tree=False)
        return real

    def _deny_fix(self) -> str:
        if self.policy.role == "training-engineer":
            return ("eval/ (suites, eval reports, signed results), the keys, git internals and the verdicts belong to the eval engineer "
                    "or to git; hand the run over for evaluation instead")
        return "this path belongs to another role"

    def _hard_link_refusal(self, what: str, path: Any, f: Path, n: int, inside: bool) -> Forbidden:
        lead = f"{what} {str(path)!r} holds a hard link: {f}" if inside else f"{what} {str(path)!r} is a hard link: the file"
        return Forbidden(
            f"{lead} has {n} names (st_nlink {n}). The guard judges a file by the path it is given, and another name of the same file "
            f"may lie where the {self.policy.role} role may not look (an eval suite, a key), so a regular file with more than one hard "
            "link is refused by every tool",
            where=str(f),
            fix="pass an independent copy instead (`cp FILE COPY` makes one; `ln` does not), or remove the file's other names",
        )

    def _refuse_hard_links(self, real: Path, path: Any, what: str, tree: bool) -> None:
        """A regular file with st_nlink > 1 (and, for a folder that is read, any such file below it; links below are not followed)."""
        try:
            st = os.lstat(real)
        except OSError:
            return
        if stat.S_ISREG(st.st_mode):
            if st.st_nlink > 1:
                raise self._hard_link_refusal(what, path, real, st.st_nlink, inside=False)
            return
        if not (tree and stat.S_ISDIR(st.st_mode)):
            return
        for top, _dirs, files in os.walk(real):
            for name in files:
                f = Path(top) / name
                try:
                    fst = os.lstat(f)
                except OSError:
                    continue
                if stat.S_ISREG(fst.st_mode) and fst.st_nlink > 1:
                    raise self._hard_link_refusal(what, path, f, fst.st_nlink, inside=True)

    # Writes re-check at the last moment and never follow a symlink planted after the check:
    # the temp file is created O_EXCL and rename() replaces a link rather than writing through it.
    def write_bytes(self, path: Any, data: bytes, mode: int | None = None) -> Path:
        real = self.check_write(path)
        return atomic_write_bytes(real, data, mode)

    def write_text(self, path: Any, text: str, mode: int | None = None) -> Path:
        return self.write_bytes(path, text.encode("utf-8"), mode)

    def create_exclusive(self, path: Any, data: bytes) -> Path:
        real = self.check_write(path)
        real.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(real.parent)
        return real

    def read_bytes(self, path: Any) -> bytes:
        real = self.check_read(path)
        try:
            fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise FtError(f"cannot read {str(path)!r}: {e.strerror}", where=str(real)) from None
        with os.fdopen(fd, "rb") as f:
            n = os.fstat(f.fileno()).st_nlink
            if n > 1:  # a second name made after the check
                raise self._hard_link_refusal("path", path, real, n, inside=False)
            return f.read()

    def read_text(self, path: Any) -> str:
        return self.read_bytes(path).decode("utf-8")
