"""What a node's instances are built from, the same in the node's process and in a device's worker
(`remote`): the seeded model and an `Instance` of the run's settings."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from ..data.sampling import TokenSampler
from ..model.devices import Placement
from ..model.model import build_model, compile_layers, enable_activation_checkpointing
from .config import TrainConfig
from .instances import BATCH_STATS, Instance

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def training_model(cfg: TrainConfig, vocab_size: int) -> tuple[PreTrainedModel, str]:
    """The model every instance of a node starts as (seeded, so every process builds it alike), and
    its transformers config as built, in JSON, before activation checkpointing turns its cache off."""
    built = build_model(cfg.model, vocab_size=vocab_size, seed=cfg.seed, max_seq_len=max(1024, cfg.seq_len))
    config = built.config.to_json_string()
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(built)
    return built, config


def instance_random_seed(cfg: TrainConfig, *, index: int, slot: int, replica: int = 0) -> int:
    """The seed of dropout's stream of instance `slot` of peer `index`, whatever its device: a hash,
    not the sampler's seed, so that the masks and the windows drawn are not the same random bits.
    A replica (rank ≥ 1 of a data-parallel instance, `parallel`) draws a stream of its own."""
    key = f"dropout|{cfg.seed}|{index}|{slot}".encode() + (f"|{replica}".encode() if replica else b"")
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def new_instance(
    cfg: TrainConfig,
    *,
    slot: int,
    model: torch.nn.Module,
    sampler: TokenSampler,
    placement: Placement,
    autocast_dtype: torch.dtype | None,
    compiled: bool,
    random_seed: int,
) -> Instance:
    """An instance training `model` (compiled here when `compiled`: a copy of a compiled model is
    not, so each instance compiles its own) with the run's inner optimizer and batch test."""
    if compiled:
        compile_layers(model)
    return Instance(
        slot=slot,
        model=model,
        sampler=sampler,
        inner=cfg.inner,
        placement=placement,
        autocast_dtype=autocast_dtype,
        batch_stats=BATCH_STATS[cfg.schedule.test],
        random_seed=random_seed,
    )
