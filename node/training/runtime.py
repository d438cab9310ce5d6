"""Shared start-up for every entry point: offline hub settings, the C allocator's settings, corpus and
tokenizer from a TrainConfig."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

from .config import TrainConfig
from .corpus import Corpus, load_corpus
from .tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# glibc's mallopt parameter (malloc.h) and the value we fix it at.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 << 10
"""Blocks from this size up are mapped on their own and go back to the kernel when freed. It is
glibc's initial value; what `tune_malloc` removes is glibc raising it as the process frees large
blocks (up to 32 MiB), after which a model's tensors (2-10 MiB each for GPT-2 124M) come from the
heap, whose free holes the kernel never gets back. At 124M that was 0.4 GiB of a node's peak, about
3 bytes per parameter (docs/results.md, issue 9)."""


def offline_hub() -> None:
    """No model or dataset is ever downloaded at run time: make transformers/datasets fail fast."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # A bad data file is reported as one UserError line; datasets would also log its own ERROR lines.
    os.environ.setdefault("DATASETS_VERBOSITY", "critical")


def tune_malloc() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` for this process (Linux with glibc only;
    a MALLOC_MMAP_THRESHOLD_ the user set wins). Returns whether the setting was made.

    Torch's CPU tensors come from malloc. With glibc's dynamic threshold, the memory of large tensors
    freed and allocated every round (gradients, activations, decoded updates) stays in the heap as
    fragments, and the resident set grows above what the node holds; with a fixed threshold each
    such tensor is its own mapping, returned to the kernel when freed.
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    logger.debug("malloc mmap threshold fixed at %d bytes: %s", MMAP_THRESHOLD_BYTES, done)
    return done


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
