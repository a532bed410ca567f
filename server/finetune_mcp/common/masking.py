"""Assistant-only loss on any chat template: choose, once per template, how the assistant's tokens are found; mark and check every record.

Four ways, tried in this order; the first that verifies on probe conversations wins:

1. generation-markers     the template's own {% generation %} blocks (transformers' return_assistant_tokens_mask)
2. trl-training-template  TRL's training copy of the template, where TRL ships one for this exact template
3. derived-spans          each assistant content is wrapped in two private-use sentinel characters before
                          rendering; where they land in the rendered text is the reply, and the end-of-turn
                          token the template writes after it (found on a probe) is added
4. delimiters             the text the template writes before an assistant reply (the response part) and
                          before a user turn (the instruction part), found on a rendered probe as Unsloth's
                          train_on_responses_only does; a reply runs from the response part to its end-of-turn

"Verifies" means what check() asserts on every record as well: the trained tokens form one run per trained
assistant message, and each run decodes to exactly that message's content (edges' whitespace aside), its
rendered tool calls when it has them, and the end-of-turn token, so the model learns to stop.

Standalone on purpose: generate_config copies this file verbatim into train.py, so the trainer masks with the
very code that prepare_dataset checked. It needs only a transformers tokenizer (and TRL for method 2).
"""

from __future__ import annotations

import hashlib
import re

MASKING_METHODS = ("generation-markers", "trl-training-template", "derived-spans", "delimiters")
# Private-use code points: never produced by a tokenizer's own text, so a rendered template cannot contain
# them unless the data does (encode() refuses such a record under derived-spans).
SENTINEL_OPEN, SENTINEL_CLOSE = "\U000FFFF0", "\U000FFFF1"
_INDEX_BASE = 0xF0000  # the opening sentinel is followed by chr(_INDEX_BASE + message index)
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Probe conversations: distinctive words, so no template text can be mistaken for them.
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}]
PROBES = {
    "single-turn": {"messages": [
        {"role": "user", "content": "Name three primary colours."},
        {"role": "assistant", "content": "Red, yellow and blue."}]},
    "system": {"messages": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the boiling point of water?"},
        {"role": "assistant", "content": "Water boils at 100 degrees Celsius at sea level."}]},
    "multi-turn": {"messages": [
        {"role": "user", "content": "Pick a number between one and ten."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Double it."},
        {"role": "assistant", "content": "Fourteen."}]},
    "tool-call": {"tools": PROBE_TOOLS, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris, France"}}}]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": "18 C and sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."}]},
}


class MaskError(Exception):
    """A record (or a probe) on which the chosen way does not give exactly the assistant's reply."""


# --------------------------------------------------------------------------- small helpers


def template_text(tok, chat_template=None):
    tpl = chat_template if chat_template is not None else tok.chat_template
    if isinstance(tpl, dict):
        tpl = tpl.get("default")
    return tpl or None


def template_sha256(text):
    return hashlib.sha256(text.encode()).hexdigest() if text else None


def content_text(content):
    """A message's content as text: a string, or the text parts of a content list joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", p.get("value", ""))) for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return str(content)


def trains(message):
    """Whether an assistant message carries loss: OpenAI's per-message weight 0 switches it off."""
    return message.get("role") == "assistant" and message.get("weight", 1) not in (0, 0.0, False)


def _render(tok, template, messages, tools=None, extra=None):
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=False, **(extra or {}))


def _control_tokens(tok):
    """Special and added token strings, longest first: the candidates for an end-of-turn marker."""
    names = set(getattr(tok, "all_special_tokens", []) or [])
    try:
        names |= {t.content if hasattr(t, "content") else str(t) for t in tok.added_tokens_decoder.values()}
    except Exception:
        pass
    return sorted((n for n in names if n), key=len, reverse=True)


