"""Renders a run's loss curve to PNG (matplotlib, in the training Python), for poll_progress(plot=True).

Params: {"out": png path, "title": str, and either "progress_path": a progress.jsonl, or "points": [[step, loss], ...]}.
"""

from __future__ import annotations

import json
import math

from finetune_mcp.jobs._proto import JobError, run_main


def _points_from_progress(path: str) -> list[tuple[int, float]]:
    pts = []
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # the trainer is still writing this one
            try:
                d = json.loads(line)
                pts.append((int(d["step"]), float(d["loss"])))
            except (ValueError, KeyError, TypeError):
                continue
    return pts


def plot(params: dict) -> dict:
    pts = _points_from_progress(params["progress_path"]) if params.get("progress_path") else [(int(s), float(v)) for s, v in params.get("points") or []]
    if not pts:
        raise JobError("no loss records to plot yet", kind="NotFound", fix="poll again after the first logged step")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A million points draw no better than a few thousand; keep every k-th, and always the last.
    k = max(1, len(pts) // 4000)
    shown = pts[::k] + ([pts[-1]] if (len(pts) - 1) % k else [])
    steps = [s for s, _ in shown]
    losses = [v if math.isfinite(v) else float("nan") for _, v in shown]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, linewidth=1.2)
    bad = [s for s, v in pts if not math.isfinite(v)]
    for s in bad[:50]:
        ax.axvline(s, color="red", alpha=0.3, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(params.get("title") or "loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(params["out"], format="png")
    plt.close(fig)
    return {"out": params["out"], "points": len(pts), "non_finite": len(bad)}


if __name__ == "__main__":
    run_main(plot)
