"""Contribution scoring by the loss (issue 10 §3, protocol/algorithms/scoring.py): the rule, the
scorer over a real loss, and the owners' reduction leaving the excluded contributors out."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping

import pytest
import torch

from adloco.protocol.algorithms.codecs import decode, make_codec
from adloco.protocol.algorithms.parts import reduce_parts
from adloco.protocol.algorithms.scoring import DEFAULT_K, RoundScorer, Score, loss_scorer
from adloco.protocol.transport.owner import Incoming, reduce_owned

LOSS = Score("loss")


@pytest.mark.parametrize(
    ("spec", "rule", "k", "printed"),
    [
        ("off", "off", DEFAULT_K, "off"),
        ("loss", "loss", DEFAULT_K, "loss"),
        ("loss:2", "loss", 2.0, "loss:2"),
    ],
)
def test_score_specs_parse_and_print_back(spec: str, rule: str, k: float, printed: str) -> None:
    score = Score.parse(spec)
    assert (score.rule, score.k, str(score), score.on) == (rule, k, printed, rule != "off")


@pytest.mark.parametrize(
    "spec", ["", "on", "loss:", "loss:0", "loss:-1", "loss:nan", "loss:inf", "off:1", "gauntlet"]
)
def test_bad_score_specs_are_refused_naming_the_forms(spec: str) -> None:
    with pytest.raises(ValueError, match=r"not off, loss, or loss:k with k > 0"):
        Score.parse(spec)


def test_honest_deltas_are_kept_and_a_sign_flipped_one_is_excluded() -> None:
    excluded = LOSS.judge(3.0, [2.90, 2.92, 2.91, 3.10])
    assert list(excluded) == [3]
    assert "raises the loss by 0.1" in excluded[3]


def test_honest_deltas_that_hurt_within_their_spread_are_kept() -> None:
    """Late in training honest gains straddle 0: a Δ that hurts as much as its peers vary stays."""
    assert LOSS.judge(3.0, [3.01, 2.99, 3.004, 2.995, 3.002]) == {}


def test_a_helpful_delta_is_kept_however_far_below_the_median_gain() -> None:
    assert LOSS.judge(3.0, [2.0, 2.01, 2.02, 2.99]) == {}


def test_decisions_do_not_depend_on_the_contributors_order() -> None:
    after = [2.90, 3.40, 2.92, 2.91, 3.10, 2.95]
    expected = {after[i] for i in LOSS.judge(3.0, after)}
    assert expected == {3.40, 3.10}
    for order in itertools.permutations(after):
        assert {order[i] for i in LOSS.judge(3.0, list(order))} == expected


def test_a_smaller_k_excludes_more() -> None:
    after = [2.90, 2.92, 2.91, 2.95, 3.005]
    assert LOSS.judge(3.0, after) == {}
    assert list(Score("loss", 0.5).judge(3.0, after)) == [4]


def test_a_non_finite_loss_after_a_delta_excludes_it() -> None:
    excluded = LOSS.judge(3.0, [2.9, math.nan, 2.91, math.inf])
    assert list(excluded) == [1, 3]


def test_at_least_one_finite_contribution_is_always_kept() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        after = [3.0 + rng.gauss(0.05, 0.2) for _ in range(n)]
        assert len(LOSS.judge(3.0, after)) < n


@pytest.mark.parametrize("before", [math.nan, math.inf])
def test_a_non_finite_loss_before_cannot_be_judged(before: float) -> None:
    with pytest.raises(ValueError, match="loss before any Δ must be finite"):
        LOSS.judge(before, [1.0])


def test_nothing_to_judge_is_an_error() -> None:
    with pytest.raises(ValueError, match="no contributions"):
        LOSS.judge(1.0, [])


# ---- the scorer over a real loss ---------------------------------------------------------------


def _regression() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """θ of a linear model away from its optimum, and a batch of its task."""
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(8, 4, generator=g)
    x = torch.randn(64, 8, generator=g)
    theta = {"w": torch.zeros(8, 4), "b": torch.zeros(4)}
    return theta, x, x @ w_true


def _loss_of(x: torch.Tensor, y: torch.Tensor) -> Callable[[Mapping[str, torch.Tensor]], float]:
    return lambda p: float(((x @ p["w"] + p["b"] - y) ** 2).mean())


def _honest_delta(
    theta: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, seed: int
) -> dict[str, torch.Tensor]:
    """θ − θ_local after a few SGD steps on the peer's own rows of the task (DiLoCo's Δ)."""
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:32]
    params = {k: v.clone().requires_grad_() for k, v in theta.items()}
    for _ in range(5):
        loss = ((x[rows] @ params["w"] + params["b"] - y[rows]) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, grad in zip(params.values(), grads, strict=True):
                p -= 0.05 * grad
    return {k: (theta[k] - params[k]).detach() for k in theta}


def test_the_scorer_excludes_flipped_and_noise_deltas_on_a_real_loss() -> None:
    theta, x, y = _regression()
    honest = [_honest_delta(theta, x, y, seed) for seed in range(5)]
    flipped = {k: -v for k, v in honest[0].items()}
    g = torch.Generator().manual_seed(1)
    noise = {k: torch.randn(v.shape, generator=g) * v.norm() / v.numel() ** 0.5 for k, v in honest[1].items()}
    deltas = [honest[0], flipped, honest[1], honest[2], noise, honest[3], honest[4]]
    scorer = loss_scorer(LOSS, _loss_of(x, y), theta, step=0.7)
    assert sorted(scorer(len(deltas), lambda i: deltas[i])) == [1, 4]
    assert torch.equal(theta["w"], torch.zeros(8, 4))  # θ itself is never changed


def test_the_scorer_applies_only_the_parts_it_is_given() -> None:
    """An owner holding only `w` judges Δ over `w` with the rest of θ as it is."""
    theta, x, y = _regression()
    seen: list[set[str]] = []

    def loss_of(p: Mapping[str, torch.Tensor]) -> float:
        seen.append({k for k in p if not torch.equal(p[k], theta[k])})
        return _loss_of(x, y)(p)

    delta = _honest_delta(theta, x, y, 0)
    loss_scorer(LOSS, loss_of, theta, step=1.0)(1, lambda i: {"w": delta["w"]})
    assert seen == [set(), {"w"}]


@pytest.mark.parametrize(
    ("delta", "match"),
    [({"v": torch.zeros(3)}, "θ does not have"), ({"b": torch.zeros(5)}, "has shape")],
)
def test_the_scorer_refuses_a_delta_that_does_not_fit_theta(
    delta: dict[str, torch.Tensor], match: str
) -> None:
    theta, x, y = _regression()
    with pytest.raises(ValueError, match=match):
        loss_scorer(LOSS, _loss_of(x, y), theta, step=1.0)(1, lambda i: delta)


@pytest.mark.parametrize("step", [0.0, -1.0, math.nan])
def test_the_scorer_needs_a_positive_step(step: float) -> None:
    theta, x, y = _regression()
    with pytest.raises(ValueError, match="step must be"):
        loss_scorer(LOSS, _loss_of(x, y), theta, step=step)


# ---- the owners' reduction -----------------------------------------------------------------------


def test_reduce_parts_leaves_the_excluded_contributor_out_of_every_part() -> None:
    theta, x, y = _regression()
    honest = [_honest_delta(theta, x, y, seed) for seed in range(3)]
    flipped = {k: -v for k, v in honest[0].items()}
    deltas = [honest[0], honest[1], flipped, honest[2]]
    ids = ["a", "b", "c", "d"]
    codec = make_codec("none")
    encoded = [{k: codec.encode(k, v) for k, v in d.items()} for d in deltas]
    reduced = reduce_parts(
        ["w", "b"],
        ids,
        lambda i, k: encoded[i][k],
        [1.0] * 4,
        [1.0] * 4,
        codec,
        scorer=loss_scorer(LOSS, _loss_of(x, y), theta, step=0.7),
    )
    assert reduced.rejected == {"c": 2}
    assert {(part, peer) for part, peer, _ in reduced.rejections} == {("w", "c"), ("b", "c")}
    for k in ("w", "b"):
        expected = torch.stack([honest[i][k] for i in range(3)]).mean(dim=0)
        torch.testing.assert_close(decode(reduced.averaged[k]), expected)


def test_an_owner_rejects_every_part_of_the_member_its_scorer_excludes() -> None:
    """The hivemind owner's reduction (`owner.reduce_owned`) takes the scorer as `reduce_parts` does,
    and the exclusion reaches the answer every member reads (`Answer.rejected`)."""
    theta, x, y = _regression()
    honest = [_honest_delta(theta, x, y, seed) for seed in range(3)]
    deltas = {"p1": honest[0], "p2": {k: -v for k, v in honest[0].items()}, "p3": honest[1], "p4": honest[2]}
    codec = make_codec("none")
    incoming = {
        peer: Incoming(1.0, 1.0, {k: codec.encode(k, v) for k, v in d.items()}, None)
        for peer, d in deltas.items()
    }
    scorer = loss_scorer(LOSS, _loss_of(x, y), theta, step=0.7)
    answer, rejections = reduce_owned(["w"], incoming, codec, None, scorer=scorer)
    assert answer.rejected == {"p2": 1}
    assert [(part, peer) for part, peer, _ in rejections] == [("w", "p2")]


def test_a_round_scorer_takes_theta_and_a_fresh_batch_at_each_call_and_counts() -> None:
    theta, x, y = _regression()
    batches = iter([torch.arange(0, 32), torch.arange(32, 64)])
    drawn: list[torch.Tensor] = []

    def batch() -> torch.Tensor:
        drawn.append(next(batches))
        return drawn[-1]

    scorer = RoundScorer(
        LOSS,
        theta=lambda: theta,
        batch=batch,
        loss=lambda p, rows: float(((x[rows] @ p["w"] + p["b"] - y[rows]) ** 2).mean()),
        step=0.7,
    )
    honest = [_honest_delta(theta, x, y, seed) for seed in range(3)]
    deltas = [*honest, {k: -v for k, v in honest[0].items()}]
    assert list(scorer(4, lambda i: deltas[i])) == [3]
    assert list(scorer(3, lambda i: deltas[i])) == []
    assert len(drawn) == 2
    stats = scorer.stats
    assert (stats.calls, stats.judged, stats.excluded, stats.sequences) == (2, 7, 1, 5 * 32 + 4 * 32)