def _runs(mask):
    """[start, end) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out


def _tool_names(message):
    names = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        if isinstance(fn, dict) and fn.get("name"):
            names.append(str(fn["name"]))
    return names


# --------------------------------------------------------------------------- the plan


def new_plan(method, template, eots=None, response_part=None, instruction_part=None):
    """eot: the end-of-turn marker(s) after a reply; the first is the one written mid-conversation."""
    return {"method": method, "template_sha256": template_sha256(template), "eot": list(eots or []),
            "response_part": response_part, "instruction_part": instruction_part}


def _find_eot(text, eots, start):
    """(position, marker) of the first end-of-turn marker at or after start, or (-1, None)."""
    best = (-1, None)
    for e in eots:
        k = text.find(e, start)
        if k >= 0 and (best[0] < 0 or k < best[0]):
            best = (k, e)
    return best


def _sentinel_render(tok, template, messages, tools=None, extra=None, wrap_roles=("assistant",)):
    """Render with the chosen roles' contents wrapped in sentinels that carry the message index.

    Returns (clean text, {message index: (start, end)}) for every wrapped content the template wrote; a
    message the template leaves out (a tool-call turn without content, a dropped system turn) is absent.
    """
    wrapped = []
    for i, m in enumerate(messages):
        if m.get("role") in wrap_roles:
            m = {**m, "content": SENTINEL_OPEN + chr(_INDEX_BASE + i) + content_text(m.get("content")) + SENTINEL_CLOSE}
        wrapped.append(m)
    text = _render(tok, template, wrapped, tools, extra)
    spans, pieces, pos, start = {}, [], 0, 0
    while True:
        k = text.find(SENTINEL_OPEN, start)
        if k < 0:
            break
        e = text.find(SENTINEL_CLOSE, k)
        if e < 0:
            raise MaskError("the template cut a message content apart (an opening sentinel without its closing)")
        inner = text[k + 2:e]
        if SENTINEL_OPEN in inner or SENTINEL_CLOSE in text[start:k]:
            raise MaskError("the template cut, repeated or reordered message contents (sentinels out of order)")
        idx = ord(text[k + 1]) - _INDEX_BASE if k + 1 < len(text) else -1
        if idx in spans:
            raise MaskError("the template writes a message content twice")
        pieces.append(text[start:k])
        pos += k - start
        spans[idx] = (pos, pos + len(inner))
        pieces.append(inner)
        pos += len(inner)
        start = e + 1
    if SENTINEL_CLOSE in text[start:]:
        raise MaskError("the template cut a message content apart (a closing sentinel without its opening)")
    pieces.append(text[start:])
    return "".join(pieces), spans


def _eot_after(tok, text, b):
    """The end-of-turn marker written right after position b: a control token, after optional spaces/newlines."""
    j = b
    while j < len(text) and text[j] in " \n":
        j += 1
    for name in _control_tokens(tok):
        if text.startswith(name, j):
            return name
    return None


def derive_parts(tok, template):
    """From a rendered probe: the end-of-turn marker, the response part and the instruction part.

    Raises MaskError when the template writes nothing the model could emit to end its reply.
    """
    msgs = PROBES["multi-turn"]["messages"]
    clean, spans = _sentinel_render(tok, template, msgs, wrap_roles=("user", "assistant"))
    if len(spans) != 4:
        raise MaskError(f"the rendered probe shows {len(spans)} of its 4 user/assistant contents")
    (u1a, u1b), (a1a, a1b), (u2a, u2b), (a2a, a2b) = (spans[i] for i in range(4))
    eot = _eot_after(tok, clean, a1b)
    if eot is None:
        after = clean[a1b:u2a][:40]
        raise MaskError(f"the template writes no end-of-turn token after an assistant reply (it writes {after!r}), "
                        "so the model could not learn to stop")
    # Between a user content and the reply: the user's own closing (its end-of-turn, whitespace) then the header.
    between = clean[u1b:a1a]
    user_eot = _eot_after(tok, clean, u1b)
    head = between
    if user_eot is not None:
        k = between.find(user_eot)
        rest = between[k + len(user_eot):]
        # Where the user's closing token is all there is ("[INST] ... [/INST]reply"), it is the response part.
        head = rest if rest.strip() else between
    head = head.lstrip("\n")
    response_part = head if head.strip() else None
    # Between a reply's end-of-turn and the next user content: the next user turn's header.
    k = clean.find(eot, a1b)
    instr = clean[k + len(eot):u2a].lstrip("\n") if k >= 0 else ""
    instruction_part = instr if instr.strip() else None
    eots = [eot]
    final = _eot_after(tok, clean, a2b)
    if final and final not in eots:
        eots.append(final)
    return eots, response_part, instruction_part


def _char_spans_to_mask(tok, text, spans):
    """Token ids of text and a mask of the tokens that overlap any [a, b) character span."""
    enc = tok(text, add_special_tokens=False)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    fast = enc.encodings[0] if getattr(enc, "encodings", None) else None
    for a, b in spans:
        first = fast.char_to_token(a) if fast is not None and a < len(text) else None
        last = fast.char_to_token(b - 1) if fast is not None and b > a else None
        if first is None or last is None:
            return _offsets_mask(tok, text, spans)  # a character no token starts at: the slow, exact way
        for i in range(first, last + 1):
            mask[i] = 1
    return ids, mask


def _offsets_mask(tok, text, spans):
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    for i, (s, e) in enumerate(offsets):
        if any((e > a and s < b) or (e == s and a <= s < b) for a, b in spans):
            mask[i] = 1
    return ids, mask


def _zero_untrained(messages, mask):
    """Switch off the runs of assistant messages that carry no loss (weight 0), in message order."""
    assistants = [m for m in messages if m.get("role") == "assistant"]
    if all(trains(m) for m in assistants):
        return mask
    runs = _runs(mask)
    if len(runs) != len(assistants):
        raise MaskError(f"{len(runs)} trained runs for {len(assistants)} assistant messages")
    mask = list(mask)
    for (a, b), m in zip(runs, assistants):
        if not trains(m):
            mask[a:b] = [0] * (b - a)
    return mask


# --------------------------------------------------------------------------- encoding one record


def encode(tok, plan, template, messages, tools=None, extra=None):
    """(input_ids, assistant_masks) of one conversation under the plan. Raises MaskError."""
    method = plan["method"]
    if method in ("generation-markers", "trl-training-template"):
        out = tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, add_generation_prompt=False, **(extra or {}))
        ids = list(out["input_ids"])
        mask = list(out.get("assistant_masks") or [0] * len(ids))
        return ids, _zero_untrained(messages, mask)
    eots = plan["eot"]
    if method == "derived-spans":
        for m in messages:
            c = content_text(m.get("content"))
            if SENTINEL_OPEN in c or SENTINEL_CLOSE in c:
                raise MaskError("the record holds the private-use characters U+FFFF0/U+FFFF1 that derived-spans masking uses")
        if len(messages) > 0xFFF0:
            raise MaskError("more than 65520 messages in one conversation")
        text, spans = _sentinel_render(tok, template, messages, tools, extra,
                                       wrap_roles=("system", "user", "assistant", "tool", "ipython", "function"))
        keep = []
        for i, m in enumerate(messages):
            if not trains(m):
                continue
            if i in spans:
                a, b = spans[i]
            elif _tool_names(m) and plan.get("response_part"):
                # A tool-call turn whose (empty) content the template does not write: the reply starts after the
                # response part that follows the previous message the template did write.
                prev = max((spans[j][1] for j in spans if j < i), default=0)
                rp = plan["response_part"].strip()
                k = text.find(rp, prev)
                if k < 0:
                    raise MaskError(f"message {i + 1}: no response part {rp!r} before the tool call")
                a = b = k + len(rp)
            else:
                raise MaskError(f"message {i + 1}: the template does not write this assistant reply")
            k, e = _find_eot(text, eots, b)
            if k < 0:
                raise MaskError(f"no end-of-turn {' or '.join(eots)} after an assistant reply")
            keep.append((a, k + len(e)))
        return _char_spans_to_mask(tok, text, keep)
    if method == "delimiters":
        text = _render(tok, template, messages, tools, extra)
        rp = plan["response_part"]
        assistants = [m for m in messages if m.get("role") == "assistant"]
        starts, pos = [], 0
        while True:
            k = text.find(rp, pos)
            if k < 0:
                break
            starts.append(k + len(rp))
            pos = k + len(rp)
        if len(starts) != len(assistants):
            raise MaskError(f"the response part {rp!r} occurs {len(starts)} times for {len(assistants)} assistant messages")
        keep = []
        for a, m in zip(starts, assistants):
            if not trains(m):
                continue
            k, e = _find_eot(text, eots, a)
            if k < 0:
                raise MaskError(f"no end-of-turn {' or '.join(eots)} after an assistant reply")
            keep.append((a, k + len(e)))
        return _char_spans_to_mask(tok, text, keep)
    raise MaskError(f"unknown masking method {method!r}")


def check(tok, plan, messages, ids, mask):
    """Every trained run must decode to one trained assistant message's content (+ tool calls) + end-of-turn."""
    eots = plan.get("eot") or []
    trained = [m for m in messages if trains(m)]
    runs = _runs(mask)
    if len(runs) != len(trained):
        raise MaskError(f"{len(runs)} trained runs for {len(trained)} trained assistant messages")
    for n, ((a, b), m) in enumerate(zip(runs, trained), 1):
        got = tok.decode(ids[a:b], skip_special_tokens=False, clean_up_tokenization_spaces=False).strip()
        want = content_text(m.get("content")).strip()
        where = f"assistant message {n}"
        eos = getattr(tok, "eos_token", None)
        if eos and eos not in eots and got.endswith(eos) and any(got[: -len(eos)].rstrip().endswith(e) for e in eots):
            got = got[: -len(eos)].rstrip()  # end-of-turn then the sequence's EOS (Phi-3): both are stop tokens
        eot = next((e for e in eots if got.endswith(e)), None)
        if eot is None:
            raise MaskError(f"{where}: the trained tokens do not end with the end-of-turn token {' or '.join(eots) or '(none)'} "
                            f"(they end {got[-30:]!r})")
        body = got[: len(got) - len(eot)].strip()
        names = _tool_names(m)
        if not names:
            if body != want:
                raise MaskError(f"{where}: the trained tokens decode to {body[:80]!r}, not the reply {want[:80]!r}")
        else:
            if want and not body.startswith(want) and not body.endswith(want):
                raise MaskError(f"{where}: the trained tokens {body[:80]!r} do not hold the reply {want[:80]!r}")
            missing = [x for x in names if x not in body]
            if missing:
                if not any(x in tok.decode(ids) for x in missing):
                    raise MaskError(f"{where}: the chat template does not render tool calls, so {missing} would be lost; "
                                    "use a template with tool support or leave the tool-call rows out")
                raise MaskError(f"{where}: the trained tokens lack the tool call(s) {missing}")


