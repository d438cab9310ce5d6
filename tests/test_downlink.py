"""The downlink of a round (protocol/algorithms/downlink.py): the sum payload, gathered parts, the
owner's error feedback across rounds and owner changes, SparseLoCo's decaying residual, the flags."""

from __future__ import annotations

import struct
import threading
from dataclasses import replace
from typing import Any

import pytest
import torch

from adloco.errors import UserError
from adloco.node.cli import sim as sim_cli
from adloco.node.cli.options import train_config_from_args
from adloco.node.data.corpus import Corpus
from adloco.node.sim.engine import SimConfig, Simulator
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.allreduce import Contribution, reduce_group
from adloco.protocol.algorithms.codecs import decode, make_codec, payload_shape, sum_payload
from adloco.protocol.algorithms.downlink import Gather, OwnerFeedback, downlink_for, make_downlink
from adloco.protocol.algorithms.feedback import ErrorFeedback
from adloco.protocol.algorithms.parts import most_bytes_moved, reduce_part
from adloco.protocol.algorithms.schedule import ScheduleConfig
from adloco.protocol.transport.memory import owner_codecs


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- the sum payload ----------------------------------------------------------------------------


def test_sum_payload_decodes_to_the_weighted_sum_of_its_parts() -> None:
    codec = make_codec("sparse:8/256:2")
    parts = [codec.encode("w", gaussian(3, 300, seed=s)) for s in range(3)]
    factors = [0.5, 0.25, 0.25]
    payload = sum_payload(parts, factors)
    # The header (magic, version, id, ndim, two dims), the count, three factors, three lengths.
    assert len(payload) == 5 + 4 * 2 + 4 + 4 * 3 + 4 * 3 + sum(len(p) for p in parts)
    assert payload_shape(payload) == (3, 300)
    expected = torch.zeros(3, 300)
    for f, p in zip(factors, parts, strict=True):
        expected.add_(decode(p).mul_(f))
    assert torch.equal(decode(payload), expected)


def test_sum_payload_refuses_what_it_cannot_carry() -> None:
    a, b = make_codec("int8").encode("w", gaussian(4, 4)), make_codec("int8").encode("w", gaussian(16))
    with pytest.raises(ValueError, match="different shapes"):
        sum_payload([a, b], [0.5, 0.5])
    with pytest.raises(ValueError, match="one factor each"):
        sum_payload([a], [0.5, 0.5])
    with pytest.raises(ValueError, match="finite"):
        sum_payload([a], [float("nan")])
    nested = sum_payload([a], [1.0])
    with pytest.raises(ValueError, match="misplaced codec id"):
        sum_payload([nested], [1.0])
    with pytest.raises(ValueError, match=r"truncated|implies"):
        payload_shape(nested[:-1])
    count_at = 5 + 4 * 2
    with pytest.raises(ValueError, match="corrupt sum"):
        payload_shape(nested[:count_at] + struct.pack("<I", 0) + nested[count_at + 4 :])
    # A part of another shape inside a sum of (4, 4): the receiver refuses it before decoding.
    forged = nested[:count_at] + struct.pack("<IfI", 1, 1.0, len(b)) + b
    with pytest.raises(ValueError, match="a part of shape"):
        payload_shape(forged)


# --- gather -------------------------------------------------------------------------------------


def test_gather_sends_the_accepted_contributions_with_their_mean_factors() -> None:
    codec = make_codec("sparse")
    members = [gaussian(2, 4096, seed=s) for s in range(3)]
    payloads = [codec.encode("w", m) for m in members]
    part = reduce_part(payloads, [1.0, 1.0, 2.0], Gather(codec), "w", outlier_factor=None)
    assert len(part.payload) == 5 + 4 * 2 + 4 + 4 * 3 + 4 * 3 + sum(len(p) for p in payloads)
    mean = sum(
        (decode(p) * w for p, w in zip(payloads, [0.25, 0.25, 0.5], strict=True)), torch.zeros(2, 4096)
    )
    torch.testing.assert_close(decode(part.payload), mean, rtol=0, atol=1e-6)
    # Nothing of the average is lost: every non-zero of every contribution arrives.
    assert int(decode(part.payload).count_nonzero()) == int(mean.count_nonzero()) > 2 * 64 * 2


