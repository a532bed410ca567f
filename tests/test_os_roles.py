"""Role separation the operating system enforces (issue 30 §3): `finetune-mcp setup-roles` and two real OS users.

As root: two throwaway users (useradd; removed afterwards, whatever happens), setup-roles on a fresh workspace,
the whole lifecycle on the embedded tiny model with each MCP server running as its own user (a real stdio
client; setpriv drops to the user), then the training user's shell (real processes with that uid) tries to read
every eval file and the private key, write the evaluation result, plant hard links, and replay a verdict from
another run. Every attempt fails, the controls (what the training user must be able to do) succeed, and the
lifecycle still exports. Without root these tests skip loudly; the refusal without root runs everywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from conftest import REPO, server_command
from finetune_mcp.common import task
from finetune_mcp.osroles import protected_hardlinks
from finetune_mcp.workspace import Workspace

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
NEEDS = ("useradd", "userdel", "setpriv")


def need_root() -> None:
    if not IS_ROOT:
        pytest.skip(f"SKIPPED LOUDLY: the two-user tests need root (they create OS users and chown); this runs as uid {os.geteuid()}")
    missing = [c for c in NEEDS if shutil.which(c) is None]
    if missing:
        pytest.skip(f"SKIPPED LOUDLY: {', '.join(missing)} not installed (util-linux / passwd): no real users to test with")
    if protected_hardlinks() is False:
        pytest.skip("SKIPPED LOUDLY: fs.protected_hardlinks is off on this kernel, and setup-roles refuses to run without it "
                    "(sysctl -w fs.protected_hardlinks=1)")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path

    def cmd(self, *argv: str) -> list[str]:
        """argv run as this user: its uid, gid and groups, nothing of root's."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", *argv]

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "HF_", "PYTEST_", "TMPDIR", "FINETUNE_MCP_MODULES"))}
        return {**env, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, "HF_HUB_OFFLINE": "1", **extra}


@contextlib.contextmanager
def throwaway_users(base: Path, *roles: str):
    """Real OS users, one per role, removed with their groups on the way out (also when the test fails)."""
    made: list[User] = []
    tag = uuid.uuid4().hex[:6]
    try:
        for role in roles:
            name = f"ftm{role[0]}{tag}"
            subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True, text=True)
            pw = pwd.getpwnam(name)
            home = base / f"home-{role}"
            home.mkdir(mode=0o700)
            os.chown(home, pw.pw_uid, pw.pw_gid)
            made.append(User(name, pw.pw_uid, pw.pw_gid, home))
        yield made
    finally:
        for u in made:
            # whatever the test left running as the user (it started every one of them), by process id
            left = subprocess.run(["pgrep", "-u", str(u.uid)], capture_output=True, text=True).stdout.split()
            for pid in left:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["userdel", u.name], capture_output=True)
        for u in made:
            with contextlib.suppress(KeyError):
                pwd.getpwnam(u.name)
                raise AssertionError(f"throwaway user {u.name} could not be removed: userdel {u.name}")


@contextlib.contextmanager
def passage_for_others(paths: list[Path]):
    """The interpreter and this checkout must be reachable by the throwaway users: add o+x (pass through, no
    listing) to each folder on the way that lacks it, for the test's duration, and put the modes back after."""
    changed: dict[Path, int] = {}
    for target in paths:
        for d in [*reversed(Path(os.path.realpath(target)).parents)]:
            mode = stat.S_IMODE(d.stat().st_mode)
            if not mode & stat.S_IXOTH and d not in changed:
                changed[d] = mode
                os.chmod(d, mode | stat.S_IXOTH)
    try:
        if changed:
            print("test_os_roles: let other users pass through " + ", ".join(f"{d} ({m:04o} -> {m | 1:04o})" for d, m in changed.items())
                  + " for the test's duration")
        yield
    finally:
        for d, mode in changed.items():
            os.chmod(d, mode)


