"""What a log shows: the failure-signals table's word signals, the numeric rules over parsed metrics, exit status and failure markers.

Everything this module knows comes from skills/dgx-spark-ops/tables/failure-signals.yaml (validated by
skilltables.FailureSignalsTable); it finds, it does not decide - classify weighs what it finds.
"""

from __future__ import annotations

import bisect
import codecs
import math
import re
import signal as _signal
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import yaml

from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.skilltables import LEVEL_WORDS
from finetune_mcp.triage.parse import (KERAS_BAR, KeyMap, Metric, MetricTable, clean_line, clean_lines_at, code_lines, decode_log,
                                      is_setting, pair_key, line_metrics, prefix_layers, log_encoding, normalise_key, parse_records,
                                      parse_text, same_record, split_lines, to_number)

SKILL = "dgx-spark-ops"
MAX_LINES_PER_HIT = 12
MAX_MARKERS = 400
# The last "Name: message" line of a traceback, with the rank prefix torchrun adds and the wrapper
# form Ray prints (RayTaskError(OutOfMemoryError): ...).
_EXCEPTION = re.compile(r"^\W*(?:\[rank\d+\]:\s*)?(?:[\w]+\.)*((?:[A-Z]\w*)?(?:Error|Exception|Interrupt|Exit))(?:\([\w.]*\))?(?::|\s*$)")
_EXCEPTION_M = re.compile(r"^[^\w\n]*(?:\[rank\d+\]:[ \t]*)?(?:[\w]+\.)*((?:[A-Z]\w*)?(?:Error|Exception|Interrupt|Exit))(?:\([\w.]*\))?(?::|[ \t]*$)", re.M)
_EXCEPTION_WORD = re.compile(r"Error|Exception|Interrupt|Exit")
# A line of a printed traceback (header, frame, source line, caret, exception line) or blank: not the program
# going on. Read only in the rare log that holds an "Exception in thread" header.
_TRACEBACK_LINE = re.compile(r"^\s*$|^Traceback \(most recent call last\)|^Exception in thread |^\s+|^[\w.]*(?:Error|Exception)\b|^During handling")


def last_bar_done(log: "Log") -> int | None:
    """The line number (1-based, in the whole log) of the last progress bar that reached its total."""
    if "100%" not in log.text:
        return None
    last = None
    for last in _BAR_DONE.finditer(log.text):
        pass
    return None if last is None else log.line_of(last.start()) + log.first_line


def last_bar_ran(records: list, ran: int) -> int | None:
    """The line of the last of the latest records that is a training bar at iteration `ran` or more (`Epoch 0:   5%|
    68/1441 [01:22<27:21, ..., loss=10.7]`): drawn after whatever was printed before it, a loop that ran past it (a
    notebook's failed optional cell, then the training cell). Only the last BAR_RECORDS records are looked at."""
    if ran:
        for m in records[-BAR_RECORDS:][::-1]:
            if m.step is not None and m.step >= ran and (bar := _BAR_RAN.search(m.text)) and int(bar.group(1)) >= ran:
                return m.line
    return None


BAR_RECORDS = 16
# A tqdm bar at its total ("100%|██████████| 46/46 [..."): the loop it counts ran to its end.
_BAR_DONE = re.compile(r"100%\|[^|\n]*\|\s*(\d+)/\1\b")
# A tqdm bar's counter with the elapsed time after it and a loss in its postfix: `68/1441 [01:22<27:21, ... loss=10.7]`
_BAR_RAN = re.compile(r"\| *(\d+)/\d+ \[[\d:]+<[^\n\]]*loss", re.I)


# Keras' fit: the header of its last epoch (`Epoch 100/100`), then that epoch's bar drawn to its total (`536/536 [====`,
# Keras 3's `536/536 ━━━━`; the cleaner leaves srun's task label before a number, `0: 536/536 [====`).
_KERAS_LAST_EPOCH = re.compile(r"^[ \t]*Epoch (\d+)/\1[ \t]*$", re.M)


def _lines_matching(log: "Log", comp: "Compiled", patterns: list[re.Pattern]) -> set[int]:
    """0-based indexes of the lines any of the patterns matches (each tried only where its literal is)."""
    return {i for p in patterns if log.may_match(p, comp) for i in log.scan(p)}


def _failure_lines(log: "Log", comp: "Compiled", levels: bool = True) -> tuple[set[int], set[int]]:
    """The failure lines of a log (0-based): those a failure marker matches, and those whose logger printed an error
    level (when `levels`), neither of them a benign_lines line (a tool's message when nothing failed)."""
    marked = _not_benign(log, comp, _lines_matching(log, comp, comp.markers))
    return marked, _not_benign(log, comp, log.level_lines(comp)) if levels else set()


# A loop's bare progress counter on a line of its own, no metric beside it (`Epoch:  44`, `Epoch 3/10`, `Iteration 1200`,
# `3rd epoch starting.`): went_on_records of them after an error are a loop that went on past it (a notebook's later
# cell training 200 epochs that prints only its epoch number, development dev32yp-005).
_PROGRESS = re.compile(r"\s*(?:(?:epoch|iteration|iter|step)\s*[:#=]?\s*\[?\s*\d+\s*(?:/\s*\d+)?\s*\]?\s*[.:!]?"
                       r"|\d+(?:st|nd|rd|th) epoch(?: starting| started| begins)?\.?)\s*$", re.I)


def progress_lines(log: "Log", most: int) -> list[int]:
    """The last `most` lines (1-based in the whole log) that are a bare progress counter (_PROGRESS)."""
    found = [i + log.first_line for i, c in enumerate(log.clean)
             if len(c) < 48 and ("poch" in c or "ter" in c or "tep" in c) and _PROGRESS.match(c) and i not in log.code]
    return found[-most:] if most else []


def last_launch(log: "Log", comp: "Compiled") -> int | None:
    """The last line (1-based in the whole log) where a shell said a new command began (launch_markers)."""
    found = _lines_matching(log, comp, comp.launches)
    return max(found) + log.first_line if found else None


def _keras_bar_done(clean: str) -> bool:
    """A Keras progress bar (parse's KERAS_BAR) drawn to its total: `536/536 [====`, `536/536 ━━━━`."""
    bar = KERAS_BAR.match(clean)
    return bool(bar and bar.group(1) == bar.group(2))


def last_finished(log: "Log", comp: "Compiled") -> tuple[int, str] | None:
    """The last line where a trainer said training ran to its end (its number, 1-based in the whole log, and its
    text): a finished marker, or the bar of Keras' last epoch drawn to its total within two lines of that epoch's header."""
    found = _lines_matching(log, comp, comp.finished)
    if "Epoch " in log.text:
        for i in log.scan(_KERAS_LAST_EPOCH):
            found.update([k for k in (i + 1, i + 2) if k < len(log.clean) and _keras_bar_done(log.clean[k])][:1])
    if not found:
        return None
    i = max(found)
    return i + log.first_line, log.lines[i]


@dataclass
class Threads:
    """Python prints an uncaught exception in a thread other than the main one as "Exception in thread NAME:"
    and a traceback, and the program goes on; one raised where it cannot propagate (a finaliser such as a
    DataLoader iterator's __del__ at exit, a weakref callback) as "Exception ignored in: OBJ" and a traceback
    (sys.unraisablehook), and the program goes on too. Counts of those headers and of all traceback headers,
    and the lines after the first thread header that are not part of a traceback (the program printing on)."""

    thread_headers: int = 0
    ignored_headers: int = 0
    tracebacks: int = 0
    lines_after: int = 0
    first_thread_at: int | None = None  # the line (1-based, whole log) of the first "Exception in thread" header

    def feed(self, log: "Log") -> None:
        if (self.thread_headers == 0 and "Exception in thread " not in log.text
                and "Exception ignored in" not in log.text):
            self.tracebacks += log.text.count("Traceback (most recent call last)")
            return
        for i, line in enumerate(log.clean):
            if line.startswith("Exception in thread "):
                self.thread_headers += 1
                if self.first_thread_at is None:
                    self.first_thread_at = i + log.first_line
            elif line.startswith("Exception ignored in"):
                self.ignored_headers += 1
            elif line.startswith("Traceback (most recent call last)"):
                self.tracebacks += 1
            elif self.thread_headers and not _TRACEBACK_LINE.match(line):
                self.lines_after += 1

    @property
    def only_threads_failed(self) -> bool:
        """Every traceback is a thread's (and the program printed on after the first) or one Python reported
        as ignored: the main program went on."""
        return self._all_threads and (self.lines_after > 0 or self.thread_headers == 0)

    @property
    def _all_threads(self) -> bool:
        """Every traceback is a thread's, or one Python reported as ignored."""
        return 0 < self.tracebacks <= self.thread_headers + self.ignored_headers

    def only_threads_after(self, line: int | None) -> bool:
        """Every traceback is a thread's, the first of them after `line` (where training said it ran to its end):
        a tracker's or a prefetcher's thread dying while the finished program shuts down (wandb's NetStatThr on a
        closed socket), not the run failing."""
        return bool(line and self.first_thread_at and self.first_thread_at > line and self._all_threads)


# --- the table ---------------------------------------------------------------------------------


def table_path(name: str) -> Path:
    from finetune_mcp.shipped import shipped_dir

    return shipped_dir("skills") / SKILL / "tables" / f"{name}.yaml"


def load_table(name: str, path: Path | None = None):
    """One of this skill's tables, validated by its registered model (only this skill's, so triage
    does not depend on every other skill being valid at the moment)."""
    return _cached(name, str(path) if path else None)


@lru_cache(maxsize=8)
def _cached(name: str, path: str | None):
    from pydantic import ValidationError

    from finetune_mcp.skills import explain
    from finetune_mcp.skilltables import TABLES

    p = Path(path) if path else table_path(name)
    model = TABLES[(SKILL, name)]
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        return model.model_validate(raw)
    except FileNotFoundError:
        raise NotFound(f"skill table {p} is missing", where=str(p), fix="restore skills/dgx-spark-ops/tables") from None
    except yaml.YAMLError as e:
        raise BadInput(f"{p}: not valid YAML: {e}", where=str(p), fix="fix the YAML syntax") from None
    except ValidationError as e:
        raise BadInput(f"{p}: {explain(e, model)}", where=str(p), fix="correct the table entries named above") from None


def load_signal_table(path: Path | None = None):
    """The validated failure-signals table (FailureSignalsTable)."""
    return load_table("failure-signals", path)


def required_literals(pattern: re.Pattern) -> list[list[str]] | None:
    """Groups of strings such that every match contains one string of each group (lower-cased for a
    case-insensitive pattern), or None when none can be read off the pattern.

    A big log is scanned chunk by chunk; `in` on a chunk is far faster than a regex that cannot skip
    ahead (one that starts with ^, \\s or a group), so a pattern whose literals are absent is not run.
    """
    try:
        import re._parser as sre_parse  # Python 3.11+
        from re._constants import BRANCH, LITERAL, MAX_REPEAT, MIN_REPEAT, SUBPATTERN
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse  # type: ignore
        from sre_constants import BRANCH, LITERAL, MAX_REPEAT, MIN_REPEAT, SUBPATTERN  # type: ignore

    def seq(items) -> list[list[str]]:
        groups: list[list[str]] = []
        run = ""

        def flush():
            nonlocal run
            if len(run) >= 3:
                groups.append([run])
            run = ""

        for op, av in items:
            if op is LITERAL:
                run += chr(av)
                continue
            flush()
            if op is SUBPATTERN:
                if av[1] & re.I:  # `(?i:...)`: its literals may match in any case, so they are no filter
                    continue
                groups.extend(seq(av[-1]))
            elif op is BRANCH:
                alts = [seq(b) for b in av[1]]
                if all(alts):  # one string of each alternative's surest group
                    groups.append([x for a in alts for x in max(a, key=lambda gr: min(map(len, gr)))])
            elif op in (MAX_REPEAT, MIN_REPEAT) and av[0] >= 1:
                groups.extend(seq(av[2]))
        flush()
        return groups

    try:
        groups = seq(sre_parse.parse(pattern.pattern, pattern.flags & ~re.M))
    except Exception:  # noqa: BLE001 - an unreadable pattern just gets no prefilter
        return None
    if not groups:
        return None
    return [[x.lower() for x in g] for g in groups] if pattern.flags & re.I else groups


