"""On an NVIDIA GPU: progress records carry NVML's readings, and bitsandbytes loads the real model in 4 bits.

Both skip, loudly, on a machine without a GPU; `pytest -m gpu` (bench/gpu_check.sh runs it) selects them.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import anyio
import pytest

from finetune_mcp import telemetry
from finetune_mcp.common import task
from finetune_mcp.worker import child_env, train_python

from conftest import link_model, mcp_session


def _gpu_handle():
    nv = telemetry.nvml()
    if nv is None or nv.nvmlDeviceGetCount() == 0:
        pytest.skip(f"SKIPPED LOUDLY: no NVIDIA GPU here (NVML: {telemetry.nvml_error() or 'no device'}); run on a GPU machine with pytest -m gpu")
    return nv, nv.nvmlDeviceGetHandleByIndex(0)


class NvmlSampler:
    """NVML's used memory and temperature, read by the test itself every 0.2 s while a run trains."""

    def __init__(self, nv, handle):
        self.nv, self.handle, self.used, self.temps = nv, handle, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.used.append(self.nv.nvmlDeviceGetMemoryInfo(self.handle).used / 1e9)
            self.temps.append(float(self.nv.nvmlDeviceGetTemperature(self.handle, self.nv.NVML_TEMPERATURE_GPU)))
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.gpu
def test_progress_records_carry_nvml_memory_and_temperature(ws_root, request):
    """A real run over MCP on the GPU: every record's mem_gb and temp_c lie within what NVML showed meanwhile."""
    nv, handle = _gpu_handle()
    link_model(ws_root, request.getfixturevalue("tiny_model_dir"))
    inbox = ws_root / "inbox"
    inbox.mkdir()
    (inbox / "training-brief.md").write_text(task.sample_brief("sft-lora"))
    data = task.write_jsonl(task.sft_conversations(400), inbox / "data.jsonl")

    async def main():
        async with mcp_session() as s:
            async def call(tool, args):
                r = await s.call_tool(tool, args)
                assert not r.is_error, f"{tool}: {r.content[0].text}"
                return r.structured_content

            exp = (await call("prepare_dataset", {"brief_path": str(inbox / "training-brief.md"), "source": str(data)}))["experiment"]
            pf = await call("preflight", {"experiment": exp})
            assert pf["platform"] in ("generic-nvidia", "dgx-spark"), pf["summary"]
            await call("generate_config", {"experiment": exp, "tag": "nvml", "backend": "trl",
                                           "overrides": {"max_steps": 40, "logging_steps": 1, "save_steps": 40}})
            launch = await call("launch_run", {"experiment": exp, "tag": "nvml", "accept_warnings": True})
            records, cursor = [], 0
            with NvmlSampler(nv, handle) as sampler:
                for _ in range(600):
                    p = await call("poll_progress", {"run_id": launch["run_id"], "cursor": cursor, "limit": 1000})
                    records += p["records"]
                    cursor = p["next_cursor"]
                    if p["status"] in ("succeeded", "failed", "stopped"):
                        break
                    await anyio.sleep(0.5)
            return p, records, sampler

    p, records, sampler = anyio.run(main)
    assert p["status"] == "succeeded", p
    assert len(records) == 40
    mem = [r["mem_gb"] for r in records]
    temp = [r["temp_c"] for r in records]
    assert None not in mem and None not in temp, records[:3]
    print(f"records mem_gb {min(mem):.3f}-{max(mem):.3f}, NVML used {min(sampler.used):.3f}-{max(sampler.used):.3f} "
          f"; records temp_c {min(temp)}-{max(temp)}, NVML {min(sampler.temps)}-{max(sampler.temps)}")
    # GPU memory in use (device-wide, as NVML counts it), not the trainer's resident memory: inside NVML's own
    # readings taken meanwhile (a record is the peak between two samples: 10 % slack on top), and at least a
    # CUDA context's worth. Other tests may share the GPU (pytest-xdist): NVML sees their memory on both sides.
    assert min(mem) > 0.3
    assert min(mem) >= min(sampler.used) - 0.05 and max(mem) <= max(sampler.used) * 1.1 + 0.05
    # The GPU's temperature sensor, not a CPU one.
    assert min(sampler.temps) - 3 <= min(temp) and max(temp) <= max(sampler.temps) + 3


BNB_PROBE = r"""
import json, sys, torch
import bitsandbytes as bnb
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"].to("cuda")
ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
ref_bytes = ref.get_memory_footprint()
with torch.no_grad():
    ref_logits = ref(ids).logits[0, -1].float()
del ref
torch.cuda.empty_cache()
q = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16), device_map={"": 0})
linears = [m for n, m in q.named_modules() if n.startswith("model.layers") and isinstance(m, torch.nn.Linear)]
with torch.no_grad():
    logits = q(ids).logits[0, -1].float()
    out = q.generate(ids, max_new_tokens=12, do_sample=False)
print(json.dumps({
    "bnb": bnb.__version__, "linear_layers": len(linears),
    "linear_4bit": sum(isinstance(m, bnb.nn.Linear4bit) for m in linears),
    "bytes_4bit": q.get_memory_footprint(), "bytes_bf16": ref_bytes,
    "finite": bool(torch.isfinite(logits).all()),
    "cosine_to_bf16": float(torch.nn.functional.cosine_similarity(logits, ref_logits, dim=0)),
    "top1_same": int(logits.argmax()) == int(ref_logits.argmax()),
    "answer": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True),
}))
"""


@pytest.mark.gpu
def test_bitsandbytes_loads_smollm2_in_4bit(request):
    """NF4 weights on CUDA: every decoder Linear becomes Linear4bit, the model shrinks, and it still answers."""
    _gpu_handle()
    smollm2_dir = request.getfixturevalue("smollm2_dir")  # after the GPU check: no model conversion just to skip
    py = train_python()
    if subprocess.run([py, "-c", "import bitsandbytes"], capture_output=True).returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: bitsandbytes does not import in {py}; QLoRA needs it")
    p = subprocess.run([py, "-c", BNB_PROBE, str(smollm2_dir)], capture_output=True, text=True, timeout=600, env=child_env({}))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(r)
    assert r["linear_layers"] > 0 and r["linear_4bit"] == r["linear_layers"]
    # The decoder's linears drop from 2 bytes to about half a byte per weight; embeddings and norms stay bf16.
    assert r["bytes_4bit"] < 0.75 * r["bytes_bf16"]
    assert r["finite"] and r["cosine_to_bf16"] > 0.9
    assert r["answer"].strip()
