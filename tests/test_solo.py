"""The solo trainer (`adloco-node --offline`) keeps only what training alone needs."""

from __future__ import annotations

import pytest
import torch

from adloco.node.solo.trainer import train_solo
from adloco.node.training.config import TrainConfig
from adloco.protocol.algorithms.feedback import Int8Residual

CFG = TrainConfig(seq_len=32, batch_size=2, instances=1, inner_steps=2, b_max=2, max_corpus_mb=0.3)


@pytest.mark.parametrize(
    ("residual_dtype", "codec", "kept"),
    [
        ("float32", "int8", torch.float32),
        ("bfloat16", "int8", torch.bfloat16),
        ("auto", "int8", torch.int8),
        ("auto", "int4", torch.int8),
        ("auto", "lowrank:2", torch.bfloat16),
    ],
)
def test_solo_keeps_no_update_for_replay_and_its_residual_in_the_configured_dtype(
    residual_dtype: str, codec: str, kept: torch.dtype
) -> None:
    """Alone no laggard replays the averaged updates, so none is kept whatever --replay-mb says;
    the error-feedback residual lives in the dtype asked for (auto: int8 codes for the uniform
    quantizers, bf16 otherwise)."""
    cfg = TrainConfig(
        **{**CFG.__dict__, "replay_mb": 256.0, "residual_dtype": residual_dtype, "codec": codec}
    )
    peer, records = train_solo(cfg, rounds=2)
    assert len(records) == 2 and peer.state.round == 2
    assert peer.state.history == []
    residuals = peer.error_feedback._residuals
    assert residuals.keys() == set(peer.names)
    assert {torch.int8 if isinstance(e, Int8Residual) else e.dtype for e in residuals.values()} == {kept}
