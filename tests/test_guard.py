"""The path guard, tested directly: traversal, outside paths, symlinks into eval/, prefixes, NUL, length, races,
the eval-owned places of the layout (eval/, keys, verdicts), git internals and hard links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from finetune_mcp.common.errors import BadInput, Forbidden
from finetune_mcp.guard import Guard, glob_match, load_policy
from finetune_mcp.workspace import Workspace


@pytest.fixture
def setup(tmp_path):
    root = tmp_path / "dgx"
    exp = root / "experiments" / "trainings" / "m-SFT-t"
    (exp / "eval").mkdir(parents=True)
    (exp / "eval2").mkdir()
    (exp / "eval" / "goldens.jsonl").write_text("{}\n")
    (exp / "configs").mkdir()
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    ws = Workspace(root=root, output_root=root / "outputs" / "trainings")
    (ws.eval_dir("m-SFT-t") / "results").mkdir(parents=True)
    (ws.eval_dir("m-SFT-t") / "prompts.jsonl").write_text('{"prompt": "p", "expected": "e"}\n')
    train = Guard(load_policy("training-engineer"), ws, [data])
    evalg = Guard(load_policy("eval-engineer"), ws, [data])
    return root, exp, data, train, evalg, tmp_path


def test_inside_paths_allowed(setup):
    root, exp, data, g, _, _ = setup
    assert g.check_write(exp / "configs" / "run-a.yaml") == (exp / "configs" / "run-a.yaml").resolve()
    assert g.check_read(data / "train.jsonl") == (data / "train.jsonl").resolve()


def test_dotdot_traversal_refused(setup):
    root, exp, data, g, _, _ = setup
    with pytest.raises(Forbidden, match="outside the allowed roots"):
        g.check_read(str(exp / ".." / ".." / ".." / ".." / "etc" / "passwd"))
    with pytest.raises(Forbidden):
        g.check_read(str(exp / "configs" / ".." / "eval" / "goldens.jsonl"))


def test_absolute_outside_refused(setup):
    g = setup[3]
    with pytest.raises(Forbidden, match="outside the allowed roots"):
        g.check_read("/etc/passwd")
    with pytest.raises(Forbidden, match="--data-dir"):
        g.check_read("/etc/passwd")


def test_data_dirs_are_read_only(setup):
    root, exp, data, g, _, _ = setup
    with pytest.raises(Forbidden, match="not writable"):
        g.check_write(data / "new.jsonl")


def test_eval_refused_for_training_role(setup):
    root, exp, data, g, ev, _ = setup
    suite = root / "eval" / "m-SFT-t"
    legacy = [exp / "eval", exp / "eval" / "goldens.jsonl", exp / "eval" / "new.jsonl"]  # a suite left inside the experiment
    for p in legacy + [root / "eval", suite, suite / "prompts.jsonl", suite / "results" / "20260101-0000-a.json", suite / "reports" / "x.md",
                       root / ".finetune-mcp-keys" / "verdict-ed25519.key", "eval/m-SFT-t/prompts.jsonl"]:
        with pytest.raises(Forbidden, match="training-engineer role may not"):
            g.check_read(p)
        with pytest.raises(Forbidden):
            g.check_write(p)
    # the eval role writes its own places, never one inside a training-owned folder (a legacy suite included)
    assert ev.check_write(suite / "new.jsonl") and ev.check_write(suite / "results" / "20260101-0000-a.json")
    with pytest.raises(Forbidden, match="eval-engineer role writes only"):
        ev.check_write(exp / "eval" / "new.jsonl")


def test_promotion_report_refused_anywhere(setup):
    root, exp, data, g, ev, _ = setup
    run = root / "outputs" / "trainings" / "m-SFT-t" / "20260101-0000-a"
    run.mkdir(parents=True)
    verdict = root / "verdicts" / "m-SFT-t" / "20260101-0000-a" / "promotion-report.md"
    verdict.parent.mkdir(parents=True)
    verdict.write_text("signed")
    for p in (run / "promotion-report.md", verdict, verdict.parent / "other.md", root / "verdicts"):
        with pytest.raises(Forbidden, match="may not write"):
            g.check_write(p)
    with pytest.raises(Forbidden):
        g.write_text(run / "promotion-report.md", "PROMOTE")
    assert not (run / "promotion-report.md").exists()
    # the verdict is readable (export verifies it); the eval role writes it in verdicts/ only, not in the run folder
    assert g.check_read(verdict) == verdict.resolve()
    assert ev.check_write(verdict)
    with pytest.raises(Forbidden, match="eval-engineer role writes only"):
        ev.check_write(run / "promotion-report.md")


def test_git_internals_refused_for_training_role(setup):
    """A repository's objects hold every file it ever had: no tool of the training role reads or writes them."""
    root, exp, data, g, ev, _ = setup
    git = root / "experiments" / ".git"
    (git / "objects" / "ab").mkdir(parents=True)
    (git / "objects" / "ab" / "cdef").write_bytes(b"x")
    for p in (git, git / "objects" / "ab" / "cdef", git / "config", root / "eval" / "m-SFT-t" / ".git" / "HEAD", exp / ".git"):
        with pytest.raises(Forbidden, match=r"policy: \*\*/\.git|policy: eval"):
            g.check_read(p)
        with pytest.raises(Forbidden):
            g.check_write(p)
    with pytest.raises(Forbidden, match=r"policy: \*\*/\.git"):
        ev.check_write(root / "eval" / "m-SFT-t" / ".git" / "config")
    assert g.check_read(exp / "configs")  # .github, .gitignore and the like are not git internals
    assert g.check_write(exp / ".gitignore") and g.check_write(exp / ".github" / "x.yml")