class Compiled:
    """The signal table turned into regexes once (multi-line mode, for whole-text scans)."""

    def __init__(self, table):
        self.table = table
        self.keys = KeyMap.from_table(table.metric_keys)
        self.line_signals: list[tuple[Any, list[re.Pattern]]] = []
        self.unless: dict[str, list[re.Pattern]] = {}
        self.unless_log: dict[str, list[re.Pattern]] = {}
        for s in table.signals:
            if s.patterns:
                flags = re.M | (re.I if s.ignore_case else 0)
                self.line_signals.append((s, [re.compile(p, flags) for p in s.patterns]))
                self.unless[s.id] = [re.compile(p, flags) for p in s.unless]
            if s.unless_log:
                self.unless_log[s.id] = [re.compile(p, re.M) for p in s.unless_log]
        self.markers = [re.compile(p, re.M) for p in table.failure_markers]
        self.finished = [re.compile(p, re.M) for p in table.finished_markers]
        self.launches = [re.compile(p, re.M) for p in table.launch_markers]
        self.levels = [re.compile(p, re.M) for p in table.failure_levels]
        self.benign = [re.compile(p) for p in table.benign_lines]
        self.literals = {p.pattern + str(p.flags): required_literals(p) for _, ps in self.line_signals for p in ps}
        self.literals.update({p.pattern + str(p.flags): required_literals(p) for p in self.markers + self.finished + self.launches})
        self.fallback = [(r, re.compile(r.match), re.compile(r.frames) if r.frames else None) for r in table.fallback]
        self.cut_traceback = [(r, re.compile(r.match)) for r in table.cut_traceback]
        self.nonfinite_ignore = frozenset(table.records.nonfinite_ignore)
        self.adversarial = frozenset(table.records.adversarial_words)
        self.discriminator = frozenset(table.records.discriminator_words)
        self.by_rule = {s.records_rule: s for s in table.signals if s.records_rule}


_COMPILED: dict[int, Compiled] = {}


def compiled(table=None) -> Compiled:
    table = table or load_signal_table()
    c = _COMPILED.get(id(table))
    if c is None or c.table is not table:
        c = _COMPILED[id(table)] = Compiled(table)
    return c


# --- one log -----------------------------------------------------------------------------------


class Log:
    """One log: its lines (verbatim, 1-based) and a per-pattern scan that runs in C over the whole text.

    Searching the joined text once per pattern is far faster than calling every regex on every line
    of a big log; each hit is then confirmed on its own line, so a match never spans two.
    """

    def __init__(self, text: str | None = None, *, lines: list[str] | None = None, first_line: int = 1,
                 wrap: int | None | bool = True):
        self.raw = text  # the text the lines were split from, when the caller has it (level_lines scans it)
        self.lines = split_lines(text) if lines is None else lines  # verbatim, for evidence
        # what the patterns see (parse.clean_line), and the width a terminal wrapped them at (wrap: see clean_lines_at)
        self.clean, self.wrap = clean_lines_at(self.lines, wrap)
        self.first_line = first_line  # the 1-based number of lines[0] in the whole log
        self.text = "\n".join(self.clean)
        self._lower: str | None = None
        self._gist: str | None = None
        self._gist_lower = ""
        self._code: set[int] | None = None
        self.starts = [0]
        for ln in self.clean[:-1]:
            self.starts.append(self.starts[-1] + len(ln) + 1)

    @property
    def code(self) -> set[int]:
        """The lines IPython prints around a frame's running line: source, not output (parse.code_lines), found once."""
        if self._code is None:
            self._code = code_lines(self.clean, self.text)
        return self._code

    def may_match(self, pattern: re.Pattern, comp: "Compiled") -> bool:
        """False when the pattern's required literal is nowhere in this log (see required_literals)."""
        lits = comp.literals.get(pattern.pattern + str(pattern.flags))
        if not lits:
            return True
        if self._gist is None:
            # The chunk's distinct lines with digits dropped: a log repeats itself (progress bars, metric
            # lines differing only in their numbers), so this is far smaller than the text it stands for.
            bare = self.text.encode("utf-8", "surrogatepass").translate(None, b"0123456789")
            self._gist = "\n".join(set(bare.decode("utf-8", "replace").split("\n")))
            self._gist_lower = self._gist.lower()
        for group in lits:
            for x in group:
                if any(ch.isdigit() for ch in x):
                    hay = self.text if not pattern.flags & re.I else (self._lower or self._lowered())
                else:
                    hay = self._gist_lower if pattern.flags & re.I else self._gist
                if x in hay:
                    break
            else:
                return False
        return True

    def level_lines(self, comp: "Compiled") -> set[int]:
        """0-based indexes of the lines a failure_levels pattern matches on the raw text (the level a logger
        printed is one of the prefixes the clean text drops). Only the lines holding a level word are tried."""
        if not comp.levels:
            return set()
        raw = self.raw if self.raw is not None else "\n".join(self.lines)
        starts = sorted({raw.rfind("\n", 0, pos) + 1 for word in LEVEL_WORDS for pos in _positions(raw, word)})
        out: set[int] = set()
        line = last = 0
        for start in starts:
            line += raw.count("\n", last, start)
            last = start
            end = raw.find("\n", start)
            text = raw[start:end if end >= 0 else len(raw)]
            # The line, and the line after each logger prefix before it: the level of a logger behind another's prefix
            # counts as well (a collector's INFO before the program's ERROR).
            if any(p.match(t) for t in prefix_layers(text) for p in comp.levels):
                out.add(line)
        return out

    def _lowered(self) -> str:
        self._lower = self.text.lower()
        return self._lower

    def line_of(self, pos: int) -> int:
        return bisect.bisect_right(self.starts, pos) - 1

    def scan(self, pattern: re.Pattern) -> dict[int, re.Match]:
        """{0-based line index: the match on that line} for every line the pattern matches."""
        found: dict[int, re.Match] = {}
        pos = 0
        while pos <= len(self.text):
            m = pattern.search(self.text, pos)
            if m is None:
                break
            first = self.line_of(m.start())
            if "\n" not in m.group(0):
                found.setdefault(first, m)
            else:
                for i in range(first, self.line_of(m.end() - 1) + 1):
                    if i not in found and (lm := pattern.search(self.clean[i])):
                        found[i] = lm
            if first + 1 >= len(self.starts):
                break
            pos = self.starts[first + 1]
        return found


@dataclass
class Hit:
    """One signal seen: the table entry (or a fallback rule), the verbatim (line, text) pairs, a detail."""

    signal: Any
    lines: list[tuple[int, str]] = field(default_factory=list)
    detail: str = ""
    last: int = 0  # the last line it matched on (lines holds the first few only); 0: not from a line

    @property
    def id(self) -> str:
        return self.signal.id

    @property
    def failure_class(self) -> str:
        return self.signal.failure_class

    @property
    def first(self) -> int:
        return self.lines[0][0] if self.lines else 10**12

    @property
    def last_line(self) -> int:
        """The last line it matched on; 0 for a hit that comes from no line (an exit status)."""
        return self.last or (self.lines[-1][0] if self.lines else 0)


@dataclass
class Findings:
    """Everything one log (or one record list) shows, before any verdict."""

    hits: list[Hit]
    metrics: list[Metric]
    markers: list[tuple[int, str]]  # failure-marker lines
    exception: tuple[int, str] | None  # the last exception line
    traceback_cut: bool  # a traceback whose exception line is missing (an excerpt cut short)
    exit_code: int | None = None
    exit_signal: int | None = None
    stopped_by: str | None = None
    dropped: list[Hit] = field(default_factory=list)  # SIGKILL signs set aside because stop_run sent the kill
    table: Any = None  # the signal table these were found with
    summary: dict | None = None  # the metrics summary, when `metrics` holds only part of a streamed log
    tail: list[str] = field(default_factory=list)  # the log's last lines (cleaned): where an excerpt cut short stops
    record_lines: list[int] = field(default_factory=list)  # line numbers of the last metric records (went_on_records at most)
    progress_lines: list[int] = field(default_factory=list)  # ... and of the last bare progress counters (progress_lines())
    threads: Threads = field(default_factory=Threads)
    bar_done: int | None = None  # the last line where a progress bar reached its total or ran went_on_records iterations
    transient: list[Hit] = field(default_factory=list)  # NaN grad norms of steps the fp16 scaler skipped: set aside
    finished: tuple[int, str] | None = None  # the last line where a trainer said training ran to its end: (number, text)
    cell_frame_at: int | None = None  # the line of the last frame of a notebook cell's traceback (`<ipython-input-9-...>`)
    last_traceback_at: int | None = None  # the line of the log's last "Traceback (most recent call last)"
    level_only: bool = False  # every failure line is a logger's level line (ERROR/FATAL/CRITICAL): no other marker
    line_count: int = 0  # the lines of the whole log
    launched_at: int | None = None  # the last line where a shell said a new command began (launch_markers)
    interrupted_failing: tuple[int, str] | None = None  # an exception a Ctrl-C interrupted the handling of (interrupted_failure)

    def _records_after(self, line: int) -> bool:
        """went_on_records metric records were logged after `line` (a line of the log, > 0)."""
        need = self.table.records.went_on_records if self.table is not None else 0
        return bool(need and line and (sum(1 for n in self.record_lines if n > line) >= need
                                       or sum(1 for n in self.progress_lines if n > line) >= need))

    def _launched_after(self, line: int) -> bool:
        """The shell started another command after `line`: what went wrong before belongs to an earlier one."""
        return bool(line and self.launched_at and self.launched_at > line)

    def _finished_after(self, line: int) -> bool:
        """A trainer said training ran to its end after `line` (HF's "Training completed", Lightning's
        "`Trainer.fit` stopped: `max_epochs=3` reached", fairseq's "done training in")."""
        return bool(line and self.finished_at and self.finished_at > line)

    @property
    def finished_at(self) -> int | None:
        return self.finished[0] if self.finished else None

    @property
    def lines_after(self) -> int:
        """Lines the log printed after its last failure line (markers keep the last ones)."""
        return self.line_count - max(n for n, _ in self.markers) if self.markers else 0

    def outlived(self, hit: Hit) -> bool:
        """The run logged went_on_records metric records after the hit's last line, or finished training
        after it: whatever it said (an OOM a batch-size finder caught, a tool an optional step lacked),
        training went on past it. An install or build that failed in a notebook is outlived by a later cell that ran
        (its traceback began after it, frames of a cell): the kernel went on, with whatever that cell had."""
        return (self._records_after(hit.last_line) or self._finished_after(hit.last_line) or self._launched_after(hit.last_line)
                or (hit.signal.before_run and self.cell_traceback_after(hit.last_line)) or self._warned_past(hit))

    def _warned_past(self, hit: Hit) -> bool:
        """A warning-only signal (host memory growing) in a log that shows no failure and logged metric records, after
        whose last hit the program printed cell_went_on_lines non-blank lines or more: it warned and went on (a TFLite
        conversion's allocator warnings after training, then its accuracy). A log of nothing but the warnings has no
        run to have gone on (a terminal that wrapped a tcmalloc line's long address list prints more lines after it)."""
        went_on = self.table.records.cell_went_on_lines if self.table is not None else 0
        return bool(hit.signal.warning_only and went_on and self.record_lines and not self.failed
                    and self.printed_after(hit.last_line) >= went_on)

    def printed_after(self, line: int) -> int:
        """Non-blank lines the log printed after `line` (1-based), counted in the tail it keeps (TAIL_LINES at most)."""
        n = self.line_count - line
        return sum(1 for x in (self.tail[-n:] if 0 < n else []) if x.strip())

    def cell_traceback_after(self, line: int | None) -> bool:
        """The log's last traceback is a notebook cell's (its frames name the cell), begun after `line`: a later cell ran."""
        start = self.last_traceback_at or (self.exception[0] if self.exception else None)
        return bool(line and start and self.cell_frame_at and line < start <= self.cell_frame_at)

    @property
    def went_on(self) -> bool:
        """The run logged went_on_records metric records after its last exception and failure line, a progress
        bar reached its total after it, or the trainer said it finished: what was printed was caught (a warning
        with a traceback, a retried worker, a failed upload, a shell's complaint before the job ran), not fatal."""
        last = max(([self.exception[0]] if self.exception else []) + [n for n, _ in self.markers], default=0)
        if last and self.bar_done and self.bar_done > last:
            return True  # a loop ran to its total after the error
        lines = self.table.records.went_on_lines if self.table is not None else 0
        if (lines and self.level_only and self.exception is None and self.last_traceback_at is None
                and self.lines_after >= lines):
            return True  # a logger's error line the program printed on well past
        return self._records_after(last) or self._finished_after(last) or self._launched_after(last)

    @property
    def failed(self) -> bool:
        """The run shows it failed: a traceback, an exception, a kill, a non-zero exit. A run known to
        have exited 0 did not fail, whatever error lines it printed on the way; nor did one whose
        training went on well past its last error (went_on)."""
        if self.exit_code == 0 and not self.exit_signal:
            return False
        kill = any(h.signal.failure_class == "oom" and getattr(h.signal, "explained_by_stop", False) and not self.outlived(h)
                   for h in self.hits)
        if kill or (self.exit_code not in (None, 0)) or self.exit_signal:
            return True
        return (bool(self.markers or self.exception) and not self.went_on and not self.threads.only_threads_failed
                and not self.threads.only_threads_after(self.finished_at))


# --- word signals ------------------------------------------------------------------------------


def word_hits(log: Log, comp: Compiled, records: set[int] = frozenset()) -> dict[str, Hit]:
    """The line signals' pattern hits; `records` (0-based line indexes) are the lines the metric readers took as
    records, which a records_decide signal leaves to the records rules."""
    out: dict[str, Hit] = {}
    for s, pats in comp.line_signals:
        matched = _lines_matching(log, comp, pats)
        unless = comp.unless.get(s.id)
        if matched:
            matched -= log.code  # IPython's source around a frame quotes the words; the run did not print them
        if matched and s.records_decide:
            matched -= records  # a CSV row `12,0.88,nan` under a `step,loss,grad_norm` header: its NaN has a name
        if matched and unless:
            # What the `unless` patterns match is cut from the line; the signal counts if it still matches the rest.
            matched = {i for i in matched if _still(log.clean[i], pats, unless)}
        if matched and s.id in comp.unless_log and any(p.search(log.text) for p in comp.unless_log[s.id]):
            matched = set()  # the log is one whose launcher prints these words about something else (unless_log)
        if matched:
            out[s.id] = Hit(s, [(i + log.first_line, log.lines[i]) for i in sorted(matched)][:MAX_LINES_PER_HIT * 4],
                            last=max(matched) + log.first_line)
    return out


