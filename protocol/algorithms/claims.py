"""What a contribution may claim: its tokens and averaging weight, bounded by the agreed schedule.

An owner averages Σ weight·Δ / Σ tokens, so a member's share of the average is what it claims, and
nothing in a payload can show the work behind it. Unchecked, one member claiming a weight of 1e12
made the average its own Δ (issue 10). Every owner therefore checks each member's claim where its
request header arrives, before a payload byte is read, and refuses and drops a member whose claim
is not a finite number ≥ 0 or exceeds what the round's schedule allows; the honest members
complete the round without it.

The bound. A peer trains H steps of b samples per instance slot (`Schedule`), so its round holds
H·Σb·seq_len tokens (`reference_tokens`, also `Peer._ref_tokens`). Switch mode can round a step's
effective batch up (micro-batch × accumulation ≥ b, and the norm test's chunks likewise), never to
2b or more, and DyLU only shortens H, so an honest fresh contribution claims fewer than 2× that.
A late one was trained under an earlier schedule, whose H·Σb the batch test only ever grew (and
"constant_tokens" holds fixed). The averaging weight is tokens × ρ(τ) with ρ ≤ 1, except under the
"tokens" staleness weight, where ρ = tokens / reference ≤ 2 (heloco.staleness_weight). So at most
`TOKEN_SLACK` × the reference tokens, and a weight of at most tokens × the largest ρ. What the bound
leaves a liar: a share of the average as if it had done 2× an honest peer's work (4× under
"tokens"), not the whole of it; robust aggregation narrows what it can do with that share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .schedule import Schedule

TOKEN_SLACK = 2.0
"""How far above the schedule's H·Σb·seq_len tokens a member's claim may go (see the module doc)."""


def reference_tokens(schedule: Schedule, seq_len: int) -> int:
    """H·Σb·seq_len: the tokens one peer's round of `schedule` holds."""
    return sum(schedule.batch) * schedule.inner_steps * seq_len


@dataclass(frozen=True)
class ClaimBounds:
    """The largest tokens and weight-per-token a contribution may claim (None: no upper bound)."""

    max_tokens: float | None = None
    max_weight_per_token: float | None = None

    @classmethod
    def for_schedule(
        cls, schedule: Schedule, *, seq_len: int, staleness_weight: Literal["constant", "inv_sqrt", "tokens"]
    ) -> ClaimBounds:
        """The bounds of a round run under `schedule` (see the module doc)."""
        rho = TOKEN_SLACK if staleness_weight == "tokens" else 1.0
        return cls(max_tokens=TOKEN_SLACK * reference_tokens(schedule, seq_len), max_weight_per_token=rho)

    @property
    def reference_tokens(self) -> float | None:
        """The work of one honest round (H·Σb·seq_len), or None without a token bound: the cap on
        the work an owner's screening credits a claim with (`parts.screening_work`)."""
        return None if self.max_tokens is None else self.max_tokens / TOKEN_SLACK

    def violation(self, weight: float, tokens: float) -> str | None:
        """Why a claim of (`weight`, `tokens`) is refused; None when it is within the bounds.

        Always refused, bounds or not: a weight or token count that is not a finite number ≥ 0.
        """
        if not (isinstance(weight, (int, float)) and isinstance(tokens, (int, float))):
            return "weight and tokens must be numbers"
        if not (math.isfinite(weight) and math.isfinite(tokens)) or weight < 0 or tokens < 0:
            return f"weight {weight!r} and tokens {tokens!r} must be finite and >= 0"
        if self.max_tokens is not None and tokens > self.max_tokens:
            return f"claims {tokens:.0f} tokens; the round's schedule allows at most {self.max_tokens:.0f}"
        if self.max_weight_per_token is not None and weight > tokens * self.max_weight_per_token * (1 + 1e-9):
            return (
                f"claims weight {weight:.6g} for {tokens:.0f} tokens; at most"
                f" {self.max_weight_per_token:g} per token"
            )
        return None


UNBOUNDED = ClaimBounds()
"""Only the checks every claim gets: finite, ≥ 0."""
