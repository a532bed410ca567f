"""Renders a run's loss curve to PNG (matplotlib, in the training Python), for poll_progress(plot=True).

Params: {"out": png path, "title": str, and either "progress_path": a progress.jsonl, or "points": [[step, loss], ...],
or "series": [{"label": str, "points": [[step, loss], ...]}, ...] for several runs overlaid (compare_runs)}.
"""

from __future__ import annotations

import json
import math

from finetune_mcp.common.proto import JobError, run_main


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


def _thin(pts: list) -> list:
    # A million points draw no better than a few thousand; keep every k-th, and always the last.
    k = max(1, len(pts) // 4000)
    return pts[::k] + ([pts[-1]] if (len(pts) - 1) % k else [])


def plot_series(params: dict) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [s for s in params["series"] if s.get("points")]
    if not series:
        raise JobError("no loss records to plot yet", kind="NotFound", fix="compare again after the runs log their first steps")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for s in series:
        shown = _thin([(int(a), float(b)) for a, b in s["points"]])
        ax.plot([a for a, _ in shown], [b for _, b in shown], linewidth=1.1, label=s.get("label"))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(params.get("title") or "loss")
    ax.grid(alpha=0.3)
    if len(series) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(params["out"], format="png")
    plt.close(fig)
    return {"out": params["out"], "series": len(series), "points": sum(len(s["points"]) for s in series)}


def plot(params: dict) -> dict:
    if params.get("series") is not None:
        return plot_series(params)
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
