"""Model shapes both sides use: the embedded tiny model's fixed shape and parameter counts from safetensors headers.

Stdlib only: the server's memory estimate reads the tiny model's shape before it is built, and the
builder job (jobs/build_tiny_model.py) builds the model from the very same numbers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# 256 byte symbols + 3 specials + merges. Large enough that every task word, with and without a
# leading space, gets merged into one token (build_tiny_model.build() checks this).
TINY_VOCAB_SIZE = 640

TINY_MODEL_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    # At the usual 0.02 a model this small starts nearly flat and the loss barely moves.
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def safetensors_param_count(folder: Path) -> int | None:
    """Exact parameter count from the safetensors headers in folder (no weights are read), or None."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in t["shape"]:
                count *= d
            total += count
    return total
