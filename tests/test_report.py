"""The round report: typed, bounded, parsed once where it enters; what the group derives from it."""

from __future__ import annotations

import json
import math

import pytest

from adloco.protocol.algorithms.batchtest import GradStats
from adloco.protocol.algorithms.report import (
    MAX_REPORT_BYTES,
    MAX_SLOTS,
    PeerReport,
    dylu_ratio,
    hiding_inner_steps,
    overlap_byte_budget,
    parse_reports,
)

STATS = GradStats(
    num_grads=2, samples_per_grad=4, sq_dev_sum=2.5, mean_sq_norm=1.25, ip_dev_sum=1.125, ortho_dev_sum=1.6
)
REPORT = PeerReport(
    peer_id="a",
    slot_stats=(STATS, None),
    b_max=8,
    tokens=100,
    staleness=2,
    step_time_s=0.5,
    base_round=7,
    bandwidth_bps=2e7,
    round_compute_s=5.0,
)


def test_encode_decode_round_trip_is_exact_and_deterministic() -> None:
    data = REPORT.encode()
    assert PeerReport.decode(data) == REPORT
    assert PeerReport.decode(data).encode() == data


@pytest.mark.parametrize(
    "change",
    [
        {"peer_id": ""},
        {"peer_id": "x" * 129},
        {"peer_id": 7},
        {"b_max": 0},
        {"b_max": 2**60},
        {"b_max": True},
        {"tokens": -1},
        {"tokens": 1.5},
        {"staleness": 1.5},
        {"base_round": -1},
        {"step_time_s": -0.1},
        {"step_time_s": 1e9},
        {"bandwidth_bps": 1e20},
        {"round_compute_s": "5"},
        {"slot_stats": [{"num_grads": 1}]},
        {"slot_stats": [1]},
        {"slot_stats": "none"},
        {"slot_stats": [None] * (MAX_SLOTS + 1)},
        {"slot_stats": [{**STATS.to_dict(), "num_grads": 2**60}]},
        {"slot_stats": [{**STATS.to_dict(), "sq_dev_sum": -1.0}]},
        {"bogus": 1},
    ],
)
def test_out_of_bounds_or_mistyped_fields_are_refused(change: dict[str, object]) -> None:
    data = json.dumps({**REPORT.to_dict(), **change}).encode()
    with pytest.raises(ValueError):
        PeerReport.decode(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"[]",
        b"null",
        b"\xff\xfe",
        b'{"peer_id": "a", "slot_stats": [], "b_max": 1, "tokens": 1, "step_time_s": NaN}',
        b'{"peer_id": "a", "slot_stats": [], "b_max": 1, "tokens": 1, "step_time_s": Infinity}',
        b" " * (MAX_REPORT_BYTES + 1),
    ],
)
def test_undecodable_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        PeerReport.decode(data)


def test_parse_keeps_the_valid_reports_and_names_why_the_others_went() -> None:
    b = PeerReport(peer_id="b", slot_stats=(), b_max=1, tokens=1)
    raw = [REPORT.encode(), b"{}", b.encode(), REPORT.encode()]
    reports, malformed = parse_reports(["a", "x", "b", "c"], raw)
    assert [r.peer_id for r in reports] == ["a", "b"]
    assert set(malformed) == {"x", "c"}
    assert "missing" in malformed["x"] and "claims peer id" in malformed["c"]
    with pytest.raises(ValueError):
        parse_reports(["a"], [])


def test_dylu_ratio_is_own_speed_against_the_fastest() -> None:
    fast = PeerReport(peer_id="f", slot_stats=(), b_max=1, tokens=1, step_time_s=0.1)
    slow = PeerReport(peer_id="s", slot_stats=(), b_max=1, tokens=1, step_time_s=0.4)
    silent = PeerReport(peer_id="q", slot_stats=(), b_max=1, tokens=1)
    assert dylu_ratio([fast, slow, silent], "s") == pytest.approx(0.25)
    assert dylu_ratio([fast, slow], "f") == 1.0
    assert dylu_ratio([fast, slow], "nobody") is None
    assert dylu_ratio([silent], "q") is None
    # Alone (or with members that reported no step time) it learns nothing: None keeps the last ratio.
    assert dylu_ratio([slow], "s") is None and dylu_ratio([slow, silent], "s") is None


def test_one_forged_step_time_moves_dylu_by_a_bounded_factor() -> None:
    """The issue's attack: one report of a microsecond step set every member's H to 1. The
    reference is now at most DYLU_MAX_SPEEDUP times faster than the median."""
    from adloco.protocol.algorithms.report import DYLU_MAX_SPEEDUP

    honest = [PeerReport(peer_id=p, slot_stats=(), b_max=1, tokens=1, step_time_s=0.4) for p in "abc"]
    forged = PeerReport(peer_id="x", slot_stats=(), b_max=1, tokens=1, step_time_s=1e-6)
    assert dylu_ratio(honest, "a") == 1.0
    assert dylu_ratio([*honest, forged], "a") == pytest.approx(1 / DYLU_MAX_SPEEDUP)
    # A real fast peer within that range is still the reference (speeds 1 and 1/15).
    fast = PeerReport(peer_id="f", slot_stats=(), b_max=1, tokens=1, step_time_s=0.4 / 15)
    assert dylu_ratio([*honest, fast], "a") == pytest.approx(1 / 15)


