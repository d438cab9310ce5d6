"""Shared start-up for every entry point: offline hub settings, corpus and tokenizer from a TrainConfig."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import cast

from ..data.corpus import Corpus, load_corpus
from ..data.tokenizer import Tokenizer, load_tokenizer
from .config import TrainConfig


def offline_hub() -> None:
    """No model or dataset is ever downloaded at run time: make transformers/datasets fail fast."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # A bad data file is reported as one UserError line; datasets would also log its own ERROR lines.
    os.environ.setdefault("DATASETS_VERBOSITY", "critical")


logger = logging.getLogger(__name__)

# glibc's mallopt parameter for the size from which a block is its own mapping (returned when freed).
_M_MMAP_THRESHOLD = -3
# What `--host-allocator lean` sets it to: glibc's initial value, kept fixed rather than raised to the
# largest block freed so far.
LEAN_MMAP_THRESHOLD = 128 << 10


def lean_allocator() -> bool:
    """Keep every block of `LEAN_MMAP_THRESHOLD` bytes or more a mapping of its own (glibc only).

    By default glibc raises that threshold to the largest block freed so far (up to 32 MiB), so the
    activations of a training step come from the heap, whose free holes between live blocks stay
    resident: 2-3 bytes per parameter at GPT-2 124M (docs/experiments.md). Fixed at 128 KiB, a freed
    block goes back to the system at once, for a page fault per page on its next use (~20 % slower
    CPU steps at 124M). False where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.warning("--host-allocator lean: this C library has no mallopt; left as it is")
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, LEAN_MMAP_THRESHOLD))


def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        return cast(Callable[..., int], getattr(ctypes.CDLL("libc.so.6"), name))
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_function("malloc_trim")


def give_back_free_memory() -> None:
    """Hand the allocator's free memory back to the system (glibc's `malloc_trim(0)`: the free
    pages inside every arena's heaps, not only at their tops); a no-op where the C library has no
    such call. The node calls it where a round's boundary has freed its transients (an update
    landed, an exchange or a catch-up ended): glibc otherwise keeps what the averaging and serving
    threads freed in their arenas, 0.3-0.6 GiB above a lone node's level at GPT-2 124M (record 083).
    Costs the next step a page fault per page it reuses, once a round, not `lean_allocator`'s every
    step."""
    if _malloc_trim is not None:
        _malloc_trim(0)


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
