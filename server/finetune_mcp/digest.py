"""The adapter digest: one sha256 over a folder's files, so a verdict binds exactly the adapter it judged.

Algorithm (train.py carries a copy, since it must stay standalone): for each file under the
folder except DIGEST, sorted by POSIX relative path, feed `relpath NUL sha256hex LF`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

DIGEST_FILE = "DIGEST"


def file_sha256(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def folder_digest(folder: Path) -> str:
    folder = Path(folder)
    h = hashlib.sha256()
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != DIGEST_FILE)
    for p in files:
        rel = p.relative_to(folder).as_posix()
        h.update(rel.encode() + b"\0" + file_sha256(p).encode() + b"\n")
    return h.hexdigest()


def verify_folder(folder: Path) -> tuple[bool, str, str | None]:
    """(ok, actual digest, recorded digest) — ok when DIGEST exists and matches the files."""
    actual = folder_digest(folder)
    rec_path = Path(folder) / DIGEST_FILE
    recorded = rec_path.read_text().strip() if rec_path.is_file() else None
    return (recorded == actual, actual, recorded)
