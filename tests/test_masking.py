"""Assistant-only masking on real chat templates (common/masking.py): the template matrix on SmolLM2's real tokenizer.

The templates are real ones copied from where each family's model authors publish them
(tests/fixtures/chat-templates/SOURCES.md names each source). Each runs on SmolLM2-135M-Instruct's
tokenizer with that family's control tokens added as special tokens and its BOS/EOS set, over four row
kinds: single-turn, with a system message, multi-turn, and with a tool call.

What is asserted is checked here, independently of masking.check(): the trained tokens of each reply
decode to the reply itself followed by the end-of-turn marker that templates.yaml records for the family
(observed in the rendered text by whoever collected the templates, not derived by the code under test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

transformers = pytest.importorskip("transformers")

from finetune_mcp.common import masking as M  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "chat-templates"
CATALOG = yaml.safe_load((FIX / "templates.yaml").read_text())["templates"]
ROWS = list(M.PROBES)


def _tokenizer(model_dir: Path, entry: dict | None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if entry is None:
        return tok
    ctl = [c.split(" (")[0] for c in entry["control_tokens"] if not c.startswith("plain text")]
    ctl += [entry[k] for k in ("bos_token", "eos_token") if entry.get(k)]
    tok.add_special_tokens({"additional_special_tokens": sorted(set(ctl))})
    if entry.get("bos_token"):
        tok.bos_token = entry["bos_token"]
    if entry.get("eos_token"):
        tok.eos_token = entry["eos_token"]
    tok.chat_template = (FIX / entry["file"]).read_text()
    return tok


def _trl_template(tok):
    from trl.chat_template_utils import get_training_chat_template

    try:
        return get_training_chat_template(tok)
    except Exception:
        return None


def _eot(entry: dict) -> str:
    """The catalogue's end-of-turn marker: the first control token it records after an assistant reply."""
    after = entry["observed_after_assistant_reply"]
    ctl = sorted({c.split(" (")[0] for c in entry["control_tokens"] if not c.startswith("plain text")}
                 | {entry.get("eos_token") or ""}, key=len, reverse=True)
    head = after.lstrip(" \n")
    return next(c for c in ctl if c and head.startswith(c))


@pytest.fixture(scope="module")
def matrix(smollm2_dir):
    out = {}
    for entry in CATALOG:
        tok = _tokenizer(smollm2_dir, entry)
        out[entry["file"]] = (entry, tok, M.choose(tok, _trl_template(tok)))
    return out


def _replies_of(tok, ids, mask):
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tok.decode(ids[start:i], skip_special_tokens=False).strip())
            start = None
    return runs


def test_every_family_is_masked_or_refused_by_name(matrix):
    families = {e["family"].split("-")[0] for e in CATALOG}
    assert {"llama3", "mistral", "zephyr", "chatml", "phi3", "phi4", "gemma", "gemma3", "qwen2.5", "qwen3", "vicuna", "alpaca"} <= families
    table = {}
    for name, (entry, tok, choice) in matrix.items():
        assert choice["plan"] is not None, f"{name}: " + "; ".join(f"{a['method']}: {a['why']}" for a in choice["attempts"])
        # Every row kind is verified or refused with a reason a person can act on.
        for row, verdict in choice["rows"].items():
            assert verdict == "verified" or (isinstance(verdict, str) and len(verdict) > 20), (name, row, verdict)
        table[name] = (choice["plan"]["method"], choice["rows"])
    # The plain single-turn and multi-turn rows are what everyone trains: every template verifies them.
    for name, (method, rows) in table.items():
        assert rows["single-turn"] == "verified" and rows["multi-turn"] == "verified", (name, method, rows)
    print("\n" + json.dumps({k: [m, r] for k, (m, r) in table.items()}, indent=1))


@pytest.mark.parametrize("entry", CATALOG, ids=[e["file"].split("--")[0] + "--" + e["file"].split("--")[1][:28] for e in CATALOG])
def test_trained_tokens_are_the_replies_and_their_end_of_turn(matrix, entry):
    """Independent of check(): decode the mask and compare with the probe's replies and the catalogue's marker."""
    _, tok, choice = matrix[entry["file"]]
    plan, tpl = choice["plan"], choice["template"]
    eot = _eot(entry)
    for row in ROWS:
        if choice["rows"][row] != "verified":
            continue
        probe = M.PROBES[row]
        ids, mask = M.encode(tok, plan, tpl, probe["messages"], probe.get("tools"))
        got = _replies_of(tok, ids, mask)
        replies = [m for m in probe["messages"] if m["role"] == "assistant"]
        assert len(got) == len(replies), (row, got)
        for text, msg in zip(got, replies):
            # Some templates also end the whole conversation with the EOS (Phi-3); it is a stop token too.
            eos = tok.eos_token
            if eos and eos != eot and text.endswith(eos):
                text = text[: -len(eos)].rstrip()
            assert text.endswith(eot), (row, text)
            body = text[: -len(eot)].strip()
            if msg.get("tool_calls"):
                assert "get_weather" in body and "Paris, France" in body, (row, body)
            else:
                assert body == msg["content"], (row, body)
        # Nothing of the prompt side is trained: the user contents never appear inside a trained run.
        for m in probe["messages"]:
            if m["role"] == "user":
                assert all(m["content"] not in t for t in got), (row, m["content"])


