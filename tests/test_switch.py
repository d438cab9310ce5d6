"""Switch-mode batch planning: balanced micro-batches, effective batch never below b."""

import pytest

from adloco.protocol.algorithms.switch import BatchPlan, plan_batch


def test_hand_examples() -> None:
    # b = 10, b_max = 8: accum = ⌈10/8⌉ = 2, micro = ⌈10/2⌉ = 5, effective 10 (AdLoCo code: 2 × 8 = 16)
    assert plan_batch(10, 8) == BatchPlan(micro=5, accum=2)
    # b = 17, b_max = 8: accum = 3, micro = ⌈17/3⌉ = 6, effective 18
    assert plan_batch(17, 8) == BatchPlan(micro=6, accum=3)
    assert plan_batch(17, 8).effective == 18
    assert plan_batch(8, 8) == BatchPlan(micro=8, accum=1)
    assert plan_batch(3, 8) == BatchPlan(micro=3, accum=1)


def test_guarantees_over_grid() -> None:
    for b in range(1, 201):
        for b_max in range(1, 41):
            plan = plan_batch(b, b_max)
            assert 1 <= plan.micro <= b_max
            assert plan.effective >= b
            assert plan.effective - b < plan.accum
            assert plan.accum == -(-b // b_max)


@pytest.mark.parametrize(("b", "b_max"), [(0, 8), (8, 0), (-1, 1)])
def test_rejects_bad_input(b: int, b_max: int) -> None:
    with pytest.raises(ValueError):
        plan_batch(b, b_max)
