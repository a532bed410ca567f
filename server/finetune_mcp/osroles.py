"""Two OS users for the two roles (`finetune-mcp setup-roles`, issue 30).

The MCP guard binds tool arguments only; a coding agent with a shell reads whatever its user may read. Here
the workspace gets the owners and modes of the storage layout (helpers/GATE-LAYOUT.md, README "Two OS users"),
so the operating system keeps the eval suite, its reports and results and the signing key from the training
user: the root is root's (neither role can rename or replace a top-level entry), experiments/datasets/base
models/outputs are the training user's (readable by the eval user, who evaluates them), eval/ is the eval
user's (0711, each experiment 0700), verdicts/ the eval user's and world-readable, the key folder 0711 with
the private key 0600. Idempotent: a second run changes nothing and says nothing.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune_mcp.common.errors import BadInput, Refused
from finetune_mcp.workspace import EXPERIMENT_RE, RUN_ID_RE, Workspace

ROOT_MODE = 0o755
TRAINING_DIR_MODE = 0o755
EVAL_ROOT_MODE = 0o711
EVAL_EXPERIMENT_MODE = 0o700
VERDICT_DIR_MODE, VERDICT_FILE_MODE = 0o755, 0o644
KEY_DIR_MODE, PRIVATE_KEY_MODE, PUBLIC_KEY_MODE = 0o711, 0o600, 0o644
# export unpacks llama.cpp's converter here (phases/export.converter_path): the training user's
TOOLS_DIR = "tools"
LEGACY_RUN_REPORT = "eval-report.md"
RIGHTS = ("setup-roles changes owners and modes of files other users own, which needs root "
          "(CAP_CHOWN to give files away, CAP_FOWNER to chmod them)")


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int

    @property
    def owner(self) -> str:
        return f"{self.name}:{_group_name(self.gid)}"

    def groups(self) -> set[int]:
        return set(os.getgrouplist(self.name, self.gid))


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _owner_text(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    return f"{user}:{_group_name(st.st_gid)}"


def account(name: str, flag: str) -> Account:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise BadInput(f"no OS user named {name!r}", where=flag,
                       fix=f"create it first, e.g. `useradd --system --user-group --shell /usr/sbin/nologin {name}`") from None
    if pw.pw_uid == 0:
        raise BadInput(f"{flag} {name!r} is root (uid 0): root reads everything, so no role separation would hold", where=flag,
                       fix="name an ordinary user for each role")
    return Account(pw.pw_name, pw.pw_uid, pw.pw_gid)


def default_training_user() -> str:
    """The user who ran sudo: the one whose agent has been working in this workspace."""
    name = os.environ.get("SUDO_USER")
    if not name or name == "root":
        raise BadInput("no training user named, and none to infer (setup-roles was not run through sudo by an ordinary user)",
                       where="--training-user", fix="pass --training-user T: the user that runs the training server, train.py and the agent's shell")
    return name


@dataclass
class Changes:
    root: Path
    lines: list[str] = field(default_factory=list)

    def rel(self, p: Path) -> str:
        """The path as the root's users know it: relative, a folder with its slash."""
        try:
            r = p.relative_to(self.root)
        except ValueError:
            r = p
        if r == Path("."):
            return f"{p}/"
        return f"{r}/" if p.is_dir() and not p.is_symlink() else str(r)

    def add(self, line: str) -> None:
        self.lines.append(line)


def _traversable(path: Path, who: Account) -> Path | None:
    """The first folder on the way to `path` that `who` may not pass through (x permission), or None; a folder
    not made yet is made by setup-roles with the layout's modes."""
    groups = who.groups()
    for p in [*reversed(path.parents), path]:
        if not p.exists():
            return None
        st = p.stat()
        bits = stat.S_IXUSR if st.st_uid == who.uid else stat.S_IXGRP if st.st_gid in groups else stat.S_IXOTH
        if not st.st_mode & bits:
            return p
    return None


def _mkdir(d: Path, ch: Changes) -> None:
    if not d.exists() and not d.is_symlink():
        d.mkdir(parents=True)
        ch.add(f"mkdir {ch.rel(d)}")


