"""The progress reader: a run's records by byte cursor, with a per-server cache, a bounded backward scan and the anomaly rules.

The cursor is a byte offset into the run's record source, always at a line boundary. The source is
logs/progress.jsonl (written by our train.py); a run whose train.py never writes that file (a
hand-written script without our callback) is read from logs/stdout.log instead, where the trainer
prints its log dicts. The source of a run never changes: while a train.py that writes progress.jsonl
has not created it yet, reads return nothing and keep the cursor at 0. A partial last line (the
trainer is mid-write) is not consumed; a read covers only the bytes after the cursor, plus a bounded
look-back of at most the spike window when this server has not seen the run before. The trainer's
printed dicts carry no step: from stdout.log, the n-th record is step n x logging_steps
(run_state.logging_every), and mem_gb / temp_c are null.

Beside the records, throughput() reads the tail of logs/log_history.jsonl (every trainer log with its
wall-clock time) for tokens/s and the time left.
"""

from __future__ import annotations

import ast
import collections
import json
import math
import os
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import BadInput
from finetune_mcp.domain.run_state import config_value, logging_every

RECORD_KEYS = ("step", "loss", "lr", "mem_gb", "temp_c")
# A loss spike is what triage calls one (dgx-spark-ops failure-signals table, `records`: above
# spike_factor x the median of the previous spike_window finite losses, once spike_min_history of them
# exist, and at least spike_abs_min above it), so a poll and a later triage of the same run agree on
# what a spike is. A poll flags it when it happens; triage, reading the log afterwards, calls it a
# divergence only if the loss did not come back within spike_recover_logs. A live run with no new record for
# FINETUNE_MCP_STALL_MINUTES (default 10) has stalled.
STALL_MINUTES_DEFAULT = 10.0
_CHUNK = 1 << 16


