"""Simulator runs for the convergence and heterogeneity benchmarks (issue 11 §2, §3).

A configuration is an `adloco-sim` command line (without --out), parsed by the simulator's own CLI
so every row of a table names the exact invocation that reproduces it, defaults included. A run goes
until a stop rule says so (a token budget, a simulated-time budget, a target loss), each round's
record kept; the summaries read a run at a budget as its last record at or before it (the model that
exists then, no interpolation). Medians over seeds come with their spread (min..max).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adloco.node.cli.sim import build_parser, config_from_args
from adloco.node.data.corpus import Corpus
from adloco.node.sim.engine import SimConfig, Simulator, initial_val_loss
from adloco.node.training.rounds import RoundRecord

Row = dict[str, Any]
ROUND_CAP = 100_000


def sim_config(argv: Sequence[str], *, seed: int, rounds: int = ROUND_CAP) -> SimConfig:
    """The SimConfig `adloco-sim ARGV --seed SEED` builds (its defaults, its validation)."""
    args = build_parser().parse_args([*argv, "--seed", str(seed), "--rounds", str(rounds), "--out", "-"])
    return config_from_args(args)


class _Stop(Exception):
    """Raised from the round callback: the run has what it needs."""


@dataclass
class SimRun:
    """One configuration at one seed: its records and the loss of θ_0."""

    name: str
    seed: int
    initial_val_loss: float
    records: list[RoundRecord] = field(default_factory=list)
    wall_s: float = 0.0

    def last_at(self, key: str, budget: float) -> RoundRecord | None:
        """The last record whose `key` (tokens_total, sim_time_s) is at or below `budget`."""
        return next((r for r in reversed(self.records) if _num(r, key) <= budget), None)

    def val_at(self, key: str, budget: float) -> float:
        """Validation loss of the model that exists at `budget` (θ_0's before the first round)."""
        record = self.last_at(key, budget)
        return self.initial_val_loss if record is None else record.val_loss

    def first_below(self, target: float) -> tuple[int, RoundRecord] | None:
        """(rounds applied, record) of the first round whose val loss is at or below `target`."""
        return next(((i + 1, r) for i, r in enumerate(self.records) if r.val_loss <= target), None)

    def curve(self) -> list[Row]:
        keep = ("round", "val_loss", "tokens_total", "sim_time_s", "staleness_mean", "batch_sizes")
        return [{k: getattr(r, k) for k in keep} for r in self.records]


def _num(record: RoundRecord, key: str) -> float:
    value = getattr(record, key)
    return math.inf if value is None else float(value)


def run_sim(
    name: str,
    cfg: SimConfig,
    corpus: Corpus,
    vocab_size: int,
    *,
    stop: Callable[[list[RoundRecord]], bool],
    on_sim: Callable[[Simulator], None] | None = None,
) -> SimRun:
    """Run `cfg` until `stop(records so far)` is true (checked after every round) or cfg.rounds."""
    t0 = time.perf_counter()
    sim = Simulator(cfg, corpus, vocab_size=vocab_size)
    if on_sim is not None:
        on_sim(sim)
    run = SimRun(name=name, seed=cfg.train.seed, initial_val_loss=initial_val_loss(sim))

    def on_round(_record: RoundRecord) -> None:
        if stop(sim.records):
            raise _Stop

    with contextlib.suppress(_Stop):
        sim.run(on_round=on_round)
    run.records = list(sim.records)
    run.wall_s = time.perf_counter() - t0
    return run


def spread(values: Sequence[float | None]) -> Row:
    """Median and min..max of the seeds' values. None (not reached within the run) counts as above
    every reached value: the median is stated when it is still determined (fewer than half the seeds
    missing), the max is None when any seed missed."""
    got = sorted(v for v in values if v is not None and math.isfinite(v))
    missing = len(values) - len(got)
    ranked = got + [math.inf] * missing
    n = len(ranked)
    median = (ranked[(n - 1) // 2] + ranked[n // 2]) / 2 if n else math.inf
    return {
        "median": median if math.isfinite(median) else None,
        "min": got[0] if got else None,
        "max": got[-1] if got and not missing else None,
        "missing": missing,
    }


def fmt(s: Row, digits: int = 3) -> str:
    """'median (min..max)' of a `spread`, with the seeds that did not reach it."""
    if s["median"] is None:
        return f"not reached ({s['missing']} seed(s))" if s["missing"] else "n/a"
    top = "not reached" if s["max"] is None else f"{s['max']:.{digits}f}"
    miss = f", {s['missing']} not reached" if s["missing"] else ""
    if s["min"] == s["max"]:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{top}{miss})"


def median_curve(
    runs: Sequence[SimRun], key: str
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per round index (over the seeds that reached it): median x (`key`), median, min and max val
    loss, starting from θ_0 at x = 0."""
    xs, med, lo, hi = [0.0], [], [], []
    first = [r.initial_val_loss for r in runs]
    med.append(statistics.median(first))
    lo.append(min(first))
    hi.append(max(first))
    for i in range(max(len(r.records) for r in runs)):
        at = [r.records[i] for r in runs if len(r.records) > i]
        if len(at) < len(runs) / 2:  # fewer than half the seeds: not a median any more
            break
        xs.append(statistics.median(_num(rec, key) for rec in at))
        losses = [rec.val_loss for rec in at]
        med.append(statistics.median(losses))
        lo.append(min(losses))
        hi.append(max(losses))
    return xs, med, lo, hi


def plot_curves(
    groups: dict[str, Sequence[SimRun]],
    path: Path,
    *,
    key: str,
    xlabel: str,
    title: str,
    hlines: Sequence[tuple[float, str]] = (),
    vlines: Sequence[tuple[float, str]] = (),
    extra: dict[str, tuple[list[float], list[float]]] | None = None,
    logx: bool = False,
) -> Path:
    """Median val loss against `key` per configuration, shaded over the seeds' min..max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name, runs in groups.items():
        xs, med, lo, hi = median_curve(runs, key)
        if logx:  # θ_0 sits at x = 0
            xs, med, lo, hi = xs[1:], med[1:], lo[1:], hi[1:]
        (line,) = ax.plot(xs, med, marker=".", markersize=3, linewidth=1.2, label=name)
        if len(runs) > 1:
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    for name, (xs, ys) in (extra or {}).items():
        if logx:
            xs, ys = [x for x in xs if x > 0], [y for x, y in zip(xs, ys, strict=True) if x > 0]
        ax.plot(xs, ys, marker=".", markersize=3, linewidth=1.2, linestyle="--", label=name)
    for y, label in hlines:
        ax.axhline(y, color="grey", linestyle=":", linewidth=1, label=label)
    for x, label in vlines:
        ax.axvline(x, color="grey", linestyle="--", linewidth=1, label=label)
    lows = [min(median_curve(runs, key)[1]) for runs in groups.values()]
    ax.set_ylim(min(lows) - 0.1, min(lows) + 1.5)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def set_threads(n: int = 1) -> None:
    """One torch thread: the machine's cores are shared (bench/codecs.py)."""
    torch.set_num_threads(n)