def _open(name, dir_fd: int | None = None, *, directory: bool = False) -> int:
    """A descriptor of the entry itself, never of a link's target."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    return os.open(name, flags, dir_fd=dir_fd)


def _fix(name, dir_fd: int | None, owner: tuple[int, int], mode_of) -> tuple[bool, int | None, os.stat_result]:
    """Owner and mode of one entry, as root in folders the training user can write: it can swap a name for a link
    between two steps, so nothing here follows a link. Folders and files are changed through a descriptor opened
    without following one; anything else (a link, a fifo) gets only its own owner (lchown), never opened.
    Returns (owner changed, the old mode when the mode changed, the stat before)."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        if (st.st_uid, st.st_gid) != owner:
            os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)
            return True, None, st
        return False, None, st
    fd = _open(name, dir_fd, directory=stat.S_ISDIR(st.st_mode))
    try:
        st = os.fstat(fd)
        owned = (st.st_uid, st.st_gid) != owner
        if owned:
            os.fchown(fd, *owner)
        want = mode_of(st)
        old = stat.S_IMODE(st.st_mode)
        if want is not None and want != old:
            os.fchmod(fd, want)
            return owned, old, st
        return owned, None, st
    finally:
        os.close(fd)


def _set(p: Path, owner: tuple[int, int], mode: int | None, ch: Changes) -> None:
    """One fixed entry of the layout (its folder is root's or the role's own), each change reported."""
    owned, old, st = _fix(p, None, owner, lambda _st: mode)
    said = [f"owner {_owner_text(st)} -> {_owner_text(os.lstat(p))}"] if owned else []
    if old is not None:
        said.append(f"mode {old:04o} -> {mode:04o}")
    if said:
        ch.add(f"{ch.rel(p)}: " + ", ".join(said))


def _tree(top: Path, who: Account, mode_of, ch: Changes, what: str) -> None:
    """Owner and mode of everything below `top` (walked by descriptor, links never followed), summed up in one
    line: a run folder holds thousands of files."""
    owned = moded = 0
    for _, dirs, files, dfd in os.fwalk(top, follow_symlinks=False):
        for name in dirs + files:
            o, old, _ = _fix(name, dfd, (who.uid, who.gid), mode_of)
            owned += o
            moded += old is not None
    said = ([f"{owned} now owned by {who.owner}"] if owned else []) + ([f"{moded} {what}"] if moded else [])
    if said:
        ch.add(f"{ch.rel(top)}**: " + "; ".join(said))


def _readable_by_others(st: os.stat_result) -> int:
    """The eval user evaluates the training side's runs, briefs, splits and base models: others may read them."""
    m = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        return m | 0o755
    return m | 0o444 | (0o111 if m & 0o100 else 0)


def _published(st: os.stat_result) -> int:
    return VERDICT_DIR_MODE if stat.S_ISDIR(st.st_mode) else VERDICT_FILE_MODE


def _break_hard_links(top: Path, who: Account, ch: Changes) -> None:
    """A regular file under eval/ with a second name elsewhere is readable through that name whatever eval/'s
    modes: the eval copy gets a fresh inode (what the other name shows was exposed already; say so). The folders
    may still be another user's here, so every step goes through descriptors and follows no link."""
    if not top.is_dir() or top.is_symlink():
        return
    for d, _, files, dfd in os.fwalk(top, follow_symlinks=False):
        for name in files:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
                continue
            tmp = f".{name}.{os.getpid()}.unlinked"
            src = _open(name, dfd)
            try:
                dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
                try:
                    while chunk := os.read(src, 1 << 20):
                        os.write(dst, chunk)
                    os.fchown(dst, who.uid, who.gid)
                    os.fchmod(dst, stat.S_IMODE(st.st_mode))
                    os.fsync(dst)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            ch.add(f"{ch.rel(Path(d) / name)}: had {st.st_nlink} hard links (another name outside eval/ could read it); now a "
                   f"separate copy. Its content was readable through the other name: find {ch.root} -inum {st.st_ino}")


@dataclass(frozen=True)
class LegacySuite:
    experiment: str
    source: Path
    target: Path


def _experiment_folders(parent: Path) -> list[Path]:
    """The real (not symlinked) folders under parent named like an experiment, sorted."""
    if not parent.is_dir():
        return []
    return [e for e in sorted(parent.iterdir()) if EXPERIMENT_RE.fullmatch(e.name) and e.is_dir() and not e.is_symlink()]