def _positions(text: str, word: str) -> Iterator[int]:
    pos = text.find(word)
    while pos >= 0:
        yield pos
        pos = text.find(word, pos + len(word))


# key: nan / key=inf / 'key': -inf, the key up to four words (a tqdm postfix, a `key: value` print, a dict), or a
# torch tensor printed whole (`loss: tensor(nan, device='cuda:0')`).
# A key and its value: `key: nan`, `key=nan`, or a key | value table's row (`| obs_rms_mean | nan |`, Stable-Baselines'
# and OpenAI Baselines' logger).
_NONFINITE_PAIR = re.compile(r"(?P<key>[A-Za-z][\w/.\-\[\]]*(?: (?:[A-Za-z][\w/.\-\[\]]*|\[\d+\])){0,3})['\"]?\s*(?:[:=]|\s\|)\s*['\"]?"
                             r"(?:tensor\(\[{0,2})?(?P<val>[-+]?(?:nan|inf(?:inity)?))(?![\w.])", re.I)
_NONFINITE_WORD = re.compile(r"[:=|]\s*['\"]?(?:tensor\(\[{0,2})?[-+]?(?:nan|inf)", re.I)
# A line that reports its own count as 0: its NaNs are means over nothing (darknet's `Region 82 Avg IOU: -nan, ...,
# .5R: -nan, .75R: -nan,  count: 0` for a detection scale that saw no object in the batch).
_EMPTY_COUNT = re.compile(r"\bcount:\s*0(?![\d.])", re.I)
_EXCEPTION_NAME = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Warning)")
# Slots NumberRules checks itself (a NaN loss is nonfinite-loss, not this rule's).
_CHECKED_KINDS = ("loss", "eval_loss", "grad_norm", "loss_scale", "kl")


def nonfinite_metric_hits(log: Log, comp: Compiled) -> list[Hit]:
    """NaN or inf in a logged metric no other rule reads (any name but the table's nonfinite_ignore words)."""
    keys = NonfiniteKeys(comp)
    keys.feed(log)
    return keys.hits()


class _KeyCounts:
    """One key's non-finite prints, as NonfiniteKeys counts them (lines are 1-based in the whole log)."""

    __slots__ = ("first_bad", "last_bad", "bad", "finite_after_first", "finite_after_last", "bad_after_finite", "lines")

    def __init__(self, line: int):
        self.first_bad = self.last_bad = line
        self.bad = 0  # its non-finite lines
        self.finite_after_first = 0  # finite prints on lines after its first non-finite one
        self.finite_after_last = 0  # ... after its last non-finite one
        self.bad_after_finite = 0  # non-finite lines after its last finite print
        self.lines: list[tuple[int, str]] = []  # its first non-finite lines, verbatim (evidence)


class NonfiniteKeys:
    """nonfinite-metric over a log read whole or in chunks (fed in order): per key printed non-finite, what decides
    whether its NaN lasted - finite prints after its last non-finite one (recovered) and after its first, and
    non-finite ones after its last finite print (flickers) - counted line by line, so chunks read as the whole does."""

    def __init__(self, comp: Compiled):
        self.comp = comp
        self.enough = comp.table.records.nonfinite_recovered_logs
        self.keys: dict[str, _KeyCounts] = {}  # by the key as printed, in the order first seen

    def feed(self, log: Log) -> None:
        found = _nonfinite_found(log, self.comp)
        bad: dict[str, list[int]] = {}  # key -> its non-finite lines in this chunk (indexes)
        for i, keys in found.items():
            for key in keys:
                lines = bad.setdefault(key, [])
                if not lines or lines[-1] != i:
                    lines.append(i)
        for key in dict.fromkeys([*self.keys, *bad]):
            mine = bad.get(key, [])
            start = log.starts[mine[0]] if key not in self.keys else 0
            finite = Counter(log.line_of(pos) for pos in _finite_prints(log, key, start))
            mine_at = set(mine)
            for i in sorted(mine_at | set(finite)):
                k = self.keys.get(key)
                line = i + log.first_line
                if i in mine_at:  # a non-finite print first, then any finite one on the same line
                    if k is None:
                        k = self.keys[key] = _KeyCounts(line)
                    k.last_bad, k.bad, k.finite_after_last = line, k.bad + 1, 0
                    k.bad_after_finite += 1
                    if len(k.lines) < MAX_LINES_PER_HIT:
                        k.lines.append((line, log.lines[i]))
                if k is not None and i in finite and line > k.first_bad:
                    k.finite_after_first += finite[i]
                    if line > k.last_bad:
                        k.finite_after_last += finite[i]
                    k.bad_after_finite = 0

    def _lasting(self, k: _KeyCounts) -> bool:
        """A key printed finite `enough` times after its last NaN/inf had a transient (a validation error of inf at
        the first epoch, finite ever after). Weights that went NaN stay NaN, so a metric computed from them cannot be
        finite again: one that goes back and forth between NaN and a number (finite `enough` times after its first NaN,
        NaN fewer times than that after its last number) is a mean over an empty set - a per-class Dice score for an
        organ absent from the validation batch, MXNet's epoch-end summary of a metric it has just reset. One that ends
        NaN for `enough` prints or more went wrong there, whatever came before."""
        if self.enough <= 0:
            return True
        recovered = k.finite_after_last >= self.enough
        flickers = k.bad >= 2 and k.finite_after_first >= self.enough and k.bad_after_finite < self.enough
        return not (recovered or flickers)

    def hits(self) -> list[Hit]:
        sig = self.comp.by_rule.get("nonfinite-metric")
        lasting = [key for key, k in self.keys.items() if self._lasting(k)]
        if sig is None or not lasting:
            return []
        lines = sorted({ln for key in lasting for ln in self.keys[key].lines})[:MAX_LINES_PER_HIT]
        names = dict.fromkeys(normalise_key(key) for key in lasting)
        return [Hit(sig, lines, f"non-finite (NaN or inf) values in {', '.join(list(names)[:6])}")]


def _nonfinite_found(log: Log, comp: Compiled) -> dict[int, list[str]]:
    """Line index -> the metric keys printed non-finite on it, as printed (nonfinite-metric's candidates)."""
    found: dict[int, list[str]] = {}
    # Only the lines holding a NaN/inf word are read (found in C over the whole text, as the word scan is).
    candidates = sorted({log.line_of(m.start()) for m in _NONFINITE_WORD.finditer(log.text)})
    for i in candidates:
        clean = log.clean[i]
        if is_setting(clean) or i in log.code or _EMPTY_COUNT.search(clean):
            continue
        for m in _NONFINITE_PAIR.finditer(clean):
            printed = m.group("key")
            if _EXCEPTION_NAME.fullmatch(printed):
                continue  # `KeyError: nan` is an exception's message (pandas looked up a NaN label), no metric
            printed = pair_key(printed)  # `Epoch[3] Train-SmoothL1=nan`: the key is Train-SmoothL1
            key = normalise_key(printed)
            words = key.split()
            if not words or any(w in comp.nonfinite_ignore for w in words):
                continue
            slot = comp.keys.slot_of(printed)
            if slot is not None and slot.partition(":")[0] in _CHECKED_KINDS:
                continue
            found.setdefault(i, []).append(printed)
    return found


def _scaler_value(v: float) -> bool:
    """A value a dynamic loss scaler holds: a power of two other than 1 (2**16 at the start, halved on overflow,
    doubled after a window of clean steps; an excerpt may start after it fell below 1), printed rounded to 3
    significant digits or more. A name only guessed to be a loss scale (`scale`, `scale_g`) that never held such a
    value is something else: a backbone's width multiplier `scale : 0.75` beside `scale : 1./255.` in a config
    dump, an augmentation's scale."""
    if not (math.isfinite(v) and v > 0 and v != 1):
        return False
    e = math.log2(v)
    return abs(e - round(e)) < 0.002


def _finite_prints(log: Log, key: str, start: int) -> Iterator[int]:
    """Where `key` is printed with a finite number from text offset `start` on (offsets)."""
    pat = re.compile(r"(?<![\w.])" + re.escape(key) + r"['\"]?\s*(?:[:=]|\s\|)\s*['\"]?[-+]?\.?\d")
    return (m.start() for m in pat.finditer(log.text, start))


def _still(line: str, pats: list[re.Pattern], unless: list[re.Pattern]) -> bool:
    for u in unless:
        line = u.sub(" ", line)
    return any(p.search(line) for p in pats)


def exit_fields(exit_info: dict | None) -> tuple[int | None, int | None, str | None]:
    """(returncode, signal number, stopped_by) from exit.json-like info; a returncode of -N means signal N."""
    if not exit_info:
        return None, None, None
    code = exit_info.get("returncode", exit_info.get("exit_code"))
    sig = exit_info.get("signal")
    if isinstance(sig, str):
        name = sig.strip().upper()
        if name.isdigit():
            sig = int(name)
        else:
            try:
                sig = _signal.Signals[name if name.startswith("SIG") else "SIG" + name].value
            except (KeyError, ValueError):
                raise BadInput(f"exit_info signal {exit_info.get('signal')!r} is not a signal name", where="exit_info.signal", fix="use e.g. 9 or 'SIGKILL'") from None
    if code is not None and not isinstance(code, int):
        raise BadInput(f"exit_info returncode {code!r} is not an integer", where="exit_info.returncode", fix="pass the process exit status")
    if code is not None and code < 0 and sig is None:
        sig = -code
    return code, sig, exit_info.get("stopped_by")


def exit_hits(comp: Compiled, code: int | None, sig_no: int | None, stopped_by: str | None) -> dict[str, Hit]:
    out: dict[str, Hit] = {}
    for s in comp.table.signals:
        if (s.exit_codes and code in s.exit_codes) or (s.exit_signals and sig_no in s.exit_signals):
            detail = f"exit status {code}" if code is not None else f"signal {sig_no}"
            out[s.id] = Hit(s, detail=detail + ("" if stopped_by else " with no stop request"))
        if s.stop_request and stopped_by:
            out[s.id] = Hit(s, detail=f"stopped by {stopped_by}")
    return out


# --- numeric rules -----------------------------------------------------------------------------


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


_PRECISE_DIGITS = 6  # a value printed with this many significant digits or more is printed whole, not rounded


def _significant_digits(v: float) -> int:
    """Significant digits of a logged value as it was printed (repr gives back the shortest form: 0.0019 -> 2)."""
    digits = repr(abs(v)).lower().split("e")[0].replace(".", "").lstrip("0")
    return len(digits.rstrip("0")) or 1


def _losses(window) -> list[float]:
    """The losses of a recurring-losses window, whose entries are a loss or (loss, perplexities)."""
    return [x[0] if x.__class__ is tuple else x for x in window]


def _distinct_window(values, spread: int) -> bool:
    """A window of losses identical to each other, or spanning at least `spread` units of their last printed digit:
    a replay of the same steps. Values a few units apart in the last digit are a plateau's print noise
    (`0.1064 0.1063 0.1062 0.1063 0.1063`), which recurs by chance over a long flat run."""
    lo, hi = min(values), max(values)
    if lo == hi or spread <= 0:
        return True
    decimals = max(len(repr(float(x)).partition(".")[2]) if "e" not in repr(float(x)) else 0 for x in values)
    return hi - lo >= spread * 10.0 ** -decimals


def _total_fell(first: Metric, last: Metric) -> bool:
    """The training loss logged on both records fell from the first to the last: a named term of it that rose
    between them is the trade-off the total makes (wav2vec 2.0's diversity term), not a divergence."""
    return _finite(first.loss) and _finite(last.loss) and last.loss < first.loss


def _weights_move(records, ppl: bool = True) -> bool:
    """The records say the weights are moving, whatever the loss print says: a grad norm that is positive and
    not the same every time, or another loss logged beside it (`Train L1 Loss`, `value_loss`, or a validation
    loss: the same weights score the same held-out data the same), a perplexity (exp of the loss, printed with
    more digits: `loss  7.14 | ppl  1264.60`) or a value network's Q estimate (PyTorch's Mario DQN tutorial prints
    `Mean Loss 3.233 - Mean Q Value 4435.121`, both means over the last 100 episodes rounded to 3 decimals) that
    changes from record to record. A loss pinned at one value
    while its neighbour moves is one term at its floor, or a print rounding it to 0.0000 or to two decimals."""
    if len({x.grad_norm for x in records if _finite(x.grad_norm) and x.grad_norm > 0}) > 1:
        return True
    if len({x.eval_loss for x in records if _finite(x.eval_loss)}) > 1:
        return True
    others: dict[str, set[float]] = {}
    for x in records:
        for k, v in x.named.items():
            if k.startswith(("loss:", "eval_loss:", "ppl:", "q:") if ppl else ("loss:", "eval_loss:", "q:")) and _finite(v):
                others.setdefault(k, set()).add(v)
    return any(len(vals) > 1 for vals in others.values())


