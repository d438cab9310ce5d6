"""Tokenizers: a byte-level default that needs no download, and local transformers tokenizers.

Every tokenizer here has the same small interface (`vocab_size`, `eos_token_id`, `encode`,
`encode_bytes`, `decode`), which is all the data pipeline and the model builder need. The default
`ByteTokenizer` maps each UTF-8 byte to its own id (vocab 256), so any text on any machine tokenizes
identically without files or network. `load_tokenizer` also accepts a local directory (or a
`tokenizer.json`) saved by transformers; hub names are refused because nodes may have no network.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ...errors import UserError

BYTE_TOKENIZER_NAMES = ("bytes", "byte")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_bytes(self, data: bytes) -> torch.Tensor: ...

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value, vocab 256, no special tokens."""

    vocab_size: int = 256
    eos_token_id: int | None = None

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


class HFTokenizer:
    """A transformers tokenizer behind the `Tokenizer` interface (no special tokens added on encode)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        # len() counts added tokens too, which the model's embedding must cover.
        self.vocab_size: int = len(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id

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

    def fingerprint(self) -> str:
        """sha256 of what decides the ids: the fast tokenizer's JSON, else the vocabulary."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        spec = backend.to_str() if backend is not None else repr(sorted(self._tok.get_vocab().items()))
        return hashlib.sha256(f"{self.vocab_size}|{self.eos_token_id}|{spec}".encode()).hexdigest()


def tokenizer_identity(tokenizer: Tokenizer) -> str:
    """A name for the ids `tokenizer` gives, the same wherever it is loaded: keys the token cache.

    Tokenizers other than the two here are named by their type, vocabulary and the ids of a probe.
    """
    if isinstance(tokenizer, ByteTokenizer):
        return "bytes"
    if isinstance(tokenizer, HFTokenizer):
        return f"hf:{tokenizer.fingerprint()}"
    probe = tokenizer.encode_bytes(_PROBE_TEXT.encode()).tolist()
    kind = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
    described = f"{kind}|{tokenizer.vocab_size}|{tokenizer.eos_token_id}|{probe}"
    return "probe:" + hashlib.sha256(described.encode()).hexdigest()


_PROBE_TEXT = "def f(x):\n    return x ** 2  # héllo wörld, 你好, 🙂\n\nThe quick brown fox.\n"


def load_tokenizer(spec: str | None = None) -> Tokenizer:
    """Return the tokenizer named by `spec`.

    None, "bytes" or "byte" give the `ByteTokenizer`. A local directory saved with
    `save_pretrained`, or a `tokenizer.json` file, gives that transformers tokenizer, loaded without
    network. Anything else raises `UserError`.
    """
    if spec is None or spec in BYTE_TOKENIZER_NAMES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(
            f"--tokenizer: no such file or directory {spec!r}; use 'bytes' (the default) or a local "
            "tokenizer directory / tokenizer.json (hub names need network and are not supported)"
        )
    try:
        return HFTokenizer(_load_hf_tokenizer(path))
    except Exception as exc:  # the tokenizers library raises bare Exception for a malformed file
        raise UserError(f"--tokenizer: cannot load a tokenizer from {spec!r}: {_one_line(exc)}") from exc


def _load_hf_tokenizer(path: Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__