# --------------------------------------------------------------------------- choosing, once per template


def _probe_ok(tok, plan, template):
    """(rows verified, {probe: why}) for the plan on every probe the template can render."""
    verified, failures = [], {}
    for name, probe in PROBES.items():
        try:
            text = _render(tok, template, probe["messages"], probe.get("tools"))
        except Exception as e:  # the template refuses this kind of row (its own raise_exception); not a masking failure
            failures[name] = f"the template does not render it: {type(e).__name__}: {str(e)[:120]}"
            continue
        if name == "tool-call" and "Paris, France" not in text:
            failures[name] = "the template does not render it: tool calls are dropped (no tool support in the template)"
            continue
        try:
            ids, mask = encode(tok, plan, template, probe["messages"], probe.get("tools"))
            check(tok, plan, probe["messages"], ids, mask)
            verified.append(name)
        except MaskError as e:
            failures[name] = str(e)
        except Exception as e:
            failures[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return verified, failures


def choose(tok, trl_training_template=None):
    """The first masking way that verifies on every probe the template renders, with every attempt's outcome.

    trl_training_template: TRL's training template for this tokenizer (get_training_chat_template), or None.
    Returns {"plan", "template", "attempts", "rows", "default_system"}; plan is None when no way verifies.
    """
    base = template_text(tok)
    attempts = []
    if not base:
        return {"plan": None, "template": None, "attempts": [{"method": m, "ok": False, "why": "the tokenizer has no chat template"}
                                                             for m in MASKING_METHODS], "rows": {}, "default_system": None}
    try:
        eot, rp, ip = derive_parts(tok, base)
        parts_error = None
    except MaskError as e:
        eot = rp = ip = None
        parts_error = str(e)
    except Exception as e:
        eot = rp = ip = None
        parts_error = f"the probe did not render: {type(e).__name__}: {str(e)[:160]}"
    candidates = []
    if _GENERATION_RE.search(base):
        candidates.append(("generation-markers", base, None))
    else:
        attempts.append({"method": "generation-markers", "ok": False, "why": "the template has no {% generation %} markers"})
    if trl_training_template:
        candidates.append(("trl-training-template", trl_training_template, None))
    else:
        attempts.append({"method": "trl-training-template", "ok": False,
                         "why": "TRL ships no training template for this exact template text"})
    for m in ("derived-spans", "delimiters"):
        if parts_error:
            attempts.append({"method": m, "ok": False, "why": parts_error})
        elif m == "delimiters" and not rp:
            attempts.append({"method": m, "ok": False, "why": "no text precedes an assistant reply to serve as the response part"})
        else:
            candidates.append((m, base, None))
    order = {m: i for i, m in enumerate(MASKING_METHODS)}
    # The first way that verifies every row kind the template renders wins; when none covers all of them,
    # the one that covers most (earlier on ties), and records of the kinds it misses are refused one by one.
    chosen, best = None, None
    for method, tpl, _ in sorted(candidates, key=lambda c: order[c[0]]):
        plan = new_plan(method, tpl, eot, rp, ip)
        if method in ("generation-markers", "trl-training-template"):
            # The end-of-turn for checking comes from the template the trainer will render with.
            try:
                plan["eot"] = derive_parts(tok, tpl)[0]
            except Exception:
                plan["eot"] = list(eot or [])
        verified, failures = _probe_ok(tok, plan, tpl)
        real_failures = {k: v for k, v in failures.items() if not v.startswith("the template does not render")}
        ok = bool(verified) and not real_failures
        attempts.append({"method": method, "ok": ok, "verified_on": verified,
                         "why": "; ".join(f"{k}: {v}" for k, v in failures.items()) or None})
        if verified and (best is None or len(verified) > len(best[2])):
            best = (plan, tpl, verified, failures)
        if ok:
            chosen = best = (plan, tpl, verified, failures)
            break
    chosen = chosen or best
    attempts.sort(key=lambda a: order[a["method"]])
    rows = {}
    if chosen:
        plan, tpl, verified, failures = chosen
        rows = {name: ("verified" if name in verified else failures.get(name)) for name in PROBES}
    return {"plan": chosen[0] if chosen else None, "template": chosen[1] if chosen else None, "attempts": attempts,
            "rows": rows, "default_system": default_system_prompt(tok, base)}


def default_system_prompt(tok, template):
    """The system prompt the template writes on its own when a conversation has none, or None."""
    user = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi."}]
    try:
        bare = _render(tok, template, user)
        with_sys, spans = _sentinel_render(tok, template, [{"role": "system", "content": ""}] + user, wrap_roles=("system",))
    except Exception:
        return None
    if 0 not in spans:
        return None
    a = spans[0][0]
    pre, post = with_sys[:a], with_sys[a:]
    if bare.startswith(pre) and bare.endswith(post) and len(bare) > len(pre) + len(post):
        return bare[len(pre):len(bare) - len(post)]
    return None


def describe(choice):
    """One line for cards and results."""
    plan = choice.get("plan")
    if not plan:
        return "no masking way verifies: " + "; ".join(f"{a['method']}: {a['why']}" for a in choice["attempts"])
    return f"{plan['method']} (end-of-turn {' or '.join(plan['eot'])}" + (f", response part {plan['response_part']!r}" if plan["method"] == "delimiters" else "") + ")"
