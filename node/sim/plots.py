"""PNG plots of a simulator run: validation loss against tokens, simulated time and wire bytes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on volunteer machines or CI
import matplotlib.pyplot as plt

AXES = (
    ("tokens_total", "tokens trained", "val_loss_vs_tokens.png"),
    ("sim_time_s", "simulated time (s)", "val_loss_vs_time.png"),
    ("bytes_sent", "wire bytes sent (all peers)", "val_loss_vs_bytes.png"),
)


def plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], out_dir: Path, *, initial_loss: float | None = None
) -> list[Path]:
    """One PNG per x axis, one line per run (label → records); returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label, filename in AXES:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for name, records in runs.items():
            xs = [0.0] + [float(r[key]) for r in records]
            ys = [initial_loss if initial_loss is not None else float("nan")] + [
                r["val_loss"] for r in records
            ]
            ax.plot(xs, ys, marker=".", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