def legacy_suites(ws: Workspace) -> list[LegacySuite]:
    """<experiment>/eval/ folders from before issue 30; refuses (before anything changes) where one cannot move."""
    found = []
    for e in _experiment_folders(ws.experiments_dir):
        src = ws.legacy_eval_dir(e.name)
        if src.is_symlink():
            raise Refused(f"{src} is a symbolic link, not a suite: setup-roles moves only a real folder", where=str(src),
                          fix=f"remove the link (rm {src}) and run setup-roles again")
        if not src.is_dir():
            continue
        if os.path.lexists(src / ".git"):
            # a suite inside the experiment was never a repository of its own: this one was planted, and the eval
            # user would run its hooks
            raise Refused(f"{src} holds a .git of its own, which no suite inside an experiment ever had", where=str(src / ".git"),
                          fix=f"look at it, remove it (rm -rf {src / '.git'}), and run setup-roles again")
        dst = ws.eval_dir(e.name)
        if dst.exists():
            raise Refused(f"experiment {e.name} has a suite in both places, the old {src} and the new {dst}", where=str(src),
                          fix=f"keep one: merge what the old one has into {dst} by hand, then remove {src}, and run setup-roles again")
        found.append(LegacySuite(e.name, src, dst))
    return found


def _open_under(base: Path, parent: Path) -> int:
    """A descriptor of `parent`, opened one folder at a time from `base` (root's), none of them through a link."""
    fd = _open(base, directory=True)
    for part in parent.relative_to(base).parts:
        try:
            nfd = _open(part, fd, directory=True)
        finally:
            os.close(fd)
        fd = nfd
    return fd


def _move_out(base: Path, parent: Path, name: str, dst: Path) -> None:
    """rename(parent/name, dst), reaching `parent` from `base` without following a link on the way."""
    fd = _open_under(base, parent)
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise Refused(f"{parent / name} turned into a symbolic link while setup-roles ran", where=str(parent / name),
                          fix="find out who changed it, then run setup-roles again")
        os.rename(name, dst, src_dir_fd=fd)
    finally:
        os.close(fd)


def _as_user(who: Account, argv: list[str], cwd: Path, umask: int) -> subprocess.CompletedProcess:
    """Work in a repository one role owns runs as that role: as root, git would run the owner's hooks and config."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": pwd.getpwuid(who.uid).pw_dir, "LANG": "C.UTF-8",
           "GIT_TERMINAL_PROMPT": "0"}
    try:
        return subprocess.run(argv, cwd=cwd, user=who.uid, group=who.gid, extra_groups=[], umask=umask, env=env,
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return subprocess.CompletedProcess(argv, 1, "", f"{type(e).__name__}: {e}")


_COMMIT_SUITE = """
import sys
from pathlib import Path
from finetune_mcp.domain.suite import ensure_eval_repo
from finetune_mcp.workspace import commit
d, msg = Path(sys.argv[1]), sys.argv[2]
ensure_eval_repo(d)
files = [p for p in d.rglob("*") if p.is_file() and not p.is_symlink() and ".git" not in p.relative_to(d).parts]
print(commit(d, files, msg) if files else "")
"""

_UNTRACK = """
import sys
from pathlib import Path
from finetune_mcp.workspace import git
repo, rel, msg = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
out = []
if git(repo, "ls-files", "--", rel).strip():
    git(repo, "rm", "-r", "-q", "--cached", "--", rel)
    out.append("untracked")
gi = repo / ".gitignore"
text = gi.read_text(encoding="utf-8") if gi.is_file() else ""
if "eval/" not in text.split():
    gi.write_text(text + ("" if not text or text.endswith("\\n") else "\\n") + "eval/\\n", encoding="utf-8")
    git(repo, "add", "--", ".gitignore")
    out.append("ignored")
if git(repo, "diff", "--cached", "--name-only").strip():
    git(repo, "commit", "-q", "-m", msg)