def test_gather_through_the_in_process_owners_and_with_a_robust_rule() -> None:
    """The hub routes each part to its owner's codec (`Codec.for_part`); a trimmed mean encodes."""
    names = ["a", "b", "c"]
    contributions = [
        Contribution(
            peer_id=p,
            payloads={k: make_codec("sparse:4/64:2").encode(k, gaussian(64, seed=i)) for k in names},
            weight=1.0,
        )
        for i, p in enumerate(["p0", "p1", "p2"])
    ]
    codecs = {c.peer_id: make_downlink(make_codec("sparse:4/64:2"), "gather") for c in contributions}
    result = reduce_group(contributions, codec=owner_codecs(contributions, codecs), outlier_factor=None)
    for k in names:
        expected = sum((decode(c.payloads[k]) for c in contributions), torch.zeros(64)) / 3
        torch.testing.assert_close(decode(result.averaged[k]), expected, rtol=0, atol=1e-6)
    assert sum(result.received_bytes.values()) == sum(result.sent_bytes.values())


# --- owner-side error feedback ------------------------------------------------------------------


def test_owner_feedback_sends_every_average_over_rounds() -> None:
    """Σ sent + committed residual = Σ averages, while each round sends one sparse payload."""
    owner = OwnerFeedback(make_codec("sparse:4/64:2"))
    total, sent = torch.zeros(8, 64), torch.zeros(8, 64)
    for r in range(50):
        average = gaussian(8, 64, seed=r)
        owner.start_round(r)
        payload = owner.encode("w", average)
        assert len(payload) == make_codec("sparse:4/64:2").wire_bytes((8, 64))
        owner.commit(r)
        total += average
        sent += decode(payload)
    residual = owner.state_dict()["residual/w"]
    torch.testing.assert_close(sent + residual, total, rtol=0, atol=1e-4)
    assert owner.residual_norm() < 0.5 * float(total.norm())


def test_owner_feedback_a_failed_try_commits_nothing_and_a_lost_part_is_dropped() -> None:
    codec = make_codec("sparse:2/32:2")
    owner = OwnerFeedback(codec)
    owner.start_round(0)
    first = gaussian(32, seed=1)
    sent0 = decode(owner.encode("w", first))
    owner.commit(0)
    residual0 = first - sent0
    # Round 1, first try: encoded but never applied (the round failed); the retry adds residual0 again.
    owner.start_round(1)
    owner.encode("w", gaussian(32, seed=2))
    second = gaussian(32, seed=3)
    owner.start_round(1)
    assert owner.encode("w", second) == codec.encode("w", second + residual0)
    owner.commit(1)
    # Round 2 goes to another owner: round 3 starts from zero, never adds round 1's residual late.
    owner.start_round(2)
    owner.commit(2)
    assert owner.state_dict() == {}
    third = gaussian(32, seed=4)
    owner.start_round(3)
    assert owner.encode("w", third) == codec.encode("w", third)
    # An owner that skipped a round it did not apply (it replayed it) drops its residual too.
    owner.commit(3)
    owner.start_round(5)
    assert owner.encode("w", third) == codec.encode("w", third)


def test_owner_feedback_state_round_trip_and_bad_states() -> None:
    owner = OwnerFeedback(make_codec("sparse:2/32:2"))
    owner.start_round(7)
    owner.encode("w", gaussian(32))
    owner.commit(7)
    restored = OwnerFeedback(make_codec("sparse:2/32:2"))
    restored.load_state_dict(owner.state_dict())
    restored.start_round(8)
    owner.start_round(8)
    assert restored.encode("w", gaussian(32, seed=9)) == owner.encode("w", gaussian(32, seed=9))
    with pytest.raises(ValueError, match="unexpected keys"):
        restored.load_state_dict({"w": torch.zeros(32)})
    with pytest.raises(ValueError, match="integer round"):
        restored.load_state_dict({"residual/w": torch.zeros(32)})
    low_rank = OwnerFeedback(make_codec("lowrank:2"))
    low_rank.start_round(0)
    low_rank.encode("m", gaussian(16, 8))
    low_rank.commit(0)
    assert any(k.startswith("codec/") for k in low_rank.state_dict())


