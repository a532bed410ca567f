"""Every path of the storage layout, experiment and run naming, atomic writes, and the experiments git."""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_mcp.common.errors import BadInput, FtError, NotFound
from finetune_mcp.common.files import process_umask

TAG_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,47}\Z")
RUN_ID_RE = re.compile(r"\A\d{8}-\d{4}-[A-Za-z0-9][A-Za-z0-9._-]{0,47}\Z")
EXPERIMENT_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,119}\Z")


@dataclass(frozen=True)
class Workspace:
    root: Path
    output_root: Path

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Workspace":
        env = os.environ if env is None else env
        root = Path(env.get("DGX_SPARK_ROOT") or Path.home() / "dgx-spark").expanduser()
        out = Path(env.get("OUTPUT_ROOT") or root / "outputs" / "trainings").expanduser()
        return cls(root=root.absolute(), output_root=out.absolute())

    @property
    def experiments_repo(self) -> Path:
        return self.root / "experiments"

    @property
    def experiments_dir(self) -> Path:
        return self.root / "experiments" / "trainings"

    @property
    def datasets_dir(self) -> Path:
        return self.root / "datasets"

    @property
    def base_models_dir(self) -> Path:
        return self.root / "base-models"

    def experiment_dir(self, experiment: str, *, must_exist: bool = True) -> Path:
        validate_experiment(experiment)
        d = self.experiments_dir / experiment
        if must_exist and not d.is_dir():
            known = sorted(p.name for p in self.experiments_dir.glob("*") if p.is_dir()) if self.experiments_dir.is_dir() else []
            raise NotFound(
                f"no experiment named {experiment!r}",
                where=str(d),
                fix=("known experiments: " + ", ".join(known)) if known else "run prepare_dataset with a training brief first; it opens the experiment",
            )
        return d

    def run_dir(self, run_ref: str, *, must_exist: bool = True) -> Path:
        experiment, run_id = parse_run_ref(run_ref)
        d = self.output_root / experiment / run_id
        if must_exist and not d.is_dir():
            raise NotFound(f"no run {run_ref!r}", where=str(d), fix="use the run_id that launch_run returned (<experiment>/<YYYYMMDD-HHMM-tag>)")
        return d

    # Eval-owned places (issue 30, helpers/GATE-LAYOUT.md): none lies inside a training-owned folder.

    @property
    def eval_root(self) -> Path:
        return self.root / "eval"

    def eval_dir(self, experiment: str) -> Path:
        """The experiment's suite (prompts/goldens/drift.jsonl, eval.yaml), its own git repository."""
        return self.eval_root / validate_experiment(experiment)

    def eval_reports_dir(self, experiment: str) -> Path:
        return self.eval_dir(experiment) / "reports"

    def eval_report_path(self, experiment: str, run_id: str) -> Path:
        """The eval report: figures and every prompt side by side (eval-only)."""
        return self.eval_reports_dir(experiment) / f"{_run_part(run_id)}.md"

    def eval_results_dir(self, experiment: str) -> Path:
        return self.eval_dir(experiment) / "results"

    def eval_result_path(self, experiment: str, run_id: str) -> Path:
        """The signed evaluation result (finetune-mcp/eval-result/v1)."""
        return self.eval_results_dir(experiment) / f"{_run_part(run_id)}.json"

    def legacy_eval_dir(self, experiment: str) -> Path:
        """Where the suite lived before issue 30 (inside the experiment); refused when present."""
        return self.experiments_dir / validate_experiment(experiment) / "eval"

    @property
    def verdicts_root(self) -> Path:
        return self.root / "verdicts"

    def verdict_dir(self, experiment: str, run_id: str) -> Path:
        return self.verdicts_root / validate_experiment(experiment) / _run_part(run_id)

    def verdict_path(self, experiment: str, run_id: str) -> Path:
        """The signed verdict, world-readable; export reads it as the training user."""
        return self.verdict_dir(experiment, run_id) / "promotion-report.md"

    @property
    def keys_dir(self) -> Path:
        return self.root / ".finetune-mcp-keys"

    @property
    def private_key_path(self) -> Path:
        return self.keys_dir / "verdict-ed25519.key"

    @property
    def public_key_path(self) -> Path:
        return self.keys_dir / "verdict-ed25519.pub"

    def ensure_dirs(self) -> None:
        for d in (self.experiments_dir, self.datasets_dir, self.base_models_dir, self.output_root):
            d.mkdir(parents=True, exist_ok=True)


