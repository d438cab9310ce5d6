"""One peer's round: instance statistics, switch mode, catch-up by replay, state adoption, merges."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from adloco.node.config import TrainConfig
from adloco.node.data import Corpus
from adloco.node.errors import UserError
from adloco.node.peer import Peer
from adloco.node.runtime import load_data
from adloco.node.tokenizer import ByteTokenizer
from adloco.protocol.allreduce import reduce_group
from adloco.protocol.switch import BatchPlan

CFG = TrainConfig(seq_len=32, batch_size=4, instances=2, inner_steps=2, b_max=4, max_corpus_mb=1)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_data(CFG)[0]


def _peer(corpus: Corpus, peer_id: str = "a", index: int = 0, cfg: TrainConfig = CFG) -> Peer:
    return Peer(peer_id=peer_id, index=index, num_peers=2, cfg=cfg, corpus=corpus, vocab_size=256)


def _round(peers: list[Peer]) -> None:
    """One synchronous round of the given peers over the in-memory reduction."""
    contributions = [p.contribute(p.train_round())[0] for p in peers]
    result = reduce_group(contributions, codec=peers[0].downlink_codec(peers[0].state.schedule.codec))
    for p in peers:
        p.apply_round(result)


def test_first_step_statistics_and_tokens(corpus: Corpus) -> None:
    inst = _peer(corpus).instances[0]
    theta = [p.detach().clone() for p in inst.params]
    result = inst.run_round(theta, plan=BatchPlan(micro=4, accum=1), steps=3)
    # accum=1: the first step is cut into stats_chunks=4 micro-batches of one sample each.
    assert result.stats is not None and result.stats.num_grads == 4 and result.stats.samples_per_grad == 1
    assert result.tokens == 4 * 3 * CFG.seq_len
    assert len(inst.optimizer.state) == len(inst.params)  # AdamW state exists and persists
    step = float(next(iter(inst.optimizer.state.values()))["step"])
    inst.run_round(theta, plan=BatchPlan(micro=2, accum=3), steps=2)
    assert next(iter(inst.optimizer.state.values()))["step"] == step + 2
    # Δ = θ_start − θ_end: applying it to θ_start recovers the instance's weights.
    for t, d, p in zip(theta, result.delta, inst.params, strict=True):
        assert t.shape == d.shape == p.shape


def test_accumulated_step_statistics_come_from_its_micro_batches(corpus: Corpus) -> None:
    inst = _peer(corpus).instances[0]
    theta = [p.detach().clone() for p in inst.params]
    result = inst.run_round(theta, plan=BatchPlan(micro=2, accum=3), steps=1)
    assert result.stats is not None and result.stats.num_grads == 3 and result.stats.samples_per_grad == 2
    assert result.samples == 6


def test_all_members_hold_identical_theta_and_a_late_peer_replays_to_it(corpus: Corpus) -> None:
    a, b, c = _peer(corpus, "a", 0), _peer(corpus, "b", 1), _peer(corpus, "c", 1)
    assert a.state.theta_hash() == b.state.theta_hash() == c.state.theta_hash()
    for _ in range(3):
        _round([a, b])
        assert a.state.theta_hash() == b.state.theta_hash()
    assert c.state.round == 0
    applied = c.catch_up(a.state.history)
    assert applied == 3 and c.state.round == 3
    assert c.state.theta_hash() == a.state.theta_hash()
    assert all(torch.equal(x, y) for x, y in zip(c.state.momentum, a.state.momentum, strict=True))
    assert c.state.schedule == a.state.schedule


def test_late_contribution_is_corrected_and_down_weighted(corpus: Corpus) -> None:
    a, late = _peer(corpus, "a", 0), _peer(corpus, "late", 1)
    stale_local = late.train_round()
    for _ in range(2):
        _round([a])
    late.catch_up(a.state.history)
    contribution, info = late.contribute(stale_local)
    assert contribution is not None and info.staleness == 2
    assert info.correction is not None
    assert info.weight == pytest.approx(stale_local.tokens / 3**0.5)  # inv_sqrt: ρ(2) = 1/√3


def test_too_stale_contribution_is_dropped(corpus: Corpus) -> None:
    cfg = replace(CFG, max_staleness=1)
    a, late = _peer(corpus, "a", 0, cfg), _peer(corpus, "late", 1, cfg)
    stale_local = late.train_round()
    for _ in range(2):
        _round([a])
    late.catch_up(a.state.history)
    contribution, info = late.contribute(stale_local)
    assert contribution is None and info.dropped


def test_full_state_download_is_hash_checked_and_merges_extra_instances(corpus: Corpus) -> None:
    cfg = replace(
        CFG, instances=3, schedule=replace(CFG.schedule, merge=replace(CFG.schedule.merge, merge_every=1))
    )
    a, newcomer = _peer(corpus, "a", 0, cfg), _peer(corpus, "n", 1, cfg)
    _round([a])
    assert a.state.schedule.instances == 2
    newcomer.adopt_state(a.state)
    assert newcomer.state.theta_hash() == a.state.theta_hash()
    assert len(newcomer.instances) == 2


def test_merge_moves_the_victims_data_to_the_survivor(corpus: Corpus) -> None:
    peer = _peer(corpus)
    tokens = [inst.sampler.num_tokens for inst in peer.instances]
    peer.merge_instances(victim=0, survivor=1)
    assert len(peer.instances) == 1
    assert peer.instances[0].sampler.num_tokens == sum(tokens)
    assert peer.instances[0].slot == 0


def test_batch_larger_than_the_data_is_a_user_error() -> None:
    cfg = replace(CFG, batch_size=10_000, seq_len=64)
    corpus, _ = load_data(cfg)
    with pytest.raises(UserError, match="--batch-size"):
        Peer(peer_id="a", index=0, num_peers=1, cfg=cfg, corpus=corpus, vocab_size=ByteTokenizer().vocab_size)