def test_hard_link_refused_in_reads_and_writes(setup):
    """A second name of the suite, planted where the training role may look, is refused whatever its path, saying why."""
    root, exp, data, g, ev, _ = setup
    suite = root / "eval" / "m-SFT-t" / "prompts.jsonl"
    planted = data / "innocent.jsonl"
    os.link(suite, planted)
    with pytest.raises(Forbidden, match=r"is a hard link: the file has 2 names \(st_nlink 2\)") as e:
        g.check_read(planted)
    assert "another name of the same file may lie where the training-engineer role may not look" in str(e.value)
    assert "cp FILE COPY" in e.value.fix
    with pytest.raises(Forbidden, match="is a hard link"):
        g.read_bytes(planted)
    inside = exp / "configs" / "run.yaml"
    os.link(suite, inside)
    with pytest.raises(Forbidden, match="is a hard link"):
        g.check_write(inside)
    # a folder that is read is refused when a file below it has another name
    with pytest.raises(Forbidden, match=r"holds a hard link: .*innocent.jsonl has 3 names"):
        g.check_read(data)
    # every role: the eval role is refused the same file
    with pytest.raises(Forbidden, match="is a hard link"):
        ev.check_read(suite)
    # an ordinary copy is fine, and so is the folder once the extra names are gone
    planted.unlink()
    inside.unlink()
    (data / "copy.jsonl").write_bytes(suite.read_bytes())
    assert g.check_read(data / "copy.jsonl") and g.check_read(data)


def test_hard_link_made_between_check_and_read_is_refused(setup, monkeypatch):
    root, exp, data, g, _, _ = setup
    f = data / "train.jsonl"
    real_check = g.check_read

    def racing_check(path, what="path"):
        r = real_check(path, what)
        os.link(root / "eval" / "m-SFT-t" / "prompts.jsonl", data / "swap.jsonl")
        os.replace(data / "swap.jsonl", f)
        return r

    monkeypatch.setattr(g, "check_read", racing_check)
    with pytest.raises(Forbidden, match="is a hard link"):
        g.read_bytes(f)