def _num(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError("boolean")
    return float(v)


def normalise_record(d: Any) -> dict | None:
    """Exactly {"step","loss","lr","mem_gb","temp_c"} in that order, or None for a line that is not a record."""
    if not isinstance(d, dict) or "step" not in d or "loss" not in d or "lr" not in d:
        return None
    try:
        step = int(d["step"])
        loss = _num(d["loss"])
        lr = _num(d["lr"])
        mem = _num(d.get("mem_gb"))
        temp = _num(d.get("temp_c"))
    except (TypeError, ValueError):
        return None
    if loss is None or lr is None:
        return None
    return {"step": step, "loss": loss, "lr": lr, "mem_gb": mem, "temp_c": temp}


def parse_progress_line(line: bytes) -> dict | None:
    line = line.strip()
    if not line:
        return None
    try:
        return normalise_record(json.loads(line))
    except (ValueError, UnicodeDecodeError):
        return None


_LOG_DICT = re.compile(r"\{'loss': [^{}]*\}")


def parse_stdout_line(line: bytes) -> dict | None:
    """A trainer log dict as printed by transformers (PrinterCallback / ProgressCallback), without its step."""
    if b"'loss'" not in line:
        return None
    text = line.decode("utf-8", "replace")
    for m in reversed(list(_LOG_DICT.finditer(text))):
        try:
            d = ast.literal_eval(m.group(0))
        except (ValueError, SyntaxError):
            continue
        if isinstance(d, dict) and "learning_rate" in d:
            try:
                return {"loss": float(d["loss"]), "lr": float(d["learning_rate"])}
            except (TypeError, ValueError):
                return None
    return None


@dataclass
class Source:
    kind: str  # "progress" | "stdout"
    path: Path


_WRITES_PROGRESS: dict[str, bool] = {}


def record_source(run_dir: Path) -> Source | None:
    prog = run_dir / "logs" / "progress.jsonl"
    if prog.exists():
        return Source("progress", prog)
    key = str(run_dir)
    if key not in _WRITES_PROGRESS:
        try:
            _WRITES_PROGRESS[key] = b"progress.jsonl" in (run_dir / "train.py").read_bytes()
        except OSError:
            _WRITES_PROGRESS[key] = True
    if _WRITES_PROGRESS[key]:
        return None
    out = run_dir / "logs" / "stdout.log"
    return Source("stdout", out) if out.exists() else None


@dataclass
class _Cache:
    """What one server remembers of a run's source between reads (a pure speed-up: never required)."""

    ino: int
    offset: int
    window: collections.deque = field(default_factory=collections.deque)
    ordinal: int = 0  # stdout source: records before offset
    last: dict | None = None  # the newest record before offset


_CACHE: dict[str, _Cache] = {}
_CACHE_LOCK = threading.Lock()


def lines_forward(f, start: int, limit_records: int, parse) -> tuple[list[tuple[int, dict]], int, bool, int]:
    """Parse complete lines from `start` until limit_records records; returns (records with end offsets, next offset, more, lines seen)."""
    f.seek(start)
    out: list[tuple[int, dict]] = []
    pos = start
    buf = b""
    lines = 0
    eof = False
    while len(out) < limit_records and not eof:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        buf += chunk
        i = 0
        while len(out) < limit_records:
            nl = buf.find(b"\n", i)
            if nl < 0:
                break
            rec = parse(buf[i:nl])
            lines += 1
            pos += nl + 1 - i
            i = nl + 1
            if rec is not None:
                out.append((pos, rec))
        buf = buf[i:]
    more = False
    if len(out) >= limit_records:
        # Are there further records past `pos`? Look for one more complete line that parses.
        f.seek(pos)
        rest = b""
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            rest += chunk
            j = 0
            while (nl := rest.find(b"\n", j)) >= 0:
                if parse(rest[j:nl]) is not None:
                    more = True
                    break
                j = nl + 1
            if more:
                break
            rest = rest[j:]
    return out, pos, more, lines


def records_backward(f, end: int, want: int, parse, max_bytes: int = 8 << 20) -> list[dict]:
    """Up to `want` records from complete lines ending at or before `end`, oldest first (bounded read)."""
    found: list[dict] = []
    pos = end
    tail = b""
    scanned = 0
    first = True
    block_size = 4096  # the last record or two usually sit in the last few kilobytes
    while pos > 0 and len(found) < want and scanned < max_bytes:
        step = min(block_size, pos)
        block_size = _CHUNK
        pos -= step
        f.seek(pos)
        block = f.read(step) + tail
        scanned += step
        lines = block.split(b"\n")
        if first:
            lines.pop()  # what follows the last newline is a line still being written, never a record yet
            first = False
        # lines[0] may be cut at the block start unless we reached the file start.
        tail = lines[0] if pos > 0 and lines else b""
        complete = lines[1:] if pos > 0 else lines
        for ln in reversed(complete):
            rec = parse(ln)
            if rec is not None:
                found.append(rec)
                if len(found) >= want:
                    break
    found.reverse()
    return found


def _check_cursor(f, cursor: int, size: int, src: Source) -> None:
    if cursor > size:
        raise BadInput(f"cursor {cursor} is past the end of {src.path.name} ({size} bytes)", where="cursor",
                       fix="pass the next_cursor of your previous poll, or 0 to read from the start")
    if cursor > 0:
        f.seek(cursor - 1)
        if f.read(1) != b"\n":
            raise BadInput(f"cursor {cursor} is not at a line boundary of {src.path.name}", where="cursor",
                           fix="pass the next_cursor of your previous poll unchanged, or 0 to read from the start")


@dataclass(frozen=True)
class SpikeRule:
    factor: float
    window: int
    min_history: int
    abs_min: float = 0.0


def spike_rule(skills) -> SpikeRule:
    r = skills.table("dgx-spark-ops", "failure-signals").records
    return SpikeRule(float(r.spike_factor), int(r.spike_window), int(r.spike_min_history), float(r.spike_abs_min))


def _anomalies(records: list[dict], window: collections.deque, rule: SpikeRule) -> list[S.Anomaly]:
    out: list[S.Anomaly] = []
    for r in records:
        loss = r["loss"]
        if math.isnan(loss):
            out.append(S.Anomaly(kind="nan-loss", step=r["step"], message=f"loss is NaN at step {r['step']}"))
            continue
        if math.isinf(loss):
            out.append(S.Anomaly(kind="inf-loss", step=r["step"], message=f"loss is infinite at step {r['step']}"))
            continue
        if len(window) >= rule.min_history:
            med = statistics.median(window)
            if med > 0 and loss > rule.factor * med and loss - med >= rule.abs_min:
                out.append(S.Anomaly(kind="loss-spike", step=r["step"],
                                     message=f"loss {loss:.4g} at step {r['step']} is {loss / med:.1f}x the running median {med:.4g} "
                                             f"of the previous {len(window)} records"))
        window.append(loss)
    return out


def stall_minutes() -> float:
    try:
        return float(os.environ.get("FINETUNE_MCP_STALL_MINUTES") or STALL_MINUTES_DEFAULT)
    except ValueError:
        return STALL_MINUTES_DEFAULT


def count_records(f, end: int, parse) -> int:
    n = 0
    f.seek(0)
    pos = 0
    buf = b""
    while pos < end:
        chunk = f.read(min(_CHUNK, end - pos))
        if not chunk:
            break
        pos += len(chunk)
        buf += chunk
        *lines, buf = buf.split(b"\n")
        n += sum(1 for ln in lines if parse(ln) is not None)
    return n




# ---------------------------------------------------------------- one read


@dataclass
class Reading:
    """What one read of a run's records found."""

    src: Source | None
    records: list[dict]
    last: dict | None  # the newest complete record in the source, read or not
    next_cursor: int
    more: bool
    anomalies: list[S.Anomaly]
    mtime: float | None  # of the source: when a record was last written


def _stdout_record(step: int, r: dict) -> dict:
    return {"step": step, "loss": r["loss"], "lr": r["lr"], "mem_gb": None, "temp_c": None}


def read(run_dir: Path, cursor: int, limit: int, rule: SpikeRule) -> Reading:
    """Records after `cursor` (at most `limit`), the newest record, and the anomalies among the new records."""
    if cursor < 0:
        raise BadInput("cursor must be 0 or more", where="cursor", fix="pass 0, or the next_cursor of your previous poll")
    if limit < 1:
        raise BadInput("limit must be at least 1", where="limit")
    src = record_source(run_dir)
    if src is None:
        if cursor:
            raise BadInput(f"cursor {cursor} given but {run_dir.parent.name}/{run_dir.name} has no records yet", where="cursor",
                           fix="poll with cursor 0")
        return Reading(None, [], None, 0, False, [], None)
    parse = parse_progress_line if src.kind == "progress" else parse_stdout_line
    every = logging_every(run_dir) if src.kind == "stdout" else 1
    last: dict | None = None
    with open(src.path, "rb") as f:
        st = os.fstat(f.fileno())
        _check_cursor(f, cursor, st.st_size, src)
        key = str(src.path)
        with _CACHE_LOCK:
            # Taken out while in use, so two concurrent reads never share one window.
            c = _CACHE.pop(key, None)
        cold = c is None or c.ino != st.st_ino or c.offset != cursor or c.window.maxlen != rule.window
        if cold:
            c = _Cache(st.st_ino, cursor, collections.deque(maxlen=rule.window))
        if cold and cursor > 0:
            # A server that has not followed this run looks back a bounded amount for the spike window.
            prev = records_backward(f, cursor, rule.window, parse)
            c.window.extend(r["loss"] for r in prev if math.isfinite(r["loss"]))
            if src.kind == "stdout":
                c.ordinal = count_records(f, cursor, parse)
                c.last = _stdout_record(c.ordinal * every, prev[-1]) if prev else None
            else:
                c.last = prev[-1] if prev else None
        got, next_cursor, more, _ = lines_forward(f, cursor, limit, parse)
        records = [r for _, r in got]
        if src.kind == "stdout":
            records = [_stdout_record((c.ordinal + i + 1) * every, r) for i, r in enumerate(records)]
            c.ordinal += len(records)
        anomalies = _anomalies(records, c.window, rule)
        c.offset = next_cursor
        if records:
            c.last = records[-1]
        with _CACHE_LOCK:
            _CACHE[key] = c
        if not more:
            last = c.last  # nothing newer is complete past next_cursor
        else:
            tail = records_backward(f, st.st_size, 1, parse)
            if tail:
                last = tail[-1]
                if src.kind == "stdout":
                    # The newest printed dict carries no step; it is the n-th of its kind.
                    last = _stdout_record(count_records(f, st.st_size, parse) * every, last)
    return Reading(src, records, last, next_cursor, more, anomalies, st.st_mtime)


def all_records(run_dir: Path) -> list[dict]:
    """Every record of the run, oldest first (for plots and comparisons; a poll reads by cursor instead)."""
    src = record_source(run_dir)
    if src is None:
        return []
    parse = parse_progress_line if src.kind == "progress" else parse_stdout_line
    with open(src.path, "rb") as f:
        got, _, _, _ = lines_forward(f, 0, 10**12, parse)
    if src.kind == "progress":
        return [r for _, r in got]
    every = logging_every(run_dir)
    return [_stdout_record((i + 1) * every, r) for i, (_, r) in enumerate(got)]


def first_record(run_dir: Path) -> dict | None:
    src = record_source(run_dir)
    if src is None:
        return None
    parse = parse_progress_line if src.kind == "progress" else parse_stdout_line
    with open(src.path, "rb") as f:
        got, _, _, _ = lines_forward(f, 0, 1, parse)
    if not got:
        return None
    r = got[0][1]
    return r if src.kind == "progress" else _stdout_record(logging_every(run_dir), r)


# ---------------------------------------------------------------- throughput


TOKEN_KEYS = ("num_tokens", "num_input_tokens_seen")  # TRL's running count, else transformers' own
THROUGHPUT_WINDOW = 20  # trainer logs the rates are taken over: recent enough to follow a change of pace


@dataclass
class Throughput:
    tokens_per_s: float | None
    steps_per_s: float | None
    eta_s: float | None


def _history_tail(run_dir: Path, want: int) -> list[dict]:
    path = run_dir / "logs" / "log_history.jsonl"
    try:
        f = open(path, "rb")
    except OSError:
        return []

    def parse(line: bytes) -> dict | None:
        try:
            d = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return None
        ok = isinstance(d, dict) and "loss" in d and isinstance(d.get("time"), (int, float)) and isinstance(d.get("step"), int)
        return d if ok else None  # training logs only: eval results and the closing summary repeat a step

    with f:
        return records_backward(f, os.fstat(f.fileno()).st_size, want, parse, max_bytes=1 << 20)


@dataclass(frozen=True)
class _Pace:
    tokens_per_s: float | None
    steps_per_s: float | None
    newest_step: int
    newest_time: float


_PACE: dict[str, tuple[tuple[int, int, int], _Pace | None]] = {}


def throughput(run_dir: Path, last_step: int | None, running: bool) -> Throughput:
    """Tokens/s and steps/s over the last THROUGHPUT_WINDOW trainer logs, and the time left to max_steps at that pace.

    Only logs of the current stretch count: a step that goes backwards or a pause longer than ten
    logging intervals (a resume, a requeue) starts the window afresh. The rates are remembered until
    log_history.jsonl changes, so a poll with nothing new costs one stat.
    """
    path = run_dir / "logs" / "log_history.jsonl"
    try:
        st = os.stat(path)
    except OSError:
        return Throughput(None, None, None)
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _CACHE_LOCK:
        seen = _PACE.get(str(path))
    if seen is not None and seen[0] == key:
        pace = seen[1]
    else:
        pace = _pace(run_dir)
        with _CACHE_LOCK:
            _PACE[str(path)] = (key, pace)
    if pace is None:
        return Throughput(None, None, None)
    eta = None
    max_steps = config_value(run_dir, "max_steps")
    if running and pace.steps_per_s and isinstance(max_steps, int) and max_steps > 0:
        step = last_step if last_step is not None else pace.newest_step
        behind = time.time() - pace.newest_time  # time already spent since the newest log
        eta = max(0.0, (max_steps - step) / pace.steps_per_s - behind)
    return Throughput(pace.tokens_per_s, pace.steps_per_s, eta)


def _pace(run_dir: Path) -> _Pace | None:
    hist = _history_tail(run_dir, THROUGHPUT_WINDOW)
    gaps = [b["time"] - a["time"] for a, b in zip(hist, hist[1:]) if b["step"] > a["step"]]
    longest = 10 * statistics.median(gaps) if gaps else None
    start = len(hist) - 1
    while start > 0:
        a, b = hist[start - 1], hist[start]
        if b["step"] <= a["step"] or (longest is not None and b["time"] - a["time"] > longest):
            break
        start -= 1
    hist = hist[start:]
    if len(hist) < 2:
        return None
    first, newest = hist[0], hist[-1]
    dt = newest["time"] - first["time"]
    if dt <= 0:
        return None
    steps_per_s = (newest["step"] - first["step"]) / dt or None
    tokens_per_s = None
    for k in TOKEN_KEYS:
        toks = [(h["time"], h[k]) for h in hist if isinstance(h.get(k), (int, float))]
        if len(toks) >= 2 and toks[-1][0] > toks[0][0]:
            tokens_per_s = (toks[-1][1] - toks[0][1]) / (toks[-1][0] - toks[0][0])
            break
    return _Pace(tokens_per_s, steps_per_s, newest["step"], newest["time"])


def forget() -> None:
    """Drop what this server remembers of runs' sources (as a freshly started server would)."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _PACE.clear()
    _WRITES_PROGRESS.clear()