def test_downlink_settings() -> None:
    assert downlink_for("auto", "sparse:64/4096:2") == "feedback"
    assert downlink_for("auto", "int8") == "encode"
    assert downlink_for("gather", "int8") == "gather"
    with pytest.raises(ValueError, match="downlink must be"):
        downlink_for("scatter", "int8")
    assert make_downlink(make_codec("int8"), "encode").name == "int8"


# --- SparseLoCo's decaying residual -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decayed_residual_is_beta_e_plus_delta_less_what_was_sent(dtype: torch.dtype) -> None:
    codec, beta = make_codec("sparse:4/64:2"), 0.9
    feedback = ErrorFeedback(dtype, decay=beta)
    first, second = gaussian(4, 64, seed=1), gaussian(4, 64, seed=2)
    e1 = first - decode(feedback.compress_tensor(codec, "w", first))
    e1 = feedback.state_dict()["w"].float()  # as kept (rounded in bf16 and int8)
    sent = decode(feedback.compress_tensor(codec, "w", second))
    assert torch.equal(sent, decode(codec.encode("w", e1 * beta + second)))
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.int8: 2e-2}[dtype]
    torch.testing.assert_close(
        feedback.state_dict()["w"].float(), beta * e1 + second - sent, rtol=0, atol=tolerance
    )
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(decay=0.0)


# --- configuration and flags --------------------------------------------------------------------


def sim_args(*flags: str) -> TrainConfig:
    return train_config_from_args(sim_cli.build_parser().parse_args(["--out", "unused", *flags]))


def test_flags() -> None:
    cfg = sim_args("--codec", "sparse", "--downlink", "gather", "--ef-momentum", "0.95")
    assert (cfg.downlink, cfg.ef_decay, cfg.outer.momentum) == ("gather", 0.95, 0.0)
    assert sim_args().outer.momentum == 0.9 and sim_args().ef_decay == 1.0
    assert sim_args("--outer-momentum", "0.5").outer.momentum == 0.5
    with pytest.raises(UserError, match=r"^--ef-momentum: .*leave --outer-momentum out"):
        sim_args("--ef-momentum", "0.95", "--outer-momentum", "0.9")
    with pytest.raises(UserError, match=r"^--ef-momentum: must be in \(0, 1\]"):
        sim_args("--ef-momentum", "1.5")
    with pytest.raises(UserError, match=r"^--downlink: .*gather .* use downlink feedback"):
        sim_args("--downlink", "gather", "--aggregate", "trimmed:0.2")
    with pytest.raises(ValueError, match="ef_decay"):
        TrainConfig(ef_decay=0)


# --- in the simulator ---------------------------------------------------------------------------

TINY = TrainConfig(
    seq_len=32,
    batch_size=2,
    instances=1,
    inner_steps=1,
    b_max=4,
    codec="sparse:8/256:2",
    schedule=replace(ScheduleConfig(), test="none"),
    max_corpus_mb=1,
    val_sequences=2,
    precision="fp32",
)


@pytest.fixture(scope="module")
def corpus_and_vocab() -> tuple[Corpus, int]:
    corpus, tokenizer = load_data(TINY)
    return corpus, tokenizer.vocab_size


def test_the_simulated_peers_agree_under_every_downlink(corpus_and_vocab: tuple[Corpus, int]) -> None:
    """Two virtual peers, two rounds each way: θ identical on every member (the simulator checks),
    gather costs more downlink bytes, and each owner keeps residuals for the parts it owns alone,
    which survive a checkpoint."""
    corpus, vocab = corpus_and_vocab
    round_bytes = {}
    for downlink in ("feedback", "gather"):
        cfg = SimConfig(peers=2, rounds=2, train=replace(TINY, downlink=downlink))
        sim = Simulator(cfg, corpus, vocab_size=vocab)
        records = sim.run()
        round_bytes[downlink] = records[-1].round_bytes
        owned = [
            {k for k, v in p.codecs.items() if isinstance(v, OwnerFeedback) for k in v.state_dict()}
            for p in sim.peers
        ]
        if downlink != "feedback":
            assert owned == [set(), set()]
            continue
        peer = sim.peers[0]
        assert owned[0] and all(k.startswith(("residual/", "round")) for k in owned[0])
        assert not (owned[0] - {"round"}) & (owned[1] - {"round"})  # one owner per part
        restored = Peer(peer_id="x", index=0, num_peers=2, cfg=cfg.train, corpus=corpus, vocab_size=vocab)
        restored.load_state_dict(peer.state_dict())
        key = f"{TINY.codec}/avg"
        assert restored.codecs[key].state_dict().keys() == peer.codecs[key].state_dict().keys()
    assert round_bytes["feedback"] < round_bytes["gather"]


