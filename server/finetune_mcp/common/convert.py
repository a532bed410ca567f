"""Record shapes and their lossless conversion into the trainer formats: detection, the plan, the converters, message clean-up, placeholders.

Stdlib only: _records.check_records calls it in the server's light pass and in the prepare_data job alike.
The shapes, conversions and refusals themselves are data in the dataset-curation skill (tables/formats.yaml);
this module holds one function per conversion id (the table's schema checks that the two agree). Every
converter maps each field it consumes and reports, through a Cx, what it did, so the dataset card can say
what was converted and that nothing was dropped.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Callable

# ---------------------------------------------------------------- shapes


def is_msg_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(m, dict) for m in v)


def shape_of(row: Any, reference_fields: list[str]) -> str:
    """The record's shape by its columns: a trainer format, a shape a conversion takes, or one that is refused."""
    if not isinstance(row, dict):
        return "not-an-object"
    k = set(row)
    vision = "images" in k or "image" in k
    labelled = "label" in k or "kto_tag" in k
    if {"input", "preferred_output", "non_preferred_output"} <= k:
        return "openai-preference"
    if {"chosen_messages", "rejected_messages"} <= k:
        return "paired-messages"
    if "messages" in k:
        if vision:
            return "vision"
        if {"chosen", "rejected"} <= k:
            return "messages-preference"
        return "messages-label" if labelled else "messages"
    if "conversations" in k:
        conv = row["conversations"]
        if {"chosen", "rejected"} <= k:
            return "sharegpt-preference"
        if labelled:
            return "sharegpt-kto"
        return "sharegpt" if is_msg_list(conv) and "from" in conv[0] else "conversations"
    if {"chosen", "rejected"} <= k:
        if "prompt" in k:
            return "preference"
        return "alpaca-preference" if "instruction" in k else "implicit-prompt-preference"
    if {"prompt", "completions", "labels"} <= k:
        return "stepwise"
    if {"prompt", "completion", "label"} <= k:
        return "kto"
    if {"prompt", "completion"} <= k:
        return "vision" if vision else "prompt-completion"
    if "prompt" in k and k & set(reference_fields):
        return "grpo"
    if "instruction" in k:
        return "alpaca-kto" if labelled else "alpaca"
    if "prompt" in k:
        return "prompt-only"
    if "text" in k:
        return "text"
    return "unknown"


def detect_shape(rows: list[Any], reference_fields: list[str]) -> str:
    """The most common shape among the first 200 object rows (ties: the first seen)."""
    counts: dict[str, int] = {}
    for r in rows[:200]:
        if isinstance(r, dict):
            s = shape_of(r, reference_fields)
            counts[s] = counts.get(s, 0) + 1
    if not counts:
        return "unknown"
    return max(counts, key=lambda s: counts[s])


class Refusal(Exception):
    """The shape cannot become the method's format without a choice the data does not make."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message, self.fix = message, fix


def plan(shape: str, method: str, formats: dict, needs_reference: bool = True) -> tuple[str, list[str]]:
    """(target format, conversion ids in order) for a shape and a method: the shortest chain of conversions
    in the skill's table that ends in a format the method trains on. Raises Refusal naming the choices."""
    table = formats["formats"]
    accepted = [name for name, spec in table.items() if method in spec["methods"]]
    if shape in accepted:
        return shape, []
    if shape == "prompt-only" and "grpo" in accepted and not needs_reference:
        # GRPO samples its own completions; a reference column is needed only by rewards that compare with one.
        return "grpo", []
    convs = [c for c in formats["conversions"] if not c.get("only_for") or method in c["only_for"]]
    frontier, seen = [(shape, [])], {shape}
    while frontier:
        nxt = []
        for node, path in frontier:
            for c in convs:
                if c["source"] != node or c["target"] in seen:
                    continue
                if c["target"] in accepted:
                    return c["target"], path + [c["id"]]
                seen.add(c["target"])
                nxt.append((c["target"], path + [c["id"]]))
        frontier = nxt
    raise refusal(shape, method, formats, accepted)


