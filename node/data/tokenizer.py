"""Tokenizers: a byte-level default that needs no download, local transformers tokenizers, and BPE training.

Every tokenizer here has the same small interface (`vocab_size`, `eos_token_id`, `fingerprint`,
`encode`, `encode_bytes`, `decode`, `save_pretrained`), which is all the data pipeline, the model
builder, the checkpoint and the export need. The default `ByteTokenizer` maps each UTF-8 byte to its
own id (vocab 256), so any text on any machine tokenizes identically without files or network.
`load_tokenizer` also accepts a `tokenizer.json`, a folder saved with `save_pretrained`, or the name
of a model already in the local Hugging Face cache; nothing is downloaded, because nodes may have no
network. `train_bpe` makes a byte-level BPE `tokenizer.json` from a corpus (`adloco-node tokenizer`).

A tokenizer's `fingerprint` hashes what decides the ids a model sees (the vocabulary, merges,
normalization, pre-tokenization, added tokens, EOS), not where the files came from: peers whose
fingerprints differ must never average, and a checkpoint is only resumed with the tokenizer it was
trained with.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ...errors import UserError

BYTE_TOKENIZER_NAMES = ("bytes", "byte")
# GPT-2's end-of-text token: `train_bpe` gives it id 0, and a bare tokenizer.json that has it as a
# special token uses it as EOS (the document separator).
EOS_TOKEN = "<|endoftext|>"
# The parts of a tokenizer.json that decide the ids of a text (not its decoding, padding or truncation).
_ID_DECIDING_PARTS = ("normalizer", "pre_tokenizer", "model", "added_tokens")
_MIN_BPE_VOCAB = 257  # the 256 byte symbols and EOS
_MAX_BPE_VOCAB = 1 << 20  # 4x the largest vocabularies in use (Gemma's 256k)


class Tokenizer(Protocol):
    """What the data pipeline, the checkpoint and the export need from a tokenizer."""

    vocab_size: int
    eos_token_id: int | None
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def encode_bytes(self, data: bytes) -> torch.Tensor: ...

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str: ...

    def save_pretrained(self, directory: Path) -> None: ...


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value, vocab 256, no special tokens."""

    vocab_size: int = 256
    eos_token_id: int | None = None
    fingerprint: str = hashlib.sha256(b"adloco byte tokenizer: id = UTF-8 byte value").hexdigest()

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of `text` as ids."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> torch.Tensor:
        """Return `data` as a uint8 tensor of ids (no copy of the text through Python ints)."""
        return (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Return the text of `ids`; byte sequences that are not valid UTF-8 decode to U+FFFD."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: Path) -> None:
        """Write a transformers tokenizer giving the same ids: a BPE of the 256 byte symbols, no merges."""
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=byte_level_equivalent()).save_pretrained(str(directory))


class HFTokenizer:
    """A transformers tokenizer behind the `Tokenizer` interface (no special tokens added on encode)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        # len() counts added tokens too, which the model's embedding must cover.
        self.vocab_size: int = len(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.fingerprint: str = _fingerprint_of(tokenizer)

    def encode(self, text: str) -> list[int]:
        """Return the ids of `text`."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_bytes(self, data: bytes) -> torch.Tensor:
        """Decode `data` as UTF-8 (invalid bytes replaced) and return its ids as an int32 tensor."""
        return torch.tensor(self.encode(data.decode("utf-8", errors="replace")), dtype=torch.int32)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Return the text of `ids`."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return str(self._tok.decode(values))

    def save_pretrained(self, directory: Path) -> None:
        """Write the tokenizer's files (tokenizer.json, tokenizer_config.json, ...) into `directory`."""
        self._tok.save_pretrained(str(directory))


def tokenizer_identity(tokenizer: Tokenizer) -> str:
    """A name for the ids `tokenizer` gives, the same wherever it is loaded: keys the token cache."""
    if isinstance(tokenizer, ByteTokenizer):
        return "bytes"
    return f"hf:{tokenizer.fingerprint}"