def number_hits(metrics: list[Metric], comp: Compiled) -> list[Hit]:
    """The records rules of the table applied to parsed metrics; each hit quotes the lines it rests on."""
    return _number_rules(metrics, comp).hits()


def _number_rules(metrics: list[Metric], comp: Compiled) -> "NumberRules":
    rules = NumberRules(comp)
    for m in metrics:
        rules.feed(m)
    return rules


def _set_aside_transients(by_id: dict[str, Hit], rules: "NumberRules") -> list[Hit]:
    """Take out the word hits of nonfinite-grad-norm when the records say those NaN grad norms were steps the
    fp16 scaler skipped and every line they quote is one of those records, so HF Trainer's `'grad_norm': nan`
    dicts read as its log history saved as CSV does; Megatron's "number of nan iterations" or any other line
    keeps the hit. A NaN/inf loss is never set aside: numbers that went wrong stay wrong."""
    big = [came_back] if (came_back := rules.big_set_aside()) is not None else []
    nonfinite = rules.comp.by_rule.get("nonfinite-loss")
    start = rules.superseded_from()
    if start and nonfinite is not None and (word := by_id.get(nonfinite.id)) is not None and word.last_line < start:
        big.append(by_id.pop(word.id))  # an earlier run's NaN loss words, the log's last run trained past (_nonfinite_superseded)
    lines = rules.transient_lines()
    sig = rules.comp.by_rule.get("nonfinite-grad-norm")
    if not lines or sig is None:
        return big
    hit = by_id.get(sig.id)
    if hit is None:
        # Only the records showed them (a CSV log history): the set-aside hit quotes those records.
        return [Hit(sig, [(m.line, m.text) for m in rules.grad_bad], "NaN grad norms of skipped steps", last=max(lines))] + big
    if hit.last_line in lines and all(n in lines for n, _ in hit.lines):
        return [by_id.pop(hit.id)] + big
    return big


