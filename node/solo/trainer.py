"""The single-node AdLoCo trainer: one peer that trains alone, averaging in a group of one.

This is what `adloco-node` runs when it has no peers: the MIT instances, adaptive batch, switch mode
and compression with error feedback all run exactly as in a swarm, and the one-member all-reduce
still goes through the codec (so the update applied is what a swarm would have applied).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ...protocol.algorithms.allreduce import reduce_group
from ..training.config import TrainConfig
from ..training.peer import Peer
from ..training.runtime import load_data

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoloRound:
    """One applied round of a node training alone."""

    round: int
    inner_loss: float
    val_loss: float
    tokens: int
    tokens_per_s: float
    batch_sizes: tuple[int, ...]
    accum_steps: int
    instances: int
    codec: str
    wire_bytes: int
    round_s: float
    theta_hash: str


def train_solo(
    cfg: TrainConfig,
    *,
    rounds: int,
    on_round: Callable[[SoloRound], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> tuple[Peer, list[SoloRound]]:
    """Train alone for `rounds` rounds (0: until `should_stop`); returns the peer and its rounds.

    Alone there is no transfer to overlap with, so rounds run in the synchronous order (overlap off).
    """
    cfg = replace(cfg, overlap="off")
    corpus, tokenizer = load_data(cfg)
    peer = Peer(
        peer_id="local", index=0, num_peers=1, cfg=cfg, corpus=corpus, vocab_size=tokenizer.vocab_size
    )
    done: list[SoloRound] = []
    tokens = 0
    while (rounds == 0 or len(done) < rounds) and not should_stop():
        t0 = time.perf_counter()
        schedule = peer.state.schedule
        local = peer.train_round()
        contribution, info = peer.contribute(local)
        assert contribution is not None  # a solo peer is never stale
        result = reduce_group([contribution], codec=peer.downlink_codec(schedule.codec))
        peer.apply_round(result)
        tokens += local.tokens
        elapsed = time.perf_counter() - t0
        record = SoloRound(
            round=peer.state.round,
            inner_loss=local.mean_loss,
            val_loss=peer.validation_loss(),
            tokens=tokens,
            tokens_per_s=local.tokens / max(local.compute_s, 1e-9),
            batch_sizes=schedule.batch,
            accum_steps=local.accum_steps,
            instances=schedule.instances,
            codec=info.codec,
            wire_bytes=info.wire_bytes,
            round_s=elapsed,
            theta_hash=peer.state.theta_hash(),
        )
        done.append(record)
        if on_round is not None:
            on_round(record)
    return peer, done
