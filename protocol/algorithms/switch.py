"""AdLoCo switch mode: turn a requested batch into micro-batches and gradient accumulation.

Stage 3 of AdLoCo (arXiv 2508.18182) brings in gradient accumulation once the adaptive batch b grows
past what the hardware fits (b_max, probed at start). Here one optimizer step always sees at least b
samples, and H counts optimizer steps, not micro-batches (research/algorithms.md §2.5, §2.10.10).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchPlan", "plan_batch"]


@dataclass(frozen=True)
class BatchPlan:
    """One optimizer step = `accum` micro-batches of `micro` samples each."""

    micro: int
    accum: int

    def __post_init__(self) -> None:
        if self.micro < 1 or self.accum < 1:
            raise ValueError(f"BatchPlan needs micro >= 1 and accum >= 1, got {self.micro}, {self.accum}")

    @property
    def effective(self) -> int:
        """Samples per optimizer step, micro × accum."""
        return self.micro * self.accum


def plan_batch(batch: int, b_max: int) -> BatchPlan:
    """Split batch b into balanced micro-batches no larger than b_max (AdLoCo switch mode).

    accum = ⌈b / b_max⌉ and micro = ⌈b / accum⌉, which guarantees micro ≤ b_max, effective ≥ b and
    effective − b < accum. This deviates from the AdLoCo code's micro = min(b, b_max) to waste less
    compute: b = 10, b_max = 8 gives 2 × 5 = 10 samples per step, not 2 × 8 = 16. It also drops the
    code's threshold (accumulate only past 2·b_max), which silently capped b in (b_max, 2·b_max].
    Raises ValueError if b < 1 or b_max < 1.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if b_max < 1:
        raise ValueError(f"b_max (largest micro-batch that fits) must be >= 1, got {b_max}")
    accum = -(-batch // b_max)
    return BatchPlan(micro=-(-batch // accum), accum=accum)
