"""The wheels the GPU check carries to a machine without network: fetch, slim, bundle, reassemble, verify.

    python3 bench/gpu_wheels.py fetch DIR            download bench/gpu-wheels.txt (hash-checked), slim, build ours
    python3 bench/gpu_wheels.py bundle DIR [--max-mib 56]   split DIR/wheels into DIR/carry-N folders for the device tool
    python3 bench/gpu_wheels.py assemble DEST SRC...  gather wheels and parts from SRC folders into DEST, verify sha256
    python3 bench/gpu_wheels.py files DIR ENV         the wheel paths one environment (server | unsloth) installs
    python3 bench/gpu_wheels.py resolve DIR           offline: pip resolves every env's wheels for cp312 x86_64

Runs on the standard library alone: on the GPU box it runs before anything is installed. The list's
format is documented at the top of bench/gpu-wheels.txt. Two wheels are slimmed (bitsandbytes keeps
only its CUDA 13 and CPU libraries, unsloth drops its web UI): the device tool moves at most 64 MiB
per call, and those two are 68 MiB as published. A slimmed wheel keeps its version and gets the build
tag `1slim` in its file name, with its RECORD rewritten, so pip installs it as that version.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LIST = HERE / "gpu-wheels.txt"
MANIFEST = "manifest.json"
ENVS = ("server", "unsloth")
PY = "3.12"
# pip matches manylinux tags exactly: name every glibc level a listed wheel was published for.
PLATFORMS = {
    "x86_64": ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
               "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
               "manylinux1_x86_64"],
}
SLIM_TAG = "1slim"


class ListError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    name: str
    version: str
    envs: tuple[str, ...]
    sha256: str
    slim: str | None  # "drop=<regex>": archive members matching it are left out
    why: str
    line: int

    @property
    def norm(self) -> str:
        return re.sub(r"[-_.]+", "_", self.name).lower()


def parse_list(path: Path = LIST) -> list[Entry]:
    """The pinned wheels of gpu-wheels.txt; every bad line is named with its number and the fix."""
    entries, errors, seen = [], [], set()
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        body, _, why = raw.partition("#")
        if not body.strip():
            continue
        cols = body.split()
        if len(cols) != 4:
            errors.append(f"{path}:{n}: expected 4 columns (name==version envs sha256:HEX slim|-), got {len(cols)}")
            continue
        req, envs, sha, slim = cols
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", req)
        if not m:
            errors.append(f"{path}:{n}: {req!r} is not an exact pin (write name==version)")
            continue
        env_t = ENVS if envs == "both" else (envs,)
        if any(e not in ENVS for e in env_t):
            errors.append(f"{path}:{n}: env {envs!r} is not one of server, unsloth, both")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", sha):
            errors.append(f"{path}:{n}: {sha!r} is not sha256:<64 hex digits> (the hash of the published wheel)")
        if slim != "-" and not slim.startswith("drop="):
            errors.append(f"{path}:{n}: slim rule {slim!r} must be '-' or drop=<regex of archive paths>")
        e = Entry(m.group(1), m.group(2), env_t, sha.removeprefix("sha256:"), None if slim == "-" else slim[5:], why.strip(), n)
        for env in env_t:
            if (e.norm, env) in seen:
                errors.append(f"{path}:{n}: {e.name} is listed twice for env {env}; one version per environment")
            seen.add((e.norm, env))
        entries.append(e)
    if errors:
        raise ListError("\n".join(errors))
    return entries


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def wheel_parts(filename: str) -> tuple[str, str]:
    """(normalised name, version) from a wheel file name."""
    name, version = filename.split("-")[:2]
    return re.sub(r"[-_.]+", "_", name).lower(), version


def pip_platform_args(arch: str = "x86_64", py: str = PY) -> list[str]:
    args = ["--python-version", py, "--implementation", "cp", "--abi", "cp" + py.replace(".", ""), "--only-binary=:all:"]
    for p in PLATFORMS[arch]:
        args += ["--platform", p]
    return args


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim_wheel(src: Path, dest_dir: Path, drop: str) -> Path:
    """A copy of the wheel without the members matching `drop`, RECORD rewritten, build tag 1slim."""
    rx = re.compile(drop)
    parts = src.name[:-4].split("-")
    if len(parts) != 5:
        raise ListError(f"{src.name}: a wheel that already has a build tag cannot be slimmed")
    out = dest_dir / ("-".join(parts[:2] + [SLIM_TAG] + parts[2:]) + ".whl")
    tmp = out.with_name(out.name + ".partial")
    kept, dropped = [], 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if info.filename == record_name:
                continue
            if rx.search(info.filename):
                dropped += 1
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/WHEEL"):
                text = re.sub(r"(?m)^Build:.*\n", "", data.decode())
                data = (text.rstrip("\n") + f"\nBuild: {SLIM_TAG}\n").encode()
            zout.writestr(info, data)
            kept.append((info.filename, _record_hash(data), len(data)))
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        for row in kept:
            w.writerow(row)
        w.writerow((record_name, "", ""))
        zout.writestr(record_name, buf.getvalue())
    if not dropped:
        tmp.unlink()
        raise ListError(f"{src.name}: the slim rule {drop!r} matches nothing; fix the rule in {LIST.name}")
    os.replace(tmp, out)
    return out


def _groups(entries: list[Entry]) -> list[list[Entry]]:
    """Download groups in which every name appears once (pip refuses two pins of one name in one call)."""
    groups: list[list[Entry]] = []
    for e in entries:
        for g in groups:
            if all(x.norm != e.norm for x in g):
                g.append(e)
                break
        else:
            groups.append([e])
    return groups


def fetch(dest: Path, entries: list[Entry], arch: str = "x86_64", own: bool = True, sim_python: str | None = None) -> dict:
    """Download every listed wheel (hashes required), slim the marked ones, build ours, write the manifest.

    sim_python (e.g. "3.11") fetches the same pins built for another Python, without the hash check (the
    published hashes are the cp312 files'): only for rehearsing the install on a CPU machine that lacks 3.12.
    """
    py = sim_python or PY
    pypi, wheels = dest / "pypi", dest / "wheels"
    pypi.mkdir(parents=True, exist_ok=True)
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    for group in _groups(entries):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
            for e in group:
                req.write(f"{e.name}=={e.version}" + ("" if sim_python else f" --hash=sha256:{e.sha256}") + "\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(pypi), *pip_platform_args(arch, py), "-r", req.name]
        if not sim_python:
            cmd.insert(5, "--require-hashes")
        p = subprocess.run(cmd, capture_output=True, text=True)
        os.unlink(req.name)
        if p.returncode:
            raise SystemExit(f"pip download failed ({' '.join(cmd)}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    by_hash = {sha256_file(p): p for p in pypi.glob("*.whl")}
    tag = "cp" + py.replace(".", "")
    by_pin = {wheel_parts(p.name): p for p in sorted(pypi.glob("*.whl"), key=lambda p: (tag not in p.name, p.name))}
    rows = []
    for e in entries:
        src = by_pin.get((e.norm, e.version)) if sim_python else by_hash.get(e.sha256)
        if src is None:
            raise SystemExit(f"{LIST}:{e.line}: no downloaded wheel has sha256 {e.sha256} ({e.name}=={e.version})")
        out = slim_wheel(src, wheels, e.slim) if e.slim else Path(shutil.copy2(src, wheels / src.name))
        rows.append(manifest_row(out, e.name, e.version, e.envs, published=src, slim=e.slim))
    if own:
        rows.append(build_own_wheel(wheels))
    return write_manifest(wheels, rows, arch, py)


def manifest_row(path: Path, name: str, version: str, envs, published: Path | None = None, slim: str | None = None) -> dict:
    """One wheel of the manifest: the file that gets installed, and the published one it came from."""
    return {"file": path.name, "name": name, "version": version, "envs": list(envs), "sha256": sha256_file(path),
            "bytes": path.stat().st_size, "published_sha256": sha256_file(published) if published else None,
            "published_bytes": published.stat().st_size if published else None, "slim": slim}


def write_manifest(wheels: Path, rows: list[dict], arch: str = "x86_64", py: str = PY) -> dict:
    manifest = {"format": "finetune-mcp/gpu-wheels@1", "python": py, "arch": arch, "wheels": rows,
                "total_bytes": sum(r["bytes"] for r in rows),
                "published_total_bytes": sum(r.get("published_bytes") or r["bytes"] for r in rows)}
    tmp = wheels / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, wheels / MANIFEST)
    return manifest


def build_own_wheel(dest: Path) -> dict:
    """finetune-mcp's own wheel, built from this checkout (not pinned by hash: it is whatever is committed here)."""
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, str(REPO)], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"building finetune-mcp's wheel failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        (built,) = Path(tmp).glob("finetune_mcp-*.whl")
        out = Path(shutil.copy2(built, dest / built.name))
    return manifest_row(out, "finetune-mcp", wheel_parts(out.name)[1], ["server"])