def setup_roles(root: Path, ev: User, tr: User) -> subprocess.CompletedProcess:
    return subprocess.run(server_command() + ["setup-roles", "--eval-user", ev.name, "--training-user", tr.name, "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


def mode_owner(p: Path) -> tuple[str, int]:
    st = os.lstat(p)
    return f"{stat.S_IMODE(st.st_mode):04o}", st.st_uid


# ---------------------------------------------------------------- without root


def test_setup_roles_refuses_without_root_and_names_the_rights(tmp_path):
    """Run as an ordinary user (this process if it is one; a throwaway user under root): refused, nothing made."""
    root = tmp_path / "ws"
    argv = server_command() + ["setup-roles", "--eval-user", "nobody", "--training-user", "daemon", "--root", str(root)]
    if IS_ROOT:
        need_root()
        base = Path(tempfile.mkdtemp(prefix="ftm-roles-"))
        os.chmod(base, 0o755)
        root = base / "ws"
        argv[-1] = str(root)
        try:
            with throwaway_users(base, "x") as (u,), passage_for_others([Path(sys.executable), REPO]):
                p = subprocess.run(u.cmd(*argv), capture_output=True, text=True, timeout=120, env=u.env(), cwd=u.home)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    else:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "needs root" in p.stderr and "CAP_CHOWN" in p.stderr and "sudo finetune-mcp setup-roles --eval-user nobody" in p.stderr, p.stderr
    assert not root.exists() and p.stdout == ""


def test_atomic_writes_take_the_umask_modes_not_mkstemps(tmp_path):
    """What the training server writes (config.yaml, briefs) must be readable by an eval user: a plain open()'s
    mode, never mkstemp's 0600; an explicit mode still wins."""
    from finetune_mcp.common.files import process_umask
    from finetune_mcp.workspace import atomic_write_text

    old = os.umask(0o027)
    try:
        assert process_umask() == 0o027
        assert mode_owner(atomic_write_text(tmp_path / "a.yaml", "x: 1\n"))[0] == "0640"
    finally:
        os.umask(old)
    assert mode_owner(atomic_write_text(tmp_path / "b.yaml", "x: 1\n"))[0] == f"{0o666 & ~old:04o}"
    assert mode_owner(atomic_write_text(tmp_path / "c.key", "k\n", 0o600))[0] == "0600"


# ---------------------------------------------------------------- setup-roles on a workspace made before issue 30


def test_setup_roles_lays_out_a_legacy_workspace_once(tmp_path):
    need_root()
    base = Path(tempfile.mkdtemp(prefix="ftm-roles-"))
    os.chmod(base, 0o755)
    root = base / "dgx-spark"
    ws = Workspace.from_env({"DGX_SPARK_ROOT": str(root)})
    exp, run = "m-SFT-LoRA-t", "20260101-0900-a"
    try:
        with throwaway_users(base, "eval", "training") as (ev, tr), passage_for_others([Path(sys.executable), REPO]):
            # As the single-user mode left it: the suite inside the experiment and tracked by its git, a run
            # that holds the old eval report, a key readable by everyone, and a hard link to the suite planted
            # in a dataset folder.
            legacy = ws.legacy_eval_dir(exp)
            (legacy / "reports").mkdir(parents=True)
            (legacy / "prompts.jsonl").write_text('{"prompt": "Repeat:\\na b c", "expected": "a b c"}\n')
            (legacy / "eval.yaml").write_text("thresholds: {max_kl: 1.0}\n")
            (ws.datasets_dir / "d").mkdir(parents=True)
            os.link(legacy / "prompts.jsonl", ws.datasets_dir / "d" / "planted.jsonl")
            # and links to a file outside the workspace, which root must not give away by following them
            outside = base / "system-file"
            outside.write_text("root's\n")
            os.chmod(outside, 0o600)
            (ws.datasets_dir / "d" / "to-system-file").symlink_to(outside)
            (legacy / "to-system-file").symlink_to(outside)
            rd = ws.output_root / exp / run
            (rd / "adapter").mkdir(parents=True)
            (rd / "adapter" / "adapter_model.safetensors").write_bytes(b"x")
            os.chmod(rd / "adapter" / "adapter_model.safetensors", 0o600)
            (rd / "eval-report.md").write_text("every held-out prompt and answer\n")
            ws.keys_dir.mkdir(parents=True)
            ws.private_key_path.write_text("PRIVATE\n")
            os.chmod(ws.private_key_path, 0o644)
            ws.public_key_path.write_text("PUBLIC\n")
            (ws.verdicts_root / exp / run).mkdir(parents=True)
            ws.verdict_path(exp, run).write_text("verdict\n")
            os.chmod(ws.verdict_path(exp, run), 0o600)
            repo = ws.experiments_repo
            g = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
            subprocess.run(g + ["init", "-q", "-b", "main"], check=True)
            subprocess.run(g + ["add", "."], check=True)
            subprocess.run(g + ["commit", "-q", "-m", "single-user"], check=True)

            p = setup_roles(root, ev, tr)
            assert p.returncode == 0, p.stderr
            out = p.stdout
            print(out)
            assert f"moved the legacy suite experiments/trainings/{exp}/eval -> eval/{exp}/" in out
            assert f"moved the legacy eval report outputs/trainings/{exp}/{run}/eval-report.md -> eval/{exp}/reports/{run}.md" in out
            assert "stopped tracking trainings/m-SFT-LoRA-t/eval" in out and "history still holds" in out
            assert "had 2 hard links" in out
            assert ".finetune-mcp-keys/verdict-ed25519.key: owner root:root -> " in out and "mode 0644 -> 0600" in out
            assert f"sudo -u {ev.name} env DGX_SPARK_ROOT={root}" in out and "serve --role eval-engineer" in out

            suite = ws.eval_dir(exp)
            assert not legacy.exists() and (suite / "prompts.jsonl").read_text().startswith('{"prompt"')
            # the layout, owner by owner and mode by mode
            want = {root: ("0755", 0), ws.experiments_repo: ("0755", tr.uid), ws.datasets_dir: ("0755", tr.uid),
                    ws.base_models_dir: ("0755", tr.uid), root / "outputs": ("0755", tr.uid), ws.output_root: ("0755", tr.uid),
                    root / "tools": ("0755", tr.uid), ws.eval_root: ("0711", ev.uid), suite: ("0700", ev.uid),
                    suite / "prompts.jsonl": ("0644", ev.uid), suite / "reports" / f"{run}.md": ("0644", ev.uid),
                    ws.verdicts_root: ("0755", ev.uid), ws.verdict_path(exp, run): ("0644", ev.uid),
                    ws.keys_dir: ("0711", ev.uid), ws.private_key_path: ("0600", ev.uid), ws.public_key_path: ("0644", ev.uid),
                    rd / "adapter" / "adapter_model.safetensors": ("0644", tr.uid)}
            assert {p: mode_owner(p) for p in want} == want
            assert mode_owner(outside) == ("0600", 0) and os.lstat(ws.datasets_dir / "d" / "to-system-file").st_uid == tr.uid
            # the planted name is cut off: the suite is a separate inode now, the eval user's
            assert os.stat(suite / "prompts.jsonl").st_nlink == 1
            assert os.stat(suite / "prompts.jsonl").st_ino != os.stat(ws.datasets_dir / "d" / "planted.jsonl").st_ino
            # the suite is its own repository, and the experiments repository no longer tracks it (and ignores eval/)
            sg = ["git", "-c", "safe.directory=*"]
            assert "prompts.jsonl" in subprocess.run(sg + ["-C", str(suite), "ls-files"], capture_output=True, text=True).stdout
            assert subprocess.run(sg + ["-C", str(repo), "ls-files"], capture_output=True, text=True).stdout.strip() == ".gitignore"
            assert "eval/" in (repo / ".gitignore").read_text().split()

            # idempotent: nothing to change, nothing said
            again = setup_roles(root, ev, tr)
            assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
            assert {p: mode_owner(p) for p in want} == want
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_setup_roles_refuses_before_changing_anything(tmp_path):
    """A root the users cannot reach, and a suite in both places: refused with the folder and the fix, nothing changed."""
    need_root()
    base = Path(tempfile.mkdtemp(prefix="ftm-roles-"))  # 0700: no other user gets through
    root = base / "dgx-spark"
    ws = Workspace.from_env({"DGX_SPARK_ROOT": str(root)})
    try:
        with throwaway_users(base, "eval", "training") as (ev, tr):
            p = setup_roles(root, ev, tr)
            assert p.returncode == 2 and p.stdout == "", p.stdout
            assert f"cannot reach {root}: {base} does not let that user through (mode 0700" in p.stderr, p.stderr
            assert f"chmod o+x {base}" in p.stderr and not root.exists()

            os.chmod(base, 0o755)
            ws.legacy_eval_dir("m-SFT-LoRA-t").mkdir(parents=True)
            ws.eval_dir("m-SFT-LoRA-t").mkdir(parents=True)
            before = {str(q): mode_owner(q) for q in [root, *root.rglob("*")]}
            p = setup_roles(root, ev, tr)
            assert p.returncode == 2 and p.stdout == "", p.stdout
            assert "has a suite in both places" in p.stderr and "merge what the old one has" in p.stderr, p.stderr
            assert {str(q): mode_owner(q) for q in [root, *root.rglob("*")]} == before
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- the lifecycle as two users, and the training shell

EVAL_YAML = "thresholds: {max_kl: 4.0, max_perplexity_ratio: 3.0}\n"  # the embedded model's loose drift bars (demo.py)
TRAIN_STEPS = 200


@contextlib.asynccontextmanager
async def session_as(user: User, role: str, root: Path, extra_args: list[str] | None = None):
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    argv = user.cmd(*server_command(), "serve", "--role", role, *(extra_args or []))
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=user.env(DGX_SPARK_ROOT=str(root)), cwd=str(user.home))
    # the server's stderr goes to a file beside the workspace (capsys's stand-in for stderr has no descriptor)
    with open(root.parent / f"{role}.stderr.log", "a") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                yield s


async def call(s, tool: str, args: dict) -> dict:
    r = await s.call_tool(tool, args)
    assert not r.is_error, f"{tool} failed: {r.content[0].text}"
    return r.structured_content


async def poll_until_done(s, run_id: str, budget_s: float = 600) -> dict:
    cursor, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < budget_s:
        res = await call(s, "poll_progress", {"run_id": run_id, "cursor": cursor, "limit": 1000})
        cursor = res["next_cursor"]
        if res["status"] in ("succeeded", "failed", "stopped"):
            return res
        await anyio.sleep(1.0)
    raise AssertionError(f"{run_id} did not finish within {budget_s:.0f}s")


def suite_files() -> dict[str, str]:
    items = task.eval_suite(20, seed=1)
    return {
        "prompts.jsonl": "".join(json.dumps({"prompt": i["prompt"], "expected": i["expected"]}) + "\n" for i in items),
        "goldens.jsonl": "".join(json.dumps({"prompt": i["prompt"]}) + "\n" for i in items[:3]),
        "drift.jsonl": "".join(json.dumps({"prompt": p}) + "\n" for p in task.drift_prompts()),
        "eval.yaml": EVAL_YAML,
    }


def short(text: str, names: dict[str, str]) -> str:
    for long, name in names.items():
        text = text.replace(long, name)
    return text


def attempt(user: User, what: str, shell: str, names: dict[str, str]) -> dict:
    """One thing the training user's shell tries: a real bash process with that uid (the result: its last line)."""
    p = subprocess.run(user.cmd("bash", "-c", shell), capture_output=True, text=True, timeout=60, env=user.env(), cwd=user.home)
    said = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or [""])[-1]
    return {"attempt": what, "command": shell, "rc": p.returncode, "result": short(said, names)}


