"""Scoring contributions by what they do to the loss, as Templar's Gauntlet does (issue 10 §3).

A contribution's Δ is judged on a batch its sender could not choose: the loss of θ on it, then the
loss of θ − η·Δ_i (η the outer learning rate; over the parts the scorer holds) for each
contributor, all on the same batch, so the batch's own difficulty cancels (a paired comparison).
Contributor i's gain is g_i = L(θ) − L(θ − η·Δ_i). `Score.judge` excludes a contributor whose Δ
raises the loss (g_i < 0) *and* lies below the honest spread (g_i < median(g) − k·1.4826·MAD(g)):
the first condition keeps every Δ that helps, however little; the second keeps an honest Δ that
hurts on this batch by noise as much as its peers' do (late in training, when the gains of honest
Δs straddle 0). The median contributor is never excluded, so a group keeps at least one Δ, and a
group of one or two cannot outvote itself. A non-finite loss after a Δ excludes it.

`loss_scorer` turns a rule, θ and a loss function (the node layer's model on its batch) into a
`Scorer`, the callback an owner's reduction takes (`parts.reduce_parts(scorer=...)`) and the
in-process hub (`MemoryHub(scorer=...)`); `RoundScorer` is one a driver hands its transport once,
which takes θ and a fresh batch each time it is called and counts what it did. The math here
knows no model: `loss_of` does.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

DEFAULT_K = 3.0
"""How many robust standard deviations (1.4826 × MAD) below the median gain a harmful Δ must lie
to be excluded. Lower it if attackers whose Δ barely raises the loss get through (watch the
"excluded" warnings against the loss curve); raise it if honest peers are excluded in a clean run
(non-IID shards spread the honest gains)."""
MAD_TO_SIGMA = 1.4826  # MAD × this estimates σ for normally distributed gains
SCORE_SEQUENCES = 16
"""Sequences in a scorer's batch: (contributors + 1) forward passes of this many per round."""
SCORE_SEED_OFFSET = 0x5C0E
"""The simulator's scorer stream is seeded with the run's seed plus this, apart from the peers'
samplers (a swarm owner seeds its own from a secret: `node.swarm.node.shard_scorer`)."""

Scorer = Callable[[int, Callable[[int], Mapping[str, torch.Tensor]]], dict[int, str]]
"""scorer(count, delta_of) -> {index: why} of the contributors to leave out; `delta_of(i)` is
contributor i's decoded Δ over the parts the caller holds (name -> tensor)."""


@dataclass(frozen=True)
class Score:
    """The scoring rule: "off" (the default), or "loss" / "loss:k" (k > 0, default `DEFAULT_K`)."""

    rule: str = "off"
    k: float = DEFAULT_K

    @classmethod
    def parse(cls, spec: str) -> Score:
        """ "off", "loss" or "loss:k" with k > 0; ValueError naming the forms."""
        name, colon, value = spec.partition(":")
        if name == "off" and not colon:
            return cls()
        if name == "loss" and not colon:
            return cls("loss")
        try:
            k = float(value)
        except ValueError:
            k = math.nan
        if name == "loss" and math.isfinite(k) and k > 0:
            return cls("loss", k)
        raise ValueError(f"score: {spec!r} is not off, loss, or loss:k with k > 0")

    @property
    def on(self) -> bool:
        return self.rule != "off"

    def __str__(self) -> str:
        return "off" if not self.on else "loss" if self.k == DEFAULT_K else f"loss:{self.k:g}"

    def judge(self, before: float, after: Sequence[float]) -> dict[int, str]:
        """Which contributors to exclude, by index, and why: the rule of the module docstring.

        `before` is L(θ), `after[i]` L(θ − η·Δ_i) on the same batch. Depends on each contributor's
        own loss and on the set of them, not on their order. Raises ValueError when `before` is not
        finite (θ itself cannot be judged) or `after` is empty.
        """
        if not math.isfinite(before):
            raise ValueError(f"score: the loss before any Δ must be finite, got {before}")
        if not after:
            raise ValueError("score: no contributions to judge")
        excluded = {i: f"loss {a} after its Δ" for i, a in enumerate(after) if not math.isfinite(a)}
        gains = {i: before - a for i, a in enumerate(after) if i not in excluded}
        if not gains:
            return excluded
        median = statistics.median(gains.values())
        spread = MAD_TO_SIGMA * statistics.median(abs(g - median) for g in gains.values())
        bar = median - self.k * spread
        for i, gain in gains.items():
            if gain < 0 and gain < bar:
                excluded[i] = (
                    f"its Δ raises the loss by {-gain:.4g} (median gain {median:.4g}, bar {bar:.4g})"
                )
        return dict(sorted(excluded.items()))


