"""`ClaimBounds`: what a contribution may claim, from the round's schedule."""

from __future__ import annotations

import math

import pytest

from adloco.protocol.algorithms.claims import TOKEN_SLACK, UNBOUNDED, ClaimBounds, reference_tokens
from adloco.protocol.algorithms.schedule import Schedule

SCHEDULE = Schedule(round=3, batch=(4, 2), inner_steps=5, codec="int8")  # H·Σb = 30 samples


def test_the_bounds_of_a_schedule() -> None:
    assert reference_tokens(SCHEDULE, 64) == 30 * 64
    inv_sqrt = ClaimBounds.for_schedule(SCHEDULE, seq_len=64, staleness_weight="inv_sqrt")
    assert inv_sqrt == ClaimBounds(max_tokens=TOKEN_SLACK * 30 * 64, max_weight_per_token=1.0)
    tokens = ClaimBounds.for_schedule(SCHEDULE, seq_len=64, staleness_weight="tokens")
    assert tokens.max_weight_per_token == TOKEN_SLACK


@pytest.mark.parametrize(
    ("weight", "tokens", "refused"),
    [
        (1920.0, 1920.0, None),  # an honest fresh round: ρ = 1
        (1920.0 / math.sqrt(3), 1920.0, None),  # an honest late one, τ = 2
        (0.0, 0.0, None),
        (3840.0, 3840.0, None),  # the schedule's tokens × the slack, exactly
        (3841.0, 3841.0, "tokens"),
        (1921.0, 1920.0, "per token"),
        (1e12, 1920.0, "per token"),
        (math.nan, 1920.0, "finite"),
        (1920.0, math.inf, "finite"),
        (-1.0, 1920.0, "finite"),
        (1.0, -1.0, "finite"),
    ],
)
def test_a_claim_is_refused_with_the_reason(weight: float, tokens: float, refused: str | None) -> None:
    bounds = ClaimBounds.for_schedule(SCHEDULE, seq_len=64, staleness_weight="inv_sqrt")
    why = bounds.violation(weight, tokens)
    assert why is None if refused is None else refused in str(why)


def test_without_bounds_only_finite_non_negative_claims_pass() -> None:
    assert UNBOUNDED.violation(1e12, 1.0) is None
    assert UNBOUNDED.violation(math.nan, 1.0) is not None
    assert UNBOUNDED.violation(1.0, -2.0) is not None