print(" ".join(out))
"""


def _commit_moved_suite(s: LegacySuite, ev: Account, ch: Changes) -> None:
    """The moved suite becomes its own repository, made as the eval user (its owner)."""
    p = _as_user(ev, [sys.executable, "-c", _COMMIT_SUITE, str(s.target),
                      f"Suite of {s.experiment}, moved from experiments/trainings/{s.experiment}/eval by setup-roles"], s.target, 0o077)
    if p.returncode != 0:
        ch.add(f"NOT DONE: {ch.rel(s.target)} could not be made a git repository as {ev.name} "
               f"({(p.stderr.strip().splitlines() or ['no output'])[-1]}); the suite is in place, uncommitted")
    else:
        ch.add(f"{ch.rel(s.target)}: its own git repository now, the moved files committed as {ev.name}")


def _untrack_suite(ws: Workspace, s: LegacySuite, tr: Account, ch: Changes) -> None:
    """The experiments repository (the training user's) stops tracking the old suite and ignores eval/."""
    repo = ws.experiments_repo
    if not (repo / ".git").exists():
        return
    rel = s.source.relative_to(repo).as_posix()
    p = _as_user(tr, [sys.executable, "-c", _UNTRACK, str(repo), rel,
                      f"Move {s.experiment}'s eval suite out of the experiment (setup-roles)"], repo, 0o022)
    if p.returncode != 0:
        ch.add(f"NOT DONE: the experiments repository still tracks {rel} ({(p.stderr.strip().splitlines() or ['no output'])[-1]}): "
               f"as {tr.name}, git -C {repo} rm -r --cached {rel}, add eval/ to .gitignore and commit")
        return
    said = p.stdout.split()
    if "untracked" in said:
        ch.add(f"experiments git: stopped tracking {rel} (its history still holds those files as objects the training "
               f"user can read: rewrite it, e.g. git filter-repo --path {rel} --invert-paths, or treat that suite as seen)")
    if "ignored" in said:
        ch.add("experiments/.gitignore: + eval/")


def _legacy_run_reports(ws: Workspace) -> list[tuple[Path, Path]]:
    """<run>/eval-report.md (every held-out prompt and answer) from before issue 30, and where each goes."""
    out = []
    for exp in _experiment_folders(ws.output_root):
        for run in sorted(exp.iterdir()):
            old = run / LEGACY_RUN_REPORT
            if not RUN_ID_RE.fullmatch(run.name) or run.is_symlink() or old.is_symlink() or not old.is_file():
                continue
            new = ws.eval_report_path(exp.name, run.name)
            out.append((old, new.with_name(f"{run.name}.run-dir-copy.md") if new.exists() else new))
    return out


def setup_roles(ws: Workspace, eval_user: str, training_user: str | None = None) -> list[str]:
    """Apply the two-user layout to the workspace; returns what changed (empty when it was already so)."""
    if os.geteuid() != 0:
        raise Refused(f"{RIGHTS}; this process runs as uid {os.geteuid()}", where="setup-roles",
                      fix=f"run it as root: sudo finetune-mcp setup-roles --eval-user {eval_user}"
                          + (f" --training-user {training_user}" if training_user else " --training-user T")
                          + f" --root {ws.root}")
    ev = account(eval_user, "--eval-user")
    tr = account(training_user or default_training_user(), "--training-user")
    if ev.uid == tr.uid:
        raise BadInput(f"the eval user and the training user are the same account ({ev.name}, uid {ev.uid})", where="--eval-user",
                       fix="give the eval role its own user; one user for both is the single-user mode, which needs no setup")
    if protected_hardlinks() is False:
        # Without it a user may hard-link any file (/etc/shadow) into its folders, and the chown below would give it away.
        raise Refused("fs.protected_hardlinks is off: any user may hard-link files it does not own into its own folders, "
                      "so giving a folder's files to its user could give away a system file", where="/proc/sys/fs/protected_hardlinks",
                      fix="sysctl -w fs.protected_hardlinks=1 (and fs.protected_hardlinks = 1 in /etc/sysctl.d/ to keep it), then run setup-roles again")
    root = ws.root
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise BadInput(f"{root} is not a folder", where="--root", fix="name the workspace folder itself (DGX_SPARK_ROOT)")
    for who in (ev, tr):
        for place in (root, ws.output_root):
            stuck = _traversable(place.parent, who)
            if stuck is not None:
                raise Refused(f"{who.name} cannot reach {place}: {stuck} does not let that user through (mode "
                              f"{stat.S_IMODE(stuck.stat().st_mode):04o}, owner {_owner_text(stuck.stat())})", where=str(stuck),
                              fix=f"chmod o+x {stuck} (lets users through without listing it), or put the workspace elsewhere")
    suites = legacy_suites(ws)  # every refusal comes before the first change

    ch = Changes(root)
    _mkdir(root, ch)
    _set(root, (0, 0), ROOT_MODE, ch)  # from here on no role can rename or replace a top-level entry
    _mkdir(ws.eval_root, ch)
    _set(ws.eval_root, (ev.uid, ev.gid), EVAL_ROOT_MODE, ch)
    for s in suites:
        _move_out(root, s.source.parent, s.source.name, s.target)
        ch.add(f"moved the legacy suite {ch.rel(s.source)} -> {ch.rel(s.target)}")
    for old, new in _legacy_run_reports(ws):
        new.parent.mkdir(parents=True, exist_ok=True)
        _move_out(ws.output_root, old.parent, old.name, new)
        ch.add(f"moved the legacy eval report {ch.rel(old)} -> {ch.rel(new)}")
    # Before either side's owners: the other name of a hard-linked eval file keeps the old inode (the training
    # side's from then on), the eval name gets a fresh one.
    _break_hard_links(ws.eval_root, ev, ch)
    _break_hard_links(ws.keys_dir, ev, ch)

    training = [ws.experiments_repo, ws.datasets_dir, ws.base_models_dir, root / "outputs", ws.output_root, root / TOOLS_DIR]
    for d in dict.fromkeys(training):
        _mkdir(d, ch)
        _set(d, (tr.uid, tr.gid), TRAINING_DIR_MODE, ch)
        _tree(d, tr, _readable_by_others, ch, "made readable by the eval user (go+rX)")
    for s in suites:
        _untrack_suite(ws, s, tr, ch)
    # Eval-owned last: a file with a name on both sides ends up the eval user's, and its other name is cut off.
    for p in sorted(ws.eval_root.iterdir()):
        suite = p.is_dir() and not p.is_symlink()
        _set(p, (ev.uid, ev.gid), EVAL_EXPERIMENT_MODE if suite else None if p.is_symlink() else 0o600, ch)
        if suite:  # the 0700 folder is what closes it: the modes inside are the eval server's own
            _tree(p, ev, lambda _st: None, ch, "")
    for s in suites:
        _commit_moved_suite(s, ev, ch)
    _mkdir(ws.verdicts_root, ch)
    _set(ws.verdicts_root, (ev.uid, ev.gid), VERDICT_DIR_MODE, ch)
    _tree(ws.verdicts_root, ev, _published, ch, "set to 0755 (folders) / 0644 (verdicts)")
    _mkdir(ws.keys_dir, ch)
    _set(ws.keys_dir, (ev.uid, ev.gid), KEY_DIR_MODE, ch)
    for p in sorted(ws.keys_dir.iterdir()):
        mode = PRIVATE_KEY_MODE if p == ws.private_key_path else PUBLIC_KEY_MODE if p == ws.public_key_path else 0o600
        _set(p, (ev.uid, ev.gid), None if p.is_symlink() else mode, ch)
    return ch.lines


def protected_hardlinks() -> bool | None:
    """fs.protected_hardlinks, None where the kernel does not say."""
    try:
        return Path("/proc/sys/fs/protected_hardlinks").read_text().strip() == "1"
    except OSError:
        return None


def warnings(ws: Workspace, eval_user: str, training_user: str) -> list[str]:
    """What setup-roles cannot fix but the user should know (stderr, every run)."""
    out = []
    for name in (eval_user, training_user):
        try:
            who = account(name, "user")
        except BadInput:
            continue
        exe = Path(sys.executable).absolute()
        stuck = _traversable(exe.parent, who) or _traversable(Path(os.path.realpath(exe)).parent, who)
        if stuck is not None:
            out.append(f"{name} cannot run this installation ({exe} -> {os.path.realpath(exe)}): {stuck} does not let that "
                       f"user through; each server needs an installation its user can run (or `chmod o+x {stuck}`)")
    return out


def server_commands(ws: Workspace, eval_user: str, training_user: str) -> list[str]:
    exe = Path(sys.executable).parent / "finetune-mcp"
    cmd = str(exe) if exe.exists() else "finetune-mcp"
    env = f"DGX_SPARK_ROOT={ws.root}" + (f" OUTPUT_ROOT={ws.output_root}" if ws.output_root != ws.root / "outputs" / "trainings" else "")
    return [f"eval server:     sudo -u {eval_user} env {env} {cmd} serve --role eval-engineer",
            f"training server: sudo -u {training_user} env {env} {cmd} serve --role training-engineer"]