def loss_scorer(
    score: Score,
    loss_of: Callable[[Mapping[str, torch.Tensor]], float],
    theta: Mapping[str, torch.Tensor],
    *,
    step: float,
) -> Scorer:
    """A `Scorer` that judges each Δ by `score.judge(loss_of(θ), [loss_of(θ − step·Δ_i)])`.

    `theta` is the round's anchor (name -> tensor, not changed); `loss_of(params)` evaluates the
    model with `params` on the scoring batch (the same batch for every call). A Δ covers some of
    θ's names (an owner's parts); the rest of θ stays as it is. Raises ValueError on a name θ does
    not have or a shape that differs from θ's.
    """
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"score: step must be finite and > 0, got {step}")

    def scorer(count: int, delta_of: Callable[[int], Mapping[str, torch.Tensor]]) -> dict[int, str]:
        before = loss_of(theta)
        after = [loss_of(_stepped(theta, delta_of(i), step)) for i in range(count)]
        return score.judge(before, after)

    return scorer


def _stepped(
    theta: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor], step: float
) -> dict[str, torch.Tensor]:
    params = dict(theta)
    for name, d in delta.items():
        if name not in theta:
            raise ValueError(f"score: Δ names {name!r}, which θ does not have")
        if d.shape != theta[name].shape:
            raise ValueError(f"score: Δ of {name!r} has shape {tuple(d.shape)}, θ {tuple(theta[name].shape)}")
        params[name] = theta[name] - step * d.to(theta[name].device, theta[name].dtype)
    return params


@dataclass
class ScoreStats:
    """What a `RoundScorer` did: calls, contributions judged and excluded, the sequences it ran
    forward passes on, and its wall time."""

    calls: int = 0
    judged: int = 0
    excluded: int = 0
    sequences: int = 0
    seconds: float = 0.0


class RoundScorer:
    """A `Scorer` for a driver to hand its transport once: each call judges from the current θ
    (`theta()`, the round's anchor) on a fresh batch (`batch()`, from data the contributors cannot
    choose), with `loss(params, batch)` the driver's model; `stats` counts what it did."""

    def __init__(
        self,
        score: Score,
        *,
        theta: Callable[[], Mapping[str, torch.Tensor]],
        batch: Callable[[], torch.Tensor],
        loss: Callable[[Mapping[str, torch.Tensor], torch.Tensor], float],
        step: float,
    ) -> None:
        self.score = score
        self.step = step
        self.stats = ScoreStats()
        self._theta, self._batch, self._loss = theta, batch, loss
        self._lock = threading.Lock()  # owners of overlapping rounds may score at once

    def __call__(self, count: int, delta_of: Callable[[int], Mapping[str, torch.Tensor]]) -> dict[int, str]:
        started = time.perf_counter()
        with self._lock:
            batch = self._batch()
        scorer = loss_scorer(
            self.score, lambda params: self._loss(params, batch), self._theta(), step=self.step
        )
        excluded = scorer(count, delta_of)
        with self._lock:
            self.stats.calls += 1
            self.stats.judged += count
            self.stats.excluded += len(excluded)
            self.stats.sequences += (count + 1) * int(batch.shape[0])
            self.stats.seconds += time.perf_counter() - started
        return excluded