def test_symlink_into_eval_refused(setup):
    root, exp, data, g, _, _ = setup
    link = exp / "configs" / "innocent.jsonl"
    link.symlink_to(exp / "eval" / "goldens.jsonl")
    with pytest.raises(Forbidden):
        g.check_read(link)
    with pytest.raises(Forbidden):
        g.check_write(link)
    # a new file below a symlinked directory is judged through its resolved parent
    dlink = exp / "configs" / "d"
    dlink.symlink_to(exp / "eval", target_is_directory=True)
    with pytest.raises(Forbidden):
        g.check_write(dlink / "planted.jsonl")


def test_chain_of_symlinked_directories(setup):
    root, exp, data, g, _, tmp = setup
    a = exp / "a"
    b = root / "b"
    a.symlink_to(b, target_is_directory=True)
    b.symlink_to(exp / "eval", target_is_directory=True)
    with pytest.raises(Forbidden):
        g.check_read(a / "goldens.jsonl")
    # and a chain that leaves the allowed roots
    out = tmp / "outside"
    out.mkdir()
    (exp / "c").symlink_to(out, target_is_directory=True)
    with pytest.raises(Forbidden, match="outside"):
        g.check_read(exp / "c" / "x")


def test_sibling_prefix_is_not_inside(setup):
    root, exp, data, g, _, tmp = setup
    assert g.check_write(exp / "eval2" / "ok.txt")  # eval2/ is not eval/
    sibling = tmp / "dgx2"  # /x/dgx2 is not inside /x/dgx
    sibling.mkdir()
    with pytest.raises(Forbidden):
        g.check_read(sibling / "f")
    assert glob_match(("eval2", "x"), "**/eval/**") is False
    assert glob_match(("a", "eval", "x"), "**/eval/**") is True


def test_nul_and_overlong(setup):
    g = setup[3]
    with pytest.raises(BadInput, match="NUL"):
        g.check_read("a\x00b")
    with pytest.raises(BadInput, match="longer"):
        g.check_read("x" * 5000)
    with pytest.raises(BadInput, match="longer"):
        g.check_read("/tmp/" + "y" * 300)


def test_symlink_planted_after_check_is_not_followed(setup):
    root, exp, data, g, _, _ = setup
    target = exp / "configs" / "run-x.yaml"
    assert g.check_write(target)  # passes: nothing there yet
    # an attacker plants a link at the checked path, pointing into eval/
    target.symlink_to(exp / "eval" / "goldens.jsonl")
    before = (exp / "eval" / "goldens.jsonl").read_text()
    # the write re-checks and refuses; and an exclusive create never follows the link
    with pytest.raises(Forbidden):
        g.write_text(target, "lr: 1\n")
    with pytest.raises(Forbidden):
        g.create_exclusive(target, b"x")
    assert (exp / "eval" / "goldens.jsonl").read_text() == before


def test_atomic_write_replaces_a_raced_link_instead_of_writing_through(setup, monkeypatch):
    """Race the last moment: the link appears between the guard's check and the rename."""
    import finetune_mcp.guard as guard_mod

    root, exp, data, g, _, _ = setup
    target = exp / "configs" / "run-y.yaml"
    real_check = g.check_write

    def racing_check(path, what="path"):
        r = real_check(path, what)
        target.symlink_to(exp / "eval" / "goldens.jsonl")
        return r

    monkeypatch.setattr(g, "check_write", racing_check)
    before = (exp / "eval" / "goldens.jsonl").read_text()
    g.write_text(target, "lr: 1\n")
    assert (exp / "eval" / "goldens.jsonl").read_text() == before
    assert not target.is_symlink() and target.read_text() == "lr: 1\n"


def test_unknown_key_in_policy_gets_did_you_mean(tmp_path):
    (tmp_path / "x.yaml").write_text("role: x\nsummary: s\nprompt: x.md\ntools: []\nwrite_denny: []\n")
    with pytest.raises(BadInput, match="did you mean 'write_deny'"):
        load_policy("x", tmp_path)
    with pytest.raises(BadInput, match="unknown role 'traning-engineer'.*did you mean 'training-engineer'"):
        load_policy("traning-engineer")