def test_one_forged_link_moves_the_byte_budget_by_a_bounded_factor() -> None:
    from adloco.protocol.algorithms.report import BUDGET_MAX_SHORTFALL

    def report(peer: str, bps: float) -> PeerReport:
        return PeerReport(
            peer_id=peer, slot_stats=(), b_max=1, tokens=1, bandwidth_bps=bps, round_compute_s=2.0
        )

    honest = [report(p, 8e6) for p in "abc"]
    clean = overlap_byte_budget(honest, group_size=4)
    assert clean is not None
    forged = overlap_byte_budget([*honest, report("x", 1.0)], group_size=4)
    assert forged == pytest.approx(clean / BUDGET_MAX_SHORTFALL)


def test_byte_budget_is_the_slowest_link_over_the_round_time() -> None:
    def report(peer: str, bps: float, seconds: float) -> PeerReport:
        return PeerReport(
            peer_id=peer, slot_stats=(), b_max=1, tokens=1, bandwidth_bps=bps, round_compute_s=seconds
        )

    reports = [report("a", 8e6, 2.0), report("b", 80e6, 2.0), report("c", 0.0, 2.0)]
    # 1 MB/s × 2 s = 2 MB in the window; each member sends 2(n−1)/n = 4/3 of its payload.
    assert overlap_byte_budget(reports, group_size=3) == pytest.approx(2e6 / (4 / 3))
    assert overlap_byte_budget(reports[:1], group_size=1) is None
    assert overlap_byte_budget([report("c", 0.0, 2.0)], group_size=2) is None


def _timed(peer: str, bps: float, step_s: float) -> PeerReport:
    return PeerReport(peer_id=peer, slot_stats=(), b_max=1, tokens=1, bandwidth_bps=bps, step_time_s=step_s)


def test_hiding_steps_make_the_round_outlast_the_slowest_members_exchange() -> None:
    """4 members, 124 MB of int8 payload each: each sends 2·3/4 of it (its parts to their owners, then
    the averages it owns to the others). At 100 Mbit/s that is 14.88 s; at 0.1 s a step the round
    hides it from 148.8 steps, × the margin 1.25 → H = 186. The member with the worst ratio decides;
    H stays within its bounds; no figures, no choice."""
    from adloco.protocol.algorithms.report import HIDE_MARGIN

    reports = [_timed("a", 1e8, 0.1), _timed("b", 1e8, 0.2), _timed("c", 2e8, 0.1), _timed("d", 1e9, 0.05)]
    steps = hiding_inner_steps(reports, payload_bytes=124e6, group_size=4, min_steps=1, max_steps=500)
    assert steps == math.ceil(124e6 * 1.5 / (1e8 / 8) / 0.1 * HIDE_MARGIN) == 186
    assert hiding_inner_steps(reports, payload_bytes=124e6, group_size=4, min_steps=200, max_steps=500) == 200
    assert hiding_inner_steps(reports, payload_bytes=124e6, group_size=4, min_steps=1, max_steps=50) == 50
    assert hiding_inner_steps(reports, payload_bytes=1.0, group_size=4, min_steps=3, max_steps=50) == 3
    silent = [PeerReport(peer_id="q", slot_stats=(), b_max=1, tokens=1)]
    assert hiding_inner_steps(silent, payload_bytes=1e6, group_size=2, min_steps=1, max_steps=500) is None
    assert hiding_inner_steps(reports[:1], payload_bytes=1e6, group_size=1, min_steps=1, max_steps=9) is None


def test_one_forged_link_or_step_time_moves_the_hiding_steps_by_a_bounded_factor() -> None:
    from adloco.protocol.algorithms.report import HIDE_MAX_SPREAD

    honest = [_timed(p, 1e8, 0.1) for p in "abc"]
    clean = hiding_inner_steps(honest, payload_bytes=1e6, group_size=4, min_steps=1, max_steps=10**6)
    assert clean == 2  # 0.12 s of exchange, × 1.25, hides in two 0.1 s steps
    for forged in (_timed("x", 1.0, 0.1), _timed("x", 1e8, 1e-9)):
        steps = hiding_inner_steps(
            [*honest, forged], payload_bytes=1e6, group_size=4, min_steps=1, max_steps=10**6
        )
        assert steps == math.ceil(0.12 / 0.1 * HIDE_MAX_SPREAD * 1.25) == 15  # not millions
