"""Schedule consensus: deterministic, order-independent, hand-checked."""

import json
import random
from dataclasses import replace
from typing import Any

import pytest
import torch

from adloco.protocol.algorithms.batchtest import GradStats, grad_stats
from adloco.protocol.algorithms.merge import MergePolicy
from adloco.protocol.algorithms.report import PeerReport
from adloco.protocol.algorithms.schedule import (
    Schedule,
    ScheduleConfig,
    accumulation_for,
    next_schedule,
    swarm_accumulation,
)
from adloco.protocol.algorithms.switch import BatchPlan

# n = 4, M = 2, S = 2.5, ||ḡ||² = 1.25 (the g1 = [2, 0], g2 = [0, 1] example of test_batchtest.py)
HAND = GradStats(
    num_grads=2, samples_per_grad=4, sq_dev_sum=2.5, mean_sq_norm=1.25, ip_dev_sum=1.125, ortho_dev_sum=1.6
)
# n = 8, M = 2, S = 0.5, ||ḡ||² = 1
QUIET = GradStats(
    num_grads=2, samples_per_grad=8, sq_dev_sum=0.5, mean_sq_norm=1.0, ip_dev_sum=0.0, ortho_dev_sum=0.5
)
REPORTS = [
    PeerReport(peer_id="a", slot_stats=(HAND, None), b_max=8, tokens=100),
    PeerReport(peer_id="b", slot_stats=(HAND, QUIET), b_max=4, tokens=200, staleness=1, step_time_s=0.5),
]
CURRENT = Schedule(round=1, batch=(4, 8), inner_steps=10)


def test_hand_example_local_scope() -> None:
    cfg = ScheduleConfig(test="norm", eta=0.5, batch_cap=512, merge=MergePolicy(merge_every=2))
    nxt, merge = next_schedule(CURRENT, REPORTS, cfg)
    # slot 0: pool of HAND, HAND: n = 4, S = 5, dof = 2, ||ḡ||² = 1.25
    #   V = 4·5/2 = 10; T = 10/(0.25·1.25) = 32 → b = 32
    # slot 1: QUIET only: V = 8·0.5/1 = 4; T = 4/(0.25·1) = 16 → b = max(8, 16) = 16
    # round 2 is a merge round: demands [32, 16] → victim 1, survivor 0, b = 32 + 16 = 48
    assert merge == (1, 0)
    assert nxt == Schedule(round=2, batch=(48,), inner_steps=10, codec="none")


def test_hand_example_swarm_scope_and_constant_tokens() -> None:
    cfg = ScheduleConfig(
        test="norm", eta=0.5, batch_scope="swarm", inner_steps_policy="constant_tokens", merge=MergePolicy()
    )
    nxt, merge = next_schedule(CURRENT, REPORTS, cfg, codec="int8")
    # slot 0: two peers reported → T = 32/2 = 16; slot 1: one peer → T = 16; b = [16, 16]
    # tie → victim 0 (lower index), survivor 1: b = 32
    # constant tokens: base = H·Σb = 10·(4 + 8) = 120; H = round(120/32 = 3.75) = 4
    assert merge == (0, 1)
    assert nxt == Schedule(round=2, batch=(32,), inner_steps=4, codec="int8", base_samples=120)


def test_constant_tokens_rounds_half_up_and_floors() -> None:
    cfg = ScheduleConfig(eta=0.5, inner_steps_policy="constant_tokens", merge=MergePolicy(merge_every=1))
    nxt, _ = next_schedule(CURRENT, REPORTS, cfg)
    # b = [32, 16] → merged 48; H = 120/48 = 2.5 → 3 (half up)
    assert nxt.batch == (48,) and nxt.inner_steps == 3
    floored, _ = next_schedule(CURRENT, REPORTS, replace(cfg, min_inner_steps=5))
    assert floored.inner_steps == 5
    # the pinned base is carried, not re-pinned from the new schedule
    later, _ = next_schedule(nxt, [], cfg)
    assert later.base_samples == 120 and later.inner_steps == 3


def test_no_merge_off_schedule_and_cap_on_merge() -> None:
    cfg = ScheduleConfig(eta=0.5, batch_cap=40, merge=MergePolicy(merge_every=2))
    odd, merge = next_schedule(replace(CURRENT, round=2), REPORTS, cfg)
    assert merge is None and odd.batch == (32, 16) and odd.round == 3
    even, merge = next_schedule(CURRENT, REPORTS, cfg)
    assert merge == (1, 0) and even.batch == (40,)  # 32 + 16 capped at 40


def test_reports_from_another_schedule_are_ignored() -> None:
    cfg = ScheduleConfig(eta=0.5, merge=MergePolicy(min_instances=2))
    stray = PeerReport(peer_id="c", slot_stats=(QUIET,), b_max=8, tokens=1)
    assert next_schedule(CURRENT, [*REPORTS, stray], cfg) == next_schedule(CURRENT, REPORTS, cfg)


