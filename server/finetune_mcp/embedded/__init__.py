"""The embedded default: a tiny causal LM built locally and a synthetic task it can learn."""
