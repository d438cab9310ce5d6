"""HeLoCo correction of late pseudo-gradients, staleness weights, and DyLU inner steps.

HeLoCo (arXiv 2606.00271) corrects a stale pseudo-gradient Δ against the outer momentum m, tensor by
tensor, before it is applied: aligned tensors are kept, the component that conflicts with m is shrunk,
and tensors in between are rotated toward m with their norm kept. The formula is that of the
third-party formula sheet (research/algorithms.md §5.2); the paper's parameter values are unknown.
Staleness weights follow Async DiLoCo (arXiv 2401.09135) and Decoupled DiLoCo; DyLU (Async DiLoCo's
dynamic local updates) shortens H on slow peers so they fall behind less (§6.3).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "Correction",
    "CorrectionReport",
    "HelocoConfig",
    "correct",
    "correct_tensor",
    "dylu_inner_steps",
    "staleness_weight",
]

Action = Literal["keep", "shrink", "rotate", "skip"]
ACTIONS: tuple[Action, ...] = ("keep", "shrink", "rotate", "skip")


@dataclass(frozen=True, kw_only=True)
class HelocoConfig:
    """HeLoCo correction strengths. These defaults are ours: the paper's values are not known.

    c_ok: keep a tensor unchanged when cos(Δ, m) ≥ c_ok. c_ok = −1 turns correction off.
    k_s, beta_max: shrink strength and cap for anti-aligned tensors (cos < 0); at most beta_max of
        the conflicting component is removed. Raise k_s if late peers visibly pull the loss back up.
    k_d: strength of the rotation toward m for 0 ≤ cos < c_ok. k_s = k_d = 0 turns correction off.
    kappa: κ, weight of ||m|| in the confidence ||Δ||/(||Δ|| + κ||m|| + ε); larger κ corrects less
        when Δ is small next to m. Lower it if corrections barely change anything (mean cosine
        before ≈ after).
    eps: ε; tensors with ||Δ|| or ||m|| below it are skipped (early rounds have m ≈ 0).
    """

    c_ok: float = 0.2
    k_s: float = 1.0
    beta_max: float = 0.5
    k_d: float = 0.5
    kappa: float = 1.0
    eps: float = 1e-12

    def __post_init__(self) -> None:
        values = (self.c_ok, self.k_s, self.beta_max, self.k_d, self.kappa, self.eps)
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"HelocoConfig values must be finite, got {self}")
        if not -1 <= self.c_ok <= 1:
            raise ValueError(
                f"heloco c_ok is a cosine threshold in [-1, 1] (-1 turns correction off), got {self.c_ok}"
            )
        if self.k_s < 0 or self.k_d < 0 or self.kappa < 0:
            raise ValueError("k_s, k_d and kappa must be >= 0 (k_s = k_d = 0 turns correction off)")
        if not 0 <= self.beta_max <= 1:
            raise ValueError(
                f"beta_max must be in [0, 1] (1 removes the whole conflict), got {self.beta_max}"
            )
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


@dataclass(frozen=True, kw_only=True)
class CorrectionReport:
    """What `correct` did: tensors per action, and the mean cosine to m before and after.

    Means run over the tensors that were not skipped; NaN if all were skipped.
    """

    keep: int
    shrink: int
    rotate: int
    skip: int
    mean_cos_before: float
    mean_cos_after: float


def correct_tensor(delta: Tensor, momentum: Tensor, cfg: HelocoConfig) -> tuple[Tensor, Action]:
    """Correct one tensor block Δ against the outer momentum m (HeLoCo, per tensor).

    With u = Δ/||Δ||, v = m/||m||, c = ⟨u, v⟩ and conf = ||Δ||/(||Δ|| + κ||m|| + ε):
    "keep" if c ≥ c_ok; "shrink" if c < 0: β = min(k_s(−c)·conf, β_max), Δ̂ = Δ − β·c·||Δ||·v, which
    removes a fraction β of the component along m only; "rotate" otherwise: λ = min(k_d(1−c)·conf, 1),
    ũ = (1−λ)u + λv, Δ̂ = ||Δ||·ũ/max(||ũ||, ε), which keeps the norm. "skip" if ||m|| < ε or
    ||Δ|| < ε. A branch whose strength is 0 (β = 0 or λ = 0) reports "keep". For "keep" and "skip"
    the input tensor itself is returned; otherwise a new tensor of Δ's dtype.
    """
    corrected, action, _, _ = _correct(delta, momentum, cfg)
    return corrected, action


class Correction:
    """`correct_tensor` over a pseudo-gradient one tensor at a time, tallied: `apply` each tensor
    as it is encoded, then `report`. A node corrects its late Δ this way, so no whole corrected Δ
    (nor a whole scaled momentum) exists beside the one it trained (8 B/param at the peak of a late
    contribution, issue 28 §2)."""

    def __init__(self, cfg: HelocoConfig) -> None:
        self.cfg = cfg
        self._counts = dict.fromkeys(ACTIONS, 0)
        self._before: list[float] = []
        self._after: list[float] = []

    def apply(self, delta: Tensor, momentum: Tensor, *, scale: float = 1.0) -> Tensor:
        """One tensor of Δ corrected against `scale` × its momentum (`correct_tensor`), counted: the
        scaled momentum is never formed."""
        corrected, action, cos_before, cos_after = _correct(delta, momentum, self.cfg, scale)
        self._counts[action] += 1
        if action != "skip":
            self._before.append(cos_before)
            self._after.append(cos_after)
        return corrected

    def report(self) -> CorrectionReport:
        """What the tensors applied so far went through."""
        before, after = self._before, self._after
        return CorrectionReport(
            keep=self._counts["keep"],
            shrink=self._counts["shrink"],
            rotate=self._counts["rotate"],
            skip=self._counts["skip"],
            mean_cos_before=math.fsum(before) / len(before) if before else math.nan,
            mean_cos_after=math.fsum(after) / len(after) if after else math.nan,
        )


def correct(
    deltas: Sequence[Tensor], momenta: Sequence[Tensor], cfg: HelocoConfig, *, scale: float = 1.0
) -> tuple[list[Tensor], CorrectionReport]:
    """Apply `correct_tensor` against `scale` × the momentum to every tensor of a pseudo-gradient
    and summarise what happened."""
    if len(deltas) != len(momenta):
        raise ValueError(f"got {len(deltas)} deltas but {len(momenta)} momenta")
    correction = Correction(cfg)
    out = [correction.apply(d, m, scale=scale) for d, m in zip(deltas, momenta, strict=True)]
    return out, correction.report()


def staleness_weight(
    tau: int,
    *,
    kind: Literal["constant", "inv_sqrt", "tokens"],
    tokens: int | None = None,
    ref_tokens: int | None = None,
) -> float:
    """Return ρ, the averaging weight factor of a contribution that is τ rounds late.

    "constant": 1. "inv_sqrt": (1+τ)^(−1/2), Async DiLoCo's polynomial weight (DeepMind toy notebook;
    its constant √K/K factor cancels in a normalized average). "tokens": (tokens/ref_tokens)·(1+τ)^(−1/2),
    weighting by the data a contribution carries as in Decoupled DiLoCo, discounted for staleness;
    use it only where the averaging weight is not already multiplied by tokens, else tokens count
    twice. Raises ValueError for τ < 0, or for "tokens" without tokens ≥ 0 and ref_tokens > 0.
    """
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
        raise ValueError(f"staleness tau must be an int >= 0, got {tau!r}")
    if kind == "constant":
        return 1.0
    discount = 1.0 / math.sqrt(1.0 + tau)
    if kind == "inv_sqrt":
        return discount
    if kind == "tokens":
        if tokens is None or ref_tokens is None or tokens < 0 or ref_tokens <= 0:
            raise ValueError(
                f"kind='tokens' needs tokens >= 0 and ref_tokens > 0, got {tokens!r}, {ref_tokens!r}"
            )
        return tokens / ref_tokens * discount
    raise ValueError(f"unknown staleness weight kind {kind!r}: use 'constant', 'inv_sqrt' or 'tokens'")


def dylu_inner_steps(inner_steps: int, speed: float, ref_speed: float, *, min_steps: int = 1) -> int:
    """Return DyLU's H_w = clamp(⌊v_w / v_ref · H⌋, min_steps, H) (Async DiLoCo, dynamic local updates).

    speed, ref_speed: steps per second of this peer and of the reference (the paper: the fastest
    worker). A product within 1e-9 of an integer counts as that integer, so 0.3/0.4·4 gives 3, not 2.
    """
    if inner_steps < 1:
        raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
    if not 1 <= min_steps <= inner_steps:
        raise ValueError(f"min_steps must be in [1, inner_steps={inner_steps}], got {min_steps}")
    if not math.isfinite(speed) or speed < 0:
        raise ValueError(f"speed must be a finite number >= 0, got {speed!r}")
    if not math.isfinite(ref_speed) or ref_speed <= 0:
        raise ValueError(f"ref_speed must be a finite number > 0, got {ref_speed!r}")
    steps = speed / ref_speed * inner_steps
    if steps >= inner_steps:
        return inner_steps
    return max(min_steps, math.floor(steps + 1e-9))


_SLICE = 1 << 20  # values of Δ and m in float64 at a time: 16 MB, never a whole tensor's


def _correct(
    delta: Tensor, momentum: Tensor, cfg: HelocoConfig, scale: float = 1.0
) -> tuple[Tensor, Action, float, float]:
    """`correct_tensor` against `scale` × `momentum`, with its cosines before and after. In two
    passes over slices in float64: the norms and ⟨Δ, m⟩, then Δ̂ = a·Δ + b·m (both branches are
    such a sum; its norm and cosine follow from the three sums), so nothing but Δ̂ is as large as
    the tensor (its float64 copies of Δ, m, v and Δ̂ were 32 B per value of the largest tensor: the
    peak of a late contribution, issue 28 §2)."""
    if delta.shape != momentum.shape:
        raise ValueError(f"delta {tuple(delta.shape)} and momentum {tuple(momentum.shape)} differ in shape")
    with torch.no_grad():
        flat_d, flat_m = delta.detach().reshape(-1), momentum.detach().reshape(-1)

        def slices() -> Iterator[tuple[int, Tensor, Tensor]]:
            for start in range(0, flat_d.numel(), _SLICE):
                d = flat_d[start : start + _SLICE].double()
                yield start, d, flat_m[start : start + _SLICE].to(device=d.device, dtype=torch.float64)

        dd = dm = mm = 0.0
        for _, d, m in slices():
            dd, dm, mm = dd + float(d @ d), dm + float(d @ m), mm + float(m @ m)
        d_norm, raw_m_norm = math.sqrt(dd), math.sqrt(mm)
        m_norm = scale * raw_m_norm
        if d_norm < cfg.eps or m_norm < cfg.eps:
            return delta, "skip", math.nan, math.nan
        dv = dm / raw_m_norm  # ⟨Δ, v⟩, v = m / ||m||
        cos = min(1.0, max(-1.0, dv / d_norm))
        conf = d_norm / (d_norm + cfg.kappa * m_norm + cfg.eps)
        if cos >= cfg.c_ok:
            return delta, "keep", cos, cos
        if cos < 0:
            beta = min(cfg.k_s * -cos * conf, cfg.beta_max)
            if beta == 0:
                return delta, "keep", cos, cos
            a, b = 1.0, -(beta * cos * d_norm) / raw_m_norm  # Δ − β·c·||Δ||·v
            action: Action = "shrink"
        else:
            lam = min(cfg.k_d * (1.0 - cos) * conf, 1.0)
            if lam == 0:
                return delta, "keep", cos, cos
            # ũ = (1 − λ)u + λv, whose norm the unit vectors' cosine gives; Δ̂ = ||Δ||·ũ / ||ũ||.
            u_norm = math.sqrt(max((1.0 - lam) ** 2 + lam**2 + 2.0 * lam * (1.0 - lam) * cos, 0.0))
            u_norm = max(u_norm, cfg.eps)
            a, b = (1.0 - lam) / u_norm, d_norm * lam / (raw_m_norm * u_norm)
            action = "rotate"
        out = torch.empty(flat_d.numel(), dtype=delta.dtype, device=delta.device)
        for start, d, m in slices():
            out[start : start + len(d)] = torch.add(d * a, m, alpha=b)  # d may be Δ itself (float64)
        new_v = a * dv + b * raw_m_norm  # ⟨Δ̂, v⟩
        new_norm = math.sqrt(max(a * a * dd + b * b * mm + 2.0 * a * b * dm, 0.0))
        cos_after = new_v / new_norm if new_norm > 0 else 0.0
        return out.view(delta.shape), action, cos, cos_after