def refusal(shape: str, method: str, formats: dict, accepted: list[str]) -> Refusal:
    table = formats["formats"]
    spec = formats["shapes"].get(shape)
    seen = {"unknown": "no known columns", "not-an-object": "records that are not JSON objects"}.get(
        shape, f"the {shape} shape ({', '.join(spec['fields'])}; {spec['origin']})" if spec else f"the {shape} shape")
    rule = next((r for r in formats["refusals"] if shape in r["shapes"] and (not r.get("methods") or method in r["methods"])), None)
    expected = "; ".join(f"{name}: {', '.join(table[name]['required_fields'])}" for name in accepted)
    why = f": {rule['why']}" if rule else ""
    choices = rule["choices"] if rule else f"rewrite the records with the expected fields, e.g. {' | '.join(table[n]['example'] for n in accepted[:2])}"
    return Refusal(f"the records have {seen}, which the chosen method {method} cannot train on{why}. It expects {expected}", choices)


# ---------------------------------------------------------------- one record's conversion


class Report:
    """What the conversions did over the whole set, for the dataset card: counts are records."""

    def __init__(self) -> None:
        self.notes: Counter = Counter()
        self.left_out: Counter = Counter()
        self.filled: Counter = Counter()
        self.weights: Counter = Counter()

    def to_dict(self) -> dict:
        # Sorted: a record's notes are a set, so first-seen order would follow string hashing and meta.json
        # would differ between two runs of data/prepare.py.
        return {"notes": dict(sorted(self.notes.items())), "left_out_columns": dict(sorted(self.left_out.items())),
                "filled": dict(sorted(self.filled.items())), "message_weights": dict(sorted(self.weights.items()))}


class Cx:
    """The conversion of one record: problems go to the sink with the record's file/line; notes count once per record."""

    def __init__(self, sink, at: dict, report: Report):
        self.sink, self.at, self.report = sink, at, report
        self.ok = True
        self.notes: set[str] = set()

    def err(self, code: str, msg: str, fld: str) -> None:
        self.ok = False
        self.sink.error(code, msg, field=fld, **self.at)

    def note(self, text: str) -> None:
        self.notes.add(text)

    def flush(self) -> None:
        for t in self.notes:
            self.report.notes[t] += 1
        self.notes.clear()


def _type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "text", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _rest(row: dict, used: tuple[str, ...]) -> dict:
    return {k: v for k, v in row.items() if k not in used}


def _text_field(row: dict, col: str, cx: Cx, required: bool = True) -> str | None:
    if col not in row or row[col] is None:
        if required:
            cx.err("missing-field", f"required field {col!r} is missing", col)
        return None
    if not isinstance(row[col], str):
        cx.err("wrong-type", f"{col} must be text, got {_type(row[col])}", col)
        return None
    return row[col]


def _need(row: dict, cols: tuple[str, ...], cx: Cx) -> bool:
    missing = [c for c in cols if c not in row]
    for c in missing:
        cx.err("missing-field", f"required field {c!r} is missing", c)
    return not missing