def bundle(dest: Path, max_mib: float) -> list[Path]:
    """Split DIR/wheels into DIR/carry-1..N, each at most max_mib (files larger than that go in numbered parts)."""
    wheels = dest / "wheels"
    manifest = json.loads((wheels / MANIFEST).read_text())
    limit = int(max_mib * 2**20)
    for old in dest.glob("carry-*"):
        shutil.rmtree(old)
    pieces: list[tuple[str, Path, int, int]] = []  # (name in the bundle, source, offset, length)
    for r in manifest["wheels"]:
        src = wheels / r["file"]
        size = src.stat().st_size
        if size <= limit:
            pieces.append((r["file"], src, 0, size))
        else:
            for i, off in enumerate(range(0, size, limit)):
                pieces.append((f"{r['file']}.part-{i:02d}", src, off, min(limit, size - off)))
    bins: list[list[tuple[str, Path, int, int]]] = []
    loads: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p[3]):  # first fit, largest first
        for i, load in enumerate(loads):
            if load + piece[3] <= limit:
                bins[i].append(piece)
                loads[i] += piece[3]
                break
        else:
            bins.append([piece])
            loads.append(piece[3])
    out = []
    for i, items in enumerate(bins, 1):
        d = dest / f"carry-{i}"
        d.mkdir()
        for name, src, off, length in items:
            with open(src, "rb") as f, open(d / name, "wb") as g:
                f.seek(off)
                g.write(f.read(length))
        (d / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        out.append(d)
    return out


def assemble(dest: Path, sources: list[Path]) -> dict:
    """Wheels and parts from the source folders into dest, checked against the manifest. Returns a report."""
    dest.mkdir(parents=True, exist_ok=True)
    manifest = None
    for s in sources:
        if (s / MANIFEST).is_file():
            manifest = json.loads((s / MANIFEST).read_text())
            break
    if manifest is None:
        return {"ok": False, "problems": [f"no {MANIFEST} in any of {', '.join(map(str, sources)) or '(none)'}"], "wheels": []}
    problems, done = [], []
    for r in manifest["wheels"]:
        target = dest / r["file"]
        whole = [s / r["file"] for s in sources if (s / r["file"]).is_file()]
        parts = sorted((p for s in sources for p in s.glob(r["file"] + ".part-*")), key=lambda p: p.name)
        if not (target.is_file() and sha256_file(target) == r["sha256"]):
            if whole:
                shutil.copyfile(whole[0], target)
            elif parts:
                seen: dict[str, Path] = {}
                for p in parts:  # the same part may sit in the stash and in a fresh carry folder
                    seen.setdefault(p.name, p)
                numbers = sorted(int(n.rsplit("-", 1)[1]) for n in seen)
                if numbers != list(range(len(numbers))):
                    problems.append(f"{r['file']}: only parts {numbers} are here, not 00..{max(numbers):02d} in a row: a carry bundle is missing")
                    continue
                partial = target.with_name(target.name + ".partial")
                with open(partial, "wb") as g:
                    for name in sorted(seen):
                        g.write(seen[name].read_bytes())
                os.replace(partial, target)
            else:
                problems.append(f"{r['file']}: not in any carry folder (was a carry-N call skipped?)")
                continue
        got = sha256_file(target)
        if got != r["sha256"]:
            problems.append(f"{r['file']}: sha256 {got[:12]}… is not the manifest's {r['sha256'][:12]}…: a part is missing or damaged")
            target.unlink()
            continue
        done.append(r["file"])
    shutil.copyfile(next(s / MANIFEST for s in sources if (s / MANIFEST).is_file()), dest / MANIFEST)
    return {"ok": not problems, "problems": problems, "wheels": done, "total_bytes": manifest["total_bytes"]}


def env_files(wheels: Path, env: str) -> list[Path]:
    manifest = json.loads((wheels / MANIFEST).read_text())
    return [wheels / r["file"] for r in manifest["wheels"] if env in r["envs"]]


def resolve(wheels: Path, arch: str = "x86_64") -> dict:
    """pip, offline, resolves each environment's wheels for the manifest's Python on arch: every file there, of the right tags."""
    out = {}
    py = json.loads((wheels / MANIFEST).read_text()).get("python", PY)
    for env in ENVS:
        files = env_files(wheels, env)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps", "--ignore-installed",
                   "--target", tmp, *pip_platform_args(arch, py), *map(str, files)]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""})
        out[env] = {"ok": p.returncode == 0, "wheels": len(files), "tail": (p.stdout + p.stderr)[-1500:]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("dir", type=Path)
    f.add_argument("--arch", default="x86_64", choices=sorted(PLATFORMS))
    f.add_argument("--list", type=Path, default=LIST)
    f.add_argument("--sim-python", help="rehearsal only: the same pins for another Python (no hash check), e.g. 3.11")
    b = sub.add_parser("bundle")
    b.add_argument("dir", type=Path)
    b.add_argument("--max-mib", type=float, default=56.0)
    a = sub.add_parser("assemble")
    a.add_argument("dest", type=Path)
    a.add_argument("sources", type=Path, nargs="+")
    e = sub.add_parser("files")
    e.add_argument("dir", type=Path)
    e.add_argument("env", choices=ENVS)
    r = sub.add_parser("resolve")
    r.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        try:
            entries = parse_list(args.list)
        except ListError as err:
            print(err, file=sys.stderr)
            return 2
        m = fetch(args.dir, entries, args.arch, sim_python=args.sim_python)
        for row in sorted(m["wheels"], key=lambda r: -r["bytes"]):
            pub = f" (published {row['published_bytes'] / 2**20:.2f})" if row["slim"] else ""
            print(f"{row['bytes'] / 2**20:8.2f} MiB  {row['file']}{pub}")
        print(f"{m['total_bytes'] / 2**20:8.2f} MiB  total, {len(m['wheels'])} wheels "
              f"(as published: {m['published_total_bytes'] / 2**20:.2f} MiB)")
    elif args.cmd == "bundle":
        for d in bundle(args.dir, args.max_mib):
            size = sum(p.stat().st_size for p in d.iterdir())
            print(f"{d}: {size / 2**20:.2f} MiB, {len(list(d.iterdir())) - 1} files")
    elif args.cmd == "assemble":
        rep = assemble(args.dest, [s for s in args.sources if s.is_dir()])
        print(json.dumps(rep, indent=2))
        return 0 if rep["ok"] else 1
    elif args.cmd == "files":
        print("\n".join(map(str, env_files(args.dir, args.env))))
    elif args.cmd == "resolve":
        rep = resolve(args.dir)
        print(json.dumps(rep, indent=2))
        return 0 if all(v["ok"] for v in rep.values()) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
