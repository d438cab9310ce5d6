"""One peer's round: instance statistics, switch mode, catch-up by replay, state adoption, merges."""

from __future__ import annotations

import gc
import types
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import torch
from residency import resident_bytes

from adloco.errors import UserError
from adloco.node.data.corpus import Corpus
from adloco.node.data.tokenizer import ByteTokenizer
from adloco.node.operations.checkpoint import save_checkpoint
from adloco.node.training import instances
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.replica import PeerState
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.allreduce import Contribution, reduce_group
from adloco.protocol.algorithms.batchtest import BatchTest, grad_stats
from adloco.protocol.algorithms.feedback import Int8Residual
from adloco.protocol.algorithms.heloco import HelocoConfig, correct
from adloco.protocol.algorithms.switch import BatchPlan

CFG = TrainConfig(seq_len=32, batch_size=4, instances=2, inner_steps=2, b_max=4, max_corpus_mb=1)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_data(CFG)[0]


def _peer(corpus: Corpus, peer_id: str = "a", index: int = 0, cfg: TrainConfig = CFG) -> Peer:
    return Peer(peer_id=peer_id, index=index, num_peers=2, cfg=cfg, corpus=corpus, vocab_size=256)


def _contribution(peer: Peer) -> Contribution:
    """The peer trains a round and contributes it (on time: never dropped, so never None)."""
    return cast(Contribution, peer.contribute(peer.train_round())[0])


def _round(peers: list[Peer]) -> None:
    """One synchronous round of the given peers over the in-memory reduction."""
    contributions = [_contribution(p) for p in peers]
    result = reduce_group(contributions, codec=peers[0].downlink_codec(peers[0].state.schedule.codec))
    for p in peers:
        p.apply_round(result)


def test_first_step_statistics_and_tokens(corpus: Corpus) -> None:
    inst = _peer(corpus).local_instances[0]
    theta = [p.detach().clone() for p in inst.params]
    result = inst.run_round(theta, plan=BatchPlan(micro=4, accum=1), steps=3)
    end_of_first = [p.detach().clone() for p in inst.params]
    # accum=1: the first step is cut into stats_chunks=2 micro-batches of two samples each.
    assert result.stats is not None and result.stats.num_grads == 2 and result.stats.samples_per_grad == 2
    assert result.tokens == 4 * 3 * CFG.seq_len
    assert len(inst.optimizer.state) == len(inst.params)  # AdamW state exists and persists
    step = float(next(iter(inst.optimizer.state.values()))["step"])
    inst.run_round(theta, plan=BatchPlan(micro=2, accum=3), steps=2)
    assert next(iter(inst.optimizer.state.values()))["step"] == step + 2
    # Δ = θ_start − θ_end: applying it to θ_start recovers the instance's weights (as they were at the
    # end of the first round, before the second round above moved them on).
    for t, d, p in zip(theta, result.delta, end_of_first, strict=True):
        torch.testing.assert_close(t - d, p, rtol=0, atol=1e-6)
    assert any(float(d.abs().max()) > 0 for d in result.delta)  # the round did move the weights