def label_value(v: Any) -> bool | None:
    """A KTO label as a bool: true/false, 1/0 or their text; None when it is none of these."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
        return v.strip().lower() in ("true", "1")
    return None


def _label_of(row: dict, cx: Cx) -> Any:
    """The label, checked where the user wrote it (kto_tag or label)."""
    col = "kto_tag" if "kto_tag" in row else "label"
    if col == "kto_tag":
        cx.note("kto_tag column → label (LLaMA-Factory's KTO tag)")
    v = label_value(row.get(col))
    if v is None:
        cx.err("wrong-type", f"{col} must be true or false, got {row.get(col)!r}", col)
    return v


# Alpaca: LLaMA-Factory's AlpacaDatasetConverter (src/llamafactory/data/converter.py) joins instruction and input
# with "\n", skipping an empty one; history pairs come first and their answers are trained.
def _alpaca_prompt(row: dict, cx: Cx) -> list[dict]:
    turns: list[dict] = []
    system = row.get("system")
    if isinstance(system, str) and system:
        turns.append({"role": "system", "content": system})
        cx.note("system column → system turn")
    elif system not in (None, ""):
        cx.err("wrong-type", f"system must be text, got {_type(system)}", "system")
    hist = row.get("history")
    if hist not in (None, "", []):
        if not isinstance(hist, list):
            cx.err("wrong-type", f"history must be a list of [prompt, response] pairs, got {_type(hist)}", "history")
        else:
            for i, pair in enumerate(hist):
                if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                    cx.err("wrong-type", "a history entry must be a [prompt, response] pair of texts", f"history[{i}]")
                    continue
                turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
            cx.note("history pairs → earlier user/assistant turns (their answers are trained, as in LLaMA-Factory)")
    instruction = _text_field(row, "instruction", cx)
    query = row.get("input")
    if query is not None and not isinstance(query, str):
        cx.err("wrong-type", f"input must be text, got {_type(query)}", "input")
        query = None
    parts = [x for x in (instruction, query) if x]
    if instruction is not None and not parts:
        cx.err("empty-field", "instruction and input are both empty", "instruction")
    if query:
        cx.note("instruction + \"\\n\" + input → one user turn")
    elif instruction is not None:
        cx.note("empty or absent input skipped: the instruction alone is the user turn")
    turns.append({"role": "user", "content": "\n".join(parts)})
    return turns


def alpaca_to_messages(row: dict, cx: Cx) -> dict:
    turns = _alpaca_prompt(row, cx)
    output = _text_field(row, "output", cx)
    return {**_rest(row, ("instruction", "input", "output", "system", "history")),
            "messages": turns + [{"role": "assistant", "content": output}]}


def alpaca_preference_to_preference(row: dict, cx: Cx) -> dict:
    _need(row, ("chosen", "rejected"), cx)
    return {**_rest(row, ("instruction", "input", "system", "history")), "prompt": _alpaca_prompt(row, cx)}


def alpaca_kto_to_kto(row: dict, cx: Cx) -> dict:
    prompt = _alpaca_prompt(row, cx)
    output = _text_field(row, "output", cx)
    label = _label_of(row, cx)
    return {**_rest(row, ("instruction", "input", "output", "system", "history", "kto_tag", "label")),
            "prompt": prompt, "completion": [{"role": "assistant", "content": output}], "label": label}


# ShareGPT: LLaMA-Factory's tags (data/README.md, "Sharegpt Format"); function_call values are JSON tool calls.
def parse_calls(value: Any, fld: str, cx: Cx) -> list[dict] | None:
    """A function-call value ('{"name": ..., "arguments": {...}}', or a list of them) as HF tool_calls."""
    obj = value
    if isinstance(value, str):
        try:
            obj = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            cx.err("wrong-type", "a function call must be JSON {\"name\": ..., \"arguments\": {...}}; this value is not JSON", fld)
            return None
    calls = obj if isinstance(obj, list) else [obj]
    out = []
    for c in calls:
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"] and "arguments" in c):
            cx.err("wrong-type", "a function call must be an object with a name and arguments", fld)
            return None
        out.append({"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}})
    return out


def _share_turn(turn: Any, fld: str, cx: Cx, role_map: dict[str, str]) -> dict | None:
    if not isinstance(turn, dict):
        cx.err("wrong-type", f"a turn must be an object, got {_type(turn)}", fld)
        return None
    tag, text = ("from", "value") if "from" in turn else ("role", "content")
    if tag not in turn:
        cx.err("missing-field", "turn has no 'from' (or 'role')", f"{fld}.from")
        return None
    src = turn[tag]
    role = role_map.get(src.strip().lower()) if isinstance(src, str) else None
    if role is None:
        cx.err("unknown-role", f"turn {tag} {src!r} maps to no role (known: {', '.join(sorted(role_map))})", f"{fld}.{tag}")
        return None
    rest = _rest(turn, (tag, text))
    if role == "tool_call":
        calls = parse_calls(turn.get(text), f"{fld}.{text}", cx)
        cx.note("function_call turns → assistant tool_calls (the template's tool-call format)")
        return {**rest, "role": "assistant", "content": "", "tool_calls": calls} if calls else None
    msg = {**rest, "role": role}
    if text in turn:
        msg["content"] = turn[text]
    if src.strip().lower() != role:
        cx.note(f"role {src.strip().lower()} → {role}")
    return msg


def _share_turns(conv: Any, fld: str, cx: Cx, role_map: dict[str, str]) -> list[dict]:
    if not isinstance(conv, list):
        cx.err("wrong-type", f"{fld} must be a list of turns, got {_type(conv)}", fld)
        return []
    out = []
    for i, t in enumerate(conv):
        m = _share_turn(t, f"{fld}[{i}]", cx, role_map)
        if m is not None:
            out.append(m)
    return out


def _with_system(turns: list[dict], row: dict, cx: Cx) -> list[dict]:
    """A system column becomes the first turn; a first 'system' turn that says otherwise is a conflict to resolve."""
    system = row.get("system")
    if system in (None, ""):
        return turns
    if not isinstance(system, str):
        cx.err("wrong-type", f"system must be text, got {_type(system)}", "system")
        return turns
    if turns and turns[0].get("role") == "system":
        if turns[0].get("content") != system:
            cx.err("ambiguous", "the system column and the conversation's first system turn differ; keep one of them", "system")
        return turns
    cx.note("system column → system turn")
    return [{"role": "system", "content": system}] + turns


def sharegpt_to_messages(row: dict, cx: Cx, role_map: dict[str, str]) -> dict:
    if not _need(row, ("conversations",), cx):
        return row
    turns = _with_system(_share_turns(row.get("conversations"), "conversations", cx, role_map), row, cx)
    return {**_rest(row, ("conversations", "system")), "messages": turns}


def _answer(v: Any, fld: str, cx: Cx, role_map: dict[str, str]) -> Any:
    """chosen/rejected as a ShareGPT message object, a list of them, or text."""
    if isinstance(v, dict) and ("from" in v or "role" in v):
        m = _share_turn(v, fld, cx, role_map)
        return [m] if m else None
    if isinstance(v, list) and v and all(isinstance(x, dict) and ("from" in x or "role" in x) for x in v):
        return _share_turns(v, fld, cx, role_map)
    return v


def sharegpt_preference_to_preference(row: dict, cx: Cx, role_map: dict[str, str]) -> dict:
    if not _need(row, ("conversations", "chosen", "rejected"), cx):
        return row
    prompt = _with_system(_share_turns(row.get("conversations"), "conversations", cx, role_map), row, cx)
    return {**_rest(row, ("conversations", "system", "chosen", "rejected")), "prompt": prompt,
            "chosen": _answer(row.get("chosen"), "chosen", cx, role_map), "rejected": _answer(row.get("rejected"), "rejected", cx, role_map)}


def _last_answer_split(turns: list, fld: str, cx: Cx) -> tuple[list, list]:
    if not turns or not isinstance(turns[-1], dict) or turns[-1].get("role") != "assistant":
        cx.err("roles-order", "the last turn must be the assistant answer that the label judges", f"{fld}[{max(len(turns) - 1, 0)}]")
        return turns, []
    cx.note("the last assistant turn → completion, the turns before it → prompt")
    return turns[:-1], turns[-1:]


def sharegpt_kto_to_kto(row: dict, cx: Cx, role_map: dict[str, str]) -> dict:
    if not _need(row, ("conversations",), cx):
        return row
    turns = _with_system(_share_turns(row.get("conversations"), "conversations", cx, role_map), row, cx)
    prompt, completion = _last_answer_split(turns, "conversations", cx)
    return {**_rest(row, ("conversations", "system", "kto_tag", "label")), "prompt": prompt, "completion": completion,
            "label": _label_of(row, cx)}


def messages_preference_to_preference(row: dict, cx: Cx, role_map: dict[str, str]) -> dict:
    if not _need(row, ("messages", "chosen", "rejected"), cx):
        return row
    return {**_rest(row, ("messages", "chosen", "rejected")), "prompt": row["messages"],
            "chosen": _answer(row.get("chosen"), "chosen", cx, role_map), "rejected": _answer(row.get("rejected"), "rejected", cx, role_map)}


def messages_label_to_kto(row: dict, cx: Cx) -> dict:
    msgs = row.get("messages")
    if not isinstance(msgs, list):
        cx.err("wrong-type", f"messages must be a list of messages, got {_type(msgs)}", "messages")
        return row
    prompt, completion = _last_answer_split(msgs, "messages", cx)
    return {**_rest(row, ("messages", "kto_tag", "label")), "prompt": prompt, "completion": completion, "label": _label_of(row, cx)}


def openai_preference_to_preference(row: dict, cx: Cx) -> dict:
    if not _need(row, ("input", "preferred_output", "non_preferred_output"), cx):
        return row
    inp = row.get("input")
    if not isinstance(inp, dict) or "messages" not in inp:
        cx.err("wrong-type", "input must be an object with messages (OpenAI's preference format)", "input.messages")
        return row
    out = {**_rest(row, ("input", "preferred_output", "non_preferred_output")), "prompt": inp["messages"],
           "chosen": row["preferred_output"], "rejected": row["non_preferred_output"]}
    if inp.get("tools"):
        out["tools"] = inp["tools"]
    for k in inp:
        if k not in ("messages", "tools"):
            # parallel_tool_calls is a setting of OpenAI's API at inference time, not something a template renders.
            cx.report.left_out[f"input.{k}"] += 1
    return out


def paired_messages_to_implicit(row: dict, cx: Cx) -> dict:
    if not _need(row, ("chosen_messages", "rejected_messages"), cx):
        return row
    return {**_rest(row, ("chosen_messages", "rejected_messages")), "chosen": row["chosen_messages"], "rejected": row["rejected_messages"]}


def extract_prompt(row: dict, cx: Cx) -> dict:
    """TRL extract_prompt: the shared leading turns (or characters) of chosen and rejected become the prompt."""
    c, r = row.get("chosen"), row.get("rejected")
    if isinstance(c, list) and isinstance(r, list):
        idx = 0
        while idx < min(len(c), len(r)) and c[idx] == r[idx]:
            idx += 1
        if idx == 0:
            cx.err("missing-field", "no prompt column, and chosen and rejected share no leading turns to take it from", "prompt")
            return row
    elif isinstance(c, str) and isinstance(r, str):
        idx, m = 0, min(len(c), len(r))
        while idx < m and c[idx] == r[idx]:
            idx += 1
        if idx < m and idx > 0 and c[idx - 1] == " ":
            idx -= 1
        if idx == 0:
            cx.err("missing-field", "no prompt column, and chosen and rejected share no leading text to take it from", "prompt")
            return row
    else:
        cx.err("wrong-type", "chosen and rejected must both be text or both be lists of messages", "chosen/rejected")
        return row
    return {**_rest(row, ("chosen", "rejected")), "prompt": c[:idx], "chosen": c[idx:], "rejected": r[idx:]}


# Conversion id -> function(row, cx[, role_map]); skilltables.DcFormatsTable checks that the skill's ids are these.
CONVERTERS: dict[str, Callable[..., dict]] = {
    "alpaca-to-messages": alpaca_to_messages,
    "alpaca-preference-to-preference": alpaca_preference_to_preference,
    "alpaca-kto-to-kto": alpaca_kto_to_kto,
    "sharegpt-to-messages": sharegpt_to_messages,
    "conversations-to-messages": sharegpt_to_messages,  # the same turn mapping reads role/content turns too
    "sharegpt-preference-to-preference": sharegpt_preference_to_preference,
    "sharegpt-kto-to-kto": sharegpt_kto_to_kto,
    "messages-preference-to-preference": messages_preference_to_preference,
    "messages-label-to-kto": messages_label_to_kto,
    "openai-preference-to-preference": openai_preference_to_preference,
    "paired-messages-to-implicit": paired_messages_to_implicit,
    "implicit-prompt-preference": extract_prompt,
    "preference-to-kto": None,  # after validation, check_records turns each checked pair into two rows
}
_TAKES_ROLE_MAP = {"sharegpt-to-messages", "conversations-to-messages", "sharegpt-preference-to-preference",
                   "sharegpt-kto-to-kto", "messages-preference-to-preference"}


def convert(row: dict, step: str, cx: Cx, role_map: dict[str, str]) -> dict:
    fn = CONVERTERS[step]
    return fn(row, cx, role_map) if step in _TAKES_ROLE_MAP else fn(row, cx)


# ---------------------------------------------------------------- messages in any format


def _flatten(m: dict, f: str, cx: Cx) -> dict:
    """Text-only content parts → one string, concatenated as LLaMA-Factory v1 does for text models
    (src/llamafactory/v1/core/rendering/format.py, _to_hf_messages); its tool_call parts → tool_calls."""
    texts, calls = [], []
    for j, part in enumerate(m["content"]):
        pf = f"{f}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" or (isinstance(part, dict) and kind is None and ("text" in part or "value" in part)):
            val = part.get("text", part.get("value"))
            if not isinstance(val, str):
                cx.err("non-string-content", f"a text part holds {_type(val)}, not text", pf)
            else:
                texts.append(val)
        elif kind == "tool_call":
            got = parse_calls(part.get("value", part.get("text")), pf, cx)
            calls += got or []
        else:
            what = f"a {kind!r} part" if kind else f"{_type(part)}"
            cx.err("non-string-content", f"{what} cannot be flattened to text; only text parts are (images need the VLM-SFT method)", pf)
    out = dict(m, content="".join(texts))
    if calls:
        out["tool_calls"] = list(out.get("tool_calls") or []) + calls
    cx.note("text content parts flattened to one string (concatenated, as LLaMA-Factory v1 renders them)")
    return out


def _tool_calls(tcs: Any, f: str, cx: Cx) -> Any:
    if not isinstance(tcs, list):
        cx.err("wrong-type", f"tool_calls must be a list, got {_type(tcs)}", f)
        return tcs
    out = []
    for j, tc in enumerate(tcs):
        tf = f"{f}[{j}]"
        if not isinstance(tc, dict):
            cx.err("wrong-type", f"a tool call must be an object, got {_type(tc)}", tf)
            continue
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else ({"name": tc.get("name"), "arguments": tc.get("arguments", {})} if "name" in tc else None)
        if fn is None or not isinstance(fn.get("name"), str) or not fn["name"]:
            cx.err("wrong-type", "a tool call needs function.name", tf + ".function.name")
            continue
        args = fn.get("arguments", {})
        if isinstance(args, str):
            # OpenAI sends arguments as JSON text; HF chat templates render an object (transformers chat_extras docs).
            try:
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                cx.err("wrong-type", "tool-call arguments are not valid JSON", tf + ".function.arguments")
                continue
            cx.note("tool-call arguments parsed from JSON text into objects (what HF chat templates render)")
        new = {k: v for k, v in tc.items() if k not in ("function", "name", "arguments")}
        new.setdefault("type", "function")
        new["function"] = {**{k: v for k, v in fn.items() if k != "arguments"}, "arguments": args}
        out.append(new)
    return out


_TOUCHED = frozenset(("function_call", "tool_calls", "loss_weight", "weight"))


def norm_turns(msgs: Any, fld: str, cx: Cx, *, flatten: bool = True) -> Any:
    """One message list as the user wrote it: text parts flattened, OpenAI's legacy function roles and calls as tools,
    tool-call arguments as objects, LLaMA-Factory v1's loss_weight read as weight (0 or 1). Problems name the
    source field; which weights survive is decided after conversion (weigh_turns)."""
    if not isinstance(msgs, list):
        return msgs
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not (_TOUCHED.intersection(m) or m.get("role") == "function" or isinstance(m.get("content"), list)):
            out.append(m)  # the common case: nothing to clean up, nothing copied
            continue
        f = f"{fld}[{i}]"
        m = dict(m)
        if m.get("role") == "function":
            m["role"] = "tool"
            cx.note("OpenAI's legacy role 'function' → tool")
        if flatten and isinstance(m.get("content"), list):
            m = _flatten(m, f, cx)
        if isinstance(m.get("function_call"), dict):
            fc = m.pop("function_call")
            m["tool_calls"] = list(m.get("tool_calls") or []) + [{"type": "function", "function": fc}]
            cx.note("OpenAI's legacy function_call → tool_calls")
        if "tool_calls" in m and m["tool_calls"] is not None:
            m["tool_calls"] = _tool_calls(m["tool_calls"], f + ".tool_calls", cx)
        for key in ("loss_weight", "weight"):
            if key in m:
                # OpenAI's weight and LLaMA-Factory v1's loss_weight (data/v1_sft_demo.jsonl) take 0 or 1.
                w = m.pop(key)
                if isinstance(w, bool) or w not in (0, 1):
                    cx.err("wrong-type", f"{key} must be 0 or 1, got {w!r}", f"{f}.{key}")
                elif w == 1 and m.get("role") not in ("assistant", None):
                    cx.err("wrong-type", f"{key} 1 on a {m.get('role')} message asks to train it; only assistant turns carry loss", f"{f}.{key}")
                else:
                    m["weight"] = int(w)
                    if key == "loss_weight":
                        cx.note("loss_weight → weight")
        out.append(m)
    return out


def norm_messages(row: dict, cx: Cx, flatten: bool = True) -> dict:
    """norm_turns on every message list and message object of a source row, before any conversion."""
    out = row
    for k, v in row.items():
        if out is row:
            out = dict(row)
        if isinstance(v, list) and any(isinstance(m, dict) and "role" in m for m in v):
            out[k] = norm_turns(v, k, cx, flatten=flatten)
        elif isinstance(v, dict) and "role" in v:
            out[k] = norm_turns([v], k, cx, flatten=flatten)[0]
        elif k == "input" and isinstance(v, dict) and isinstance(v.get("messages"), list):
            out[k] = {**v, "messages": norm_turns(v["messages"], "input.messages", cx, flatten=flatten)}
    return out


def weigh_turns(msgs: Any, fld: str, cx: Cx, role: str) -> Any:
    """Which weights survive in a converted list. role: "conversation" (messages: each assistant turn's weight is kept
    for the masking), "prompt" (context, never trained: weights say nothing there) or "answer" (a completion, chosen
    or rejected, trained whole: weight 1 is the default and weight 0 a contradiction)."""
    if not isinstance(msgs, list):
        return msgs
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "weight" not in m:
            out.append(m)
            continue
        w = m["weight"]
        if m.get("role") != "assistant":
            out.append({k: v for k, v in m.items() if k != "weight"})  # never trained: weight 0 is what happens anyway
        elif role == "conversation":
            out.append(m)
            cx.report.weights[f"weight {w}"] += 1
        elif role == "answer" and w == 0:
            cx.err("wrong-type", "weight 0 on an answer that the method trains whole; drop the row, or the weight", f"{fld}[{i}].weight")
            out.append(m)
        else:
            cx.note("weights on prompt turns and weight 1 on answers dropped (the method trains answers whole and prompts never)")
            out.append({k: v for k, v in m.items() if k != "weight"})
    return out


def norm_tools(row: dict, cx: Cx) -> dict:
    """tools (a list or JSON text) and OpenAI's legacy functions → one JSON string of {type: function, function: …}
    entries. TRL json.loads a string tools column (SFT, DPO, KTO); as text it also keeps Arrow from merging the
    different schemas of different rows into one with null-filled keys."""
    has = [k for k in ("tools", "functions") if row.get(k) not in (None, "", [])]
    if not has:
        return _rest(row, ("tools", "functions"))
    if len(has) == 2:
        cx.err("ambiguous", "both tools and OpenAI's legacy functions are given; keep one", "tools/functions")
        return row
    key = has[0]
    val = row[key]
    if isinstance(val, str):
        try:
            val = json.loads(val)
        except (json.JSONDecodeError, RecursionError):
            cx.err("wrong-type", f"{key} holds text that is not JSON", key)
            return row
    if not isinstance(val, list):
        val = [val] if isinstance(val, dict) else val
    if not isinstance(val, list):
        cx.err("wrong-type", f"{key} must be a list of function descriptions, got {_type(val)}", key)
        return row
    out = []
    for i, t in enumerate(val):
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict):
            out.append(t)
        elif isinstance(t, dict) and isinstance(t.get("name"), str):
            out.append({"type": "function", "function": t})
            cx.note("bare function descriptions wrapped as {type: function, function: …}")
        else:
            cx.err("wrong-type", "a tool must be a function description with a name", f"{key}[{i}]")
            return row
    if key == "functions":
        cx.note("OpenAI's legacy functions column → tools")
    cx.note("tools → the template's tools argument (kept as JSON text)")
    new = _rest(row, ("tools", "functions"))
    new["tools"] = json.dumps(out, ensure_ascii=False)
    return new


def coerce_pair(row: dict, cols: tuple[str, ...], cx: Cx) -> dict:
    """prompt/completion/chosen/rejected given partly as text, partly as messages, or as one message object:
    made all messages, a text prompt as a user turn and a text answer as an assistant turn."""
    row = dict(row)
    for c in cols:
        if isinstance(row.get(c), dict) and "role" in row[c]:
            row[c] = [row[c]]
            cx.note(f"a single message object in {c} → a one-message list")
    if any(isinstance(row.get(c), list) for c in cols) and any(isinstance(row.get(c), str) for c in cols):
        for c in cols:
            if isinstance(row.get(c), str):
                role = "user" if c == "prompt" else "assistant"
                if not row[c].strip():
                    cx.err("empty-field" if c == "prompt" else "empty-assistant", f"{c} is empty", c)
                row[c] = [{"role": role, "content": row[c]}]
                cx.note(f"{c} text beside message lists → one {role} turn")
    return row


# ---------------------------------------------------------------- placeholders


PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def fill_placeholders(v: Any, fill: dict[str, str], used: set[str]) -> Any:
    """Every string inside v with {{key}} replaced by fill[key]; keys that were found go into `used`."""
    if isinstance(v, str):
        if "{{" not in v:
            return v

        def sub(m: re.Match) -> str:
            if m.group(1) in fill:
                used.add(m.group(1))
                return fill[m.group(1)]
            return m.group(0)

        return PLACEHOLDER.sub(sub, v)
    if isinstance(v, list):
        return [fill_placeholders(x, fill, used) for x in v]
    if isinstance(v, dict):
        return {k: fill_placeholders(x, fill, used) for k, x in v.items()}
    return v


def find_placeholders(v: Any, fld: str = "") -> list[tuple[str, list[str]]]:
    """[(field path, placeholder names)] for every string inside v that still holds {{name}}."""
    out: list[tuple[str, list[str]]] = []
    if isinstance(v, str):
        if "{{" in v:
            names = list(dict.fromkeys(PLACEHOLDER.findall(v)))
            if names:
                out.append((fld, names))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += find_placeholders(x, f"{fld}[{i}]")
    elif isinstance(v, dict):
        for k, x in v.items():
            out += find_placeholders(x, f"{fld}.{k}" if fld else k)
    return out