def test_hide_comm_takes_the_hiding_steps_within_its_bounds_and_fixed_ignores_them() -> None:
    cfg = ScheduleConfig(inner_steps_policy="hide_comm", min_inner_steps=4, max_inner_steps=60)
    assert next_schedule(CURRENT, [], cfg, hiding_steps=37)[0].inner_steps == 37
    assert next_schedule(CURRENT, [], cfg, hiding_steps=1000)[0].inner_steps == 60
    assert next_schedule(CURRENT, [], cfg, hiding_steps=1)[0].inner_steps == 4
    assert next_schedule(CURRENT, [], cfg, hiding_steps=None)[0].inner_steps == 10  # nothing measured
    assert next_schedule(CURRENT, [], ScheduleConfig(), hiding_steps=37)[0].inner_steps == 10
    with pytest.raises(ValueError, match="max_inner_steps"):
        ScheduleConfig(inner_steps_policy="hide_comm", min_inner_steps=10, max_inner_steps=5)


def test_no_reports_keeps_batches() -> None:
    nxt, merge = next_schedule(CURRENT, [], ScheduleConfig(merge=MergePolicy(min_instances=2)))
    assert merge is None and nxt == Schedule(round=2, batch=(4, 8), inner_steps=10)


def _random_report(rng: random.Random, peer: int, slots: int) -> PeerReport:
    stats: list[GradStats | None] = []
    for _ in range(slots):
        if rng.random() < 0.2:
            stats.append(None)
            continue
        grads = [
            torch.randn(6, generator=torch.Generator().manual_seed(rng.randrange(10**6))) + 0.3
            for _ in range(3)
        ]
        stats.append(grad_stats(grads, samples_per_grad=rng.randint(1, 8)))
    return PeerReport(
        peer_id=f"peer-{peer}", slot_stats=tuple(stats), b_max=rng.randint(1, 16), tokens=rng.randint(0, 999)
    )


def test_order_independence() -> None:
    rng = random.Random(5)
    reports = [_random_report(rng, i, 3) for i in range(7)]
    current = Schedule(round=4, batch=(2, 3, 5), inner_steps=20)
    for cfg in (
        ScheduleConfig(test="norm"),
        ScheduleConfig(test="augmented", batch_scope="swarm", inner_steps_policy="constant_tokens"),
    ):
        reference = next_schedule(current, reports, cfg)
        for _ in range(20):
            shuffled = reports[:]
            rng.shuffle(shuffled)
            assert next_schedule(current, shuffled, cfg) == reference


def test_batch_grows_with_noisy_stats() -> None:
    gen = torch.Generator().manual_seed(0)
    cfg = ScheduleConfig(test="norm", eta=0.8, batch_cap=256, merge=MergePolicy(min_instances=2))
    schedule = Schedule(round=0, batch=(1, 1), inner_steps=5)
    history = [schedule.batch[0]]
    for _ in range(4):
        reports = []
        for peer in range(3):
            # true gradient [0.1, ..., 0.1] buried in unit noise: S/M ≈ d = 16 ≫ η²·||∇F||² = 0.64·0.16
            grads = [torch.full((16,), 0.1) + torch.randn(16, generator=gen) for _ in range(4)]
            stats = grad_stats(grads, samples_per_grad=schedule.batch[0])
            reports.append(PeerReport(peer_id=str(peer), slot_stats=(stats, stats), b_max=8, tokens=1))
        schedule, merge = next_schedule(schedule, reports, cfg)
        assert merge is None
        history.append(schedule.batch[0])
    assert history == sorted(history)
    assert history[-1] > 1


def test_accumulation() -> None:
    schedule = Schedule(round=0, batch=(10, 17), inner_steps=1)
    # b_max 8: 10 → 2 × 5; 17 → 3 × 6
    assert accumulation_for(schedule, 8) == (BatchPlan(micro=5, accum=2), BatchPlan(micro=6, accum=3))
    # b_max 4: 17 → ⌈17/4⌉ = 5 steps; b_max 8 at most 3
    reports = [replace(REPORTS[0], b_max=8), replace(REPORTS[1], b_max=4)]
    assert swarm_accumulation(schedule, reports) == 5
    assert swarm_accumulation(schedule, []) == 1


def test_round_trips() -> None:
    for report in REPORTS:
        assert PeerReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert Schedule.from_dict(json.loads(json.dumps(CURRENT.to_dict()))) == CURRENT
    msgpack = pytest.importorskip("msgpack")
    for report in REPORTS:
        assert PeerReport.from_dict(msgpack.unpackb(msgpack.packb(report.to_dict()))) == report
    assert Schedule.from_dict(msgpack.unpackb(msgpack.packb(CURRENT.to_dict()))) == CURRENT


@pytest.mark.parametrize(
    "data",
    [
        {"round": 0, "batch": [], "inner_steps": 1},
        {"round": -1, "batch": [1], "inner_steps": 1},
        {"round": 0, "batch": [0], "inner_steps": 1},
        {"round": 0, "batch": [1], "inner_steps": 0},
        {"round": 0, "batch": [1], "inner_steps": 1, "codec": ""},
        {"round": 0, "batch": "1", "inner_steps": 1},
        {"round": 0, "batch": [1]},
        {"round": 0, "batch": [1], "inner_steps": 1, "extra": 0},
    ],
)
def test_schedule_rejects_bad_records(data: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Schedule.from_dict(data)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"test": "bogus"},
        {"eta": 0.0},
        {"nu": -1.0},
        {"batch_cap": 0},
        {"batch_scope": "global"},
        {"inner_steps_policy": "auto"},
        {"min_inner_steps": 0},
    ],
)
def test_config_validation(kwargs: dict[str, Any]) -> None:  # bad values on purpose
    with pytest.raises(ValueError):
        ScheduleConfig(**kwargs)
