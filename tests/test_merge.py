"""AdLoCo MIT merge: weighted average of two instances and the worst-with-worst schedule."""

import pytest
import torch

from adloco.protocol.algorithms.merge import MergePolicy, choose_merge, merge_weighted


def test_merge_weighted_hand_values() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "step": torch.tensor(7)}
    b = {"w": torch.tensor([5.0, -2.0]), "step": torch.tensor(3)}
    out = merge_weighted(a, b, weight_a=3.0, weight_b=1.0)
    # (3·[1, 2] + 1·[5, −2]) / 4 = [8, 4] / 4 = [2, 1]
    assert torch.equal(out["w"], torch.tensor([2.0, 1.0]))
    assert torch.equal(out["step"], torch.tensor(7))
    assert out["w"] is not a["w"] and out["step"] is not a["step"]


def test_merge_zero_weights_keep_a() -> None:
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.tensor([float("inf"), 0.0])}
    assert torch.equal(merge_weighted(a, b, weight_a=0.0, weight_b=0.0)["w"], a["w"])
    assert torch.equal(merge_weighted(b, a, weight_a=0.0, weight_b=2.0)["w"], a["w"])


def test_merge_low_precision_keeps_dtype() -> None:
    a = {"w": torch.tensor([1.0], dtype=torch.bfloat16)}
    b = {"w": torch.tensor([3.0], dtype=torch.bfloat16)}
    out = merge_weighted(a, b, weight_a=1.0, weight_b=1.0)
    # (1 + 3) / 2 = 2
    assert out["w"].dtype == torch.bfloat16 and out["w"].item() == 2.0


def test_merge_rejects_mismatch() -> None:
    with pytest.raises(ValueError):
        merge_weighted({"w": torch.zeros(1)}, {"v": torch.zeros(1)}, weight_a=1, weight_b=1)
    with pytest.raises(ValueError):
        merge_weighted({"w": torch.zeros(1)}, {"w": torch.zeros(2)}, weight_a=1, weight_b=1)
    with pytest.raises(ValueError):
        merge_weighted({"w": torch.zeros(1)}, {"w": torch.zeros(1)}, weight_a=-1, weight_b=1)


def test_choose_merge_worst_with_worst() -> None:
    policy = MergePolicy(merge_every=2)
    # sorted by (demand, index): (4, 1), (4, 3), (8, 0), (9, 2) → victim 1, survivor 3
    assert choose_merge([8, 4, 9, 4], round=2, policy=policy) == (1, 3)
    assert choose_merge([8, 4, 9, 4], round=3, policy=policy) is None
    assert choose_merge([8, 4, 9, 4], round=0, policy=policy) is None
    assert choose_merge([5], round=2, policy=policy) is None


def test_four_instances_reach_one_after_round_six() -> None:
    policy = MergePolicy(merge_every=2, min_instances=1)
    demands = [4.0, 1.0, 3.0, 2.0]
    merged_at = []
    for r in range(1, 11):
        pick = choose_merge(demands, round=r, policy=policy)
        if pick is not None:
            victim, survivor = pick
            demands[survivor] += demands[victim]
            del demands[victim]
            merged_at.append(r)
    # round 2: 1 → 2 ([4, 3, 3]); round 4: 3 (idx 1) → 3 (idx 2) ([4, 6]); round 6: 4 → 6 ([10])
    assert merged_at == [2, 4, 6]
    assert demands == [10.0]


def test_merging_stops_at_min_instances() -> None:
    policy = MergePolicy(merge_every=2, min_instances=2)
    demands = [4.0, 1.0, 3.0, 2.0]
    for r in range(1, 11):
        pick = choose_merge(demands, round=r, policy=policy)
        if pick is not None:
            demands[pick[1]] += demands[pick[0]]
            del demands[pick[0]]
    assert len(demands) == 2


@pytest.mark.parametrize("kwargs", [{"merge_every": 0}, {"min_instances": 0}])
def test_policy_validation(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        MergePolicy(**kwargs)


def test_choose_merge_validation() -> None:
    with pytest.raises(ValueError):
        choose_merge([1.0, 2.0], round=-1, policy=MergePolicy())
    with pytest.raises(ValueError):
        choose_merge([1.0, float("nan")], round=2, policy=MergePolicy())
