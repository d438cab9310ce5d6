"""Shared start-up for every entry point: offline hub settings, corpus and tokenizer from a TrainConfig."""

from __future__ import annotations

import os

from .config import TrainConfig
from .corpus import Corpus, load_corpus
from .tokenizer import Tokenizer, load_tokenizer


def offline_hub() -> None:
    """No model or dataset is ever downloaded at run time: make transformers/datasets fail fast."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # A bad data file is reported as one UserError line; datasets would also log its own ERROR lines.
    os.environ.setdefault("DATASETS_VERBOSITY", "critical")


def load_data(cfg: TrainConfig) -> tuple[Corpus, Tokenizer]:
    """The tokenizer the config names (default: byte-level, needs no download) and the corpus."""
    offline_hub()
    tokenizer = load_tokenizer(cfg.tokenizer)
    max_bytes = max(1, int(cfg.max_corpus_mb * 1e6)) if cfg.max_corpus_mb else None
    corpus = load_corpus(
        cfg.dataset,
        tokenizer=tokenizer,
        text_field=cfg.text_field,
        max_bytes=max_bytes,
        cache_dir=cfg.data_cache_dir,
    )
    return corpus, tokenizer