@pytest.mark.parametrize("slice_elements", [None, 7])
@pytest.mark.parametrize("plan", [BatchPlan(micro=4, accum=1), BatchPlan(micro=2, accum=3)])
@pytest.mark.parametrize("test", ["norm", "augmented"])
def test_first_step_statistics_are_those_of_its_micro_batch_gradients(
    corpus: Corpus,
    plan: BatchPlan,
    slice_elements: int | None,
    test: BatchTest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The instance gathers them tensor by tensor (each tensor a slice at a time: 7 elements cuts
    # every tensor into many, the last one shorter): for the norm test in the step's own backward
    # passes, for the augmented test in a second pass. Here each micro-batch's gradient is computed
    # whole, on a copy that draws the same batches, and given to grad_stats. Three peers of one
    # config and seed: the same weights and the same batches, bit for bit.
    if slice_elements is not None:
        monkeypatch.setattr(instances, "STATS_SLICE", slice_elements)
    _check_first_step_statistics(corpus, replace(CFG, schedule=replace(CFG.schedule, test=test)), plan)


@pytest.mark.parametrize("test", ["norm", "augmented"])
def test_first_step_statistics_of_a_model_whose_head_is_its_embedding(
    corpus: Corpus, test: BatchTest, tmp_path: Path
) -> None:
    # GPT-2 ties its head to its input embedding, whose gradient the lookup assembles itself
    # (`TiedEmbedding`): the hooks must see it whole, once per micro-batch.
    config = tmp_path / "gpt2.json"
    config.write_text(
        '{"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,'
        ' "vocab_size": 256, "resid_pdrop": 0, "embd_pdrop": 0, "attn_pdrop": 0}'
    )  # no dropout: the reference below draws no random masks in step with the instance
    cfg = replace(CFG, model=str(config), schedule=replace(CFG.schedule, test=test))
    _check_first_step_statistics(corpus, cfg, BatchPlan(micro=4, accum=1), exact=test == "augmented")


def _check_first_step_statistics(
    corpus: Corpus, cfg: TrainConfig, plan: BatchPlan, *, exact: bool = True
) -> None:
    test = cfg.schedule.test
    inst, twin, plain = (_peer(corpus, cfg=cfg).local_instances[0] for _ in range(3))
    assert inst.batch_stats == {"norm": "sums", "augmented": "full"}[test]
    _, stats = inst.inner_step(plan, collect_stats=True)
    micro, accum = twin._stats_split(plan)
    grads = []
    for _ in range(accum):
        batch = twin.sampler.next_batch(micro)
        loss = twin.model(input_ids=batch, labels=batch).loss
        grads.append([g.detach() for g in torch.autograd.grad(loss, twin.params)])
    expected = grad_stats(grads, samples_per_grad=micro)
    assert stats is not None and (stats.num_grads, stats.samples_per_grad) == (accum, micro)
    # The norm test reads S and ||ḡ||² alone; only the augmented test measures the inner products.
    names = ("sq_dev_sum", "mean_sq_norm") + (("ip_dev_sum", "ortho_dev_sum") if test == "augmented" else ())
    for name in names:
        assert getattr(stats, name) == pytest.approx(getattr(expected, name), rel=1e-4), name
    # Gathering them left the step alone: the same micro-batches without statistics give the same
    # weights, bit for bit. Except where a plain step adds a tied head's gradient straight into the
    # one the weight holds (`TiedEmbedding`), in another order than one micro-batch's gradient at
    # a time: there, to rounding.
    plain.inner_step(BatchPlan(micro=micro, accum=accum), collect_stats=False)
    for p, q in zip(inst.params, plain.params, strict=True):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_without_a_batch_test_the_first_step_gathers_nothing(corpus: Corpus) -> None:
    cfg = replace(CFG, schedule=replace(CFG.schedule, test="none"))
    inst, plain = (_peer(corpus, cfg=cfg).local_instances[0] for _ in range(2))
    assert inst.batch_stats == "none"
    _, stats = inst.inner_step(BatchPlan(micro=4, accum=1), collect_stats=True)
    assert stats is None
    plain.inner_step(BatchPlan(micro=4, accum=1), collect_stats=False)  # the step was a plain one
    for p, q in zip(inst.params, plain.params, strict=True):
        assert torch.equal(p, q)


def test_a_slot_whose_batch_is_at_the_cap_gathers_no_statistics(corpus: Corpus) -> None:
    """The batch test only grows b up to the cap: a slot already there reports no statistics (they
    could not change the schedule) and its round is the plain one; a slot below the cap reports them."""
    at_cap = replace(CFG, schedule=replace(CFG.schedule, batch_cap=CFG.batch_size))
    capped, below = _peer(corpus, cfg=at_cap), _peer(corpus)
    assert capped.state.schedule.batch == below.state.schedule.batch == (CFG.batch_size,) * CFG.instances
    capped_round, below_round = capped.train_round(), below.train_round()
    assert all(s is None for s in capped_round.report.slot_stats)
    assert all(s is not None and s.num_grads >= 2 for s in below_round.report.slot_stats)
    assert capped_round.tokens == below_round.tokens
    # The same schedule either way: at the cap the test keeps b whatever it is told.
    _round([capped])
    assert capped.state.schedule.batch == (CFG.batch_size,) * CFG.instances


def test_the_inner_adamw_runs_pytorchs_fused_kernel_on_a_cpu(corpus: Corpus) -> None:
    inst = _peer(corpus).local_instances[0]
    assert inst.params[0].device.type == "cpu" and inst.optimizer.defaults["fused"] is True


def test_accumulated_step_statistics_come_from_its_micro_batches(corpus: Corpus) -> None:
    inst = _peer(corpus).local_instances[0]
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


def test_catch_up_checks_the_replayed_theta_before_it_applies_a_single_update(corpus: Corpus) -> None:
    """A holder serving poisoned updates (one scaled, the θ hash of the swarm's head trusted): the
    replay is worked out on copies and refused, nothing changes, and the full state is taken; honest
    updates lead to the hash and are applied. `Peer.replayed_hash` is the hash `catch_up` reaches."""
    from adloco.node.training.catchup import catch_up
    from adloco.protocol.algorithms.codecs import decode, make_codec

    a, b, late = _peer(corpus, "a", 0), _peer(corpus, "b", 1), _peer(corpus, "late", 1)
    for _ in range(2):
        _round([a, b])
    head = a.state.theta_hash()
    assert late.replayed_hash(a.state.history) == head
    name = a.names[0]
    none = make_codec("none")
    poisoned = [
        replace(u, averaged={**u.averaged, name: none.encode(name, decode(u.averaged[name]) * -50)})
        for u in a.state.history
    ]
    assert late.replayed_hash(poisoned) != head

    class Holder:
        def __init__(self, updates: list[Any]) -> None:
            self.kept, self.downloaded = updates, False

        def updates(self, from_round: int) -> list[Any]:
            return self.kept

        def state(self) -> PeerState:
            self.downloaded = True
            return a.state

    before = [t.clone() for t in late.state.theta]
    holder = Holder(poisoned)
    refused: list[str] = []
    done = catch_up(late, holder, expected_hash=head, on_refused=lambda: refused.append("poisoned"))
    assert done.how == "download" and holder.downloaded and late.state.theta_hash() == head
    assert refused == ["poisoned"]  # the swarm then asks that holder for no updates a while
    # Had the replay been applied first, θ would have moved before the download replaced it; the
    # download would then be all that saved it. Without a state to download, nothing moves at all:
    stuck = _peer(corpus, "late", 1)

    class Liar(Holder):
        def state(self) -> PeerState:
            raise ConnectionError("gone")

    with pytest.raises(ConnectionError):
        catch_up(stuck, Liar(poisoned), expected_hash=head)
    assert stuck.state.round == 0
    assert all(torch.equal(x, y) for x, y in zip(stuck.state.theta, before, strict=True))
    honest = catch_up(
        _peer(corpus, "late", 1),
        Holder(a.state.history),
        expected_hash=head,
        on_refused=lambda: refused.append("x"),
    )
    assert honest.how == "replay" and honest.rounds == 2 and refused == ["poisoned"]


def test_catch_up_replays_up_to_the_trusted_round_from_a_holder_that_moved_on(corpus: Corpus) -> None:
    """The head is read from the records, the kept updates asked for afterwards: a holder one round
    further by then sends an update past the trusted hash. The updates before the head's round
    lead to it and are replayed; without `to_round` they would end elsewhere and cost a download
    (a container restarted into a swarm of 2 s rounds downloaded its state for that, 2.5 s)."""
    from adloco.node.training.catchup import catch_up

    a, b = _peer(corpus, "a", 0), _peer(corpus, "b", 1)
    for _ in range(2):
        _round([a, b])
    head = a.state.theta_hash()  # θ at round 2, as the records say
    _round([a, b])  # the holder moves on to round 3 before the laggard asks

    class Holder:
        downloaded = False

        def updates(self, from_round: int) -> list[Any]:
            return list(a.state.history)

        def state(self) -> PeerState:
            self.downloaded = True
            raise ConnectionError("no state to download here")

    late = _peer(corpus, "late", 1)
    done = catch_up(late, Holder(), expected_hash=head, to_round=2)
    assert (done.how, done.rounds, late.state.round) == ("replay", 2, 2)
    assert late.state.theta_hash() == head
    with pytest.raises(ConnectionError):  # all three updates end at round 3's θ, not the head's
        catch_up(_peer(corpus, "late", 1), Holder(), expected_hash=head)


def test_an_update_whose_merge_names_no_slot_changes_nothing(corpus: Corpus) -> None:
    a, c = _peer(corpus, "a", 0), _peer(corpus, "c", 1)
    _round([a])
    update = a.state.history[0]
    for merge in ((5, 0), (0, 0), (-1, 0)):
        bad = replace(update, merge=merge, schedule=replace(update.schedule, batch=update.schedule.batch[:1]))
        with pytest.raises(ValueError, match="merge"):
            c.catch_up([bad])
        assert c.state.round == 0 and len(c.local_instances) == 2


def test_kept_updates_are_bounded_by_their_bytes(corpus: Corpus) -> None:
    a = _peer(corpus, "a", 0)
    _round([a])
    one = a.state.history[0].num_bytes
    # Room for two updates' encoded bytes (and a half): the last two are kept, not HISTORY_ROUNDS.
    a.cfg = replace(CFG, replay_mb=2.5 * one / 2**20)
    for _ in range(3):
        _round([a])
    assert [u.round for u in a.state.history] == [2, 3]
    a.cfg = replace(CFG, replay_mb=0.0)
    _round([a])
    assert a.state.history == []


def test_kept_updates_on_disk_are_the_same_bytes_and_replay_to_the_same_theta(
    corpus: Corpus, tmp_path: Path
) -> None:
    """A networked node keeps its updates for laggards on disk (`keep_updates_on_disk`): the same
    payloads as a peer that keeps them in memory, none held in memory, a laggard replays them to
    the same θ, and a checkpoint of the state carries them."""
    from adloco.node.training.replica import SpilledPayloads

    a, b = _peer(corpus, "a", 0), _peer(corpus, "b", 1)
    a.keep_updates_on_disk(str(tmp_path))
    for _ in range(3):
        _round([a, b])
    assert a.state.theta_hash() == b.state.theta_hash()
    assert [u.round for u in a.state.history] == [u.round for u in b.state.history] == [0, 1, 2]
    for on_disk, in_memory in zip(a.state.history, b.state.history, strict=True):
        assert isinstance(on_disk.averaged, SpilledPayloads) and not isinstance(
            in_memory.averaged, SpilledPayloads
        )
        assert on_disk.num_bytes == in_memory.num_bytes
        assert dict(on_disk.averaged) == dict(in_memory.averaged)
    assert list(tmp_path.iterdir()) == []  # unnamed files: nothing to leave behind
    late = _peer(corpus, "late", 1)
    assert late.catch_up(a.state.history) == 3 and late.state.theta_hash() == a.state.theta_hash()
    restored = _peer(corpus, "a", 0)
    restored.keep_updates_on_disk(str(tmp_path))
    restored.load_state_dict(a.state_dict())
    assert all(isinstance(u.averaged, SpilledPayloads) for u in restored.state.history)
    assert [dict(u.averaged) for u in restored.state.history] == [dict(u.averaged) for u in b.state.history]


def test_kept_updates_stay_in_memory_where_the_disk_cannot_hold_them(
    corpus: Corpus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder gone (or a full disk) costs the memory, not the round: the update applies and is
    kept in memory, with one warning."""
    from adloco.node.training.replica import SpilledPayloads

    a = _peer(corpus, "a", 0)
    a.keep_updates_on_disk(str(tmp_path / "gone"))
    with caplog.at_level("WARNING"):
        _round([a])
        _round([a])
    assert a.state.round == 2 and [u.round for u in a.state.history] == [0, 1]
    assert not any(isinstance(u.averaged, SpilledPayloads) for u in a.state.history)
    assert sum("stay in memory" in r.getMessage() for r in caplog.records) == 1


def test_a_residual_on_disk_gives_the_same_contributions_and_holds_no_memory(
    corpus: Corpus, tmp_path: Path
) -> None:
    """A networked node keeps its int8 error-feedback residuals in an unnamed file
    (`keep_residual_on_disk`): over three rounds its contributions are a twin's in memory bit for
    bit, its residuals hold no bytes in memory, their values are the twin's, nothing is left in
    the folder, and a checkpoint restored into a peer that keeps them on disk puts them back there."""
    a, twin = _peer(corpus, "a", 0), _peer(corpus, "a", 0)
    assert a.cfg.codec == "int8"
    a.keep_residual_on_disk(str(tmp_path))
    for _ in range(3):
        mine, theirs = _contribution(a), _contribution(twin)
        assert mine.payloads == theirs.payloads
        for p in (a, twin):
            p.apply_round(reduce_group([mine if p is a else theirs], codec=p.downlink_codec("int8")))
    residuals = a.error_feedback._residuals.values()
    assert residuals and all(isinstance(r, Int8Residual) and r.nbytes() == 0 for r in residuals)
    assert all(
        isinstance(r, Int8Residual) and r.nbytes() > 0 for r in twin.error_feedback._residuals.values()
    )
    state, expected = a.error_feedback.state_dict(), twin.error_feedback.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    assert list(tmp_path.iterdir()) == []  # an unnamed file: nothing to leave behind
    restored = _peer(corpus, "a", 0)
    restored.keep_residual_on_disk(str(tmp_path))
    restored.load_state_dict(a.state_dict())
    again = restored.error_feedback.state_dict()
    assert all(
        isinstance(r, Int8Residual) and r.nbytes() == 0 for r in restored.error_feedback._residuals.values()
    )
    assert all(torch.equal(again[k], expected[k]) for k in expected)


def test_a_residual_stays_in_memory_where_the_disk_cannot_hold_it(
    corpus: Corpus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder gone (or a full disk) costs the memory, not the contribution: it is made, its
    residuals kept in memory, with one warning."""
    a = _peer(corpus, "a", 0)
    a.keep_residual_on_disk(str(tmp_path / "gone"))
    with caplog.at_level("WARNING"):
        _round([a])
        _round([a])
    assert a.state.round == 2
    assert all(isinstance(r, Int8Residual) and r.nbytes() > 0 for r in a.error_feedback._residuals.values())
    assert sum("stay in memory" in r.getMessage() for r in caplog.records) == 1


def test_an_update_that_does_not_fit_changes_nothing(corpus: Corpus) -> None:
    a = _peer(corpus, "a", 0)
    contribution = _contribution(a)
    result = reduce_group([contribution], codec=a.downlink_codec("int8"))
    before = a.state_dict()
    theta = [t.clone() for t in a.state.theta]
    # The last tensor of another's shape carries the first one's bytes.
    name = next(n for n, t in reversed(list(a.named_theta().items())) if t.shape != a.state.theta[0].shape)
    bad = replace(result, averaged={**result.averaged, name: result.averaged[a.names[0]]})
    with pytest.raises(ValueError, match="misshapen"):
        a.apply_round(bad)
    assert a.state.round == before["round"] == 0
    assert all(torch.equal(x, y) for x, y in zip(a.state.theta, theta, strict=True))
    a.apply_round(result)  # the good one still applies
    assert a.state.round == 1


@pytest.mark.parametrize("bomb", ["shape", "sum"])
def test_a_kept_update_that_would_decode_to_another_size_or_many_tensors_is_refused_undecoded(
    corpus: Corpus, bomb: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25 §1.3 where an update comes from any holder (catch-up): a low-rank payload stating a
    10^5 × 10^5 tensor (40 GB decoded, from 200 KB), and a sum of more tiny sparse parts than
    `MAX_SUM_PARTS` (each decoding to the whole tensor), are refused from their headers before
    anything decodes them: by the replay's check on copies and by the apply."""
    from adloco.node.sim.engine import sum_bomb
    from adloco.node.training import peer as peer_module
    from adloco.node.training.replica import Update
    from adloco.protocol.algorithms.codecs import sum_count
    from adloco.protocol.algorithms.codecs.dense import Int8Codec
    from adloco.protocol.algorithms.codecs.frame import _ID_LOWRANK, _header
    from adloco.protocol.algorithms.codecs.lowrank import _LOWRANK_PARAMS

    a = _peer(corpus, "a", 0)
    result = reduce_group([_contribution(a)], codec=a.downlink_codec("int8"))
    name = a.names[0]
    if bomb == "shape":
        factor = Int8Codec().encode("f", torch.ones(1, 10**5))
        payload = (
            _header(_ID_LOWRANK, (10**5, 10**5)) + _LOWRANK_PARAMS.pack(1, len(factor)) + factor + factor
        )
    else:
        payload = sum_bomb(20_000, tuple(a.state.theta[0].shape))
        assert sum_count(payload) > peer_module.MAX_SUM_PARTS
    decoded: list[bytes] = []
    real_spans = getattr(peer_module, "decoded_spans")  # noqa: B009 (not exported)

    def watched(payload: bytes, span: int) -> Iterator[torch.Tensor]:
        decoded.append(payload)
        return cast(Iterator[torch.Tensor], real_spans(payload, span))

    monkeypatch.setattr(peer_module, "decoded_spans", watched)
    averaged = {**result.averaged, name: payload}
    theta = [t.clone() for t in a.state.theta]
    with pytest.raises(ValueError, match=r"misshapen|a sum of"):
        a.replayed_hash([Update(0, averaged, a.state.schedule, None)])
    with pytest.raises(ValueError, match=r"misshapen|a sum of"):
        a.apply_round(replace(result, averaged=averaged))
    assert payload not in decoded
    assert a.state.round == 0
    assert all(torch.equal(x, y) for x, y in zip(a.state.theta, theta, strict=True))


def test_an_update_is_checked_and_stepped_a_span_at_a_time_with_the_whole_tensors_bits(
    corpus: Corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_apply` never decodes a tensor of the update whole: its outer step sees no Δ wider than a
    span, and θ and m end bit for bit where the outer step on each whole decoded tensor leaves them
    (two rounds, so the momentum is not Δ alone)."""
    from adloco.node.training import peer as peer_module
    from adloco.protocol.algorithms.codecs import decode
    from adloco.protocol.algorithms.outer import outer_step

    widest: list[int] = []

    def spying_step(params: Any, momentum: Any, delta: Any, cfg: Any, *, index: int = 0) -> None:
        widest.append(max(d.numel() for d in delta))
        outer_step(params, momentum, delta, cfg, index=index)

    monkeypatch.setattr(peer_module, "_SPAN", 7)
    monkeypatch.setattr(peer_module, "outer_step", spying_step)
    a = _peer(corpus, "a", 0)
    theta = [t.clone() for t in a.state.theta]
    momentum = [m.clone() for m in a.state.momentum]
    assert max(t.numel() for t in theta) > 7 * 100
    for r in range(2):
        result = reduce_group([_contribution(a)], codec=a.downlink_codec(a.state.schedule.codec))
        whole = [decode(result.averaged[name]) for name in a.names]
        outer_step(theta, momentum, whole, a.cfg.outer, index=r)
        a.apply_round(result)
        assert all(torch.equal(x, y) for x, y in zip(a.state.theta, theta, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(a.state.momentum, momentum, strict=True))
    assert widest and max(widest) == 7


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_update_not_finite_in_any_slice_changes_nothing(
    corpus: Corpus, bad: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finite check goes a slice at a time: a NaN or infinity in the last slice of a tensor is
    found as in the first."""
    from adloco.node.training import peer as peer_module
    from adloco.protocol.algorithms.codecs import decode, make_codec

    monkeypatch.setattr(peer_module, "_SPAN", 7)
    a = _peer(corpus, "a", 0)
    result = reduce_group([_contribution(a)], codec=a.downlink_codec("int8"))
    theta = [t.clone() for t in a.state.theta]
    name = a.names[0]
    poisoned = decode(result.averaged[name])
    assert poisoned.numel() > 7
    poisoned.view(-1)[-1] = bad
    averaged = {**result.averaged, name: make_codec("none").encode(name, poisoned)}
    with pytest.raises(ValueError, match="not finite"):
        a.apply_round(replace(result, averaged=averaged))
    assert a.state.round == 0
    assert all(torch.equal(x, y) for x, y in zip(a.state.theta, theta, strict=True))


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


def test_a_late_contribution_is_corrected_a_tensor_at_a_time_as_the_whole_would_be(corpus: Corpus) -> None:
    """Issue 28 §2: HeLoCo corrects a late Δ a tensor at a time as it is encoded (no whole corrected
    Δ nor a whole (1 − μ)·m beside the trained one, 8 B/param); the payloads and the report are
    those of correcting the whole Δ against (1 − μ) × the momentum first, bit for bit."""
    cfg = replace(CFG, heloco=HelocoConfig(c_ok=0.95))  # near-alignment asked: tensors are rotated
    a = _peer(corpus, "a", 0, cfg)
    late, twin = _peer(corpus, "late", 1, cfg), _peer(corpus, "late", 1, cfg)
    mine, theirs = late.train_round(), twin.train_round()
    for _ in range(2):
        _round([a])
    for p in (late, twin):
        p.catch_up(a.state.history)
    contribution, info = late.contribute(mine)
    mu = twin.cfg.outer.momentum
    whole, report = correct(list(theirs.delta), twin.state.momentum, cfg.heloco, scale=1 - mu)
    codec = twin.codec(twin.state.schedule.codec)
    expected = {
        n: twin.error_feedback.compress_tensor(codec, n, d) for n, d in zip(twin.names, whole, strict=True)
    }
    assert contribution is not None and contribution.payloads == expected
    assert info.correction == report and report.shrink + report.rotate > 0


def test_too_stale_contribution_is_dropped(corpus: Corpus) -> None:
    cfg = replace(CFG, max_staleness=1)
    a, late = _peer(corpus, "a", 0, cfg), _peer(corpus, "late", 1, cfg)
    stale_local = late.train_round()
    for _ in range(2):
        _round([a])
    late.catch_up(a.state.history)
    contribution, info = late.contribute(stale_local)
    assert contribution is None and info.dropped


def test_a_delta_trained_ahead_of_a_round_the_peer_healed_back_to_is_dropped(corpus: Corpus) -> None:
    """A peer that ran ahead alone and then took the swarm's earlier state (another lineage) holds a
    local round whose base round is past its current one: no round here can take that Δ (the soak
    found a node crash on it, staleness −2)."""
    alone, swarm = _peer(corpus, "alone", 0), _peer(corpus, "swarm", 1)
    _round([alone])
    _round([alone])
    ahead = alone.train_round()  # trained from round 2
    alone.adopt_state(swarm.state, expected_hash=swarm.state.theta_hash())  # healed back to round 0
    contribution, info = alone.contribute(ahead)
    assert contribution is None and info.dropped and info.staleness == -2


def test_full_state_download_is_hash_checked_and_merges_extra_instances(corpus: Corpus) -> None:
    cfg = replace(
        CFG, instances=3, schedule=replace(CFG.schedule, merge=replace(CFG.schedule.merge, merge_every=1))
    )
    a, newcomer = _peer(corpus, "a", 0, cfg), _peer(corpus, "n", 1, cfg)
    _round([a])
    assert a.state.schedule.instances == 2
    published = a.state.theta_hash()
    # A donor whose θ differs from the published hash by one value is refused, and nothing changes.
    forged = PeerState(
        theta=[t.clone() for t in a.state.theta],
        momentum=a.state.momentum,
        round=a.state.round,
        schedule=a.state.schedule,
    )
    forged.theta[0].view(-1)[0] += 1e-3
    before = newcomer.state.theta_hash()
    with pytest.raises(ValueError, match="published"):
        newcomer.adopt_state(forged, expected_hash=published)
    assert newcomer.state.theta_hash() == before and newcomer.state.round == 0
    assert len(newcomer.local_instances) == 3
    newcomer.adopt_state(a.state, expected_hash=published)
    assert newcomer.state.theta_hash() == published
    assert newcomer.state.round == a.state.round
    assert len(newcomer.local_instances) == 2


def test_merge_moves_the_victims_data_to_the_survivor(corpus: Corpus) -> None:
    peer = _peer(corpus)
    tokens = [inst.sampler.num_tokens for inst in peer.local_instances]
    peer.merge_instances(victim=0, survivor=1)
    assert len(peer.local_instances) == 1
    assert peer.local_instances[0].sampler.num_tokens == sum(tokens)
    assert peer.local_instances[0].slot == 0


def test_batch_larger_than_the_data_is_a_user_error() -> None:
    cfg = replace(CFG, batch_size=10_000, seq_len=64)
    corpus, _ = load_data(cfg)
    with pytest.raises(UserError, match="--batch-size"):
        Peer(peer_id="a", index=0, num_peers=1, cfg=cfg, corpus=corpus, vocab_size=ByteTokenizer().vocab_size)


# --- one-step-delay overlap -----------------------------------------------------------------------

OVERLAP = replace(
    CFG, overlap="rebase", schedule=replace(CFG.schedule, merge=replace(CFG.schedule.merge, merge_every=100))
)


@pytest.mark.parametrize("mode", ["rebase", "overwrite", "mix"])
def test_shift_moves_progress_onto_the_new_theta(corpus: Corpus, mode: str) -> None:
    inst = _peer(corpus).local_instances[0]
    theta_a = [torch.randn_like(p) for p in inst.params]
    theta_b = [torch.randn_like(p) for p in inst.params]
    inst.begin(theta_a)
    with torch.no_grad():
        for p in inst.params:
            p.add_(1.0)  # one round's local progress: +1 everywhere
    inst.shift(theta_b, mode=mode, mix=0.25)
    for p, s, a, b in zip(inst.params, inst.start, theta_a, theta_b, strict=True):
        want = {"rebase": b + 1, "overwrite": b, "mix": 0.25 * (a + 1) + 0.75 * b}[mode]
        torch.testing.assert_close(p.detach(), want)
        torch.testing.assert_close(s, b)  # Δ is measured from the new θ from now on


@pytest.mark.parametrize("mode", ["rebase", "overwrite", "mix"])
def test_a_joiner_that_never_trained_takes_theta_when_it_catches_up(
    corpus: Corpus, mode: Literal["rebase", "overwrite", "mix"]
) -> None:
    """Overlap on, no round begun yet: catching up (replay or download) puts the instances on the
    swarm's θ, with no progress of their own to carry over."""
    cfg = replace(OVERLAP, overlap=mode)
    a, replayer, downloader = (_peer(corpus, n, i, cfg) for n, i in (("a", 0), ("r", 1), ("d", 1)))
    for _ in range(2):
        _round([a])
    replayer.catch_up(a.state.history)
    downloader.adopt_state(a.state, expected_hash=a.state.theta_hash())
    for peer in (replayer, downloader):
        assert peer.state.theta_hash() == a.state.theta_hash()
        inst = peer.local_instances[0]
        for p, s, t in zip(inst.params, inst.start, peer.state.theta, strict=True):
            assert torch.equal(p.detach(), t) and torch.equal(s, t)


@pytest.mark.parametrize("cfg", [CFG, OVERLAP], ids=["in-order", "overlap"])
def test_a_peer_that_merged_sooner_adopts_a_state_of_more_slots(corpus: Corpus, cfg: TrainConfig) -> None:
    """A joiner that trained alone for a while may have merged its instances (its own MIT) before
    the swarm did; the swarm's state then has more slots than it has instances. It rebuilds them
    (before: the next round failed in zip(instances, plans)) and trains the swarm's schedule."""
    a, b = _peer(corpus, "a", 0, cfg), _peer(corpus, "b", 1, cfg)
    _round([a])
    b.merge_instances(1, 0)
    assert len(b.local_instances) == 1 and a.state.schedule.instances == 2
    b.adopt_state(a.state, expected_hash=a.state.theta_hash())
    assert [inst.slot for inst in b.local_instances] == [0, 1]
    local = b.train_round()
    assert len(local.report.slot_stats) == 2
    _round([a, b])
    assert b.state.theta_hash() == a.state.theta_hash()


def test_overlap_update_lands_mid_round_and_progress_is_rebased(corpus: Corpus) -> None:
    peers = [_peer(corpus, "a", 0, OVERLAP), _peer(corpus, "b", 1, OVERLAP)]
    contributions = [_contribution(p) for p in peers]
    result = reduce_group(contributions, codec=peers[0].downlink_codec(peers[0].state.schedule.codec))
    locals_ = []
    for p in peers:
        seen: dict[str, list[torch.Tensor]] = {}

        def land(samples: int, p: Peer = p, seen: dict[str, list[torch.Tensor]] = seen) -> None:
            if p.state.round == 0:  # after the first inner step of round 1
                inst = p.local_instances[0]
                seen["progress"] = [w.detach() - s for w, s in zip(inst.params, inst.start, strict=True)]
                p.apply_round(result)

        local = p.train_round(on_step=land)
        locals_.append(local)
        assert p.state.round == 1 and p.phase_round == 1 and local.base_round == 1
        inst = p.local_instances[0]
        assert all(torch.equal(s, t) for s, t in zip(inst.start, p.state.theta, strict=True))
        # Δ of round 1 is measured from θ_1 for every instance, so it is θ_1 − their weighted end.
        ends = [
            [t - w.detach() for t, w in zip(p.state.theta, i.params, strict=True)] for i in p.local_instances
        ]
        for k, d in enumerate(local.delta):
            torch.testing.assert_close(d, sum(e[k] for e in ends) / len(ends))
        assert seen["progress"][0].abs().sum() > 0
    assert peers[0].state.theta_hash() == peers[1].state.theta_hash()
    # Round 1 contributes at round 1 with staleness 0.
    assert all(p.contribute(loc)[1].staleness == 0 for p, loc in zip(peers, locals_, strict=True))


@pytest.mark.parametrize("mode", ["mix", "overwrite"])
@pytest.mark.parametrize("outcome", ["applied", "failed"])
def test_a_round_that_ends_before_its_update_lands_is_measured_as_if_it_landed_after_the_last_step(
    corpus: Corpus, mode: Literal["mix", "overwrite"], outcome: str
) -> None:
    """Record 080: under mix and overwrite a round with its update in flight keeps no copy of where
    it started. One that ends first takes the update at its end (`land`), and its Δ, its weights
    and θ are those of a twin whose update landed after its last step, bit for bit; where the update
    failed, both are measured from the θ they hold. Nothing of the lean one is a copy of θ."""
    cfg = replace(OVERLAP, overlap=mode, instances=1)
    lean, twin = _peer(corpus, cfg=cfg), _peer(corpus, cfg=cfg)
    results = [reduce_group([_contribution(p)], codec=p.downlink_codec("int8")) for p in (lean, twin)]
    calls: list[int] = []
    _peer(corpus, cfg=cfg).train_round(on_step=calls.append)  # a third twin counts the steps

    def land(_compute_s: float) -> None:
        if outcome == "applied":
            lean.apply_round(results[0])

    def at_last_step(samples: int) -> None:
        if samples == calls[-1] and twin.state.round == 0:
            twin.apply_round(results[1]) if outcome == "applied" else twin.rebase_instances()

    got = lean.train_round(land=land)
    want = twin.train_round(on_step=at_last_step)
    assert len(calls) == cfg.inner_steps and lean.state.round == twin.state.round
    assert got.base_round == want.base_round == lean.state.round
    assert all(torch.equal(a, b) for a, b in zip(got.delta, want.delta, strict=True))
    for a, b in zip(lean.local_instances[0].params, twin.local_instances[0].params, strict=True):
        assert torch.equal(a, b)
    assert lean.state.theta_hash() == twin.state.theta_hash()
    start = lean.local_instances[0].start
    assert all(s is t for s, t in zip(start, lean.state.theta, strict=True))  # θ's own tensors
    assert not all(s is t for s, t in zip(twin.local_instances[0].start, twin.state.theta, strict=True))


def _bytes_beyond_the_state(peer: Peer) -> int:
    """Bytes of the tensors the peer holds (reachable from it, not through code) that are none of θ,
    m, the instances' weights and AdamW moments."""
    known = {t.untyped_storage().data_ptr() for t in [*peer.state.theta, *peer.state.momentum]}
    for inst in peer.local_instances:
        known |= {p.untyped_storage().data_ptr() for p in inst.params}
        for fields in inst.optimizer.state.values():
            known |= {v.untyped_storage().data_ptr() for v in fields.values() if isinstance(v, torch.Tensor)}
    code = (types.FunctionType, types.MethodType, types.ModuleType, types.BuiltinFunctionType, type)
    storages: dict[int, int] = {}
    seen, todo = {id(peer)}, [peer]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, code):
                seen.add(id(ref))
                todo.append(ref)
    return sum(size for ptr, size in storages.items() if ptr not in known)


def test_an_overlapped_peer_keeps_no_copy_of_its_round_start(corpus: Corpus) -> None:
    """Record 080: between rounds under overlap (mix) a peer holds θ, m, the weights, the AdamW
    moments and the int8 error-feedback residual (1 B/param), whether the round overlapped its update
    (landing at its end) or waited for it and started from θ; no copy of a round start (4 B/param)."""
    peer = _peer(corpus, cfg=replace(OVERLAP, overlap="mix", instances=1))
    params = sum(t.numel() for t in peer.state.theta)
    contribution = _contribution(peer)  # round 1: nothing in flight, so it records its start
    peer.apply_round(reduce_group([contribution], codec=peer.downlink_codec("int8")))
    local = peer.train_round(from_theta=True)  # round 2 waited for its update
    assert _bytes_beyond_the_state(peer) < 1.5 * params
    contribution = cast(Contribution, peer.contribute(local)[0])
    result = reduce_group([contribution], codec=peer.downlink_codec("int8"))
    del contribution, local

    def land(_compute_s: float) -> None:
        peer.apply_round(result)

    peer.train_round(land=land)  # round 3 overlapped, landing late
    assert _bytes_beyond_the_state(peer) < 1.5 * params


def test_an_instance_done_before_its_update_lands_mid_round_is_measured_from_the_new_theta(
    corpus: Corpus,
) -> None:
    """Record 080, two instances in one process: the update lands while the second trains, after the
    first has ended its steps without a start of its own. Every instance's Δ is then θ_1 − its
    weights at the end, the first one's too (read after the shift, not left empty)."""
    peer = _peer(corpus, cfg=replace(OVERLAP, overlap="mix"))
    result = reduce_group([_contribution(peer)], codec=peer.downlink_codec("int8"))
    calls: list[int] = []

    def on_step(samples: int) -> None:
        calls.append(samples)
        if len(calls) == OVERLAP.inner_steps + 1:  # the second instance's first step
            peer.apply_round(result)

    def land(_compute_s: float) -> None:
        assert peer.state.round == 1  # landed mid-round: nothing left to land

    local = peer.train_round(on_step=on_step, land=land)
    assert len(calls) == 2 * OVERLAP.inner_steps and local.base_round == 1
    ends = [
        [t - w.detach() for t, w in zip(peer.state.theta, i.params, strict=True)]
        for i in peer.local_instances
    ]
    for k, d in enumerate(local.delta):
        torch.testing.assert_close(d, (ends[0][k] + ends[1][k]) / 2)


def test_overlap_rebase_keeps_the_progress_made_before_landing(corpus: Corpus) -> None:
    peer = _peer(corpus, cfg=OVERLAP)
    result = reduce_group([_contribution(peer)], codec=peer.downlink_codec("int8"))
    before: list[torch.Tensor] = []

    def land(samples: int) -> None:
        if peer.state.round == 0:
            inst = peer.local_instances[0]
            before.extend(w.detach() - s for w, s in zip(inst.params, inst.start, strict=True))
            peer.apply_round(result)
            after = [w.detach() - t for w, t in zip(inst.params, peer.state.theta, strict=True)]
            for x, y in zip(before, after, strict=True):
                torch.testing.assert_close(x, y)

    peer.train_round(on_step=land)
    assert before


def test_overlap_defers_a_merge_to_the_end_of_the_local_round(corpus: Corpus) -> None:
    cfg = replace(OVERLAP, schedule=replace(CFG.schedule, merge=replace(CFG.schedule.merge, merge_every=1)))
    peer = _peer(corpus, cfg=cfg)
    result = reduce_group([_contribution(peer)], codec=peer.downlink_codec("int8"))
    counts: list[int] = []

    def land(samples: int) -> None:
        if peer.state.round == 0:
            peer.apply_round(result)
        counts.append(len(peer.local_instances))

    local = peer.train_round(on_step=land)
    assert peer.state.schedule.instances == 1
    assert set(counts) == {2}  # both instances ran the whole round
    assert len(peer.local_instances) == 1 and len(local.report.slot_stats) == 1
    assert local.report.slot_stats[0] is not None and local.report.slot_stats[0].num_grads == 4


def test_theta_and_momentum_on_disk_give_the_same_rounds_and_are_held_only_at_a_boundary(
    corpus: Corpus, tmp_path: Path
) -> None:
    """A node keeps θ and m in mapped unnamed files (`keep_state_on_disk`): over three rounds its
    contributions, θ and m are a twin's in memory bit for bit; through a round's inner steps it holds
    none of their pages (θ, read for the round's start, is released before the first); nothing is
    left in the folder; θ's hash and a checkpoint give back the pages they read, an evaluation holds
    θ a module at a time; an adopted state and a restored checkpoint go into its files."""
    cfg = replace(CFG, instances=1, inner_steps=3)
    a, twin = _peer(corpus, cfg=cfg), _peer(corpus, cfg=cfg)
    a.keep_state_on_disk(str(tmp_path))
    for _ in range(3):
        held: list[tuple[int, int]] = []

        def holding(_done: int, held: list[tuple[int, int]] = held) -> None:
            held.append((resident_bytes(a.state.theta[0]), resident_bytes(a.state.momentum[0])))

        local = a.train_round(on_step=holding)
        mine = cast(Contribution, a.contribute(local)[0])
        theirs = _contribution(twin)
        assert mine.payloads == theirs.payloads
        assert held == [(0, 0)] * 3
        for p, c in ((a, mine), (twin, theirs)):
            p.apply_round(reduce_group([c], codec=p.downlink_codec("int8")))
    assert all(torch.equal(x, y) for x, y in zip(a.state.theta, twin.state.theta, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.state.momentum, twin.state.momentum, strict=True))
    assert a.state.momentum[0].abs().sum() > 0
    assert list(tmp_path.iterdir()) == []  # unnamed files: nothing to leave behind
    # What reads them whole outside a round gives their pages back as it goes: θ's hash, a checkpoint.
    assert a.theta_hash() == twin.state.theta_hash()
    save_checkpoint(tmp_path / "ck", a.state_dict(), written=a.release_state)
    assert resident_bytes(a.state.theta[0]) == 0 and resident_bytes(a.state.momentum[0]) == 0
    # An evaluation reads θ a module at a time: never as much as half of it held at once.
    held_at: list[int] = []
    probes = [
        m.register_forward_pre_hook(lambda *_: held_at.append(resident_bytes(a.state.theta[0])))
        for m in a.home_model.modules()
        if next(m.parameters(recurse=False), None) is not None
    ]
    try:
        assert a.validation_loss() == twin.validation_loss()
    finally:
        for probe in probes:
            probe.remove()
    theta_bytes = sum(t.numel() * t.element_size() for t in a.state.theta)
    assert len(held_at) > 4 and max(held_at) < theta_bytes / 2
    adopter = _peer(corpus, cfg=cfg)
    adopter.keep_state_on_disk(str(tmp_path))
    adopter.adopt_state(twin.state, expected_hash=twin.state.theta_hash())  # copied straight to files
    assert resident_bytes(adopter.state.theta[0]) == 0 and resident_bytes(adopter.state.momentum[0]) == 0
    assert adopter.state.theta[0] is not twin.state.theta[0]
    assert all(torch.equal(x, y) for x, y in zip(adopter.state.momentum, twin.state.momentum, strict=True))
    restored = _peer(corpus, cfg=cfg)
    restored.keep_state_on_disk(str(tmp_path))
    restored.load_state_dict(a.state_dict())
    for mine_now, theirs_now in (
        (restored.state.theta, twin.state.theta),
        (restored.state.momentum, twin.state.momentum),
    ):
        assert resident_bytes(mine_now[0]) == 0
        assert all(torch.equal(x, y) for x, y in zip(mine_now, theirs_now, strict=True))


@pytest.mark.parametrize("overlap", ["off", "mix"])
def test_a_mapped_theta_and_momentum_are_held_a_span_at_a_time_by_a_round_s_start_step_and_shift(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: Literal["off", "mix"]
) -> None:
    """A round's start copies θ into the instance (without overlap), the outer step decodes and steps
    the update, and an overlap's shift moves the instance onto the new θ, a span at a time, handing
    a mapped θ's and m's pages back after each span: never more than a span's pages of either held
    (GPT-2's embedding would otherwise hold 154 MB of θ at the start and 0.29 GiB of θ and m at the
    step); the rounds are a twin's in memory bit for bit."""
    import mmap

    from adloco.node.training import peer as peer_module

    span = mmap.PAGESIZE // 4  # float32 values: a page
    monkeypatch.setattr(instances, "LOAD_SPAN", span)
    monkeypatch.setattr(peer_module, "_SPAN", span)
    cfg = replace(CFG, instances=1, inner_steps=2, overlap=overlap)
    a, twin = _peer(corpus, cfg=cfg), _peer(corpus, cfg=cfg)
    a.keep_state_on_disk(str(tmp_path))
    # A span of θ and of m, each over 2 pages at most, and each mapping's fault-around: a read
    # fault maps up to 16 pages around the one it needs where the page cache holds them.
    bound = 2 * (2 * mmap.PAGESIZE + (64 << 10))
    assert max(t.numel() * t.element_size() for t in a.state.theta) > bound  # a tensor at a time: over
    release = a.release_state
    held: list[int] = []

    def spying(index: int | None = None, start: int = 0, stop: int | None = None) -> None:
        if index is not None and stop is not None:
            held.append(resident_bytes(a.state.theta[0]) + resident_bytes(a.state.momentum[0]))
        release(index, start, stop)

    a.release_state = spying  # type: ignore[method-assign]
    spans = sum(-(-t.numel() // span) for t in a.state.theta)  # of θ, and as many of m
    for _ in range(2):
        local = a.train_round()
        read_at_start = len(held)
        assert read_at_start == (spans if overlap == "off" else 0)  # (under overlap: shifted)
        mine = cast(Contribution, a.contribute(local)[0])
        theirs = _contribution(twin)
        assert mine.payloads == theirs.payloads
        for p, c in ((a, mine), (twin, theirs)):
            p.apply_round(reduce_group([c], codec=p.downlink_codec("int8")))
        assert len(held) == read_at_start + (spans if overlap == "off" else 2 * spans)
        assert max(held) <= bound, max(held)
        held.clear()
    assert all(torch.equal(x, y) for x, y in zip(a.state.theta, twin.state.theta, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.state.momentum, twin.state.momentum, strict=True))


def test_theta_s_hash_reads_a_mapped_theta_a_span_at_a_time(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """θ's hash (published every round, written with every checkpoint) reads a mapped θ a span at a
    time, its pages handed back after each: never more than a span's held (GPT-2's embedding would
    hold 154 MB), and the digest of the tensors read whole."""
    import mmap

    from adloco.node.training import peer as peer_module

    span = mmap.PAGESIZE // 4  # float32 values: a page
    monkeypatch.setattr(peer_module, "_SPAN", span)
    a = _peer(corpus, cfg=replace(CFG, instances=1))
    whole = a.state.theta_hash()
    a.keep_state_on_disk(str(tmp_path))
    bound = 2 * mmap.PAGESIZE + (64 << 10)  # a span over 2 pages at most, and the fault-around
    assert max(t.numel() * t.element_size() for t in a.state.theta) > bound
    release = a.release_state
    held: list[int] = []

    def spying(index: int | None = None, start: int = 0, stop: int | None = None) -> None:
        if index is not None and stop is not None:
            held.append(resident_bytes(a.state.theta[index]))
        release(index, start, stop)

    a.release_state = spying  # type: ignore[method-assign]
    assert a.theta_hash() == whole
    assert len(held) == sum(-(-t.numel() // span) for t in a.state.theta)
    assert max(held) <= bound, max(held)


def test_a_round_contributed_late_waits_in_mapped_files_while_the_node_catches_up(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose round ended behind the swarm catches up before it contributes: its Δ is
    computed whole first (θ, its start, changes), into files beside θ's, whose pages are handed
    back with θ's as each span is computed (never more than a span of each held) and encoded;
    its late contribution is a twin's in memory bit for bit."""
    import mmap

    from adloco.protocol.algorithms import pseudograd
    from adloco.protocol.algorithms.pseudograd import PseudoGradient

    span = mmap.PAGESIZE // 4  # float32 values: a page
    monkeypatch.setattr(pseudograd, "MATERIALIZE_SPAN", span)
    cfg = replace(CFG, instances=1, inner_steps=2)
    a, twin, ahead = _peer(corpus, cfg=cfg), _peer(corpus, cfg=cfg), _peer(corpus, "b", 1, cfg)
    a.keep_state_on_disk(str(tmp_path))
    (inst,) = a.local_instances
    files = inst.delta_files
    assert files is not None
    held: list[int] = []  # of θ and of Δ as each span of Δ is handed back

    def watched(like: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[int, int, int], None]]:
        tensors, hand_back = files(like)

        def watching(j: int, start: int, stop: int) -> None:
            held.append(resident_bytes(a.state.theta[0]) + resident_bytes(tensors[0]))
            hand_back(j, start, stop)

        return tensors, watching

    inst.delta_files = watched
    local, twin_local = a.train_round(), twin.train_round()
    _round([ahead])
    # (the replay's check, a span at a time on copies: where the updates lead, θ's pages handed back)
    assert a.replayed_hash(ahead.state.history) == ahead.state.theta_hash()
    assert resident_bytes(a.state.theta[0]) <= 2 * (64 << 10)  # (a fault-around or two at most)
    for p in (a, twin):
        p.catch_up(ahead.state.history)
    # A span of θ and of Δ, each over 2 pages at most, and each mapping's fault-around (64 KiB).
    bound = 2 * (2 * mmap.PAGESIZE + (64 << 10))
    assert max(t.numel() * t.element_size() for t in a.state.theta) > bound  # a tensor at a time: over
    assert len(held) == sum(-(-t.numel() // span) for t in a.state.theta)
    assert max(held) <= bound, max(held)
    delta = local.delta
    assert isinstance(delta, PseudoGradient) and not delta.is_lazy
    assert resident_bytes(delta[0]) == 0  # in a mapped file, none of it held
    mine, info = a.contribute(local)
    theirs, _ = twin.contribute(twin_local)
    assert info.staleness == 1 and mine is not None and theirs is not None
    assert mine.payloads == theirs.payloads
    assert resident_bytes(delta[0]) == 0  # read and encoded, handed back tensor by tensor
    assert list(tmp_path.iterdir()) == []


def test_theta_and_momentum_stay_in_memory_where_the_disk_cannot_hold_them(
    corpus: Corpus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder gone costs the memory, not the run: θ and m stay in memory, with one warning."""
    a = _peer(corpus)
    with caplog.at_level("WARNING"):
        a.keep_state_on_disk(str(tmp_path / "gone"))
        _round([a])
    assert a.state.round == 1 and not a._mapped
    assert sum("stay in memory" in r.getMessage() for r in caplog.records) == 1