class _Series:
    """One loss series (the training loss, or a named one such as value_loss) as the curve rules need it:
    bounded state, fed one value at a time, so a log of any length is checked in one pass.

    A spike counts unless the loss comes back under spike_recover_factor x the median before it within
    spike_recover_logs logs (an episode the curve came back from), and only if it rose at least
    spike_abs_min (a loss printed to four decimals around 0.0001 is noise, whatever the ratio). A long
    curve (rise_smooth_after values or more) is read for a rise by its rolling median over rise_window
    values and the value it started at: one lucky batch is not a level the run reached, nor one unlucky batch the level it came back to; the
    level it ended at is the lowest of its last rise_window medians (a level that held)."""

    def __init__(self, rules, name: str = "loss"):
        self.rules = rules
        self.name = name  # what the verdict calls it: "loss" for the training loss under any of its keys
        self.rl = False  # logged beside a reward: a reinforcement-learning trainer's loss (rl_rise_factor)
        self.window: deque[float] = deque(maxlen=rules.spike_window)
        self.spikes: list[tuple[Metric, float]] = []
        self.pending: list[tuple[Metric, float, int, float]] = []  # spikes not yet known to last: (metric, median, logs since, ratio)
        self.came_back_from = 0.0  # the highest spike (as a ratio to its median) this curve came back from
        self.first: float | None = None
        self.count = 0
        self.low: tuple[float, Metric] | None = None  # the minimum before the last value
        self.last: Metric | None = None
        self.last_value: float | None = None
        self.recent: deque[tuple[float, Metric]] = deque(maxlen=rules.rise_window)
        self.sorted_recent: list[float] = []  # the values of `recent`, sorted (the rolling median without a sort per value)
        self.smooth_low: tuple[float, Metric] | None = None  # the lowest rolling median before the last one
        self.smooth_last: float | None = None
        self.smooth_at: tuple[float, Metric] | None = None
        self.smooth_tail: deque[float] = deque(maxlen=rules.rise_window)  # the last rolling medians
        # The rewards logged beside this loss (a reinforcement-learning trainer's): its first and its latest rise_window.
        self.rewards_first: list[float] = []
        self.rewards_last: deque[float] = deque(maxlen=rules.rise_window)
        self.ev_last: deque[float] = deque(maxlen=rules.rise_window)  # the value head's latest explained variances
        # The step of a series that so far only counted up by one whole number (1, 2, 3 ...), None before its second
        # value, False once it did anything else (see counter).
        self.count_step: float | None | bool = None

    def feed(self, m: Metric, v: float):
        r = self.rules
        if m.reward is not None and math.isfinite(m.reward):
            if len(self.rewards_first) < r.rise_window:
                self.rewards_first.append(m.reward)
            self.rewards_last.append(m.reward)
        if m.ev is not None and math.isfinite(m.ev):
            self.ev_last.append(m.ev)
        self._settle(v)
        if len(self.window) >= r.spike_min_history and v > r.spike_factor * min(self.window):
            med = _median(self.window)
            if med > 0 and v > r.spike_factor * med and v - med >= r.spike_abs_min:
                self.pending.append((m, med, 0, v / med))
        self.window.append(v)
        if self.last is not None and (self.low is None or self.last_value < self.low[0]):
            self.low = (self.last_value, self.last)
        if self.first is None:
            self.first = v
            self.smooth_low = (v, m)  # where the curve started is a level it held, however short the log
        if self.count_step is not False:
            if not math.isfinite(v) or v != int(v):
                self.count_step = False
            elif self.last_value is not None:
                step = v - self.last_value
                ok = step > 0 and step == int(step) and self.count_step in (None, step)
                self.count_step = step if ok else False
        self.last, self.last_value = m, v
        self.count += 1
        if len(self.recent) == self.recent.maxlen:
            self.sorted_recent.remove(self.recent[0][0])
        self.recent.append((v, m))
        bisect.insort(self.sorted_recent, v)
        if len(self.recent) == self.recent.maxlen:
            if self.smooth_last is not None and self.smooth_last < self.smooth_low[0]:
                self.smooth_low = self.smooth_at
            self.smooth_last = _median_of_sorted(self.sorted_recent)
            self.smooth_at = (self.smooth_last, self.recent[len(self.recent) // 2][1])
            self.smooth_tail.append(self.smooth_last)

    def _settle(self, v: float):
        """Age the pending spikes by one log: one the loss came back from is dropped, one that lasted is kept."""
        r = self.rules
        still = []
        for m, med, age, ratio in self.pending:
            if v <= r.spike_recover_factor * med:
                self.came_back_from = max(self.came_back_from, ratio)
                continue  # recovered: an episode, not a divergence
            if age + 1 >= r.spike_recover_logs:
                if len(self.spikes) < MAX_LINES_PER_HIT:
                    self.spikes.append((m, med))
            else:
                still.append((m, med, age + 1, ratio))
        self.pending = still

    def returns_grew(self) -> bool:
        """A reinforcement-learning loss whose logged reward, by the median of its last rise_window values, ended
        above the median of its first by at least as much as the first was from 0 (1 -> 2, -120 -> 0 or more, 0.1 ->
        16): a value or TD loss scales with the returns it predicts, so its rise is the policy improving."""
        if not self.rl or self.count < 2 * self.rules.rise_window:
            return False
        if len(self.ev_last) >= self.rules.rise_window and _median(self.ev_last) >= self.rules.rl_fit_explained_variance:
            # The returns are not logged, but the value head explains most of their variance to the end: its loss,
            # (1 - explained variance) x Var(returns), rose because the returns' spread did (a policy reaching rewards).
            return True
        if len(self.rewards_first) < self.rules.rise_window:
            return False
        first, last = _median(self.rewards_first), _median(self.rewards_last)
        return last - first >= max(abs(first), 1e-9)

    def lasting_spikes(self) -> list[tuple[Metric, float]]:
        """The spikes that did not recover, and a spike the log ends on (nothing shows it recovered) unless this
        curve already came back from one as high: a noisy curve (a PPO value loss) ending on more of the same."""
        ending = [(m, med) for m, med, _, ratio in self.pending if ratio > self.came_back_from]
        r = self.rules
        if r.spike_settled_below and self.first and self.first > 0 and self._level() <= r.spike_settled_below * self.first:
            return []  # the curve ends far below where it started: it learned again after its spikes
        return (self.spikes + ending)[:MAX_LINES_PER_HIT]

    def _level(self) -> float:
        """Where the curve ends: its last value, or for a long curve its lowest recent rolling median."""
        if self.count >= self.rules.rise_smooth_after and self.smooth_tail:
            return min(self.smooth_tail)
        return self.last_value

    @property
    def counter(self) -> bool:
        """The series only ever counted up by one whole step (1, 2, 3 ... or 10, 20, 30 ...) over rise_window values or
        more: an epoch or step number the reader took for the value (`Loss on train for epoch 3: 0.99` read as 3), not a
        loss - no curve rule reads it."""
        return bool(self.count_step) and self.count >= self.rules.rise_window

    def rise(self) -> tuple[Metric, float, Metric, float] | None:
        r = self.rules
        if self.count <= r.rise_min_history or self.low is None:
            return None
        if self.count >= r.rise_smooth_after and self.smooth_last is not None:
            # The level the curve ends at is one its rolling median held for rise_window logs: a few bad batches
            # at the end of a noisy per-batch curve lift one median, not all of the last ones.
            (low_v, low_m), last_v = self.smooth_low, min(self.smooth_tail)
        else:
            (low_v, low_m), last_v = self.low, self.last_value
        factor = r.rl_rise_factor if self.rl else r.rise_factor
        if low_v > 0 and last_v >= factor * low_v and last_v >= r.rise_back_to * self.first:
            return low_m, low_v, self.last, last_v
        # A long curve whose held level ends above where it started and rise_abs above its lowest level: a
        # cross-entropy is a log, so a language model's 4.8 -> 7.8 nats (1.6x) is a perplexity 20x higher. Only a
        # curve that starts where a cross-entropy can (rise_abs_first_max) is read in nats: an MSE of 60 is not.
        if (r.rise_abs and not self.rl and self.count >= r.rise_smooth_after and low_v > 0 and last_v >= self.first
                and last_v - low_v >= r.rise_abs and self.first <= r.rise_abs_first_max):
            return low_m, low_v, self.last, last_v
        return None


def _median(values) -> float:
    return _median_of_sorted(sorted(values))


def _median_of_sorted(w) -> float:
    n = len(w)
    return w[n // 2] if n % 2 else (w[n // 2 - 1] + w[n // 2]) / 2


class NumberRules:
    """The table's records rules over a stream of Metrics: NaN/inf in any loss, grad norm or loss scale
    (whatever its name), spikes and rises in every loss series, grad-norm explosions, a loss scale cut
    to its floor or halved step after step once settled, and a loss that stops moving."""

    def __init__(self, comp: Compiled):
        self.comp = comp
        self.r = comp.table.records
        self.nonfinite: list[Metric] = []
        self.nonfinite_names: dict[str, int] = {}
        self.held: Metric | None = None  # a record without an epoch waiting for the next one (see feed)
        self.nan_tail = 0  # training losses logged NaN/inf since the last finite one
        # A NaN training loss on the log's first record, at epoch or step 0, is a mean over no steps yet (a metrics
        # CSV's epoch-0 row, written after evaluating the untrained model); held here, it counts unless
        # nonfinite_recovered_logs finite losses follow and no other NaN.
        self.empty_mean: Metric | None = None
        self.empty_after = 0  # finite training losses logged since
        # Lines of the records that logged a non-finite grad norm (to tell a word hit on those very lines, which
        # a skipped fp16 step explains, from a framework's own NaN check); None once past MAX_TRANSIENT_LINES.
        self.grad_bad_lines: set[int] | None = set()
        self.grad_bad: list[Metric] = []
        self.grad_finite_after = 0  # finite grad norms logged since the last non-finite one
        self.grad_finite_since = 0  # finite grad norms logged since the first non-finite one
        self.grad_last: deque[bool] = deque(maxlen=max(1, comp.table.records.nonfinite_recovered_logs))  # latest norms: finite?
        self.zero_nan: list[Metric] = []
        self.series: dict[str, _Series] = {}
        self.closed_series: list[_Series] = []  # the series of runs a restart closed
        self.big: list[Metric] = []
        self.big_max = 0.0
        self.big_after = 0  # finite grad norms under grad_norm_max logged since the last one at or above it
        self.big_loss: float | None = None  # the loss of the record with the last grad norm at or above it
        self.huge: list[tuple[Metric, str, float]] = []
        self.huge_start: list[tuple[Metric, str, float]] = []  # huge, but no bigger than where that loss started (see _huge)
        self.precise: set[str] = set()  # losses printed with _PRECISE_DIGITS significant digits or more
        self.clamped: list[tuple[Metric, str, float]] = []  # a precise loss at exactly loss_clamp (see _huge)
        self.ends: dict[str, list[float]] = {}  # each loss's (and KL's) first and last finite value
        self._adv: dict[str, bool] = {}
        self.game: dict[str, _Side] = {}  # each side of a GAN's game, by its loss's name (see _game_over)
        self.game_over: tuple | None = None  # (discriminator, generator): the discriminator won (discriminator-won)
        self.critic_blown: _Side | None = None  # a WGAN critic whose loss went far positive (critic-blowup)
        self.side_stuck: _Side | None = None  # a side of the game that logged one value throughout (see _stuck_side)
        self.restarted = False  # a new run began in the log (see _restart)
        self.run_start_line: int | None = None  # the line of the first record since (None until one is fed)
        self.run_nonfinite = 0  # non-finite losses logged since the last restart
        self.closed_nonfinite = 0  # the most non-finite losses an earlier run logged
        self.printed: set[int] = set()  # hashes of the latest record lines (see feed), and of the generation before
        self.printed_before: set[int] = set()
        # Named losses of a reinforcement-learning trainer's records (beside a reward) that printed a value below
        # 0: signed surrogates (a PPO policy-gradient loss, an entropy bonus) hovering around 0, whose ratios say
        # nothing, so they have no spikes and no rise. (Outside RL a named loss's negative values are skipped and
        # its positive ones still read, as before: a loss can print negative values and still blow up.)
        self.signed: set[str] = set()
        self.kl_low: tuple[Metric, str, float] | None = None
        self.kl_blow: tuple[Metric, str, float] | None = None
        self.scale_prev: float | None = None
        self.scale_max: float | None = None
        self.scale_names: set[str] = set()  # names only guessed to be a loss scale that held a dynamic scaler's value
        self.floor: list[Metric] = []
        self.floor_min: float | None = None
        self.floor_left = False  # a scale above the floor was logged after the last cut to it
        self.settled = 0  # logged scales since the last cut that did not fall (the scaler had settled)
        self.halving: list[Metric] = []
        self.halving_best: list[Metric] = []
        self.halving_from: float | None = None
        self.grew_at = 0  # the line of the last logged scale above the one before it (the scaler grew: no overflow for a window)
        # flat-loss state
        self.run_vals: list[Metric] = []
        self.flat: tuple[list[Metric], str] | None = None
        self.flat_before: tuple[list[Metric], str] | None = None  # a flat loss an earlier run of the log showed
        self.run_first: float | None = None  # the current run's first finite loss
        self.run_count = 0  # ... and how many it logged
        self.recent: deque[Metric] = deque(maxlen=self.r.flat_repeat_window)
        self.recent_vals: deque[float | tuple[float, ...]] = deque(maxlen=self.r.flat_repeat_window)  # loss, or (loss, perplexities)
        self.seen_windows: dict[tuple[float, ...], tuple[int, int, str]] = {}
        self.finite_count = 0
        # A run whose loss never left a band of flat_still_band x its lowest value: its losses while it has not
        # (None once it has: then it moved, and nothing more is kept), and the first and last of their records
        self.still: list[float] | None = []
        self.still_lines: list[Metric] = []
        self.last_losses: deque[Metric] = deque(maxlen=max(1, self.r.chance_logs))  # the run's latest finite losses
        self.run_high: float | None = None  # the highest and lowest loss of this run (since the last restart)
        self.run_low: float | None = None
        self.zero_seen = False  # this run logged a loss of 0
        # ... and after it one above 0 and at most zero_print_floor, or a -0: its zeros are a print's rounding
        self.tiny_seen = False
        self.points: set[tuple] = set()  # (epoch, step, loss) of this run's records, to see a replay
        self.step_last: float | None = None  # the step of the last record with a step and a finite loss
        self.point_last: tuple | None = None  # and its (epoch, step, loss)
        self.epoch_max: float | None = None
        # the summary classify reports
        self.records = 0
        self.losses = 0
        self.loss_first = self.loss_min = self.loss_last = None
        self.grad_norm_max = None
        self.loss_scale_last = None

    def _restart(self):
        """A new run began - the epoch went back, HF's end-of-training summary closed a train() call, or a record
        repeated an earlier one exactly (a replay): the curve rules start over, so the new run's first losses are
        not read against the old run's minimum. What the old run already showed (a KL blow-up, a NaN) stays; its
        flat loss stays unless the log's last run learned (_last_run_learned)."""
        self._close_run()  # a flat stretch the old run ended on is judged as it stands
        self._close_still()
        if self.flat is not None:
            if self.flat_before is None:
                self.flat_before = self.flat
            self.flat = None
        self.run_first, self.run_count = None, 0
        self.closed_nonfinite = max(self.closed_nonfinite, self.run_nonfinite)
        self.restarted, self.run_nonfinite, self.run_start_line = True, 0, None
        for se in self.series.values():  # and its own lasting spikes and rise, against its own curve
            if len(self.closed_series) < MAX_CLOSED_SERIES:
                self.closed_series.append(se)
        self.series = {}
        self.run_vals = []
        self.recent.clear()
        self.recent_vals.clear()
        self.seen_windows = {}
        self.run_high = self.run_low = None
        self.zero_seen = self.tiny_seen = False
        self.still, self.still_lines = [], []
        self.last_losses.clear()
        self.points = set()
        self._judge_game()  # the old run's game is judged as it stood; a new run's starts afresh
        self.game = {}
        if self.kl_blow is None:
            self.kl_low = None  # a new run's KL starts over too (a blow-up already seen keeps the KL it rose from)
        self.epoch_max = None

    def _adversarial(self, name: str) -> bool:
        """One side of a GAN's game (d_loss, g_loss, loss_D): its rises and spikes are the game, not a divergence."""
        hit = self._adv.get(name)
        if hit is None:
            hit = self._adv[name] = name != "loss" and any(w in self.comp.adversarial for w in name.split())
        return hit

    def _empty_mean_counts(self):
        """The first record's NaN loss was no empty mean after all (another NaN came, or too few finite losses)."""
        m, self.empty_mean = self.empty_mean, None
        if m is not None:
            self.nonfinite_names["loss"] = self.nonfinite_names.get("loss", 0) + 1
            self.nonfinite.insert(0, m)
            del self.nonfinite[MAX_LINES_PER_HIT:]

    def _bad(self, m: Metric, name: str):
        self.nonfinite_names[name] = self.nonfinite_names.get(name, 0) + 1
        self.run_nonfinite += 1
        if not self.nonfinite or self.nonfinite[-1] is not m:
            if len(self.nonfinite) < MAX_LINES_PER_HIT:
                self.nonfinite.append(m)

    def feed(self, m: Metric):
        """One record. A record line printed again to the letter, its epoch or step included, among the latest
        PRINTED_RECENT records or more, is a second writer's copy (two handlers on one file, a tee): it is read once.
        A record without an epoch in a run whose records carry one waits for the next record: if
        that one starts a new run (its epoch went back), the record was the new run's first (a relaunch prints
        its first loss before the progress bar that names the epoch), not the old run's last."""
        key = m.seen_as  # the log line as the readers saw it, prefixes dropped (None: a record no log line printed)
        if key is not None:
            key = hash((key, m.epoch))  # under an epoch header the line itself may not name its epoch
            if key in self.printed or key in self.printed_before:
                if m.epoch is not None or m.step is not None:
                    return
            else:
                self.printed.add(key)
                if len(self.printed) >= PRINTED_RECENT:  # two generations: the latest PRINTED_RECENT to 2x as many
                    self.printed_before, self.printed = self.printed, set()
        held, self.held = self.held, None
        if m.epoch is None and m.run_end is None and self.epoch_max is not None:
            if held is not None:
                self._feed(held)
            self.held = m
            return
        if held is not None:
            if m.epoch is not None and math.isfinite(m.epoch) and m.epoch < self.epoch_max / 2:
                self._restart()
            self._feed(held)
        self._feed(m)

    def _feed(self, m: Metric):
        self.records += 1
        if self.run_start_line is None and m.run_end is None:
            self.run_start_line = m.line
        if m.run_end is not None:
            # A run ended: HF Trainer's end-of-training summary ({'train_runtime': ..., 'train_loss': <the mean>},
            # the run's average restated; a later stage - SFT, then DPO - or a relaunch starts its curve afresh),
            # or a KeyboardInterrupt (what a notebook logs next is a resumed run). A NaN in the summary still counts.
            if m.loss is not None and not math.isfinite(m.loss):
                self._bad(m, "loss")
            elif m.loss == 0 and m.run_end > 1 and self.flat is None and not m.rl:
                # The run's mean training loss is exactly 0 (`TrainOutput(global_step=465, training_loss=0.0, ...)`):
                # every step logged 0, as HF Trainer does for a forward pass that went NaN under fp16 (a T5). (A resume
                # past the last step trains nothing and reports 0.0 too, in a train_runtime of a second or less.)
                self.flat = ([m], "the run's mean training loss in its end-of-training summary is exactly 0: every step logged 0")
            self._restart()
            return
        if m.epoch is not None and math.isfinite(m.epoch):
            if self.epoch_max is not None and m.epoch < self.epoch_max / 2:
                self._restart()
            self.epoch_max = m.epoch if self.epoch_max is None else max(self.epoch_max, m.epoch)
        if m.step is not None and _finite(m.loss):
            # The same loss at the same step of the same epoch, printed again: the run replayed from its start (a
            # notebook cell run twice, a relaunch with the same seed appended to the log). Its curve starts over.
            # (Each epoch repeating the last one's per-step losses is stuck weights: flat-loss's, not this.)
            # A replay starts over: its step goes back. On a plateau the same rounded loss recurs at the same batch
            # index of a later epoch (`batch 6300/6400 loss=-1.8781`, the step still climbing within the epoch).
            # The same point as the record just before is one step printed twice (Keras draws a batch's bar line
            # with its ETA, then again with its time per step: `66/66 ... ETA: 0s - loss: 0.0228` twice), no replay.
            point = (m.epoch, m.step, m.loss)
            if (point in self.points and point != self.point_last and _significant_digits(m.loss) >= 3
                    and (self.step_last is None or m.step <= self.step_last)):
                self._restart()
            self.step_last, self.point_last = m.step, point
            if len(self.points) < MAX_WINDOWS:
                self.points.add(point)
        losses: list[tuple[str, float]] = []
        grads: list[tuple[str, float]] = []
        scales: list[float] = []
        if m.loss is not None:
            losses.append(("loss", m.loss))
            self.losses += 1
            self.nan_tail = 0 if math.isfinite(m.loss) else self.nan_tail + 1
        if m.eval_loss is not None and not math.isfinite(m.eval_loss):
            self._bad(m, "eval loss")
        if m.grad_norm is not None:
            grads.append(("grad norm", m.grad_norm))
        if m.loss_scale is not None:
            scales.append(m.loss_scale)
        for key, v in m.named.items():
            kind, _, name = key.partition(":")
            if kind == "loss":
                losses.append((name, v))
            elif kind in ("eval_loss", "kl"):
                if not math.isfinite(v):
                    if kind == "kl" and _finite(m.loss):
                        # A KL that is NaN beside a finite loss in the same record is no term of that loss (NaN
                        # carries through any sum): an estimate the trainer could not make (torchtune's kl_div=nan
                        # with no reference policy).
                        continue
                    self._bad(m, name)
                elif kind == "kl":
                    self._kl(m, name, v)
                    self._huge(m, name, v)  # a VAE's KL_loss at 3e15 is broken numbers like any loss
            elif kind == "grad_norm":
                grads.append((name, v))
            elif kind == "loss_scale" and m.loss_scale is None and (name in self.scale_names or _scaler_value(v)):
                self.scale_names.add(name)  # a bare `scale` is a loss scale once it held a power of two, as scalers do
                scales.append(v)
        for name, v in losses:
            if math.isfinite(v):
                self._huge(m, name, v)
            if not math.isfinite(v):
                if name == "loss" and self.losses == 1 and self.records == 1 and (m.epoch == 0 or m.step == 0):
                    self.empty_mean = m
                    continue
                self._empty_mean_counts()
                self._bad(m, name)
            elif self._adversarial(name):
                side = self.game.get(name)  # its rises and spikes are the game (negative values too: a WGAN critic's)
                if side is None:
                    side = self.game[name] = _Side(name, self.r.game_window, bool(set(name.split()) & self.comp.discriminator))
                side.feed(m, v)
            elif v < 0 and name != "loss":
                if m.rl:
                    self.signed.add(name)
            else:
                key = name if name != "loss" else m.loss_key or "loss"  # each key its own curve: 'loss', 'avg loss'
                se = self.series.get(key)
                if se is None:
                    se = self.series[key] = _Series(self.r, name)
                se.rl = se.rl or m.rl
                se.feed(m, v)
        for name, v in grads:
            self.grad_last.append(math.isfinite(v))
            if not math.isfinite(v):
                self.grad_finite_after = 0
                if self.grad_bad_lines is not None:
                    self.grad_bad_lines.add(m.line)
                    if len(self.grad_bad_lines) > MAX_TRANSIENT_LINES:
                        self.grad_bad_lines = None
                if len(self.grad_bad) < MAX_LINES_PER_HIT and (not self.grad_bad or self.grad_bad[-1] is not m):
                    self.grad_bad.append(m)
                self.nonfinite_names[name] = self.nonfinite_names.get(name, 0) + 1
            elif v >= self.r.grad_norm_max:
                if len(self.big) < MAX_LINES_PER_HIT and (not self.big or self.big[-1] is not m):
                    self.big.append(m)
                self.big_max = max(self.big_max, v)
                self.big_after, self.big_loss = 0, m.loss
            elif self.big:
                self.big_after += 1
            if math.isfinite(v):
                self.grad_finite_after += 1
                if self.grad_bad:
                    self.grad_finite_since += 1
                self.grad_norm_max = v if self.grad_norm_max is None else max(self.grad_norm_max, v)
        if m.loss == 0 and m.grad_norm is not None and math.isnan(m.grad_norm) and len(self.zero_nan) < MAX_LINES_PER_HIT:
            self.zero_nan.append(m)
        for v in scales[:1]:
            if _finite(v) and (v > 0 or self.scale_prev is not None):  # a first scale of 0 is a config's "dynamic"
                self._scale(m, v)
        if _finite(m.loss):
            self.empty_after += 1
            self._flat(m)
            self.loss_last = m.loss
            self.loss_first = m.loss if self.loss_first is None else self.loss_first
            self.loss_min = m.loss if self.loss_min is None else min(self.loss_min, m.loss)

    def _game_over(self):
        """A GAN whose discriminator won: a discriminator loss (never negative at the end: a BCE or hinge, not a
        WGAN critic) whose median over its last game_window values is game_d_zero or less after one of its first
        game_window values was at least game_d_zero x 10 (a discriminator can win within its first few logs), while
        a generator loss's median over its last values is game_g_rise times its first values' median. The
        discriminator tells every fake from every real sample, and the generator, which learns only from the
        discriminator's mistakes, has nothing left to learn from."""
        r = self.r
        done = [s for s in self.game.values() if s.count >= 2 * r.game_window]
        for d in (s for s in done if s.discriminator and s.tail_min() >= 0):
            if not (d.tail_median() <= r.game_d_zero and d.head_max() >= r.game_d_zero * 10):
                continue
            for g in (s for s in done if not s.discriminator):
                if g.head_median() > 0 and g.tail_median() >= r.game_g_rise * g.head_median():
                    return d, g
        return None

    def superseded_from(self) -> int | None:
        """The first line of the log's last run when every non-finite loss came before it (_nonfinite_superseded)."""
        return self.run_start_line if self._nonfinite_superseded() else None

    def _nonfinite_superseded(self) -> bool:
        """Every non-finite loss came in an earlier run of the log, none of those runs logged went_on_records of them or
        more, and the last run (after a restart) logged went_on_records finite training losses or more and none that
        was not: a run abandoned at its NaN and relaunched (an Optuna trial pruned, a fine-tune early stopping restored
        from), which the log's last run trained past. A run that went on logging NaN for went_on_records prints ran
        to its end on garbage: a failed experiment of its own, whatever ran after it (a notebook's next model, the
        next optimizer of a sweep)."""
        need = self.comp.table.records.went_on_records
        return bool(self.nonfinite and self.restarted and need and self.closed_nonfinite < need and not self.run_nonfinite
                    and self.run_count >= need and not self.nan_tail)

    def _judge_game(self) -> None:
        """The game's verdicts as the current run's sides stand, each kept once found (a run closes, the log ends)."""
        self.game_over = self.game_over or self._game_over()
        self.critic_blown = self.critic_blown or self._critic_blown()
        self.side_stuck = self.side_stuck or self._stuck_side()

    def _stuck_side(self) -> _Side | None:
        """One side of a GAN's game that logged the same value, printed to 3 significant digits or more, at every one of
        its 2 x game_window logs or more: that network's weights never moved (a discriminator at exactly 1.38763 for
        100 epochs while its generator's loss changes every epoch, development dev32yp-018). The game's rise and spike
        exemption is for sides that move."""
        r = self.r
        for side in self.game.values():
            if side.count >= 2 * r.game_window and not side.moved and _significant_digits(side.head[0][1]) >= 3:
                return side
        return None

    def _critic_blown(self) -> _Side | None:
        """A WGAN critic (a discriminator loss that printed a negative value among its first game_window values: the
        negated Wasserstein estimate plus a gradient penalty) whose median over its last game_window values is positive
        and game_critic_rise x or more the largest magnitude of its first values: the penalty term dominates, the
        critic's gradients are far from norm 1 - the game blew up."""
        r = self.r
        for d in self.game.values():
            if (d.discriminator and d.count >= 2 * r.game_window and min(v for _, v in d.head) < 0
                    and d.tail_median() >= r.game_critic_rise * max(abs(v) for _, v in d.head) > 0):
                return d
        return None

    def _huge(self, m: Metric, name: str, v: float) -> None:
        """Keep a finite loss (or KL) value of loss_abs_max or more as loss-magnitude evidence. One no bigger than the
        loss's first value is kept aside: a loss that starts that big (a sum over pixels, a beta-VAE on raw data) and
        falls by huge_fall_factor or more by its last value was on a scale of its own, not broken (_fell_from_start).
        A value of exactly loss_clamp, once that loss was printed with _PRECISE_DIGITS digits, is kept as well."""
        ends = self.ends.get(name)
        if ends is None:
            ends = self.ends[name] = [v, v]
        ends[1] = v
        if v == self.r.loss_clamp and v and name in self.precise:
            if len(self.clamped) < MAX_LINES_PER_HIT:
                self.clamped.append((m, name, v))  # at BCELoss's clamp, not a rounding (see the table's loss_clamp)
        elif name not in self.precise and _significant_digits(v) >= _PRECISE_DIGITS:
            self.precise.add(name)
        if abs(v) < self.r.loss_abs_max:
            return
        kept = self.huge_start if abs(v) <= abs(ends[0]) else self.huge
        if len(kept) < MAX_LINES_PER_HIT:
            kept.append((m, name, v))

    def _fell_from_start(self, name: str) -> bool:
        first, last = self.ends[name]
        return abs(last) * self.r.huge_fall_factor <= abs(first)

    def _kl(self, m: Metric, name: str, v: float):
        r = self.r
        if v <= r.kl_max / r.kl_rise_factor:
            if self.kl_low is None:
                self.kl_low = (m, name, v)
        elif v >= r.kl_max and self.kl_low is not None and self.kl_blow is None:
            self.kl_blow = (m, name, v)
        elif v >= r.kl_first_max and "approx" in name.lower() and self.kl_blow is None:
            self.kl_blow = (m, name, v)  # PPO's sampled KL: the first update can blow up, with no small KL before it

    def _scale(self, m: Metric, v: float):
        r = self.r
        prev = self.scale_prev
        if v <= r.loss_scale_floor and (m.scale_cut or (self.scale_max is not None and self.scale_max > v)):
            if len(self.floor) < MAX_LINES_PER_HIT:
                self.floor.append(m)
            self.floor_min = v if self.floor_min is None else min(self.floor_min, v)
            self.floor_left = False
        elif self.floor and v > r.loss_scale_floor:
            self.floor_left = True  # grown back above the floor after its last cut there: a transient
        if prev is not None and v <= prev / 2 * 1.0001:
            if not self.halving:
                self.halving_from = prev if self.settled >= r.scale_settled_logs else None
            self.halving.append(m)
            if self.halving_from is not None and len(self.halving) > len(self.halving_best):
                self.halving_best = list(self.halving[:MAX_LINES_PER_HIT])
            self.settled = 0
        elif prev is not None and v < prev:
            self.halving = []
            self.settled = 0
        else:
            self.halving = []
            if prev is not None:
                self.settled += 1
                if v > prev:
                    self.grew_at = m.line
        self.scale_prev = v
        self.scale_max = v if self.scale_max is None else max(self.scale_max, v)
        self.loss_scale_last = v

    def _last_run_learned(self) -> bool:
        """The log's last run (after a restart) logged 3 losses or more and fell to flat_superseded_fall x its first
        loss or lower: an earlier run's flat loss was abandoned for one that trained (a stuck run spreads nothing)."""
        f = self.r.flat_superseded_fall
        return bool(f and self.run_first and self.run_first > 0 and self.run_count >= 3 and self.run_low is not None
                    and self.run_low <= f * self.run_first)

    def _converged(self, values) -> bool:
        """Flat at the lowest loss of the run (within flat_converged_near of the value), flat_converged_factor x below
        its highest - for a signed objective (a negative log-likelihood), as far below it as that factor puts a positive
        one: converged, not stuck. A loss flat at exactly 0 is never converged (zero_loss_run)."""
        f = self.r.flat_converged_factor
        top = max(values)
        if f <= 0 or self.run_low is None or top == 0:
            return False
        near = top - self.run_low <= self.r.flat_converged_near * abs(top)
        return near and self.run_high - top >= (f - 1) * abs(top)

    def _flat(self, m: Metric):
        r = self.r
        self.finite_count += 1
        if self.run_first is None:
            self.run_first = m.loss
        self.run_count += 1
        if m.loss == 0:
            self.zero_seen = True
            if math.copysign(1.0, m.loss) < 0:
                self.tiny_seen = True  # '-0.0000': a signed objective (PPO's surrogate) rounded to 0, not exactly 0
        elif self.zero_seen and abs(m.loss) <= r.zero_print_floor:
            self.tiny_seen = True  # the loss left 0 for a value at the print's last digit: it flickers there
        self.run_high = m.loss if self.run_high is None else max(self.run_high, m.loss)
        self.run_low = m.loss if self.run_low is None else min(self.run_low, m.loss)
        self.last_losses.append(m)
        if self.still is not None:
            if self.run_low > 0 and self.run_high - self.run_low <= r.flat_still_band * self.run_low:
                if len(self.still) < MAX_WINDOWS:
                    self.still.append(m.loss)
                    self.still_lines[MAX_LINES_PER_HIT - 1:] = [m]  # the first ones, and the latest
            else:
                self.still, self.still_lines = None, []
        if self.flat is not None:
            return
        if m.redraw:
            return  # a bar's running mean mid-epoch repeats at its printed precision late in the epoch: no step of its own
        if self.run_vals and self.run_vals[0].loss != m.loss:
            self._close_run()
            self.run_vals = []
        self.run_vals.append(m)
        self.recent.append(m)
        # A perplexity beside the loss is part of what must recur: `loss 7.14 | ppl 1264.60` then `loss 7.14 |
        # ppl 1259.47` is the same rounded loss from other weights.
        ppl = [v for k, v in m.named.items() if k.startswith("ppl:")] if m.named else None
        self.recent_vals.append((m.loss, *ppl) if ppl else m.loss)
        if len(self.recent_vals) == r.flat_repeat_window:
            key = tuple(self.recent_vals)
            i = self.finite_count - r.flat_repeat_window
            have = self.seen_windows.get(key)
            # (The same losses at the same steps are a replay, which feed() already restarted the run for.)
            if (have is not None and i >= have[0] + r.flat_repeat_window and not _weights_move(self.recent, ppl=False)
                    and max(_significant_digits(x) for x in _losses(key)) >= 3 and not self._converged(_losses(key))
                    and _distinct_window(_losses(key), r.flat_window_spread)):
                first = Metric(have[1], have[2])
                self.flat = ([first] + list(self.recent), f"the same {r.flat_repeat_window} losses recur exactly (from line {first.line} "
                                                          f"and again from {self.recent[0].line}): the weights are not changing")
            elif have is None and len(self.seen_windows) < MAX_WINDOWS:
                self.seen_windows[key] = (i, self.recent[0].line, self.recent[0].text)

    def _close_still(self):
        """At a run's end (a restart, or the log's): did its loss never move, or end pinned at chance?"""
        r = self.r
        tail = self.last_losses
        if self.flat is None and r.chance_logs and len(tail) == r.chance_logs and 0 < tail[-1].loss < math.log(r.chance_classes + 1):
            # Each of the run's last chance_logs losses within chance_near of ln k, k classes (2 .. chance_classes):
            # the model predicts a uniform distribution over them - it learned nothing, or came apart to it.
            k = round(math.exp(tail[-1].loss))
            if 2 <= k <= r.chance_classes and all(abs(x.loss - math.log(k)) <= r.chance_near * math.log(k) for x in tail):
                self.flat = (list(tail), f"the run ends pinned at ln {k} = {math.log(k):.4f}, a uniform guess over {k} "
                                         f"classes: its last {len(tail)} losses {tail[0].loss:g} .. {tail[-1].loss:g}")
                return
        if self.flat is None and self.still and r.flat_still_logs and len(self.still) >= r.flat_still_logs:
            # The loss never moved: within flat_still_band of itself from the run's first log to its last, and no
            # lower in the second half than in the first (a run that starts at uniform over its vocabulary, 10.83
            # -> 10.78 in ten logs, is learning slowly). Caffe's MobileNetV3 pinned at ln 1000 = 6.9078 from the
            # start, printed beside the solver's smoothed average (6.905 .. 6.912), is never identical five times.
            half = len(self.still) // 2
            if min(self.still[half:]) >= min(self.still[:half]):
                ms = self.still_lines
                self.flat = (ms, f"the loss never moved: {len(self.still)} logs from line {ms[0].line} to {ms[-1].line} "
                                 f"all between {self.run_low:g} and {self.run_high:g}")

    def _close_run(self):
        r = self.r
        if self.flat is None and self.run_vals:
            v = self.run_vals[0].loss
            if len(self.run_vals) < (r.zero_loss_run if v == 0 else r.flat_identical_run):
                return  # too short to be flat (most runs are one value long): nothing more to check
            if v == 0 and self.tiny_seen:
                # 'loss=0.000000' between 'loss=0.000001's: a loss that flickers at its print's last digit is rounded to 0,
                # not exactly 0 (one that reached 0.0000 from 0.0001 and stays is judged as any zero run)
                return
            if v == 0 and all(x.acc_full for x in self.run_vals):
                return  # 'Acc: 100.0000, Loss: 0.0000': a model that fits its (few-shot) set, the loss rounded to 0
            if v == 0 and _reward_moves(self.run_vals):
                # A loss logged beside a reward that moves: a policy-gradient loss is 0 whenever the batch's advantages
                # are (every completion of a GRPO group scored alike), and a DQN logs 0 until its replay memory is full.
                # (A reward stuck at one value beside it, or a grad norm of exactly 0, is a policy learning nothing.)
                return
            if _weights_move(self.run_vals) or (v != 0 and _significant_digits(v) < 3) or self._converged([v]):
                # A loss printed rounded ('loss': 4.3, 'Train Loss: 0.0019') repeats while the weights move; a grad
                # norm that moves beside it says so outright (a GRPO loss logs 0.0 while the policy learns).
                return
            self.flat = (self.run_vals[:MAX_LINES_PER_HIT], f"the loss stays at exactly {v:g} for {len(self.run_vals)} consecutive logs")

    def transient_lines(self) -> set[int]:
        """The lines of the NaN/inf grad norms the run recovered from (see _grad_transient); empty if it did not."""
        return (self.grad_bad_lines or set()) if self._grad_transient() else set()

    def big_set_aside(self) -> "Hit | None":
        """The grad-norm-explosion hit the run came back from (see _big_transient), set aside; None if there is none."""
        sig = self.comp.by_rule.get("grad-norm-explosion")
        if not self.big or sig is None or not self._big_transient():
            return None
        return Hit(sig, [(m.line, m.text) for m in self.big][:MAX_LINES_PER_HIT],
                   f"grad norm reached {self.big_max:.3g} (limit {self.r.grad_norm_max:g}), then "
                   f"{self.big_after} norms under it with the loss finite and no higher")

    def _big_transient(self) -> bool:
        """Grad norms at or above grad_norm_max that the run came back from: went_on_records or more norms under the
        limit logged after the last, no loss NaN/inf, and the last loss no higher than the loss beside that norm (the
        first norms an fp16 or bf16 run logs among its scaler's skipped steps, 1e18 beside `inf`, while the loss
        falls). A run whose loss climbed after its explosion, or broke, keeps the hit."""
        need = self.comp.table.records.went_on_records
        if not need or self.nonfinite or self.big_after < need:
            return False
        return self.big_loss is None or (self.loss_last is not None and math.isfinite(self.big_loss)
                                         and self.loss_last <= self.big_loss)

    def _grad_transient(self) -> bool:
        """NaN/inf grad norms that were steps the fp16 loss scaler skipped, not the run diverging: the loss
        stayed finite, and the run logged nonfinite_recovered_logs finite norms after its last bad one, or as
        many between and after its bad ones with a finite one among the latest (a norm NaN every few steps
        while the loss falls, to the end of training, as HF log histories of fp16 runs show)."""
        n = self.r.nonfinite_recovered_logs
        if not n or self.nonfinite:
            return False
        return self.grad_finite_after >= n or (self.grad_finite_since >= n and any(self.grad_last))

    def summary(self) -> dict:
        out: dict = {"records": self.records, "losses": self.losses}
        if self.nan_tail:
            out["loss_nonfinite_at_end"] = self.nan_tail
        if self.loss_first is not None:
            out.update(loss_first=self.loss_first, loss_min=self.loss_min, loss_last=self.loss_last)
        if self.grad_norm_max is not None:
            out["grad_norm_max"] = self.grad_norm_max
        if self.loss_scale_last is not None:
            out["loss_scale_last"] = self.loss_scale_last
        return out

    def hits(self) -> list[Hit]:
        comp, r = self.comp, self.r
        if self.held is not None:
            held, self.held = self.held, None
            self._feed(held)
        if self.empty_after < r.nonfinite_recovered_logs:
            self._empty_mean_counts()
        out: list[Hit] = []

        def add(rule: str, ms: list[Metric], detail: str):
            sig = comp.by_rule.get(rule)
            if sig is not None and ms:
                out.append(Hit(sig, [(m.line, m.text) for m in ms][:MAX_LINES_PER_HIT], detail))

        def names(pick) -> str:
            ks = [k for k in self.nonfinite_names if pick(k)]
            return ", ".join(ks[:6])

        grad_names = {k for k in self.nonfinite_names if "norm" in k}
        add("nonfinite-loss", [] if self._nonfinite_superseded() else self.nonfinite, f"non-finite (NaN or inf) values in {names(lambda k: k not in grad_names)}")
        if not self._grad_transient():
            add("nonfinite-grad-norm", self.grad_bad, f"non-finite grad norm(s) in {names(lambda k: k in grad_names)}")
        add("loss-zero-grad-nan", self.zero_nan, f"{len(self.zero_nan)} log(s) show loss exactly 0 with a NaN grad norm")
        every = [(se.name, se) for se in self.closed_series + list(self.series.values())
                 if se.name not in self.signed and not se.returns_grew() and not se.counter]
        spikes = [(name, sp) for name, se in every for sp in se.lasting_spikes()]
        if spikes:
            name, (m, med) = min(spikes, key=lambda x: x[1][0].line)
            what = "loss" if name == "loss" else name
            add("loss-spike", sorted({sp[0].line: sp[0] for _, sp in spikes}.values(), key=lambda x: x.line),
                f"{what} {_value(m, name):g} at line {m.line} is {_value(m, name) / med:.1f}x the running median {med:g}")
        for name, se in every:
            rise = se.rise()
            if rise and not (name != "loss" and _total_fell(rise[0], rise[2])):
                low_m, low_v, last_m, last_v = rise
                what = "the loss" if name == "loss" else name
                add("loss-rise", [low_m, last_m], f"{what} rose from its minimum {low_v:g} (line {low_m.line}) to {last_v:g} "
                                                  f"(line {last_m.line}), {last_v / low_v:.1f}x")
                break
        huge = self.huge + [h for h in self.huge_start if not self._fell_from_start(h[1])]
        if self.clamped and not huge:
            m0, name, v = self.clamped[0]
            add("loss-magnitude", [m for m, _, _ in self.clamped],
                f"{'the loss' if name == 'loss' else name} reads exactly {v:g} at line {m0.line}, after prints of it at "
                f"{_PRECISE_DIGITS} significant digits or more: BCELoss's clamp, every prediction saturated")
        if huge:
            huge.sort(key=lambda h: h[0].line)
            m0, name, v = huge[0]
            add("loss-magnitude", list({m.line: m for m, _, _ in huge}.values()),
                f"{'the loss' if name == 'loss' else name} reached {v:.3g} at line {m0.line} (limit {r.loss_abs_max:g}, either sign)")
        if self.kl_blow and self.kl_low:
            (lm, _, lv), (bm, name, bv) = self.kl_low, self.kl_blow
            add("kl-blowup", [lm, bm], f"{name} reached {bv:g} at line {bm.line} after {lv:g} at line {lm.line} (kl_max {r.kl_max:g})")
        elif self.kl_blow:
            bm, name, bv = self.kl_blow
            add("kl-blowup", [bm], f"{name} reached {bv:g} at line {bm.line} (kl_first_max {r.kl_first_max:g})")
        if self.big and not self._big_transient():
            add("grad-norm-explosion", self.big, f"grad norm reached {self.big_max:.3g} (limit {r.grad_norm_max:g})")
        if self.floor and not self.floor_left:
            add("loss-scale-collapse", self.floor, f"the loss scale was cut to {self.floor_min:g} "
                                                   f"(floor {r.loss_scale_floor:g}): every step overflows")
        if len(self.halving_best) >= r.scale_halving_run and self.grew_at <= self.halving_best[-1].line:
            # (a scale logged higher after the run: the scaler grows only after a window of steps without an overflow,
            # so the overflows stopped - a transient, as for loss-scale-collapse)
            ms = self.halving_best
            add("loss-scale-halving", ms, f"the loss scale halved {len(ms)} logs in a row after it had settled "
                                          f"({_scale_of(ms[0]) * 2:g} down to {_scale_of(ms[-1]):g}): fp16 overflow at every step")
        self._judge_game()
        self._game_hits(add)
        self._close_run()
        self._close_still()
        stuck = self.side_stuck
        if self.flat:
            add("flat-loss", self.flat[0], self.flat[1])
        elif stuck:
            add("flat-loss", [stuck.head[0][0], stuck.tail[-1][0]],
                f"{stuck.name} logged {stuck.head[0][1]:g} at every one of its {stuck.count} logs: that side of the game never moved")
        elif self.flat_before and not self._last_run_learned():
            add("flat-loss", self.flat_before[0], self.flat_before[1])
        return out

    def _game_hits(self, add) -> None:
        """A GAN's game gone wrong: its discriminator won (discriminator-won), its WGAN critic blew up (critic-blowup)."""
        if self.game_over:
            d, g = self.game_over
            add("discriminator-won", [d.tail[-1][0], g.head[0][0], g.tail[-1][0]],
                f"{d.name} fell to {d.tail_median():.3g} (median of its last {len(d.tail)} values, from {d.head_max():.3g}) "
                f"while {g.name} rose from {g.head_median():.3g} to {g.tail_median():.3g}")
        critic = self.critic_blown
        if critic:
            add("critic-blowup", [critic.head[0][0], critic.tail[-1][0]],
                f"the critic's {critic.name} went from at most {max(abs(v) for _, v in critic.head):.3g} in magnitude over its "
                f"first {len(critic.head)} values to a median of {critic.tail_median():.3g} over its last {len(critic.tail)}")


def _reward_moves(run: list[Metric]) -> bool:
    """The records log a reward that takes more than one value, and no grad norm of exactly 0."""
    rewards = {m.reward for m in run if m.reward is not None and math.isfinite(m.reward)}
    return len(rewards) > 1 and not any(m.grad_norm == 0 for m in run)


# Records remembered to see a record line printed again (see NumberRules.feed).
PRINTED_RECENT = 1000


class _Side:
    """One side of a GAN's game (a loss named with an adversarial word): its first and last game_window finite
    values, and how many it logged."""

    __slots__ = ("name", "discriminator", "head", "tail", "count", "window", "moved")

    def __init__(self, name: str, window: int, discriminator: bool):
        self.name, self.discriminator, self.window = name, discriminator, window
        self.head: list[tuple[Metric, float]] = []
        self.tail: deque[tuple[Metric, float]] = deque(maxlen=window)
        self.count = 0
        self.moved = False  # a value other than its first was logged

    def feed(self, m: Metric, v: float):
        if not math.isfinite(v):
            return
        self.count += 1
        self.moved = self.moved or (bool(self.head) and v != self.head[0][1])
        if len(self.head) < self.window:
            self.head.append((m, v))
        self.tail.append((m, v))

    def head_median(self) -> float:
        return _median([v for _, v in self.head])

    def tail_median(self) -> float:
        return _median([v for _, v in self.tail])

    def head_max(self) -> float:
        return max(v for _, v in self.head)

    def tail_min(self) -> float:
        return min(v for _, v in self.tail)


# Lines of non-finite records remembered to set a transient's word hits aside; past this many, none are.
MAX_TRANSIENT_LINES = 4096
# Windows remembered for the recurring-losses rule: a repeat further apart than this many logs goes unseen.
MAX_WINDOWS = 20_000
# Loss series of earlier runs in one log kept for their own spikes and rise (a log of more runs keeps the first).
MAX_CLOSED_SERIES = 64


def _scale_of(m: Metric) -> float:
    if m.loss_scale is not None:
        return m.loss_scale
    return next((v for k, v in m.named.items() if k.startswith("loss_scale:")), math.nan)


def _value(m: Metric, name: str) -> float:
    return m.loss if name == "loss" else m.named.get(f"loss:{name}", math.nan)


# --- failure evidence --------------------------------------------------------------------------


def last_exception(log: Log, comp: Compiled) -> tuple[int, str] | None:
    """The last exception line (1-based in the whole log, and its text) that is not a benign_lines line (Numba's
    warning quoting, indented, the typing error it fell back from)."""
    if not _EXCEPTION_WORD.search(log.text):
        return None
    found = list(_EXCEPTION_M.finditer(log.text))
    for last in reversed(found):
        i = log.line_of(last.start())
        if _not_benign(log, comp, {i}):
            return i + log.first_line, log.lines[i]
    return None


_DURING = "During handling of the above exception, another exception occurred:"


def interrupted_failure(log: Log, comp: Compiled) -> tuple[int, str] | None:
    """The last exception (line, 1-based in the whole log, and its text) that a KeyboardInterrupt was raised while handling
    - Python chains them: the exception, "During handling of the above exception, another exception occurred:", then a
    traceback ending in KeyboardInterrupt. The process had already failed and hung in its clean-up (multiprocessing
    joining a worker at exit) until someone pressed Ctrl-C: the failure is the exception, not the stop. The exception
    must be its chain's first: one raised while handling an interrupt (IPython failing to render it) is the stop's."""
    pos = log.text.rfind(_DURING)
    while pos >= 0:
        i = log.line_of(pos)
        above = next((k for k in range(i - 1, max(-1, i - 4), -1) if log.clean[k].strip()), None)
        after = next((m for m in _EXCEPTION_M.finditer(log.text, pos + len(_DURING))), None)
        head = log.text.rfind("Traceback (most recent call last)", 0, log.starts[above]) if above is not None else -1
        before = log.text[max(0, head - 200):head] if head >= 0 else ""
        if (above is not None and (m := _EXCEPTION_M.match(log.clean[above])) and m.group(1) != "KeyboardInterrupt"
                and after is not None and after.group(1) == "KeyboardInterrupt" and _DURING not in before
                and _not_benign(log, comp, {above})):
            return above + log.first_line, log.lines[above]
        pos = log.text.rfind(_DURING, 0, pos)
    return None


def last_traceback(log: Log) -> int | None:
    pos = log.text.rfind("Traceback (most recent call last)")
    return None if pos < 0 else log.line_of(pos) + log.first_line


# A frame of IPython's traceback of a notebook cell: `<ipython-input-9-95de...>` (IPython 7), `/tmp/ipykernel_451042/
# 622961601.py` (ipykernel 6 names a cell's code so; on Windows `~\AppData\Local\Temp\ipykernel_6156\1376251600.py`),
# `Cell In[12], line 3` (8), `Input In [5]` (8.0-8.4).
_IPYTHON_CELL = re.compile(r"<ipython-input-\d+-[0-9a-f]+>|[/\\]ipykernel_\d+[/\\]\d+\.py\b|\bCell In\s?\[\d+\]|\bInput In \[\d+\]")


def last_cell_frame(log: Log) -> int | None:
    """The line (1-based, in the whole log) of the last frame of a notebook cell's traceback."""
    if not any(w in log.text for w in ("ipython-input-", "ipykernel_", "In [", "In[")):
        return None
    found = log.scan(_IPYTHON_CELL)
    return max(found) + log.first_line if found else None


def traceback_cut(head: int | None, exception: tuple[int, str] | None) -> bool:
    """The last traceback header (`head`) has no exception line after it: the excerpt stops inside the traceback."""
    return head is not None and (exception is None or exception[0] < head)


def fallback_rule(comp: Compiled, exception: tuple[int, str] | None, markers: list[tuple[int, str]], cut: bool = False,
                  tail: list[str] = ()):
    """The fallback rule for a failure no signal names: by the exception line, else the last markers
    (the innermost traceback frames, where an excerpt cut before the exception line stops); a traceback
    cut short is read by the table's cut_traceback rules first, on the log's last lines (frames and their code)."""
    if cut or exception is None:
        frames = "\n".join(tail)
        for rule, rx in comp.cut_traceback:
            if rx.search(frames):
                return rule
    # The rules read the lines as the patterns do, without a launcher's or logger's prefix ([rank0]: KeyError).
    text = clean_line(exception[1]) if exception else "\n".join(clean_line(t) for _, t in markers[-3:])
    for rule, rx, frames_rx in comp.fallback:
        if rx.search(text) and (frames_rx is None or frames_rx.search("\n".join(tail))):
            return rule
    return comp.fallback[-1][0]


# --- all of it ---------------------------------------------------------------------------------

# The last lines kept for a traceback cut short: its innermost frames and the code lines under them.
TAIL_LINES = 8


def _merge_hits(by_id: dict[str, Hit], hits, most: int | None = None) -> None:
    """Add hits to by_id; a rule already hit keeps one Hit with the lines of both (the first `most` of them)."""
    for h in hits:
        have = by_id.get(h.id)
        if have is None:
            by_id[h.id] = h
        else:
            have.lines = sorted(set(have.lines) | set(h.lines))[:most]
            have.detail = have.detail or h.detail
            have.last = max(have.last, h.last)


def find(text: str, *, exit_info: dict | None = None, table=None) -> Findings:
    """Everything a log shows: word signals, numeric signals over its parsed metrics, exit status, markers."""
    if not isinstance(text, str):
        raise BadInput(f"log text must be a string, got {type(text).__name__}", fix="read the log file as text first")
    comp = compiled(table)
    log = Log(text)
    code, sig_no, stopped_by = exit_fields(exit_info)
    metrics = parse_text(text, comp.keys, lines=log.lines, cleaned=log.clean, code=log.code)
    by_id = word_hits(log, comp, {m.line - 1 for m in metrics})
    for k, h in exit_hits(comp, code, sig_no, stopped_by).items():
        have = by_id.setdefault(k, h)
        have.detail = have.detail or h.detail
    rules = _number_rules(metrics, comp)
    _merge_hits(by_id, rules.hits())
    transient = _set_aside_transients(by_id, rules)
    _merge_hits(by_id, nonfinite_metric_hits(log, comp))
    marked, level = _failure_lines(log, comp)
    level_only = bool(level) and level >= marked
    marked |= level
    markers = _ends([(i + 1, log.lines[i]) for i in sorted(marked)])
    finished = last_finished(log, comp)
    launched = last_launch(log, comp)
    cell_frame = last_cell_frame(log)
    exc = last_exception(log, comp)
    interrupted = interrupted_failure(log, comp)
    head = last_traceback(log)
    threads = Threads()
    threads.feed(log)
    bar_done = max(last_bar_done(log) or 0, last_bar_ran(metrics, comp.table.records.went_on_records) or 0) or None
    dropped: list[Hit] = []
    if stopped_by:
        dropped = [h for h in by_id.values() if h.signal.explained_by_stop]
        by_id = {k: h for k, h in by_id.items() if not h.signal.explained_by_stop}
    return Findings(list(by_id.values()), metrics, markers, exc, traceback_cut(head, exc), code, sig_no, stopped_by, dropped, comp.table,
                    tail=log.clean[-TAIL_LINES:], record_lines=[m.line for m in metrics[max(0, len(metrics) - comp.table.records.went_on_records):]],
                    progress_lines=progress_lines(log, comp.table.records.went_on_records), threads=threads, bar_done=bar_done, transient=transient, finished=finished, last_traceback_at=head,
                    cell_frame_at=cell_frame, level_only=level_only, line_count=len(log.lines), launched_at=launched,
                    interrupted_failing=interrupted)


# A log up to this size is read whole; a bigger one is streamed in chunks of whole lines, so memory stays
# bounded by the chunk, whatever the log's size (triage_failure on a 100 MB log: bench/bench_triage_big.py).
WHOLE_BYTES = 8 << 20
CHUNK_BYTES = 2 << 20


def find_file(path, *, exit_info: dict | None = None, table=None) -> Findings:
    """find() over a log file of any size: a small one read whole, a big one streamed once, chunk by chunk.

    Every chunk gets the same word scan, failure markers and metric parsing as a whole log; the numeric
    rules run over the whole curve (NumberRules keeps bounded state), the exception and traceback are the
    last ones in the file (the tail), and evidence lines keep their line numbers in the whole file.
    """
    import os

    path = str(path)
    size = os.path.getsize(path)
    if size <= WHOLE_BYTES:
        with open(path, "rb") as fh:
            return find(decode_log(fh.read()), exit_info=exit_info, table=table)
    comp = compiled(table)
    code, sig_no, stopped_by = exit_fields(exit_info)
    by_id: dict[str, Hit] = {}
    rules = NumberRules(comp)
    metric_table = MetricTable(comp.keys)  # a table header read in one chunk holds for the next
    markers: list[tuple[int, str]] = []
    exc: tuple[int, str] | None = None
    head: int | None = None
    tail_metrics: list[Metric] = []
    record_lines: deque[int] = deque(maxlen=comp.table.records.went_on_records or 1)
    threads = Threads()
    bar_done: int | None = None
    finished: tuple[int, str] | None = None
    launched: int | None = None
    cell_frame: int | None = None
    interrupted: tuple[int, str] | None = None
    prev: Metric | None = None
    first_line = 1
    tail: list[str] = []
    progress: deque[int] = deque(maxlen=comp.table.records.went_on_records or 1)
    wrap: int | None | bool = True
    other_marked = level_marked = False  # a failure line that is not a logger's level line / one that is
    nonfinite = NonfiniteKeys(comp)
    with open(path, "rb") as fh:
        decoder = codecs.getincrementaldecoder(log_encoding(fh.read(4096)))(errors="replace")
        fh.seek(0)
        carry = ""
        while True:
            block = fh.read(CHUNK_BYTES)
            data = carry + decoder.decode(block, final=not block)
            if not data:
                break
            cut = data.rfind("\n") if block else len(data) - 1
            if cut < 0:
                carry = data
                continue
            chunk, carry = data[:cut + 1], data[cut + 1:]
            del data  # one copy of the chunk in memory, not two
            log = Log(chunk, first_line=first_line, wrap=wrap)
            wrap = log.wrap  # the first chunk's answer holds for the rest (see parse.clean_lines_at)
            chunk_metrics = list(line_metrics(log.lines, log.clean, log.code, comp.keys, metric_table, first_line, end=not block))
            _merge_hits(by_id, list(word_hits(log, comp, {m.line - first_line for m in chunk_metrics}).values()),
                        most=MAX_LINES_PER_HIT * 4)
            nonfinite.feed(log)
            # A logger's error line 8 MB before the end is one the run logged past: levels only in the last WHOLE_BYTES.
            marked, level = _failure_lines(log, comp, levels=fh.tell() >= size - WHOLE_BYTES)
            other_marked = other_marked or bool(marked - level)
            level_marked = level_marked or bool(level)
            marked |= level
            markers = _ends(markers + [(i + first_line, log.lines[i]) for i in sorted(marked)])
            exc = last_exception(log, comp) or exc
            head = last_traceback(log) or head
            threads.feed(log)
            bar_done = last_bar_done(log) or bar_done
            finished = last_finished(log, comp) or finished
            launched = last_launch(log, comp) or launched
            cell_frame = last_cell_frame(log) or cell_frame
            interrupted = interrupted_failure(log, comp) or interrupted
            tail_metrics = []
            for m in chunk_metrics:
                if prev is not None and same_record(prev, m):
                    continue
                rules.feed(m)
                tail_metrics.append(m)
                record_lines.append(m.line)
                prev = m
            bar_done = max(bar_done or 0, last_bar_ran(tail_metrics, comp.table.records.went_on_records) or 0) or None
            tail = (tail + log.clean)[-TAIL_LINES:]
            progress.extend(progress_lines(log, comp.table.records.went_on_records))
            first_line += len(log.lines)
            if not block:
                break
    for k, h in exit_hits(comp, code, sig_no, stopped_by).items():
        have = by_id.setdefault(k, h)
        have.detail = have.detail or h.detail
    _merge_hits(by_id, rules.hits())
    transient = _set_aside_transients(by_id, rules)
    _merge_hits(by_id, nonfinite.hits())
    dropped: list[Hit] = []
    if stopped_by:
        dropped = [h for h in by_id.values() if h.signal.explained_by_stop]
        by_id = {k: h for k, h in by_id.items() if not h.signal.explained_by_stop}
    return Findings(list(by_id.values()), tail_metrics, markers, exc, traceback_cut(head, exc), code, sig_no, stopped_by, dropped, comp.table,
                    summary=rules.summary(), tail=tail, record_lines=list(record_lines),
                    progress_lines=list(progress), threads=threads, bar_done=bar_done,
                    transient=transient, finished=finished, last_traceback_at=head, cell_frame_at=cell_frame,
                    level_only=level_marked and not other_marked, line_count=first_line - 1, launched_at=launched,
                    interrupted_failing=interrupted)


def _not_benign(log: Log, comp: Compiled, lines: set[int]) -> set[int]:
    """The failure lines (0-based indexes) that are not a benign_lines line (a tool's message when nothing failed)."""
    if not comp.benign:
        return lines
    return {i for i in lines if not any(b.search(log.clean[i]) for b in comp.benign)}


def _ends(items: list, most: int = MAX_MARKERS) -> list:
    """The first and last most/2 of a long list (the first failure and the last frames both matter)."""
    return items if len(items) <= most else items[:most // 2] + items[-(most // 2):]


def find_in_records(records: list, *, table=None) -> Findings:
    """The numeric signals of a list of progress records ({"step", "loss", ...}); a null loss is NaN."""
    if not isinstance(records, list):
        raise BadInput("records must be a list of dicts", fix="pass poll_progress's records list")
    comp = compiled(table)
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise BadInput(f"progress record {i} is not an object: {rec!r}", where=f"record {i}", fix="pass dicts like {'step': 1, 'loss': 2.3}")
        for key in ("loss", "grad_norm"):
            v = rec.get(key)
            if v is not None and not isinstance(v, (int, float)) and (not isinstance(v, str) or _bad_number(v)):
                raise BadInput(f"progress record {i}: {key} {v!r} is not a number", where=f"record {i}.{key}", fix="log numbers (or null for NaN)")
    metrics = parse_records(records, comp.keys)
    return Findings(number_hits(metrics, comp), metrics, [], None, False, table=comp.table)


def _bad_number(v: str) -> bool:
    return to_number(v) is None
