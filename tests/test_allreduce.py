"""The all-reduce semantics: every member receives identical bytes, whatever the arrival order."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

from adloco.protocol.algorithms.allreduce import Contribution, reduce_group
from adloco.protocol.algorithms.codecs import decode_tensors, encode_tensors, make_codec
from adloco.protocol.algorithms.report import PeerReport


def _report(peer: str, tokens: int = 0) -> bytes:
    return PeerReport(peer_id=peer, slot_stats=(None,), b_max=4, tokens=tokens).encode()


def _contributions(spec: str, n: int = 3) -> list[Contribution]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        tensors = {"w": torch.randn(16, 12, generator=g), "b": torch.randn(12, generator=g)}
        payloads = encode_tensors(make_codec(spec), tensors)
        metadata = _report(f"p{i}", tokens=i)
        out.append(Contribution(peer_id=f"p{i}", payloads=payloads, weight=float(i + 1), metadata=metadata))
    return out


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "int4", "lowrank:2"])
def test_identical_result_for_every_arrival_order(spec: str) -> None:
    contributions = _contributions(spec)
    results = [
        reduce_group(list(order), codec=make_codec(spec)) for order in itertools.permutations(contributions)
    ]
    first = results[0]
    for r in results[1:]:
        assert r.averaged == first.averaged
        assert r.reports == first.reports and r.malformed == first.malformed == {}
        assert r.sent_bytes == first.sent_bytes


def test_uncompressed_average_is_the_weighted_mean() -> None:
    contributions = _contributions("none")
    result = reduce_group(contributions, codec=make_codec("none"))
    decoded = [decode_tensors(dict(c.payloads)) for c in contributions]
    expected = (1 * decoded[0]["w"] + 2 * decoded[1]["w"] + 3 * decoded[2]["w"]) / 6
    torch.testing.assert_close(result.decoded()["w"], expected)


def test_traffic_counts_only_bytes_that_cross_between_members() -> None:
    contributions = _contributions("none", n=2)
    result = reduce_group(contributions, codec=make_codec("none"))
    # Two tensors, two members: each owns one part, sends the other part up and its own average down.
    w_bytes, b_bytes = len(contributions[0].payloads["w"]), len(contributions[0].payloads["b"])
    assert sum(result.sent_bytes.values()) == 2 * (w_bytes + b_bytes)
    assert result.sent_bytes == result.received_bytes or sum(result.received_bytes.values()) == 2 * (
        w_bytes + b_bytes
    )


def test_group_of_one_sends_nothing() -> None:
    result = reduce_group(_contributions("int8", n=1), codec=make_codec("int8"))
    assert result.sent_bytes == {"p0": 0}


def test_mismatched_tensors_are_rejected() -> None:
    a, _ = _contributions("none", n=2)
    bad = Contribution(peer_id="p9", payloads={"w": a.payloads["w"]}, weight=1.0)
    with pytest.raises(ValueError, match="p9"):
        reduce_group([a, bad], codec=make_codec("none"))
    with pytest.raises(ValueError):
        reduce_group([], codec=make_codec("none"))


def test_staleness_weight_shrinks_a_late_contribution_even_alone() -> None:
    (c,) = _contributions("none", n=1)
    fresh = Contribution(peer_id="p0", payloads=c.payloads, weight=100.0, tokens=100.0)
    late = Contribution(peer_id="p0", payloads=c.payloads, weight=50.0, tokens=100.0)  # ρ(τ) = 0.5
    full = reduce_group([fresh], codec=make_codec("none")).decoded()["w"]
    half = reduce_group([late], codec=make_codec("none")).decoded()["w"]
    torch.testing.assert_close(half, 0.5 * full)
    # Σ weight·Δ / Σ tokens: a fresh Δa (tokens 100) and a late Δb (tokens 100, ρ = 0.5).
    a, b = _contributions("none", n=2)
    pair = [
        Contribution(peer_id="a", payloads=a.payloads, weight=100.0, tokens=100.0),
        Contribution(peer_id="b", payloads=b.payloads, weight=50.0, tokens=100.0),
    ]
    got = reduce_group(pair, codec=make_codec("none")).decoded()["w"]
    da, db = decode_tensors(dict(a.payloads))["w"], decode_tensors(dict(b.payloads))["w"]
    torch.testing.assert_close(got, (100 * da + 50 * db) / 200)


def test_poisoned_parts_are_rejected_per_part_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    contributions = _contributions("none")
    honest = decode_tensors(dict(contributions[1].payloads))
    poisoned = {"w": torch.full_like(honest["w"], math.nan), "b": 1000 * honest["b"]}
    contributions[1] = Contribution(
        peer_id="p1",
        payloads=encode_tensors(make_codec("none"), poisoned),
        weight=2.0,
        metadata=contributions[1].metadata,
    )
    with caplog.at_level(logging.WARNING, logger="adloco.protocol.allreduce"):
        result = reduce_group(contributions, codec=make_codec("none"))
    # p1 stays a member; both of its parts are left out, and the others' weights renormalized.
    assert result.members == ("p0", "p1", "p2") and result.rejected == {"p1": 2}
    decoded = [decode_tensors(dict(c.payloads)) for c in contributions]
    for key in ("w", "b"):
        torch.testing.assert_close(result.decoded()[key], (1 * decoded[0][key] + 3 * decoded[2][key]) / 4)
    assert any("'w' of p1: non-finite" in r.getMessage() for r in caplog.records)
    assert any("'b' of p1: norm" in r.getMessage() for r in caplog.records)
    screened_off = reduce_group(contributions, codec=make_codec("none"), outlier_factor=None)
    assert screened_off.rejected == {"p1": 1}
    assert reduce_group(_contributions("none"), codec=make_codec("none")).rejected == {}


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        (b"{}", "missing"),
        (b"\xff\x00 not json", "not a JSON report"),
        (b'{"peer_id": "p1", "slot_stats": [], "b_max": 4, "tokens": NaN}', "NaN"),
        (_report("p2"), "claims peer id"),
        (b"x" * (65 << 10), "bytes (at most"),
    ],
    ids=["empty-object", "garbage", "nan", "another-peer", "oversized"],
)
def test_a_malformed_report_is_dropped_alike_and_the_round_completes(metadata: bytes, reason: str) -> None:
    contributions = _contributions("int8")
    contributions[1] = Contribution(
        peer_id="p1", payloads=contributions[1].payloads, weight=contributions[1].weight, metadata=metadata
    )
    results = [
        reduce_group(list(order), codec=make_codec("int8")) for order in itertools.permutations(contributions)
    ]
    first = results[0]
    assert first.members == ("p0", "p1", "p2")  # its Δ still counts: only the report is dropped
    assert [r.peer_id for r in first.reports] == ["p0", "p2"]
    assert list(first.malformed) == ["p1"] and reason in first.malformed["p1"]
    assert all(r.reports == first.reports and r.malformed == first.malformed for r in results)
    assert all(r.averaged == first.averaged for r in results)