def _run_part(run_id: str) -> str:
    """The YYYYMMDD-HHMM-tag part; a full <experiment>/<run> reference is accepted too."""
    if isinstance(run_id, str) and "/" in run_id:
        return parse_run_ref(run_id)[1]
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
        raise BadInput(f"invalid run id {run_id!r}", where="run_id", fix="the run part is YYYYMMDD-HHMM-<tag>, as launch_run returned it")
    return run_id


def _safe_part(text: str, what: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip()).strip("-.")
    s = re.sub(r"-{2,}", "-", s)
    if not s:
        raise BadInput(f"{what} {text!r} has no usable characters for a directory name", fix=f"give the brief a {what} made of letters, digits, '.', '_' or '-'")
    return s


def experiment_name(model: str, method: str, task: str) -> str:
    """<Model>-<Method>-<Task>; the model keeps only its last path part (Qwen/Qwen3-4B -> Qwen3-4B)."""
    model_part = _safe_part(model.rstrip("/").split("/")[-1], "base model")
    name = f"{model_part}-{_safe_part(method, 'method')}-{_safe_part(task, 'task')}"
    return name[:120]


def validate_experiment(name: str) -> str:
    if not isinstance(name, str) or not EXPERIMENT_RE.fullmatch(name) or ".." in name:
        raise BadInput(f"invalid experiment name {name!r}", where="experiment", fix="use the name prepare_dataset returned: <Model>-<Method>-<Task>, letters, digits, '.', '_' and '-' only")
    return name


def validate_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):
        raise BadInput(
            f"invalid run tag {tag!r}",
            where="tag",
            fix="a tag is 1-48 characters of letters, digits, '.', '_' or '-', starting with a letter or digit, and says what was varied, e.g. r16-lr2e4",
        )
    return tag


