"""prepare_dataset throughput against datasets.map + TRL packing called directly, and BFD packing efficiency.

    /work/main/.venv/bin/python bench/bench_prepare.py              # 50k examples, seq 512
    /work/main/.venv/bin/python bench/bench_prepare.py --n 5000     # quicker
    /work/main/.venv/bin/python bench/bench_prepare.py --real       # real public files: the long_records table

Builds the embedded model into a temporary DGX_SPARK_ROOT, writes two synthetic sets of N examples from
finetune_mcp.common.task, and for each runs, side by side:

  ours      the prepare_dataset phase end to end (light pass, worker child start, validation, near
            duplicates, collapse guard, templating, TRL pack_dataset "bfd", decoding, writing files, card)
  baseline  in a fresh Python: datasets.load_dataset("json") -> Dataset.map(the templating TRL's SFTTrainer
            does, assistant mask -> labels) -> trl.data_utils.pack_dataset(seq, "bfd"); timed after its
            imports ("warm", the strict comparison) and including them ("cold", what a fresh process pays)

Sets: "dialogues" is task.sft_dialogues, the embedded task's chat set (1-4 exchanges of 2-5 words to
repeat per conversation, so lengths spread as in a real chat set); "uniform" is task.sft_conversations,
one exchange of three words each (every example is 19 tokens, so BFD can hold at most 26 per 512-token
row: an efficiency ceiling of 26*19/512 = 0.965 by arithmetic, whatever the packer). Ours and the baseline alternate --rounds times and
the best time of each counts, so load from other processes hits both alike.

Ours runs the way a server runs it: the job worker is warm (the training stack imported once, each job a
fresh fork; see finetune_mcp/jobs/_zygote.py), as it is for every job after a server's first, and the
strict figure compares that with the baseline timed after its imports. A first call, with the worker
stopped beforehand (cold: it pays the imports), is compared with the baseline including its imports.
Goals: examples/s ratio >= 0.8; packing efficiency at seq 512 >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from finetune_mcp.common import task  # noqa: E402

BASELINE = textwrap.dedent('''
    import json, sys, time
    t0 = time.perf_counter()
    import datasets
    from transformers import AutoTokenizer
    from trl.data_utils import _tokenize, pack_dataset
    datasets.disable_progress_bars()
    t1 = time.perf_counter()
    model, src, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tok = AutoTokenizer.from_pretrained(model)
    ds = datasets.load_dataset("json", data_files=src, split="train", cache_dir=sys.argv[4])

    markers = "generation" in (tok.chat_template or "")

    def tokenize(ex):
        if not markers:
            # TRL cannot mask a template without {% generation %} markers (SmolLM2's): what a user gets by hand
            # is the tokenized conversation, loss on every token.
            ids = _tokenize(tok, ex["messages"])["input_ids"]
            return {"input_ids": ids, "labels": list(ids)}
        out = _tokenize(tok, ex["messages"], return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"],
                "labels": [t if m else -100 for t, m in zip(out["input_ids"], out["assistant_masks"])]}

    ds = ds.map(tokenize, remove_columns=ds.column_names)
    packed = pack_dataset(ds, seq, "bfd")
    lens = packed["seq_lengths"]
    t2 = time.perf_counter()
    print(json.dumps({"warm_s": t2 - t1, "imports_s": t1 - t0, "rows": packed.num_rows,
                      "efficiency": sum(map(sum, lens)) / (packed.num_rows * seq)}))
''')


REAL = HERE.parent / "tests" / "fixtures" / "datasets" / "real"
REAL_CASES = [("alpaca_en_demo.json", "sft-lora"), ("alpaca_en_demo.parquet", "sft-lora"), ("dpo_en_demo.json", "dpo"),
              ("kto_en_demo.json", "kto"), ("glaive_toolcall_en_demo.json", "sft-lora"), ("identity.json", "sft-lora"),
              ("c4_demo.jsonl", "sft-lora"), ("v1_sft_demo.jsonl", "sft-lora"), ("fastchat_dummy_conversation.json", "sft-lora"),
              ("gsm8k_chat_train.jsonl", "sft-lora"), ("orca_dpo_pairs_validation.jsonl", "dpo"), ("orca_dpo_pairs_trl.parquet", "dpo")]


def real_table() -> int:
    """Each real file through jobs/prepare_data.prepare in this process (the job prepare_dataset runs), SmolLM2's
    tokenizer, 256 and 512 tokens, both long_records policies that keep data; one markdown row per run."""
    from finetune_mcp.jobs.prepare_data import prepare
    from finetune_mcp.skills import load_skills

    from bench_memory import ensure_smollm2

    model = ensure_smollm2()
    sk = load_skills()
    tables = {t: sk.table("dataset-curation", t).model_dump(mode="json") for t in ("formats", "validation", "collapse")}
    head = ["file", "method", "seq", "long_records", "in", "kept", "dropped", "truncated", "cut in answer", "dedup", "trained tokens", "s", "refused"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    out = Path(tempfile.mkdtemp(prefix="bench-real-"))
    for f, method in REAL_CASES:
        for seq in (256, 512):
            for policy in ("drop", "truncate"):
                P = {"name": "t", "source": {"kind": "path", "path": str(REAL / f)}, "model_path": str(model), "method": method,
                     "max_seq_length": seq, "packing": False, "eval_fraction": 0.05, "seed": 0, "out_dir": str(out / f"{f}-{seq}-{policy}"),
                     "tables": tables, "long_records": policy,
                     "fill": {"name": "Ada", "author": "Example Labs"} if f in ("identity.json", "v1_sft_demo.jsonl") else {}}
                t = time.perf_counter()
                r = prepare(P)
                c, lr = r.get("counts") or {}, r.get("long_records") or {}
                err = next((p for p in r.get("problems", []) if p["severity"] == "error"), None)
                cells = [f, method, seq, policy, c.get("read"), c.get("kept") if r["ok"] else 0, c.get("dropped_long", 0), c.get("truncated", 0),
                         lr.get("cut_inside_answer", 0), c.get("dropped_exact_duplicates", 0), (r.get("tokens") or {}).get("trained_tokens") if r["ok"] else 0,
                         f"{time.perf_counter() - t:.1f}", "" if r["ok"] else f"{err['code']}: {err['message'][:80]}".replace("|", "/")]
                print("| " + " | ".join(str(x) for x in cells) + " |", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="alternate ours and the baseline this many times; the best of each counts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                    help="smollm2: SmolLM2-135M-Instruct's real tokenizer and template (masked by derived spans), identity chats")
    ap.add_argument("--real", action="store_true", help="the real public files of tests/fixtures/datasets/real/ through the job, on "
                    "SmolLM2's tokenizer, at seq 256 and 512 under long_records drop and truncate: the file x method x length table")
    a = ap.parse_args()
    if a.real:
        return real_table()
    a.out = a.out or str(HERE / "results" / f"bench_prepare{'' if a.model == 'tiny' else '_' + a.model}.json")

    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    os.environ["DGX_SPARK_ROOT"] = str(tmp / "root")
    from finetune_mcp.context import PhaseContext
    from finetune_mcp.tools import call
    from finetune_mcp.worker import release_warm, run_job
    from finetune_mcp.workspace import Workspace

    ws = Workspace.from_env()
    brief = ws.root / "brief.md"
    if a.model == "smollm2":
        from bench_memory import ensure_smollm2
        from finetune_mcp.embedded import identity

        model = ws.base_models_dir / "SmolLM2-135M-Instruct"
        model.parent.mkdir(parents=True, exist_ok=True)
        model.symlink_to(ensure_smollm2(), target_is_directory=True)
        brief.write_text(identity.sample_brief("SmolLM2-135M-Instruct", a.seq, packing=True))
        sets = (("identity-chats", identity.chats(a.n)),)
    else:
        model = ws.base_models_dir / "finetune-mcp-tiny"
        run_job("build_tiny_model", {"target_dir": str(model), "seed": 0}, timeout=900)
        brief.write_text(task.sample_brief("sft-lora").replace("max_seq_length: 64", f"max_seq_length: {a.seq}"))
        sets = (("dialogues", task.sft_dialogues(a.n)), ("uniform", task.sft_conversations(a.n)))

    results = {}
    for name, rows in sets:
        src = ws.root / "incoming" / f"{name}.jsonl"
        task.write_jsonl(rows, src)
        # A first call on a stopped worker: it pays the training stack's imports, as the baseline's cold figure does.
        release_warm()
        pc = PhaseContext.for_role("training-engineer", ws)
        t0 = time.perf_counter()
        res = call("prepare_dataset", pc, brief_path=str(brief), source=str(src), dataset_name=f"bench-{name}-cold")
        ours_cold = time.perf_counter() - t0
        if not res.complete:
            print(res.text(), file=sys.stderr)
            return 1
        # Alternate the two so that load from other processes on the machine hits both alike; keep the best.
        bases, ours = [], []
        for k in range(a.rounds):
            p = subprocess.run([sys.executable, "-c", BASELINE, str(model), str(src), str(a.seq), str(tmp / "hf-cache" / f"{name}-{k}")],
                               capture_output=True, text=True, timeout=3600)
            if p.returncode:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            bases.append(json.loads(p.stdout.strip().splitlines()[-1]))
            pc = PhaseContext.for_role("training-engineer", ws)
            t0 = time.perf_counter()
            res = call("prepare_dataset", pc, brief_path=str(brief), source=str(src), dataset_name=f"bench-{name}")
            ours.append(time.perf_counter() - t0)
            if not res.complete:
                print(res.text(), file=sys.stderr)
                return 1
        base = min(bases, key=lambda b: b["warm_s"])
        base["imports_s"] = min(b["imports_s"] for b in bases)
        ours_s = min(ours)
        r = {
            "examples": a.n,
            "rounds": a.rounds,
            "ours_s": round(ours_s, 2),
            "ours_all_s": [round(x, 2) for x in ours],
            "baseline_warm_all_s": [round(b["warm_s"], 2) for b in bases],
            "ours_ex_per_s": round(a.n / ours_s),
            "baseline_warm_s": round(base["warm_s"], 2),
            "baseline_warm_ex_per_s": round(a.n / base["warm_s"]),
            "ours_cold_s": round(ours_cold, 2),
            "baseline_cold_s": round(base["warm_s"] + base["imports_s"], 2),
            "ratio_vs_warm": round(base["warm_s"] / ours_s, 3),
            "ratio_cold_vs_cold": round((base["warm_s"] + base["imports_s"]) / ours_cold, 3),
            "ours_packing_efficiency": res.packing["efficiency"],
            "baseline_packing_efficiency": round(base["efficiency"], 4),
            "packed_rows": res.packing["rows"],
        }
        results[name] = r
        print(f"{name}: {json.dumps(r)}", flush=True)
        print("BENCH " + json.dumps({"figure": f"prepare_dataset examples/s, {name} set, {a.n} examples (warm worker vs baseline after its imports)",
                                     "ours": r["ours_ex_per_s"], "baseline": r["baseline_warm_ex_per_s"],
                                     "ratio": r["ratio_vs_warm"], "goal": ">= 0.8"}))
        print("BENCH " + json.dumps({"figure": f"prepare_dataset first call (worker cold) vs baseline incl. its imports, {name} set (s)",
                                     "ours": r["ours_cold_s"], "baseline": r["baseline_cold_s"], "ratio": r["ratio_cold_vs_cold"], "goal": ">= 0.8"}))
        print("BENCH " + json.dumps({"figure": f"BFD packing efficiency at seq {a.seq}, {name} set",
                                     "ours": r["ours_packing_efficiency"], "baseline": r["baseline_packing_efficiency"],
                                     "goal": ">= 0.97" + (" (ceiling 0.965 for 19-token examples)" if name == "uniform" else "")}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"seq": a.seq, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
