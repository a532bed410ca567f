"""File modes both sides use: what the server's atomic writes and the jobs' outputs give the files they write.

Stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_umask() -> int:
    """The umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
