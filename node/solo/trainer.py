"""The single-node AdLoCo trainer: one peer that trains alone, averaging in a group of one.

This is what `adloco-node --offline` runs: the MIT instances, adaptive batch, switch mode and
compression with error feedback all run exactly as in a swarm, and the round goes through the same
`Averager` interface as every other driver (an in-process one with no window), so the update
applied is what a swarm of one would have applied, encoded bytes included. With a checkpoint folder
it checkpoints as a swarm node does (`node.operations.checkpoint`: atomic, verified): it resumes from
the newest usable one, writes one every `checkpoint_every` rounds and one when it stops (its rounds
done, or `should_stop`: SIGTERM), which `adloco-node export` reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ...protocol.transport.memory import MemoryAverager, MemoryHub
from ..operations.checkpoint import load_checkpoint, save_checkpoint
from ..training.config import TrainConfig
from ..training.peer import Peer
from ..training.rounds import RoundRecord
from ..training.runtime import give_back_free_memory, load_data

logger = logging.getLogger(__name__)

PEER_ID = "local"


def train_solo(
    cfg: TrainConfig,
    *,
    rounds: int,
    on_round: Callable[[RoundRecord], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 10,
) -> tuple[Peer, list[RoundRecord]]:
    """Train alone for `rounds` rounds (0: until `should_stop`); returns the peer and the rounds it
    trained in this call. With `checkpoint_dir`, resume from its newest usable checkpoint first (the
    `rounds` are counted from there, as a swarm node counts them), checkpoint every
    `checkpoint_every` rounds (0: only at the end) and when the loop ends (not when a round raised:
    its state may be half applied; the last checkpoint stands).

    Alone there is no transfer to overlap with, so rounds run in the synchronous order (overlap off),
    and no laggard to replay the averaged updates, so none is kept (replay_mb 0).
    """
    cfg = replace(cfg, overlap="off", replay_mb=0.0)
    corpus, tokenizer = load_data(cfg)
    peer = Peer(
        peer_id=PEER_ID,
        index=0,
        num_peers=1,
        cfg=cfg,
        corpus=corpus,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer,
    )
    # As a networked node: θ, m and the int8 residual wait in files beside the checkpoints (or in
    # the temporary folder) while the instances train (record 082).
    spill_dir = None if checkpoint_dir is None else str(checkpoint_dir)
    peer.keep_residual_on_disk(spill_dir)
    peer.keep_state_on_disk(spill_dir)
    tokens = 0
    if checkpoint_dir is not None:
        extra = load_checkpoint(checkpoint_dir, peer.load_state_dict)
        if extra is not None:
            tokens = int(extra.get("tokens_total", 0))
            logger.warning("resumed from the checkpoint of round %d", peer.state.round)

    def save() -> None:
        if checkpoint_dir is not None:
            save_checkpoint(
                checkpoint_dir, peer.state_dict(), extra={"tokens_total": tokens}, written=peer.release_state
            )

    done: list[RoundRecord] = []
    with MemoryAverager(MemoryHub(window_s=0.0), PEER_ID) as averager:
        while (rounds == 0 or len(done) < rounds) and not should_stop():
            record = _round(peer, averager, done[-1] if done else None, tokens)
            give_back_free_memory()  # what the round's boundary freed (record 083)
            done.append(record)
            tokens = record.tokens_total
            if checkpoint_every > 0 and len(done) % checkpoint_every == 0:
                save()
            if on_round is not None:
                on_round(record)
    if done and (checkpoint_every <= 0 or len(done) % checkpoint_every != 0):
        save()  # the last round, unless the periodic one just wrote it
    return peer, done


def _round(
    peer: Peer, averager: MemoryAverager, previous: RoundRecord | None, tokens_before: int
) -> RoundRecord:
    t0 = time.perf_counter()
    schedule = peer.state.schedule
    local = peer.train_round()
    contribution, info = peer.contribute(local)
    assert contribution is not None  # a solo peer is never stale
    result = averager.average(
        contribution,
        round=peer.state.round,
        codec=peer.downlink_codec(schedule.codec),
        timeout=60.0,
        bounds=peer.claim_bounds(),  # its own claim: one beyond the bounds honest peers set is a bug
    )
    if result is None:
        raise RuntimeError("a group of one failed to average")  # in process this is a bug, not a fault
    peer.apply_round(result)
    sent = result.traffic.wire_sent
    return RoundRecord(
        round=peer.state.round,
        val_loss=peer.validation_loss(),
        inner_loss=local.mean_loss,
        theta_hash=peer.theta_hash(),
        tokens=local.tokens,
        tokens_total=local.tokens + (previous.tokens_total if previous else tokens_before),
        tokens_per_s=local.tokens / max(local.compute_s, 1e-9),
        batch_sizes=list(schedule.batch),
        accum_steps=local.accum_steps,
        instances=schedule.instances,
        inner_steps=local.inner_steps,
        codec=info.codec,
        group_size=len(result.members),
        staleness=info.staleness,
        bytes_sent=sent + (previous.bytes_sent if previous else 0),
        bytes_received=result.traffic.wire_received + (previous.bytes_received if previous else 0),
        round_bytes=sent,
        round_s=time.perf_counter() - t0,
        wait_s=0.0,
        compute_s=local.compute_s,
        contribution_bytes=info.wire_bytes,
    )
