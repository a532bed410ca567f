"""Reads dataset records (JSONL, JSON, CSV/TSV), detects their shape, converts lossless variants and validates them.

Stdlib only: the server runs it for a fast first pass and the prepare_data job runs the very same code
on the same source, so both see identical records. Tables from the dataset-curation skill arrive as
plain dicts. Every problem is a dict {severity, code, message, file, line, record, field}; `record` is
the 0-based index in the source order, `line` the 1-based line in the file where the record starts.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from finetune_mcp.common import convert as C
from finetune_mcp.common.proto import JobError

TEXT_EXTS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv"}
ARROW_EXTS = {".parquet": "parquet", ".arrow": "arrow"}
_SPLIT_WORDS = re.compile(r"(^|[-_.])(test|valid|validation|eval|dev)([-_.]|$)", re.I)
_TRAIN_WORD = re.compile(r"(^|[-_.])train([-_.]|$)", re.I)
# Columns of a CSV that hold JSON (lists of messages and the like) rather than plain text.
_JSON_COLUMNS = ("messages", "conversations", "prompt", "completion", "chosen", "rejected", "images", "tools")
_TEXT_OR_JSON = ("prompt", "completion", "chosen", "rejected")  # standard (text) rows use these too


# ---------------------------------------------------------------- problems


def problem(severity: str, code: str, message: str, *, file: str | None = None, line: int | None = None,
            record: int | None = None, field: str | None = None) -> dict:
    return {"severity": severity, "code": code, "message": message, "file": file, "line": line, "record": record, "field": field}


class Sink:
    """Collects problems; lists the first `per_code` of each code and severity and counts the rest."""

    def __init__(self, per_code: int = 25):
        self.per_code = per_code
        self.listed: list[dict] = []
        self.counts: dict[str, dict[str, int]] = {}

    def add(self, p: dict) -> None:
        c = self.counts.setdefault(p["code"], {"error": 0, "warning": 0})
        c[p["severity"]] += 1
        # Counted per severity, so a set-level error after many per-record warnings is still listed; set-level
        # problems (no line, no record) are few and carry the summary, so they are always listed.
        if c[p["severity"]] <= self.per_code or (p["line"] is None and p["record"] is None):
            self.listed.append(p)

    def error(self, code: str, message: str, **where) -> None:
        self.add(problem("error", code, message, **where))

    def warn(self, code: str, message: str, **where) -> None:
        self.add(problem("warning", code, message, **where))

    @property
    def errors(self) -> int:
        return sum(c["error"] for c in self.counts.values())

    def counts_of(self, code: str) -> int:
        c = self.counts.get(code)
        return c["error"] if c else 0

    def to_dict(self) -> dict:
        return {"problems": self.listed, "problem_counts": self.counts}


# ---------------------------------------------------------------- reading


@dataclass
class Raw:
    rows: list[Any] = field(default_factory=list)
    origins: list[tuple[str, int | None]] = field(default_factory=list)  # (file, 1-based line or None)
    files: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def source_files(path: Path) -> tuple[str, list[Path], list[Path]]:
    """(kind, files, ignored) for a file or folder. kind: text | parquet | arrow | save_to_disk."""
    path = Path(path)
    if path.is_file():
        ext = path.suffix.lower()
        if ext in TEXT_EXTS:
            return "text", [path], []
        if ext in ARROW_EXTS:
            return ARROW_EXTS[ext], [path], []
        raise JobError(
            f"unsupported source file type {ext or '(none)'!r}", kind="BadInput", where=str(path),
            fix="give a .jsonl, .json, .csv, .tsv or .parquet file, a folder of them, a save_to_disk folder, or an HF dataset id",
        )
    if not path.is_dir():
        raise JobError(f"source {str(path)!r} not found", kind="NotFound", where=str(path),
                       fix="pass an existing file or folder, or an HF dataset id that is in the local HF cache")
    if (path / "dataset_info.json").is_file() and (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return "save_to_disk", [path], []
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    by_kind: dict[str, list[Path]] = {}
    for p in files:
        ext = p.suffix.lower()
        kind = "text" if ext in TEXT_EXTS else ARROW_EXTS.get(ext)
        if kind:
            by_kind.setdefault(kind, []).append(p)
    if not by_kind:
        raise JobError(f"folder {str(path)!r} holds no .jsonl, .json, .csv, .tsv or .parquet files", kind="BadInput", where=str(path),
                       fix="point source at the data file, or at a folder of data files")
    if len(by_kind) > 1:
        raise JobError(f"folder {str(path)!r} mixes file kinds ({', '.join(sorted(by_kind))})", kind="BadInput", where=str(path),
                       fix="keep one kind of data file in the folder, or pass one file")
    kind, chosen = next(iter(by_kind.items()))
    if kind == "text" and len({p.suffix.lower() for p in chosen}) > 1:
        raise JobError(f"folder {str(path)!r} mixes {', '.join(sorted({p.suffix for p in chosen}))} files", kind="BadInput", where=str(path),
                       fix="keep one kind of data file in the folder, or pass one file")
    # A folder with train and test/validation files: train on the train files only, so somebody's held-out
    # split never leaks into training.
    train = [p for p in chosen if _TRAIN_WORD.search(p.stem)]
    held = [p for p in chosen if _SPLIT_WORDS.search(p.stem)]
    if train and held:
        return kind, train, [p for p in chosen if p not in train]
    return kind, chosen, []


def _line_of_offset(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def read_text_file(path: Path, sink: Sink) -> Raw:
    """Rows of one JSONL/JSON/CSV/TSV file; malformed parts become problems, never exceptions."""
    fmt = TEXT_EXTS[path.suffix.lower()]
    f = str(path)
    raw = Raw(files=[f])
    try:
        data = path.read_bytes()
    except OSError as e:
        sink.error("unreadable", f"cannot read the file: {e.strerror}", file=f)
        return raw
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if fmt == "jsonl":
        _read_jsonl(data, f, raw, sink)
    elif fmt == "json":
        _read_json(data, f, raw, sink)
    else:
        _read_csv(data, f, raw, sink, "\t" if fmt == "tsv" else ",")
    return raw


def _read_jsonl(data: bytes, f: str, raw: Raw, sink: Sink) -> None:
    decoder = json.JSONDecoder()
    for lineno, bline in enumerate(data.split(b"\n"), start=1):
        if not bline.strip():
            continue
        try:
            line = bline.decode("utf-8")
        except UnicodeDecodeError as e:
            sink.error("invalid-utf8", f"bytes that are not UTF-8 at column {e.start + 1} ({bline[e.start:e.start + 4]!r})", file=f, line=lineno)
            continue
        try:
            obj, end = decoder.raw_decode(line.strip())
            if line.strip()[end:].strip():
                raise json.JSONDecodeError("extra data after the JSON value", line.strip(), end)
        except json.JSONDecodeError as e:
            sink.error("malformed-json", f"not valid JSON: {e.msg} at column {e.colno}", file=f, line=lineno)
            continue
        except RecursionError:
            sink.error("malformed-json", "JSON nested too deeply", file=f, line=lineno)
            continue
        raw.rows.append(obj)
        raw.origins.append((f, lineno))



def _decode_at(decoder, s: str, pos: int, text: str, base: int, f, sink):
    """One JSON value at s[pos:], or None after recording where and why it is malformed."""
    try:
        return decoder.raw_decode(s, pos)
    except json.JSONDecodeError as e:
        sink.error("malformed-json", f"not valid JSON: {e.msg}", file=f, line=_line_of_offset(text, base + e.pos))
    except RecursionError:
        sink.error("malformed-json", "JSON nested too deeply", file=f, line=_line_of_offset(text, base + pos))
    return None

def _read_json(data: bytes, f: str, raw: Raw, sink: Sink) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        sink.error("invalid-utf8", f"bytes that are not UTF-8 at byte {e.start}", file=f, line=line)
        return
    decoder = json.JSONDecoder()
    s = text.lstrip()
    base = len(text) - len(s)
    if not s:
        return
    if s[0] != "[":
        # A single object, or JSON lines saved as .json.
        pos = 0
        while pos < len(s):
            while pos < len(s) and s[pos] in " \t\r\n":
                pos += 1
            if pos >= len(s):
                break
            decoded = _decode_at(decoder, s, pos, text, base, f, sink)
            if decoded is None:
                return
            obj, end = decoded
            if isinstance(obj, dict) and pos == 0 and end >= len(s.rstrip()):
                # {"data": [...]} / {"train": [...]} wrappers hold the rows in one list.
                lists = [k for k, v in obj.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
                key = next((k for k in ("data", "rows", "train", "examples", "records") if k in lists), None)
                if key is not None and len(obj) <= 3:
                    line = _line_of_offset(text, base)
                    for row in obj[key]:
                        raw.rows.append(row)
                        raw.origins.append((f, line))
                    return
            raw.rows.append(obj)
            raw.origins.append((f, _line_of_offset(text, base + pos)))
            pos = end
        return
    # A JSON array: decode element by element to know each record's line.
    pos, n = 1, len(s)
    state = "first"  # first: a value or ']'; value: a value; sep: ',' or ']'
    while True:
        while pos < n and s[pos] in " \t\r\n":
            pos += 1
        if pos >= n:
            sink.error("malformed-json", "the JSON array is not closed", file=f, line=_line_of_offset(text, base + n))
            return
        ch = s[pos]
        if ch == "]" and state in ("first", "sep"):
            if s[pos + 1:].strip():
                sink.error("malformed-json", "extra data after the JSON array", file=f, line=_line_of_offset(text, base + pos + 1))
            return
        if state == "sep":
            if ch != ",":
                sink.error("malformed-json", "expected ',' or ']' between array elements", file=f, line=_line_of_offset(text, base + pos))
                return
            pos += 1
            state = "value"
            continue
        decoded = _decode_at(decoder, s, pos, text, base, f, sink)
        if decoded is None:
            return
        obj, end = decoded
        raw.rows.append(obj)
        raw.origins.append((f, _line_of_offset(text, base + pos)))
        pos = end
        state = "sep"


def _read_csv(data: bytes, f: str, raw: Raw, sink: Sink, delimiter: str) -> None:
    # surrogateescape keeps going past bad bytes so every bad line is reported, not just the first.
    text = data.decode("utf-8", "surrogateescape")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as e:
        sink.error("malformed-json", f"CSV header cannot be parsed: {e}", file=f, line=1)
        return
    header = [h.strip() for h in header]
    if any(_has_surrogates(h) for h in header):
        sink.error("invalid-utf8", "bytes that are not UTF-8 in the header", file=f, line=1)
        return
    start = reader.line_num + 1
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            sink.error("malformed-json", f"CSV row cannot be parsed: {e}", file=f, line=start)
            break
        line = start
        start = reader.line_num + 1
        if not any(c.strip() for c in cells):
            continue
        if len(cells) != len(header):
            sink.error("malformed-json", f"{len(cells)} cells where the header has {len(header)} columns", file=f, line=line)
            continue
        row: dict[str, Any] = {}
        bad = False
        for col, val in zip(header, cells):
            if _has_surrogates(val):
                sink.error("invalid-utf8", "bytes that are not UTF-8", file=f, line=line, field=col)
                bad = True
                continue
            if col in _JSON_COLUMNS and val.strip()[:1] in ("[", "{"):
                try:
                    val = json.loads(val)
                except (json.JSONDecodeError, RecursionError) as e:
                    if col in _TEXT_OR_JSON:
                        pass  # plain text that happens to start with a bracket, e.g. "[INST] ..."
                    else:
                        sink.error("malformed-json", f"the {col} cell is not valid JSON: {getattr(e, 'msg', 'nested too deeply')}", file=f, line=line, field=col)
                        bad = True
                        continue
            row[col] = val
        if not bad:
            raw.rows.append(row)
            raw.origins.append((f, line))


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def read_text_source(path: Path, per_code: int = 25) -> tuple[Raw, Sink]:
    kind, files, ignored = source_files(path)
    if kind != "text":
        raise JobError(f"{kind} sources are read by the worker", kind="BadInput")
    sink = Sink(per_code)
    raw = Raw(ignored=[str(p) for p in ignored])
    for p in files:
        part = read_text_file(p, sink)
        raw.rows += part.rows
        raw.origins += part.origins
        raw.files += part.files
    return raw, sink


def file_digests(paths: list[str]) -> dict[str, str]:
    out = {}
    for p in paths:
        h = hashlib.sha256()
        pp = Path(p)
        if pp.is_dir():
            for q in sorted(x for x in pp.rglob("*") if x.is_file()):
                h.update(str(q.relative_to(pp)).encode())
                with open(q, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
        else:
            with open(pp, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        out[p] = h.hexdigest()
    return out


# ---------------------------------------------------------------- shapes and formats


shape_of, detect_shape = C.shape_of, C.detect_shape


def plan_format(shape: str, method: str, formats: dict, needs_reference: bool = True) -> tuple[str, list[str]]:
    """(target format, conversion ids in order) for a detected shape and method; JobError(BadInput) when refused."""
    try:
        return C.plan(shape, method, formats, needs_reference)
    except C.Refusal as r:
        raise JobError(r.message, kind="BadInput", where="source (first records)", fix=r.fix) from None


# ---------------------------------------------------------------- validation


@dataclass
class Checked:
    records: list[dict]
    origins: list[tuple[str, int | None, int]]  # (file, line, source record index)
    shape: str
    format: str
    conversion: str | None
    read: int
    dropped: dict[str, int]
    reference_field: str | None
    sink: Sink
    extra: dict = field(default_factory=dict)


class _V:
    """Validation of one record; `at` carries file/line/record for every problem it raises."""

    def __init__(self, sink: Sink, roles: list[str], at: dict, vision: bool = False):
        self.sink, self.roles, self.at, self.vision = sink, roles, at, vision
        self.ok = True
        self.placeholders = 0

    def err(self, code: str, msg: str, fld: str) -> None:
        self.ok = False
        self.sink.error(code, msg, field=fld, **self.at)

    def text(self, v: Any, fld: str, what: str, empty_code: str = "empty-field") -> None:
        if not isinstance(v, str):
            self.err("wrong-type", f"{what} must be text, got {_type(v)}", fld)
        elif not v.strip():
            self.err(empty_code, f"{what} is empty", fld)

    def turns(self, msgs: Any, fld: str, kind: str) -> None:
        """kind: conversation (ends on assistant), prompt (ends on user/tool), completion (assistant turns)."""
        if not isinstance(msgs, list):
            self.err("wrong-type", f"{fld} must be a list of messages, got {_type(msgs)}", fld)
            return
        if not msgs:
            self.err("empty-field", f"{fld} has no messages", fld)
            return
        roles: list[str | None] = []
        for i, m in enumerate(msgs):
            f = f"{fld}[{i}]"
            if not isinstance(m, dict):
                self.err("wrong-type", f"message must be an object with role and content, got {_type(m)}", f)
                roles.append(None)
                continue
            role = m.get("role")
            if "role" not in m:
                self.err("missing-field", "message has no role", f + ".role")
                roles.append(None)
                continue
            if not isinstance(role, str) or role not in self.roles:
                self.err("unknown-role", f"role {role!r} is not one of {', '.join(self.roles)}", f + ".role")
                roles.append(None)
                continue
            roles.append(role)
            self.content(m, f, role)
        if None in roles:
            return
        self.order(roles, fld, kind)

    def content(self, m: dict, f: str, role: str) -> None:
        has_tools = bool(m.get("tool_calls")) and role == "assistant"
        if "content" not in m or m["content"] is None:
            if not has_tools:
                if "content" not in m:
                    self.err("missing-field", f"{role} message has no content", f + ".content")
                else:
                    self.err("non-string-content", f"{role} message content is null", f + ".content")
            return
        c = m["content"]
        if isinstance(c, list) and self.vision:
            texts = []
            for j, part in enumerate(c):
                pf = f"{f}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                    self.err("non-string-content", "a content part must be {\"type\": \"text\", \"text\": ...} or {\"type\": \"image\"}", pf)
                elif part["type"] == "image":
                    self.placeholders += 1
                elif not isinstance(part.get("text"), str):
                    self.err("non-string-content", f"text part holds {_type(part.get('text'))}, not text", pf + ".text")
                else:
                    texts.append(part["text"])
            if role == "assistant" and not "".join(texts).strip() and not has_tools:
                self.err("empty-assistant", "assistant turn has no text", f + ".content")
            return
        if not isinstance(c, str):
            self.err("non-string-content", f"{role} content must be text, got {_type(c)}", f + ".content")
            return
        if not c.strip() and not has_tools:
            if role == "assistant":
                self.err("empty-assistant", "assistant turn is empty", f + ".content")
            else:
                self.err("empty-field", f"{role} turn is empty", f + ".content")

    def order(self, roles: list[str], fld: str, kind: str) -> None:
        if kind == "completion":
            if roles[0] != "assistant":
                self.err("roles-order", f"{fld} must start with an assistant turn, not {roles[0]}", f"{fld}[0].role")
            for i, r in enumerate(roles):
                if r not in ("assistant", "tool"):
                    self.err("roles-order", f"{fld} holds a {r} turn; only assistant (and tool) turns belong in a completion", f"{fld}[{i}].role")
                    break
            return
        prev = None
        for i, r in enumerate(roles):
            f = f"{fld}[{i}].role"
            if r == "system":
                if i != 0:
                    self.err("roles-order", f"system turn at position {i}; only the first turn may be system", f)
                    return
                continue
            if prev is None:
                if r != "user":
                    self.err("roles-order", f"the first turn after any system turn must be user, not {r}", f)
                    return
            elif r == prev and r in ("user", "assistant"):
                self.err("roles-order", f"two {r} turns in a row (positions {i - 1} and {i}); turns must alternate", f)
                return
            elif prev == "user" and r == "tool":
                self.err("roles-order", f"tool turn at position {i} follows a user turn; tool results follow an assistant turn", f)
                return
            elif prev == "tool" and r == "user":
                self.err("roles-order", f"user turn at position {i} follows a tool result; the assistant should answer it first", f)
                return
            prev = r
        if prev is None:
            self.err("roles-order", f"{fld} holds only system turns", f"{fld}[0].role")
        elif kind == "conversation":
            if "assistant" not in roles:
                self.err("roles-order", f"{fld} has no assistant turn, so nothing would be trained", f"{fld}")
            elif prev != "assistant":
                self.err("roles-order", f"{fld} ends with a {prev} turn; nothing after the last assistant turn is trained", f"{fld}[{len(roles) - 1}].role")
        elif kind == "prompt" and prev == "assistant":
            self.err("roles-order", "the prompt ends with an assistant turn; that answer belongs in the completion", f"{fld}[{len(roles) - 1}].role")


MAIN_FIELDS = {"messages": "messages", "vision": "messages", "prompt-completion": "prompt/completion", "text": "text",
               "preference": "prompt/chosen/rejected", "kto": "prompt/completion/label", "grpo": "prompt"}


def main_field(fmt: str) -> str:
    """The column(s) a whole-record problem (a duplicate, a length) is about."""
    return MAIN_FIELDS.get(fmt, "record")


def _type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "text", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


_label = C.label_value


def check_records(
    raw: Raw,
    sink: Sink,
    *,
    method: str,
    formats: dict,
    validation: dict,
    path_ok: Callable[[Path], bool] | None = None,
    fill: dict[str, str] | None = None,
    keep_placeholders: bool = False,
    needs_reference: bool = True,
    provenance: str | None = None,
) -> Checked:
    """Convert, validate and normalise every row. Structural problems are errors; exact duplicates are dropped
    (warning, or error above the skill's share). Raises JobError(BadInput) when the shape cannot fit.

    fill: {{name}} placeholders to fill before anything else (the brief's `fill:`); placeholders left over are
    errors unless keep_placeholders. needs_reference: whether GRPO's rewards need a reference-answer column.
    provenance: what the brief or the data's card states (None: unstated); a many-copies set fails only when it is
    stated synthetic, the collapse the guard exists for; otherwise the copies are removed and reported."""
    report = C.Report()
    if not any(isinstance(r, dict) for r in raw.rows):
        return _nothing_readable(raw, sink, method, formats, report)
    plan = _Plan.of(raw, method, formats, needs_reference)
    fill = dict(fill or {})
    kept = _Kept()
    unfilled: dict[str, list[str]] = {}
    ref_field: str | None = None
    for idx, (row, (f, line)) in enumerate(zip(raw.rows, raw.origins)):
        at = {"file": f, "line": line, "record": idx}
        if not isinstance(row, dict):
            sink.error("not-an-object", f"record is {_type(row)}, not an object with the format's columns", **at)
            continue
        row = _convert_row(row, plan, C.Cx(sink, at, report), fill, report)
        if row is None:
            continue
        # Pairs bound for KTO are checked as the pairs they are, then unpaired.
        outs = _validate(row, plan.check_fmt, at, sink, plan.roles, plan.refs, raw, path_ok, needs_reference)
        if outs is None:
            continue
        row, rf = outs
        if rf:
            ref_field = ref_field or rf
        produced = _produce(row, plan, report)
        pkeys = [record_key(rec) for rec in produced]
        if not keep_placeholders and any("{{" in k for k in pkeys) and _unfilled(row, at, unfilled, sink):
            continue
        for rec, key in zip(produced, pkeys):
            kept.add(rec, key, at, plan.fmt, sink)
    _share_rules(raw, plan.fmt, kept, unfilled, fill, report, validation, provenance, sink)
    conv_report = {"source_shape": plan.shape, "steps": plan.path, **report.to_dict(),
                   "filled": {k: {"value": fill[k], "records": n} for k, n in report.filled.items()}}
    return Checked(kept.records, kept.origins, plan.shape, plan.fmt, " → ".join(plan.path) or None, len(raw.rows),
                   {"exact-duplicate": len(kept.dups)}, ref_field, sink,
                   extra={"labels": kept.labels if plan.fmt == "kto" else None, "keys": kept.keys, "report": conv_report,
                          "duplicates": kept.dups})


def _nothing_readable(raw: Raw, sink: Sink, method: str, formats: dict, report: C.Report) -> Checked:
    """Nothing readable to judge the shape by: report what was wrong with the lines (or that there were none)."""
    fmt = next(n for n, spec in formats["formats"].items() if method in spec["methods"])
    for idx, (row, (f, line)) in enumerate(zip(raw.rows, raw.origins)):
        sink.error("not-an-object", f"record is {_type(row)}, not an object with the format's columns", file=f, line=line, record=idx)
    if not raw.rows and not sink.errors:
        sink.error("empty-field", "the source holds no records", file=raw.files[0] if raw.files else None)
    return Checked([], [], "unknown", fmt, None, len(raw.rows), {"exact-duplicate": 0}, None, sink, extra={"report": report.to_dict()})


@dataclass
class _Plan:
    """How rows of the source's shape become records of the method's format."""

    shape: str
    fmt: str
    path: list[str]
    steps: list[str]
    unpair: bool
    produces: dict[str, str]
    keep_cols: set[str]
    check_fmt: str
    conversational: tuple[str, ...]
    role_map: dict
    refs: list[str]
    roles: list[str]

    @classmethod
    def of(cls, raw: Raw, method: str, formats: dict, needs_reference: bool) -> "_Plan":
        refs = formats["reference_fields"]
        shape = detect_shape(raw.rows, refs)
        fmt, path = plan_format(shape, method, formats, needs_reference)
        unpair = "preference-to-kto" in path
        spec = formats["formats"][fmt]
        check_fmt = "preference" if unpair else fmt
        return cls(
            shape=shape, fmt=fmt, path=path, steps=[x for x in path if x != "preference-to-kto"], unpair=unpair,
            # Each step knows the shape it produces; a row already past a step (a mixed file) skips it.
            produces={c["id"]: c["target"] for c in formats["conversions"]},
            keep_cols=set(spec["required_fields"]) | set(spec.get("optional_fields", [])),
            check_fmt=check_fmt,
            conversational={"messages": ("messages",), "prompt-completion": ("prompt", "completion"),
                            "preference": ("prompt", "chosen", "rejected"), "kto": ("prompt", "completion"),
                            "grpo": ("prompt",)}.get(check_fmt, ()),
            role_map=next((c["role_map"] for c in formats["conversions"] if c["id"] == "sharegpt-to-messages"), {}),
            refs=refs, roles=formats["roles"])


def _convert_row(row: dict, plan: _Plan, cx: C.Cx, fill: dict, report: C.Report) -> dict | None:
    """One row filled, converted to the target format and normalised; None when a conversion refused it."""
    if fill:
        used: set[str] = set()
        row = C.fill_placeholders(row, fill, used)
        for k in used:
            report.filled[k] += 1
    if plan.check_fmt != "vision":
        row = C.norm_messages(row, cx)
    # Conversions first, so the checks after see the target format.
    for step in plan.steps:
        rshape = shape_of(row, plan.refs)
        if rshape in (plan.produces[step], plan.check_fmt) or (step == "implicit-prompt-preference" and "prompt" in row):
            continue
        row = C.convert(row, step, cx, plan.role_map)
    if plan.check_fmt != "vision":
        for col in plan.conversational:
            if col in row:
                row[col] = C.weigh_turns(row[col], col, cx, "conversation" if col == "messages" else "prompt" if col == "prompt" else "answer")
        if len(plan.conversational) > 1:
            row = C.coerce_pair(row, plan.conversational, cx)
        row = C.norm_tools(row, cx)
    cx.flush()
    return row if cx.ok else None


def _produce(row: dict, plan: _Plan, report: C.Report) -> list[dict]:
    """The records a checked row becomes: itself, or a KTO pair's two halves; columns the format does not keep left out."""
    if plan.unpair:
        rest = {k: v for k, v in row.items() if k not in ("chosen", "rejected")}
        produced = [{**rest, "completion": row["chosen"], "label": True}, {**rest, "completion": row["rejected"], "label": False}]
    else:
        produced = [row]
    if plan.fmt == "grpo":
        return produced
    for rec in produced:
        for k in rec:
            if k not in plan.keep_cols:
                report.left_out[k] += 1
    return [{k: v for k, v in rec.items() if k in plan.keep_cols} for rec in produced]


def _unfilled(row: dict, at: dict, unfilled: dict[str, list[str]], sink: Sink) -> bool:
    """Placeholders left in a row: each an error, noted by name for the summary line; whether there were any."""
    # The canonical JSON is built for the duplicate check anyway; braces in it can only sit inside strings.
    found = [x for x in C.find_placeholders({k: v for k, v in row.items() if k != "tools"})]
    f, line, idx = at["file"], at["line"], at["record"]
    for fld, names in found:
        for n in names:
            unfilled.setdefault(n, []).append(f"{Path(f).name}:{line}" if line else f"{Path(f).name} record {idx}")
        sink.error("placeholder", f"{', '.join('{{' + n + '}}' for n in names)} left unfilled", field=fld, **at)
    return bool(found)


class _Kept:
    """The records kept in order, first copy of each; later exact copies counted, located and warned."""

    def __init__(self):
        self.records: list[dict] = []
        self.origins: list[tuple[str, int | None, int]] = []
        self.keys: list[str] = []
        self.seen: dict[str, tuple[str, int | None, int]] = {}
        self.dups: list[dict] = []
        self.labels = {True: 0, False: 0}

    def add(self, rec: dict, key: str, at: dict, fmt: str, sink: Sink) -> None:
        f, line, idx = at["file"], at["line"], at["record"]
        if fmt == "kto":
            self.labels[rec["label"]] += 1
        first = self.seen.get(key)
        if first is not None:
            where = f"{Path(f).name}:{line}" if line else f"{Path(f).name} record {idx}"
            self.dups.append({"where": where, "record": idx,
                              "same_as": f"{Path(first[0]).name}:{first[1]}" if first[1] else f"{Path(first[0]).name} record {first[2]}"})
            sink.warn("exact-duplicate", f"same record as line {first[1]}" if first[1] else f"same record as record {first[2]}",
                      field=main_field(fmt), **at)
            return
        self.seen[key] = (f, line, idx)
        self.keys.append(key)
        self.records.append(rec)
        self.origins.append((f, line, idx))


def _share_rules(raw: Raw, fmt: str, kept: _Kept, unfilled: dict[str, list[str]], fill: dict, report: C.Report,
                 validation: dict, provenance: str | None, sink: Sink) -> None:
    """What the records decide together: the duplicate share, placeholders left unfilled, unused fills, one-sided labels."""
    n_read = len(raw.rows)
    rule = validation["share_rules"]["exact-duplicate"]
    n_dup = len(kept.dups)
    share = n_dup / max(n_read, 1)
    dup_where = [d["where"] for d in kept.dups]
    if n_dup:
        said = (f"{n_dup} of {n_read} records ({share:.1%}) are exact duplicates of an earlier record "
                f"({', '.join(dup_where[:8])}{f' and {len(dup_where) - 8} more' if len(dup_where) > 8 else ''})")
        if share > rule["fail_above"] and provenance == "synthetic":
            sink.error("exact-duplicate", field=main_field(fmt), message=f"{said}, above the {rule['fail_above']:.0%} the skill allows in a "
                       "synthetic set: a generator repeating itself; deduplicate at the source, or state `provenance: curated` if people chose these records")
        else:
            sink.warn("duplicates-removed", field=main_field(fmt), message=f"{said}: the first copy of each is kept, the rest removed")
    for name, where in unfilled.items():
        # One line per placeholder with every place it was left, so a forgotten fill is fixed in one edit.
        sink.error("placeholder", f"{{{{{name}}}}} is left unfilled in {len(where)} record(s) ({', '.join(where[:8])}"
                   f"{f' and {len(where) - 8} more' if len(where) > 8 else ''}); add `fill: {name}=<text>` to the brief's "
                   "## Dataset Expectation, or `placeholders: keep` if the braces are meant to be trained", field="placeholders")
    for k in sorted(set(fill) - set(report.filled)):
        sink.warn("fill-unused", f"the brief fills {{{{{k}}}}}, but no record holds it", field="fill")
    if fmt == "kto" and kept.records and (kept.labels[True] == 0 or kept.labels[False] == 0):
        only = "desirable (true)" if kept.labels[True] else "undesirable (false)"
        sink.warn("one-sided-labels", f"every label is {only}; KTO then pushes in one direction only", field="label")
    if not raw.rows and not sink.errors:
        sink.error("empty-field", "the source holds no records", file=raw.files[0] if raw.files else None)


def _validate(row: dict, fmt: str, at: dict, sink: Sink, roles: list[str], refs: list[str], raw: Raw,
              path_ok: Callable[[Path], bool] | None, needs_reference: bool = True) -> tuple[dict, str | None] | None:
    v = _V(sink, roles, at, vision=(fmt == "vision"))
    rf = None

    def need(col: str) -> bool:
        if col not in row:
            v.err("missing-field", f"required field {col!r} is missing", col)
            return False
        return True

    if fmt in ("messages", "vision") and "messages" in row or fmt == "messages":
        if need("messages"):
            v.turns(row["messages"], "messages", "conversation")
            answers = [m for m in row["messages"] if isinstance(m, dict) and m.get("role") == "assistant"] if v.ok else []
            if answers and all(m.get("weight", 1) == 0 for m in answers):
                v.err("no-trained-tokens", "every assistant turn has weight 0, so nothing would be trained", "messages")
    if fmt == "text" and need("text"):
        v.text(row["text"], "text", "text")
    if fmt == "vision" and "messages" not in row:
        # prompt/completion vision rows
        if need("prompt") and need("completion"):
            v.turns(row["prompt"], "prompt", "prompt")
            v.turns(row["completion"], "completion", "completion")
    if fmt in ("prompt-completion", "kto"):
        if need("prompt") & need("completion"):
            p, c = row["prompt"], row["completion"]
            if isinstance(p, list) or isinstance(c, list):
                if not (isinstance(p, list) and isinstance(c, list)):
                    v.err("wrong-type", "prompt and completion must both be text or both be lists of messages", "prompt/completion")
                else:
                    v.turns(p, "prompt", "prompt")
                    v.turns(c, "completion", "completion")
            else:
                v.text(p, "prompt", "prompt")
                v.text(c, "completion", "completion", "empty-assistant")
    if fmt == "kto" and need("label"):
        lab = _label(row["label"])
        if lab is None:
            v.err("wrong-type", f"label must be true or false, got {row['label']!r}", "label")
        else:
            row = dict(row, label=lab)
    if fmt == "preference":
        if need("prompt") & need("chosen") & need("rejected"):
            p, c, r = row["prompt"], row["chosen"], row["rejected"]
            lists = [isinstance(x, list) for x in (p, c, r)]
            if any(lists) and not all(lists):
                v.err("wrong-type", "prompt, chosen and rejected must all be text or all be lists of messages", "prompt/chosen/rejected")
            elif all(lists):
                v.turns(p, "prompt", "prompt")
                v.turns(c, "chosen", "completion")
                v.turns(r, "rejected", "completion")
            else:
                v.text(p, "prompt", "prompt")
                v.text(c, "chosen", "chosen", "empty-assistant")
                v.text(r, "rejected", "rejected", "empty-assistant")
            if v.ok and _norm(c) == _norm(r):
                v.err("identical-pair", "chosen and rejected are identical, so the pair teaches nothing", "chosen/rejected")
    if fmt == "grpo":
        if need("prompt"):
            p = row["prompt"]
            if isinstance(p, list):
                v.turns(p, "prompt", "prompt")
            else:
                v.text(p, "prompt", "prompt")
        rf = next((k for k in refs if k in row), None)
        if rf is None:
            if needs_reference:
                v.err("missing-field", f"no reference answer column (one of {', '.join(refs)})", refs[0])
        else:
            val = row[rf]
            if isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val):
                pass
            else:
                v.text(val, rf, "the reference answer")
    if fmt == "vision":
        v_images(row, v, at, raw, path_ok)
    if not v.ok:
        return None
    return row, rf


def v_images(row: dict, v: _V, at: dict, raw: Raw, path_ok: Callable[[Path], bool] | None) -> None:
    if "images" in row:
        imgs, fld = row["images"], "images"
    else:
        imgs, fld = row.get("image"), "image"
        imgs = [imgs] if imgs is not None and not isinstance(imgs, list) else imgs
    if not isinstance(imgs, list) or not imgs:
        v.err("missing-field" if imgs is None else "wrong-type", "images must be a non-empty list of image file paths", fld)
        return
    base = Path(at["file"]).parent if at.get("file") else Path(".")
    for i, im in enumerate(imgs):
        f = f"{fld}[{i}]" if fld == "images" else fld
        if isinstance(im, dict) and isinstance(im.get("path"), str):
            im = im["path"]
        if not isinstance(im, str) or not im.strip():
            v.err("wrong-type", f"an image entry must be a file path, got {_type(im)}", f)
            continue
        p = Path(im)
        p = p if p.is_absolute() else base / p
        try:
            real = p.resolve()
        except (OSError, RuntimeError):
            real = p
        if path_ok is not None and not path_ok(real):
            v.err("image-missing", f"image {im!r} lies outside the folders this server may read", f)
        elif not real.is_file():
            v.err("image-missing", f"image file {im!r} not found (looked at {real})", f)
    if v.placeholders and v.placeholders != len(imgs):
        v.err("image-mismatch", f"{v.placeholders} image placeholders but {len(imgs)} images", fld)


def _norm(x: Any) -> str:
    if isinstance(x, str):
        return " ".join(x.split())
    return json.dumps(x, sort_keys=True, ensure_ascii=False)


# ---------------------------------------------------------------- text views (collapse guard, near duplicates)


def _content_text(c: Any) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return " ".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _turns_text(msgs: Any, roles: tuple[str, ...] | None = None) -> list[str]:
    if isinstance(msgs, str):
        return [msgs]
    if not isinstance(msgs, list):
        return []
    return [_content_text(m.get("content")) for m in msgs if isinstance(m, dict) and (roles is None or m.get("role") in roles)]


def trained_texts(rec: dict, fmt: str, ref_field: str | None = None) -> list[str]:
    """The text the model is trained to produce, one string per trained span."""
    if fmt in ("messages", "vision") and "messages" in rec:
        return _turns_text(rec["messages"], ("assistant",))
    if fmt in ("prompt-completion", "kto", "vision"):
        return _turns_text(rec.get("completion"), ("assistant",)) if isinstance(rec.get("completion"), list) else [rec.get("completion", "")]
    if fmt == "preference":
        return _turns_text(rec.get("chosen"), ("assistant",)) if isinstance(rec.get("chosen"), list) else [rec.get("chosen", "")]
    if fmt == "grpo":
        v = rec.get(ref_field) if ref_field else None
        return [str(v)] if v is not None else []
    if fmt == "text":
        return [rec.get("text", "")]
    return []


def full_text(rec: dict, fmt: str) -> str:
    parts: list[str] = []
    for col in ("messages", "prompt", "completion", "chosen", "rejected", "text"):
        if col in rec:
            parts += _turns_text(rec[col])
    return "\n".join(parts)


WORD_RE = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return WORD_RE.findall(text.lower())


def split_key(rec_key: str, seed: int) -> float:
    """A number in [0, 1) from the record's content: the same record always lands in the same split."""
    h = hashlib.blake2b(f"{seed}:{rec_key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def record_key(rec: dict) -> str:
    """Canonical JSON of a record: equal keys are exact duplicates; the split hash is taken over it."""
    return json.dumps(rec, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr)