def test_the_answer_bound_a_member_checks_fits_a_gathered_answer() -> None:
    """A member refuses an owner's answer longer than `Codec.answer_bytes`: a gathered part is
    every member's payload in one, and the exchange's deadlines count those bytes too."""
    codec = make_codec("sparse:8/256:2")
    payloads = [codec.encode("w", gaussian(3, 300, seed=s)) for s in range(3)]
    gathered = reduce_part(payloads, [1.0, 1.0, 1.0], Gather(codec), "w", outlier_factor=None).payload
    assert len(gathered) == Gather(codec).answer_bytes((3, 300), len(payloads[0]), 3)
    assert codec.answer_bytes((3, 300), len(payloads[0]), 3) == len(payloads[0])
    # Member 1 sends its 10 bytes to the owner, the owner answers with 30: the busiest link moves 30.
    assert most_bytes_moved([10], [0], 2) == 10 and most_bytes_moved([10], [0], 2, [30]) == 30


@pytest.mark.timeout(90)
def test_gathered_parts_cross_the_network_transport() -> None:
    """Three hivemind averagers with a gathering downlink: every member holds the bytes
    `reduce_group` computes (sum payloads several times a single one's size: the answer bound and
    the deadlines count them), and the traffic is what `reduce_group` counts."""
    from adloco.protocol.transport.hivemind_averager import HivemindAverager
    from adloco.protocol.transport.identity import NodeDHT
    from adloco.protocol.transport.matchmaking import form_group, layout_of

    spec = "sparse:8/256:2"
    local: dict[str, Any] = {
        "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
        "nat_port_map": False,
        "auto_nat": False,
    }
    local |= {"use_relay": False, "use_auto_relay": False}
    first = NodeDHT(start=True, **local)
    dhts = [first] + [
        NodeDHT(initial_peers=first.get_visible_maddrs(), start=True, **local) for _ in range(2)
    ]
    averagers = [
        HivemindAverager(
            dht, prefix="gather", window_s=1.0, grace_s=0.3, part_timeout_s=2.0, reduce_timeout_s=1.0
        )
        for dht in dhts
    ]
    try:
        contributions = [
            Contribution(
                peer_id=a.peer_id,
                payloads={
                    k: make_codec(spec).encode(k, gaussian(*shape, seed=10 * i + j))
                    for j, (k, shape) in enumerate({"a": (64, 40), "b": (300,)}.items())
                },
                weight=1.0 + i,
                tokens=100.0,
            )
            for i, a in enumerate(averagers)
        ]
        results: list[Any] = [None] * 3
        start = threading.Barrier(3)

        def member(i: int) -> None:
            start.wait()
            codec = make_downlink(make_codec(spec), "gather")
            results[i] = averagers[i].average(contributions[i], round=0, codec=codec, timeout=20.0)

        threads = [threading.Thread(target=member, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        # Parts are dealt in the group's order (`matchmaking.form_group`; fresh peers list nobody).
        members = sorted(a.peer_id for a in averagers)
        group = form_group("gather", 0, members, layout_of(contributions[0].payloads), {})
        downlink = make_downlink(make_codec(spec), "gather")
        expected = reduce_group(contributions, codec=downlink, owners=group.owners)
        assert all(len(p) > 2 * len(contributions[0].payloads[k]) for k, p in expected.averaged.items())
        for r in results:
            assert r is not None and r.averaged == expected.averaged
            assert r.traffic.payload_received == expected.received_bytes[r.peer_id]
    finally:
        for a in averagers:
            a.shutdown()
        for dht in dhts:
            dht.shutdown()