def new_run_id(tag: str, now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now()
    return f"{now:%Y%m%d-%H%M}-{validate_tag(tag)}"


def parse_run_ref(run_ref: str) -> tuple[str, str]:
    if not isinstance(run_ref, str) or run_ref.count("/") != 1:
        raise BadInput(f"invalid run id {run_ref!r}", where="run_id", fix="a run is addressed as <experiment>/<YYYYMMDD-HHMM-tag>, as launch_run returned it")
    experiment, run_id = run_ref.split("/")
    validate_experiment(experiment)
    if not RUN_ID_RE.fullmatch(run_id):
        raise BadInput(f"invalid run id {run_id!r} in {run_ref!r}", where="run_id", fix="the run part is YYYYMMDD-HHMM-<tag>, as launch_run returned it")
    return experiment, run_id


# ---------------------------------------------------------------- atomic writes

def atomic_write_bytes(path: Path | str, data: bytes, mode: int | None = None) -> Path:
    """Write via a temp file in the same directory + rename, so readers never see a partial file.

    Without a mode the file gets what a plain open() would give (0o666 less the umask), not mkstemp's 0600:
    with the roles as two OS users, the eval user reads the run's config and brief the training user wrote."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~process_umask())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def fsync_dir(directory: Path | str) -> None:
    """Make a rename or a new name in `directory` durable: without it, a crash can leave the old name, or none."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the file's own fsync still holds
    finally:
        os.close(fd)


def atomic_write_text(path: Path | str, text: str, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path | str, obj: Any, mode: int | None = None) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n", mode)


def read_json_file(path: Path | str) -> dict | None:
    """A JSON file's object, or None when it is missing, unreadable or not an object: the one reader of the
    state files (exit.json, env-report.json, run.json...), where a file mid-write reads as absent."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------- git

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "finetune-mcp",
    "GIT_AUTHOR_EMAIL": "finetune-mcp@localhost",
    "GIT_COMMITTER_NAME": "finetune-mcp",
    "GIT_COMMITTER_EMAIL": "finetune-mcp@localhost",
}


GIT_TIMEOUT_DEFAULT_S = 60.0


def git_timeout() -> float:
    """Seconds one git command may take (FINETUNE_MCP_GIT_TIMEOUT_S): a hook from the user's git config runs inside
    our commits, and one that waits on something would otherwise hang the tool forever."""
    raw = os.environ.get("FINETUNE_MCP_GIT_TIMEOUT_S")
    try:
        value = float(raw) if raw else GIT_TIMEOUT_DEFAULT_S
    except ValueError:
        raise BadInput(f"FINETUNE_MCP_GIT_TIMEOUT_S={raw!r} is not a number of seconds", where="FINETUNE_MCP_GIT_TIMEOUT_S",
                       fix="set it to the seconds a git command may take, e.g. 60") from None
    return value if value > 0 else GIT_TIMEOUT_DEFAULT_S


def git(repo: Path, *args: str, check: bool = True) -> str:
    env = {**os.environ, **_GIT_ENV, "GIT_TERMINAL_PROMPT": "0"}
    limit = git_timeout()
    try:
        p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, timeout=limit,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise FtError(f"git {' '.join(args[:2])} did not finish within {limit:g}s; nothing waits on it any longer", where=str(repo),
                      fix="a hook in your git configuration (core.hooksPath, or the repository's .git/hooks) is the usual "
                          "cause: make it return promptly, or raise FINETUNE_MCP_GIT_TIMEOUT_S") from None
    if check and p.returncode != 0:
        raise FtError(f"git {' '.join(args)} failed: {p.stderr.strip() or p.stdout.strip()}", where=str(repo))
    return p.stdout


def ensure_repo(repo: Path) -> Path:
    repo.mkdir(parents=True, exist_ok=True)
    if not (repo / ".git").exists():
        git(repo, "init", "-q", "-b", "main")
        # eval/: a suite must never enter this repository, which the training side reads (it lives in $DGX_SPARK_ROOT/eval/).
        atomic_write_text(repo / ".gitignore", "# experiments hold code and config only (layout seed)\n*.safetensors\n*.bin\n*.gguf\ncheckpoints/\neval/\n")
        git(repo, "add", ".gitignore")
        git(repo, "commit", "-q", "-m", "Initialise experiments repository")
    return repo


def commit(repo: Path, paths: list[Path], message: str) -> str:
    """Commit the named files (and only them); returns the commit id (HEAD when nothing changed)."""
    ensure_repo(repo)
    rel = [str(Path(p).resolve().relative_to(repo.resolve())) for p in paths]
    git(repo, "add", "--", *rel)
    staged = git(repo, "diff", "--cached", "--name-only", "--", *rel).strip()
    if staged:
        git(repo, "commit", "-q", "-m", message, "--", *rel)
    return git(repo, "rev-parse", "HEAD").strip()


def file_state(repo: Path, path: Path) -> str:
    """'clean' when committed and unchanged, 'modified' when changed since, 'untracked' when never committed."""
    rel = str(Path(path).resolve().relative_to(repo.resolve()))
    if not (repo / ".git").exists():
        return "untracked"
    tracked = git(repo, "ls-files", "--error-unmatch", "--", rel, check=False)
    if not tracked.strip():
        return "untracked"
    dirty = git(repo, "status", "--porcelain", "--", rel).strip()
    return "modified" if dirty else "clean"


def last_commit_of(repo: Path, path: Path) -> str | None:
    rel = str(Path(path).resolve().relative_to(repo.resolve()))
    out = git(repo, "log", "-1", "--format=%H", "--", rel, check=False).strip()
    return out or None
