"""The token cache: a corpus tokenized once into files that every later run reads on demand.

A cache is a directory: `tokens.bin` holds every document's token ids (separator included),
concatenated, little-endian uint8/uint16/uint32 by vocabulary size; `index.bin` one fixed-size
record per document (where its tokens lie, the 64-bit key its split and shard are derived from, its
size in the source, where its name lies in `names.bin`, its group, the split its source gave it);
`meta.json`, written last, the sizes and sha256 of the three files and what the corpus module keeps
there (group names, fingerprint entries). It is written streaming, one document at a time, into a
temporary directory renamed into place under an exclusive lock: memory stays constant in the corpus
size, nodes sharing a machine build it once, a crash leaves no partial cache. `open_or_build`
checks every size and sha256 before it trusts a cache; one that fails is set aside and rebuilt from
the source, which is only ever read. The cache is derived data: deleting it costs a rebuild. The
token file is then read with positioned reads (`streams.TokenFile`), never loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from ...errors import UserError
from .streams import TokenFile

logger = logging.getLogger(__name__)

FORMAT = 1
SPLIT_AUTO, SPLIT_TRAIN, SPLIT_VAL = 0, 1, 2
# Little-endian and packed, so a cache reads the same on any machine that copies it.
INDEX_DTYPE = np.dtype(
    [
        ("start", "<i8"),
        ("length", "<i8"),
        ("key", "<u8"),
        ("nbytes", "<i8"),
        ("name_start", "<i8"),
        ("name_length", "<i4"),
        ("group", "<i4"),
        ("split", "u1"),
    ]
)
_FILES = ("tokens.bin", "index.bin", "names.bin")
_RECORDS_PER_WRITE = 8192
_HASH_CHUNK = 1 << 20  # one reused buffer: verifying costs 1 MiB whatever the cache's size


def token_dtype(vocab_size: int) -> np.dtype[np.unsignedinteger[Any]]:
    """The smallest unsigned little-endian dtype that holds every id below `vocab_size`."""
    for name, limit in (("u1", 1 << 8), ("<u2", 1 << 16)):
        if vocab_size <= limit:
            return np.dtype(name)
    return np.dtype("<u4")


def default_cache_root() -> Path:
    """`$XDG_CACHE_HOME/adloco`, else `~/.cache/adloco`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "adloco")


@dataclass(frozen=True)
class TokenCache:
    """An opened, verified cache; its files are read on demand (`records.read(0, n)` for all)."""

    path: Path
    tokens: TokenFile
    records: TokenFile
    names: TokenFile
    extra: dict[str, Any]

    def name(self, record: int) -> str:
        """The name of the document of index record `record`."""
        (entry,) = self.records.read(record, record + 1)
        start, length = int(entry["name_start"]), int(entry["name_length"])
        return self.names.read(start, start + length).tobytes().decode("utf-8")


class CacheWriter:
    """Appends documents to a cache being built; `open_or_build` hands one to the build function."""

    def __init__(self, directory: Path, dtype: np.dtype[np.unsignedinteger[Any]]) -> None:
        self.directory = directory
        self.dtype = dtype
        self._files = {name: (directory / name).open("wb") for name in _FILES}
        self._digests = {name: hashlib.sha256() for name in _FILES}
        self._sizes = dict.fromkeys(_FILES, 0)
        self._records: list[tuple[int, int, int, int, int, int, int, int]] = []
        self.num_docs = 0
        self.num_tokens = 0

    def add(
        self, *, name: str, key: int, tokens: npt.NDArray[Any], nbytes: int, group: int, split: int
    ) -> None:
        """Append one document: its token ids (any integer dtype below the vocabulary) and identity."""
        encoded = name.encode("utf-8")
        ids = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._records.append(
            (self.num_tokens, ids.size, key, nbytes, self._sizes["names.bin"], len(encoded), group, split)
        )
        self._write("tokens.bin", ids.tobytes())
        self._write("names.bin", encoded)
        self.num_tokens += ids.size
        self.num_docs += 1
        if len(self._records) >= _RECORDS_PER_WRITE:
            self._flush_records()

    def _write(self, name: str, data: bytes) -> None:
        self._files[name].write(data)
        self._digests[name].update(data)
        self._sizes[name] += len(data)

    def _flush_records(self) -> None:
        if self._records:
            self._write("index.bin", np.array(self._records, dtype=INDEX_DTYPE).tobytes())
            self._records.clear()

    def finish(self, extra: dict[str, Any]) -> None:
        """Flush and fsync the files, then write meta.json (the cache is complete once it exists)."""
        self._flush_records()
        for f in self._files.values():
            _close_synced(f)
        body = {
            "format": FORMAT,
            "dtype": self.dtype.str,
            "docs": self.num_docs,
            "tokens": self.num_tokens,
            "files": {
                name: {"bytes": self._sizes[name], "sha256": self._digests[name].hexdigest()}
                for name in _FILES
            },
            "extra": extra,
        }
        with (self.directory / "meta.json").open("wb") as meta:
            meta.write(json.dumps({"body": body, "sha256": _body_digest(body)}).encode())
            meta.flush()
            os.fsync(meta.fileno())

    def abandon(self) -> None:
        """Close the files of a build that failed (the caller removes the directory)."""
        for f in self._files.values():
            f.close()