def load_tokenizer(spec: str | None = None) -> Tokenizer:
    """Return the tokenizer named by `spec`.

    None, "bytes" or "byte" give the `ByteTokenizer`. A `tokenizer.json` file, a folder saved with
    `save_pretrained`, or the name of a model already in the local Hugging Face cache give that
    transformers tokenizer, loaded without network. Anything else raises `UserError`.
    """
    if spec is None or spec in BYTE_TOKENIZER_NAMES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    try:
        if path.exists():
            return HFTokenizer(_load_hf_tokenizer(path))
        return HFTokenizer(_load_cached_tokenizer(spec))
    except Exception as exc:  # the tokenizers library raises bare Exception for a malformed file
        if path.exists():
            raise UserError(f"--tokenizer: cannot load a tokenizer from {spec!r}: {_one_line(exc)}") from exc
        raise UserError(
            f"--tokenizer: {spec!r} is no file or folder here and no model in the local Hugging Face "
            "cache (nothing is downloaded); use 'bytes' (the default), a tokenizer.json, a "
            "save_pretrained folder, or make one with `adloco-node tokenizer`"
        ) from exc


def _load_hf_tokenizer(path: Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path.is_file():
        raw = RawTokenizer.from_file(str(path))
        specials = {t.content for t in raw.get_added_tokens_decoder().values() if t.special}
        eos = EOS_TOKEN if EOS_TOKEN in specials else None
        return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _load_cached_tokenizer(name: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def _fingerprint_of(tokenizer: Any) -> str:
    """sha256 of what decides the ids: the backend's model, normalizer, pre-tokenizer and added
    tokens (or, for a tokenizer without a `tokenizers` backend, its vocabulary), the size and EOS."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        data = json.loads(backend.to_str())
        decisive: Any = {key: data.get(key) for key in _ID_DECIDING_PARTS}
    else:
        decisive = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}
    decisive["size"] = len(tokenizer)
    decisive["eos"] = tokenizer.eos_token_id
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """The files `tokenizer.save_pretrained` writes, by name (what a checkpoint keeps for an export)."""
    with tempfile.TemporaryDirectory(prefix="adloco-tokenizer-") as tmp:
        tokenizer.save_pretrained(Path(tmp))
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def byte_level_equivalent() -> Any:
    """A `tokenizers.Tokenizer` giving the `ByteTokenizer`'s ids: GPT-2's byte symbols, no merges."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    symbols = _byte_symbols()
    raw = RawTokenizer(models.BPE(vocab={symbols[b]: b for b in range(256)}, merges=[]))
    # No regex split: the whole text is one word, so every byte is its own token as in ByteTokenizer.
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    return raw


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (the alphabet of the ByteLevel pre-tokenizer)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def check_bpe_settings(*, vocab_size: int, min_frequency: int) -> None:
    """UserError unless 257 <= vocab_size <= 2^20 (the 256 bytes and EOS at least) and min_frequency >= 1."""
    if not _MIN_BPE_VOCAB <= vocab_size <= _MAX_BPE_VOCAB:
        raise UserError(
            f"--vocab-size: must be in [{_MIN_BPE_VOCAB}, {_MAX_BPE_VOCAB}] (the 256 bytes and EOS at least),"
            f" got {vocab_size}"
        )
    if min_frequency < 1:
        raise UserError(f"--min-frequency: must be >= 1, got {min_frequency}")


def train_bpe(texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2) -> str:
    """Train a byte-level BPE tokenizer on `texts` and return its tokenizer.json text.

    GPT-2's design: the text's UTF-8 bytes as 256 base symbols (no unknown token, any text encodes),
    split into words by GPT-2's regex, `EOS_TOKEN` as id 0, then merges until `vocab_size` tokens or
    no pair occurs `min_frequency` times. The same texts in the same order and settings give the
    same file byte for byte (tests/test_tokenizer.py checks it across processes).

    Raises:
        UserError: bad settings (`check_bpe_settings`).
    """
    check_bpe_settings(vocab_size=vocab_size, min_frequency=min_frequency)
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    return str(raw.to_str())


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__
