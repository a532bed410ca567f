"""Evaluation's greedy decoding (jobs/evaluate.py: greedy_rows and the teacher-forced passes) against the plain
left-padded `model.generate` and full passes it replaces: same tokens, same end ids, the same step logits to
float rounding, on the embedded tiny model and on SmolLM2-135M-Instruct; and the models it must decline."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from finetune_mcp.jobs import evaluate as E  # noqa: E402

SYSTEM = {"role": "system", "content": "You repeat words. Answer with the words only, in the order given."}
WORDS = "apple river stone cloud green horse lamp music north paper quiet sugar".split()


def tiny_prompts(with_system: bool) -> list:
    out = []
    for i in range(10):
        q = {"role": "user", "content": "Repeat:\n" + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 4))}
        out.append([SYSTEM, q] if with_system else [q])
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    tok = E.load_tokenizer(str(tiny_model_dir))
    torch.manual_seed(0)
    base = E.load_model(str(tiny_model_dir))
    # init_lora_weights=False: a non-zero adapter, so the fine-tuned side really differs from the base
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)).eval()
    return tok, model


def both(model, tok, ids, limits, want):
    got = []
    for fast in (False, True):
        steps: dict[int, object] = {}

        def keep(rows, step_logits, steps=steps):
            for j, t in zip(rows, step_logits):
                steps[j] = t

        got.append((E.generate_ids(model, tok, ids, limits, 4, on_batch=keep, want_logits=want, fast=fast), steps))
    return got


def assert_same(plain, fast, want):
    (a, sa), (b, sb) = plain, fast
    assert [x[1:] for x in b] == [x[1:] for x in a]  # tokens and end ids
    assert [x[0] for x in b] == [x[0] for x in a]
    for i, (_, toks, end) in enumerate(b):
        if want[i]:
            assert sb[i].shape == sa[i].shape == (len(toks) + (end is not None), sa[i].shape[-1])
            assert torch.allclose(sb[i], sa[i], atol=1e-4, rtol=0), float((sb[i] - sa[i]).abs().max())
        else:
            assert sb[i] is None and sa[i] is None


@pytest.mark.parametrize("with_system", [True, False], ids=["shared-prefix", "no-shared-prefix"])
def test_greedy_rows_give_generate_answers_on_the_tiny_model(tiny, with_system):
    tok, model = tiny
    ids = [E.prompt_ids(tok, p) for p in tiny_prompts(with_system)]
    prefix = E.shared_prefix(ids, min(len(q) for q in ids) - 1)
    assert (prefix >= E.MIN_SHARED_PREFIX) == with_system  # each case takes the path it names
    limits = [3, 12, 1, 7, 12, 5, 12, 2, 9, 12]  # rows leave the batch at different steps
    want = [i % 3 != 0 for i in range(len(ids))]
    for adapter in (True, False):
        if adapter:
            plain, fast = both(model, tok, ids, limits, want)
        else:
            with model.disable_adapter():
                plain, fast = both(model, tok, ids, limits, want)
        assert_same(plain, fast, want)
        assert all(len(t) <= lim for (_, t, _), lim in zip(fast[0], limits))
        assert any(len(t) == lim for (_, t, _), lim in zip(fast[0], limits))  # some rows run to their limit


def test_teacher_forced_pass_over_a_shared_prefix_equals_the_full_pass(tiny, monkeypatch):
    tok, model = tiny
    pairs = [(p, " ".join(WORDS[:3])) for p in tiny_prompts(True)]
    seqs = [E._loss_ids(tok, p, c) for p, c in pairs]
    assert E.shared_prefix([s for s, _ in seqs], min(n for _, n in seqs)) >= E.MIN_SHARED_PREFIX
    shared = E.nll_sums(model, [s for s, _ in seqs], [n for _, n in seqs], 0)
    monkeypatch.setattr(E, "MIN_SHARED_PREFIX", 10**9)
    full = E.nll_sums(model, [s for s, _ in seqs], [n for _, n in seqs], 0)
    assert [c for _, c in shared] == [c for _, c in full] and all(c > 0 for _, c in full)
    assert all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for (a, _), (b, _) in zip(shared, full))


def test_a_sliding_window_model_is_declined_and_decoded_by_generate(tiny):
    from transformers import MistralConfig, MistralForCausalLM

    tok, _ = tiny
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = MistralForCausalLM(cfg).eval()
    ids = [E.prompt_ids(tok, p) for p in tiny_prompts(True)[:4]]
    assert E.prefix_cache(model, ids, 8) == (0, None)
    assert E.greedy_rows(model, ids, [6] * 4, E.stop_ids(tok, model), 0, [False] * 4) is None
    assert E.generate_ids(model, tok, ids, 6, fast=True) == E.generate_ids(model, tok, ids, 6, fast=False)


def test_merging_the_adapter_keeps_the_fine_tuned_model(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    tok = E.load_tokenizer(str(tiny_model_dir))
    torch.manual_seed(1)
    model = get_peft_model(E.load_model(str(tiny_model_dir)),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)).eval()
    ids = [E.prompt_ids(tok, p) for p in tiny_prompts(True)]
    with model.disable_adapter():
        base = E.nll_sums(model, ids, [1] * len(ids), 0)
    unmerged = E.nll_sums(model, ids, [1] * len(ids), 0)
    assert E.merge_adapter(model) is None
    merged = E.nll_sums(model, ids, [1] * len(ids), 0)
    assert all(abs(a - b) <= 1e-3 for (a, _), (b, _) in zip(merged, unmerged))
    assert any(abs(a - b) > 0.1 for (a, _), (b, _) in zip(unmerged, base))  # the adapter matters, so the check has teeth


def test_greedy_rows_give_generate_answers_on_smollm2(smollm2_dir):
    tok = E.load_tokenizer(str(smollm2_dir))
    model = E.load_model(str(smollm2_dir))
    prompts = ["What is the capital of France?", "How many legs does a spider have?", "Who wrote Romeo and Juliet?",
               "Name the largest planet in the solar system.", "Translate 'thank you' into Spanish.", "Is the sun a star?"]
    ids = [E.prompt_ids(tok, p) for p in prompts]
    assert E.shared_prefix(ids, min(len(q) for q in ids) - 1) >= E.MIN_SHARED_PREFIX  # its default system prompt
    want = [True, False] * 3
    plain, fast = both(model, tok, ids, [16, 10, 16, 6, 16, 12], want)
    assert_same(plain, fast, want)


def test_step_store_spills_past_its_budget_and_gives_back_the_same_tensors():
    import os

    kept = {k: torch.randn(5, 7) for k in range(4)}
    store = E.StepStore(budget=2 * 5 * 7 * 4)  # room for two in memory
    for k, t in kept.items():
        store.put(k, t)
    assert sorted(store.mem) == [0, 1] and sorted(store.files) == [2, 3]
    assert all(torch.equal(store.get(k), t) for k, t in kept.items())
    folder = os.path.dirname(store.files[2])
    store.close()
    assert not os.path.exists(folder)