def open_or_build(
    root: Path,
    label: str,
    key: str,
    *,
    dtype: np.dtype[np.unsignedinteger[Any]],
    build: Callable[[CacheWriter], dict[str, Any]],
) -> TokenCache:
    """The cache named (`label`, `key`) under `root`, built with `build` if missing or corrupt.

    `build` adds every document to the writer and returns the `extra` JSON kept in meta.json; what
    it raises (a UserError for a bad source) propagates and leaves no cache behind. Concurrent
    callers on one machine wait on a lock while one of them builds.
    """
    path = root / f"{_safe(label)}-{key[:24]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--data-cache-dir: cannot create '{root}': {exc.strerror or exc}") from exc
    with _locked(root / f"{path.name}.lock"):
        # Under the lock no one else builds this cache: what a crashed build left is garbage.
        for leftover in root.glob(f"{glob.escape(path.name)}.*-*"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
        if path.exists():
            try:
                return open_cache(path, dtype=dtype)
            except ValueError as exc:
                logger.warning("token cache %s is unusable (%s); rebuilding it from the source", path, exc)
                _remove(path)
        start = time.perf_counter()
        _build(path, dtype=dtype, build=build)
        cache = open_cache(path, dtype=dtype)
        logger.info(
            "token cache %s: %d documents, %d tokens, built in %.1f s",
            path,
            cache.records.size,
            cache.tokens.size,
            time.perf_counter() - start,
        )
        return cache


def open_cache(path: Path, *, dtype: np.dtype[np.unsignedinteger[Any]]) -> TokenCache:
    """Open and verify the cache at `path`; ValueError says what is wrong with it."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"meta.json unreadable: {exc}") from exc
    body = meta.get("body") if isinstance(meta, dict) else None
    if not isinstance(body, dict) or meta.get("sha256") != _body_digest(body):
        raise ValueError("meta.json fails its checksum")
    if body.get("format") != FORMAT or body.get("dtype") != dtype.str:
        raise ValueError(f"format {body.get('format')}/{body.get('dtype')}, expected {FORMAT}/{dtype.str}")
    files = body["files"]
    for name in _FILES:
        _verify_file(path / name, size=files[name]["bytes"], sha256=files[name]["sha256"])
    tokens = TokenFile(path / "tokens.bin", dtype)
    records = TokenFile(path / "index.bin", INDEX_DTYPE)
    if tokens.size != body["tokens"] or records.size != body["docs"]:
        raise ValueError("token or document count differs from meta.json")
    names = TokenFile(path / "names.bin", np.dtype("u1"))
    return TokenCache(path, tokens, records, names, dict(body["extra"]))


def _build(
    path: Path, *, dtype: np.dtype[np.unsignedinteger[Any]], build: Callable[[CacheWriter], dict[str, Any]]
) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    _remove(tmp)
    tmp.mkdir()
    writer = CacheWriter(tmp, dtype)
    try:
        extra = build(writer)
        writer.finish(extra)
        os.rename(tmp, path)
    except BaseException:
        writer.abandon()
        _remove(tmp)
        raise


def _verify_file(path: Path, *, size: int, sha256: str) -> None:
    try:
        actual = path.stat().st_size
        if actual != size:
            raise ValueError(f"{path.name} has {actual} bytes, meta.json says {size}")
        digest = hashlib.sha256()
        buffer = bytearray(_HASH_CHUNK)
        view = memoryview(buffer)
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
    except OSError as exc:
        raise ValueError(f"{path.name}: {exc.strerror or exc}") from exc
    if digest.hexdigest() != sha256:
        raise ValueError(f"{path.name} fails its sha256")


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    """Remove a cache directory: renamed aside first, so no reader ever sees it half deleted."""
    if not path.exists():
        return
    aside = path.with_name(f"{path.name}.old-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _close_synced(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _safe(label: str) -> str:
    """A short, filesystem-safe form of a corpus name, for people reading the cache folder."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in label.strip("/").split("/")[-1])
    return cleaned[:40] or "corpus"
