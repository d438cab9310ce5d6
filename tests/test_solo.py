"""The solo trainer (`adloco-node --offline`) keeps only what training alone needs."""

from __future__ import annotations

import pytest
import torch

from adloco.node.solo.trainer import train_solo
from adloco.node.training.config import TrainConfig

CFG = TrainConfig(seq_len=32, batch_size=2, instances=1, inner_steps=2, b_max=2, max_corpus_mb=0.3)


@pytest.mark.parametrize("residual_dtype", ["float32", "bfloat16"])
def test_solo_keeps_no_update_for_replay_and_its_residual_in_the_configured_dtype(
    residual_dtype: str,
) -> None:
    """Alone no laggard replays the averaged updates, so none is kept whatever --replay-mb says;
    the error-feedback residual lives in the dtype asked for."""
    cfg = TrainConfig(**{**CFG.__dict__, "replay_mb": 256.0, "residual_dtype": residual_dtype})
    peer, records = train_solo(cfg, rounds=2)
    assert len(records) == 2 and peer.state.round == 2
    assert peer.state.history == []
    residuals = peer.error_feedback.state_dict()
    assert residuals.keys() == set(peer.names)
    assert {e.dtype for e in residuals.values()} == {getattr(torch, residual_dtype)}