def test_trl_originals_get_trls_training_template(matrix):
    """Templates TRL ships a training copy of are masked with that copy (the second way), not re-derived."""
    shipped = [e for e in CATALOG if "TRL" in e["source"].split(":")[0] or "trl/chat_templates" in e.get("corroborated_by", "")]
    assert shipped
    for e in shipped:
        _, tok, choice = matrix[e["file"]]
        trl = _trl_template(tok)
        if trl is not None and next(a for a in choice["attempts"] if a["method"] == "trl-training-template")["ok"]:
            assert choice["plan"]["method"] == "trl-training-template", e["file"]


def test_wrong_end_of_turn_or_rewritten_reply_fails_the_check(matrix):
    """check() is what refuses records: a plan with the wrong marker, or a reply that is not what was rendered, fails."""
    _, tok, choice = matrix["chatml--HuggingFaceTB-SmolLM2-135M-Instruct.jinja"]
    plan, tpl = choice["plan"], choice["template"]
    probe = M.PROBES["multi-turn"]["messages"]
    ids, mask = M.encode(tok, plan, tpl, probe)
    M.check(tok, plan, probe, ids, mask)
    with pytest.raises(M.MaskError, match="end-of-turn"):
        M.check(tok, {**plan, "eot": ["<|endoftext|>"]}, probe, ids, mask)
    # One token short at the end of the first reply: its end-of-turn is no longer trained.
    start = mask.index(1)
    first_end = next(i for i in range(start, len(mask)) if not mask[i]) - 1
    cut = list(mask)
    cut[first_end] = 0
    with pytest.raises(M.MaskError):
        M.check(tok, plan, probe, ids, cut)
    with pytest.raises(M.MaskError, match="not the reply"):
        M.check(tok, plan, [*probe[:1], {"role": "assistant", "content": "Eight."}, *probe[2:]], ids, mask)


def test_weight_zero_replies_carry_no_loss(matrix):
    """OpenAI's per-message weight 0: that reply's tokens are masked, the others trained, under every method."""
    for name in ("chatml--HuggingFaceTB-SmolLM2-135M-Instruct.jinja", "qwen2.5--Qwen-Qwen2.5-7B-Instruct.jinja",
                 "llama3--meta-llama-Llama-3.1-8B-Instruct.jinja"):
        _, tok, choice = matrix[name]
        msgs = [dict(m) for m in M.PROBES["multi-turn"]["messages"]]
        msgs[1]["weight"] = 0
        ids, mask = M.encode(tok, choice["plan"], choice["template"], msgs)
        M.check(tok, choice["plan"], msgs, ids, mask)
        got = _replies_of(tok, ids, mask)
        assert len(got) == 1 and got[0].startswith("Fourteen."), (name, got)


def test_default_system_prompt_is_detected(matrix):
    smol = matrix["chatml--HuggingFaceTB-SmolLM2-135M-Instruct.jinja"][2]
    assert "SmolLM" in (smol["default_system"] or "")
    qwen = matrix["qwen2.5--Qwen-Qwen2.5-7B-Instruct.jinja"][2]
    assert "Qwen" in (qwen["default_system"] or "")
    assert matrix["chatml--teknium-OpenHermes-2.5-Mistral-7B.jinja"][2]["default_system"] is None


def test_a_template_that_writes_no_end_of_turn_is_refused_by_name(smollm2_dir):
    """No way can verify when nothing follows a reply that the model could emit to stop: refused, and why."""
    tok = _tokenizer(smollm2_dir, None)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
                         "{% else %}A: {{ m['content'] }}\n{% endif %}{% endfor %}")
    choice = M.choose(tok, None)
    assert choice["plan"] is None
    why = " ".join(a["why"] or "" for a in choice["attempts"])
    assert "no end-of-turn token" in why and "could not learn to stop" in why


@pytest.mark.parametrize("name", ["llama3--meta-llama-Llama-3.1-8B-Instruct.jinja", "chatml--HuggingFaceTB-SmolLM2-135M-Instruct.jinja",
                                  "gemma3--google-gemma-3-4b-it.jinja", "mistral--mistralai-Mistral-7B-Instruct-v0.2.jinja"])
def test_the_delimiter_way_masks_the_same_replies(matrix, name):
    """The fourth way (response part to end-of-turn, found on a rendered probe) gives the replies the first way found."""
    entry, tok, choice = matrix[name]
    tpl = M.template_text(tok)
    eots, rp, ip = M.derive_parts(tok, tpl)
    assert rp and rp.strip() and eots
    plan = M.new_plan("delimiters", tpl, eots, rp, ip)
    for row in ("single-turn", "multi-turn"):
        msgs = M.PROBES[row]["messages"]
        ids, mask = M.encode(tok, plan, tpl, msgs)
        M.check(tok, plan, msgs, ids, mask)
        got = [t[: -len(_eot(entry))].strip() if t.endswith(_eot(entry)) else t for t in _replies_of(tok, ids, mask)]
        assert got == [m["content"] for m in msgs if m["role"] == "assistant"], (row, got)