def table(rows: list[dict], title: str) -> str:
    w = max(len(r["attempt"]) for r in rows)
    lines = [title, f"{'attempt':<{w}}   rc  {'expected':<8}  result (its last line)", "-" * (w + 110)]
    lines += [f"{r['attempt']:<{w}}  {r['rc']:>3}  {r['expected']:<8}  {r['result']}" for r in rows]
    return "\n".join(lines)


def test_two_users_run_the_lifecycle_and_the_training_shell_cannot_reach_the_eval_side(capsys):
    need_root()
    t0 = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="ftm-roles-"))
    os.chmod(base, 0o755)
    root = base / "dgx-spark"
    ws = Workspace.from_env({"DGX_SPARK_ROOT": str(root)})
    try:
        with throwaway_users(base, "eval", "training") as (ev, tr), passage_for_others([Path(sys.executable), REPO]):
            p = setup_roles(root, ev, tr)
            assert p.returncode == 0, p.stderr
            assert "mkdir eval/" in p.stdout and "eval/: owner root:root -> " in p.stdout
            # the training user's inbox: a brief and its data, outside the workspace
            inbox = base / "inbox"
            inbox.mkdir()
            (inbox / "training-brief.md").write_text(task.sample_brief("sft-lora"))
            task.write_jsonl(task.sft_conversations(2000, seed=0), inbox / "repeat-words.jsonl")
            for x in [inbox, *inbox.iterdir()]:
                os.chown(x, tr.uid, tr.gid)
            t_setup = time.monotonic() - t0

            facts: dict = {}

            async def lifecycle():
                async with session_as(tr, "training-engineer", root, ["--data-dir", str(inbox)]) as s:
                    prep = await call(s, "prepare_dataset", {"brief_path": str(inbox / "training-brief.md"),
                                                             "source": str(inbox / "repeat-words.jsonl")})
                    assert prep["complete"], prep["summary"]
                    exp = facts["experiment"] = prep["experiment"]
                    pf = await call(s, "preflight", {"experiment": exp})
                    assert pf["verdict"] != "blocked", pf
                    await call(s, "generate_config", {"experiment": exp, "tag": "os-roles",
                                                      "overrides": {"max_steps": TRAIN_STEPS}})
                    run = await call(s, "launch_run", {"experiment": exp, "tag": "os-roles",
                                                       "accept_warnings": pf["verdict"] == "ready-with-warnings"})
                    facts["run_id"] = run["run_id"]
                    done = await poll_until_done(s, run["run_id"])
                    assert done["status"] == "succeeded", done
                facts["t_train"] = time.monotonic() - t0
                async with session_as(ev, "eval-engineer", root) as s:
                    for name, content in suite_files().items():
                        await call(s, "write_eval_file", {"experiment": facts["experiment"], "relpath": name, "content": content})
                    e = facts["eval"] = await call(s, "evaluate_checkpoint", {"run_id": facts["run_id"]})
                    assert e["passed"] and all(e["passed"].values()), e["passed"]
                    assert e["eval_loss"] is not None  # the eval user read the training user's prepared split
                    await call(s, "record_verdict", {"run_id": facts["run_id"], "verdict": "PROMOTE",
                                                     "evidence": f"task accuracy {e['base_accuracy']} -> {e['task_accuracy']}"})
                facts["t_eval"] = time.monotonic() - t0

            anyio.run(lifecycle)
            exp, run_id = facts["experiment"], facts["run_id"]
            run_a = run_id.split("/")[1]
            run_b = run_a.replace("-os-roles", "-replayed")
            suite = ws.eval_dir(exp)
            # each server ran as its user: the run is the training user's, the suite, report, result and verdict the eval user's
            rd = ws.output_root / exp / run_a
            assert os.stat(rd / "adapter" / "adapter_config.json").st_uid == tr.uid
            for f in (suite / "prompts.jsonl", ws.eval_report_path(exp, run_a), ws.eval_result_path(exp, run_a),
                      ws.verdict_path(exp, run_a), ws.private_key_path):
                assert os.stat(f).st_uid == ev.uid, f
            eval_files = sorted(p for p in suite.rglob("*") if p.is_file() and ".git" not in p.relative_to(suite).parts)
            assert {suite / n for n in suite_files()} | {ws.eval_report_path(exp, run_a), ws.eval_result_path(exp, run_a)} <= set(eval_files)

            # The training user's shell. Run B: a copy of run A it makes itself, to replay A's verdict onto.
            q = lambda p: "'" + str(p) + "'"  # noqa: E731 (paths here have no quotes)
            rows: list[dict] = []
            names = {str(root): "$ROOT", exp: "$EXP", run_a: "$A", run_b: "$B"}

            def expect(what: str, shell: str, ok: bool) -> None:
                r = attempt(tr, what, shell, names)
                r["expected"] = "allowed" if ok else "refused"
                rows.append(r)

            expect("control: who am I", f"test $(id -u) = {tr.uid}", True)
            expect("control: read the public key", f"cat {q(ws.public_key_path)}", True)
            expect("control: read run A's verdict", f"cat {q(ws.verdict_path(exp, run_a))}", True)
            expect("control: copy run A to run B (own folders)", f"cp -a {q(rd)} {q(ws.output_root / exp / run_b)}", True)
            for f in eval_files:
                expect(short(f"read eval/{f.relative_to(ws.eval_root)}", names), f"cat {q(f)}", False)
            expect("list eval/", f"ls {q(ws.eval_root)}", False)
            expect("list the suite folder", f"ls {q(suite)}", False)
            expect("read the suite's git history", f"git -C {q(suite)} log -p", False)
            expect("read the suite's .git internals", f"cat {q(suite / '.git' / 'HEAD')}", False)
            expect("read the private key", f"cat {q(ws.private_key_path)}", False)
            expect("write run A's evaluation result", f"printf '{{}}' > {q(ws.eval_result_path(exp, run_a))}", False)
            expect("write a result for run B", f"printf '{{}}' > {q(ws.eval_result_path(exp, run_b))}", False)
            expect("rename eval/ away", f"mv {q(ws.eval_root)} {q(root / 'eval.old')}", False)
            expect("plant a suite at the top level", f"mkdir {q(root / 'eval2')}", False)
            expect("replace the public key", f"cp {q(ws.public_key_path)} /tmp/pub.$$ && cp /tmp/pub.$$ {q(ws.public_key_path)}", False)
            expect("add a key beside it", f"touch {q(ws.keys_dir / 'other.pub')}", False)
            expect("hard-link the suite into a dataset", f"ln {q(suite / 'prompts.jsonl')} {q(ws.datasets_dir / 'planted.jsonl')}", False)
            # (fs.protected_hardlinks=1, which setup-roles requires: no link to a file the user may not write)
            expect("hard-link the private key", f"ln {q(ws.private_key_path)} {q(ws.datasets_dir / 'k')}", False)
            expect("hard-link the public key", f"ln {q(ws.public_key_path)} {q(ws.datasets_dir / 'p')}", False)
            expect("hard-link run A's verdict", f"ln {q(ws.verdict_path(exp, run_a))} {q(ws.datasets_dir / 'v')}", False)
            expect("edit run A's verdict", f"printf x >> {q(ws.verdict_path(exp, run_a))}", False)
            expect("replay run A's verdict onto run B",
                   f"mkdir -p {q(ws.verdict_dir(exp, run_b))} && cp {q(ws.verdict_path(exp, run_a))} {q(ws.verdict_path(exp, run_b))}", False)
            expect("control: plant A's verdict in run B's folder", f"cp {q(ws.verdict_path(exp, run_a))} {q(ws.output_root / exp / run_b)}/", True)

            async def export():
                async with session_as(tr, "training-engineer", root) as s:
                    r = await s.call_tool("export", {"run_id": f"{exp}/{run_b}", "format": "merged-16bit", "target_runtime": "transformers"})
                    rows.append({"attempt": "export run B (A's verdict planted in its folder)", "command": "MCP export",
                                 "rc": 1 if r.is_error else 0, "expected": "refused",
                                 "result": short(r.content[0].text.splitlines()[0], names)})
                    facts["export"] = await call(s, "export", {"run_id": run_id, "format": "merged-16bit", "target_runtime": "transformers"})

            anyio.run(export)
            wall = time.monotonic() - t0
            text = table(rows, f"training user {tr.name} (uid {tr.uid}) against the eval user {ev.name} (uid {ev.uid}); "
                               f"$ROOT={root}, $EXP={exp}, runs $A={run_a} (promoted) and $B={run_b} (its copy):")
            e = facts["eval"]
            timing = (f"task accuracy {e['base_accuracy']} (base) -> {e['task_accuracy']} (tuned, {TRAIN_STEPS} steps); "
                      f"exported {facts['export']['format']}, smoke test {'passed' if facts['export']['smoke_test']['passed'] else 'FAILED'}\n"
                      f"wall {wall:.1f} s: setup {t_setup:.1f} s, training side to a finished run {facts['t_train'] - t_setup:.1f} s, "
                      f"evaluation + verdict {facts['t_eval'] - facts['t_train']:.1f} s, attempts + exports {wall - facts['t_eval']:.1f} s")
            print(text + "\n" + timing)
            with capsys.disabled():
                print("\n" + text + "\n" + timing)

            wrong = [r for r in rows if (r["rc"] == 0) != (r["expected"] == "allowed")]
            assert not wrong, "\n" + text
            refusals = [r for r in rows if r["expected"] == "refused" and r["command"] != "MCP export"]
            assert all("Permission denied" in r["result"] or "Operation not permitted" in r["result"] for r in refusals), "\n" + text
            assert "verdict" in rows[-1]["result"].lower(), rows[-1]
            assert not ws.eval_result_path(exp, run_b).exists() and not ws.verdict_dir(exp, run_b).exists()
            assert not (root / "eval2").exists() and ws.eval_root.is_dir()
            # the lifecycle still exports: the verdict verified with the public key only, as the training user
            ex = facts["export"]
            assert ex["smoke_test"]["passed"], ex["smoke_test"]
            assert ex["exported"] and ex["artifacts"]
            assert all(os.stat(a).st_uid == tr.uid for a in ex["artifacts"]), ex["artifacts"]
            # the servers themselves kept the eval side's layout: setup-roles again finds nothing there to change
            again = setup_roles(root, ev, tr)
            assert again.returncode == 0, again.stderr
            eval_side = [line for line in again.stdout.splitlines()
                         if line.startswith(("eval/", "verdicts/", ".finetune-mcp-keys/", "mkdir ", "moved ", "NOT DONE"))]
            assert eval_side == [], again.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)
