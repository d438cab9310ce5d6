"""The training corpus: read once, document by document, into a token cache, then split by document.

The embedded default corpus ("stdlib") is the Python standard library's own source, present on every
machine that runs the node: ~12 MB of code and docstrings in ~730 files, tests and site-packages
excluded. Local text files, local json/jsonl/parquet/csv files and cached `datasets` datasets are
also accepted; nothing is downloaded unless the user sets HF_HUB_OFFLINE=0 and HF_DATASETS_OFFLINE=0.

Nothing is read whole: text files are read one at a time (in segments past 4 MiB), data files and
datasets as streams of row batches, and every document is tokenized and appended to an on-disk
token cache (`token_cache.py`) keyed by the source, its sizes and modification times, the tokenizer
and the cap; later runs open the cache without reading the source. A `Corpus` is then only arrays
of where each document lies in the cache, so memory does not grow with the corpus's tokens.

Every choice peers must agree on is a pure function of names or content, never of the machine or
the order files are listed in: each document carries a 64-bit key (the first 8 bytes of the sha256
of its relative path, or of its text for a data row) and goes to validation iff the key's bucket is
below `val_percent`; `Corpus.fingerprint` names exactly which files were used, since peers on
different Python versions see slightly different stdlib files.

Over 500 lines, one idea: reading a corpus into the token cache from any of its sources (folders,
file lists, the Hugging Face Hub, the standard library, text rows) and splitting it; each source is
small and exists only for `load_corpus`.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import logging
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from ...errors import UserError
from .streams import TokenSource, read_source
from .token_cache import (
    SPLIT_AUTO,
    SPLIT_TRAIN,
    SPLIT_VAL,
    CacheWriter,
    TokenCache,
    default_cache_root,
    open_or_build,
    token_dtype,
)
from .tokenizer import Tokenizer, tokenizer_identity

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "stdlib"
DEFAULT_VAL_PERCENT = 5.0
# A text file larger than this is read (and split into documents) in segments cut at line ends, so
# one huge file costs no more memory than this; every stdlib file is far smaller (the largest 0.8 MB).
SEGMENT_BYTES = 4 << 20
ROW_BATCH = 1024

# Tests are 2/3 of the stdlib's bytes and highly repetitive; the others are not source or are
# machine-specific (_sysconfigdata holds this build's paths and flags).
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
STDLIB_EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")

TEXT_SUFFIXES = frozenset(
    {".txt", ".md", ".rst", ".py", ".tex", ".html", ".c", ".h", ".cpp", ".js", ".rs", ".go"}
)
DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# How much each `datasets` builder reads at a time when streaming; they bound the memory of reading
# a data file (datasets' own defaults, 10 MB of JSON or 10,000 CSV rows, cost ~100 MB parsed).
STREAM_CHUNKS: dict[str, dict[str, int]] = {
    "json": {"chunksize": 1 << 20},
    "csv": {"chunksize": 1_000},
    "parquet": {"batch_size": ROW_BATCH},
}
VALIDATION_SPLITS = ("validation", "valid", "test")
# Rows of a dataset have no package to group by; contiguous blocks of rows stand in for it (datasets
# are often stored sorted by source), giving non-IID peers different regions of the dataset.
DATASET_GROUPS = 64

IntArray = npt.NDArray[np.int64]


class Document(NamedTuple):
    """One source document: where it came from, its group for non-IID sharding, its token ids.

    `tokens` already ends with the document separator (the tokenizer's EOS, or a blank line for
    the byte tokenizer), so documents can be concatenated as they are.
    """

    name: str
    group: str
    tokens: torch.Tensor


@dataclass(frozen=True)
class DocTable:
    """Documents of one split as arrays: where each one's tokens lie in the corpus's token array.

    `key` is the 64-bit identity every split and shard decision is derived from, `group` an index
    into `Corpus.groups`, `record` the document's entry in the cache (its name).
    """

    start: IntArray
    length: IntArray
    key: npt.NDArray[np.uint64]
    group: IntArray
    record: IntArray

    def __len__(self) -> int:
        return int(self.start.size)

    @property
    def num_tokens(self) -> int:
        """Tokens in these documents (separators included)."""
        return int(self.length.sum())

    def take(self, rows: IntArray) -> DocTable:
        """The documents at positions `rows`, in that order."""
        return DocTable(
            self.start[rows], self.length[rows], self.key[rows], self.group[rows], self.record[rows]
        )

    def by_key(self) -> DocTable:
        """The documents in key order (ties by record): an order no file listing can change."""
        return self.take(np.lexsort((self.record, self.key)))


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus split by document into training and validation sets.

    `tokens` is the cache's token file (an in-memory array for `from_documents`); the tables say
    where each split's documents lie in it, so nothing is read until sampled.
    """

    name: str
    tokens: TokenSource
    train: DocTable
    val: DocTable
    fingerprint: str
    groups: tuple[str, ...]
    names: Callable[[int], str]
    source_bytes: int = 0
    cache_path: Path | None = None

    @property
    def num_train_tokens(self) -> int:
        """Tokens in the training documents (separators included)."""
        return self.train.num_tokens

    @property
    def num_val_tokens(self) -> int:
        """Tokens in the validation documents (separators included)."""
        return self.val.num_tokens

    def documents(self, table: DocTable) -> Iterator[Document]:
        """The documents of `table` (e.g. `corpus.val`), each read (copied) from the cache when reached."""
        for i in range(len(table)):
            start, length = int(table.start[i]), int(table.length[i])
            tokens = torch.from_numpy(np.array(read_source(self.tokens, start, start + length)))
            yield Document(self.names(int(table.record[i])), self.groups[int(table.group[i])], tokens)

    @classmethod
    def from_documents(
        cls, name: str, train: Sequence[Document], val: Sequence[Document], *, fingerprint: str = ""
    ) -> Corpus:
        """An in-memory corpus of the given documents (tests, tools); keys are the names' hashes."""
        docs = [*train, *val]
        groups = sorted({d.group for d in docs})
        lengths = np.array([d.tokens.numel() for d in docs], dtype=np.int64)
        tokens = (
            np.concatenate([d.tokens.reshape(-1).numpy() for d in docs]) if docs else np.empty(0, np.uint8)
        )
        table = DocTable(
            np.cumsum(lengths) - lengths,
            lengths,
            np.array([name_key(d.name) for d in docs], dtype=np.uint64),
            np.array([groups.index(d.group) for d in docs], dtype=np.int64),
            np.arange(len(docs), dtype=np.int64),
        )
        n = len(train)
        return cls(
            name,
            tokens,
            table.take(np.arange(n)),
            table.take(np.arange(n, len(docs))),
            fingerprint,
            tuple(groups),
            lambda record: docs[record].name,
        )


def load_corpus(
    spec: str | None = None,
    *,
    tokenizer: Tokenizer,
    text_field: str = "text",
    max_bytes: int | None = None,
    val_percent: float = DEFAULT_VAL_PERCENT,
    cache_dir: str | None = None,
) -> Corpus:
    """Load (tokenizing into the token cache on first use) and split the corpus named by `spec`.

    Args:
        spec: None or "stdlib" for the embedded corpus; a local directory of text files; a local
            file or glob of text (.txt, .md, .py, ...) or data (.json, .jsonl, .parquet, .csv)
            files; otherwise the name of a `datasets` dataset already in the local cache, with an
            optional config as "name:config".
        tokenizer: turns each document's bytes into ids.
        text_field: the column holding the text in data files and datasets.
        max_bytes: an explicit cap: stop adding documents past this many source bytes (default:
            no cap, the whole corpus).
        val_percent: share of documents (by their keys) held out for validation, 0 to 50; decided
            when the cache is opened, so changing it needs no rebuild.
        cache_dir: where the token cache lives (`tokens/` under it; default `~/.cache/adloco`) and
            where `datasets` keeps its own cache (its default when None).

    Raises:
        UserError: the corpus cannot be found or read, or holds no tokens.
    """
    if not 0 <= val_percent <= 50:
        raise UserError(f"--val-percent: must be between 0 and 50, got {val_percent}")
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"--max-corpus-mb: must be positive, got {max_bytes} bytes")
    name = spec or DEFAULT_CORPUS
    opts = _ReadOptions(tokenizer, text_field, max_bytes, cache_dir)
    source = _stdlib_source(opts) if name == DEFAULT_CORPUS else _resolve(name, opts)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    dtype = token_dtype(tokenizer.vocab_size)
    key = _cache_key(source.identity, opts, dtype)
    cache = open_or_build(root / "tokens", name, key, dtype=dtype, build=lambda w: source.write(w, opts))
    corpus = _corpus_from_cache(name, cache, val_percent=val_percent)
    if not len(corpus.train):
        raise UserError(f"--dataset: {name!r} holds no text to train on")
    logger.info(
        "corpus %s: %d train docs (%d tokens), %d val docs (%d tokens), cache %s",
        name,
        len(corpus.train),
        corpus.num_train_tokens,
        len(corpus.val),
        corpus.num_val_tokens,
        cache.path,
    )
    return corpus


@dataclass(frozen=True)
class _ReadOptions:
    tokenizer: Tokenizer
    text_field: str
    max_bytes: int | None
    cache_dir: str | None


@dataclass(frozen=True)
class _Source:
    """A resolved source: what names its content (for the cache key) and how to write it to a cache."""

    identity: Iterable[str]
    write: Callable[[CacheWriter, _ReadOptions], dict[str, Any]]


def _cache_key(identity: Iterable[str], opts: _ReadOptions, dtype: np.dtype[Any]) -> str:
    digest = hashlib.sha256()
    header = (
        f"tokenizer={tokenizer_identity(opts.tokenizer)}|dtype={dtype.str}|field={opts.text_field}|"
        f"max_bytes={opts.max_bytes}|segment={SEGMENT_BYTES}"
    )
    for part in itertools.chain([header], identity):
        digest.update(part.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


# ---- resolving a spec ------------------------------------------------------------------------------


def _resolve(name: str, opts: _ReadOptions) -> _Source:
    path = Path(name).expanduser()
    if path.is_dir():
        return _directory_source(path, opts)
    if glob.has_magic(name):
        paths = [Path(p) for p in sorted(glob.glob(str(path))) if Path(p).is_file()]
    else:
        paths = [path] if path.exists() else []
    return _file_list_source(name, paths, opts) if paths else _hub_source(name, opts)


def _directory_source(root: Path, opts: _ReadOptions) -> _Source:
    files = _walk(root)
    text_files = [rel for rel in files if _suffix(rel) in TEXT_SUFFIXES]
    if text_files:
        return _text_source(root, text_files, opts)
    data_files = [root / rel for rel in files if _suffix(rel) in DATASET_BUILDERS]
    if not data_files:
        raise UserError(
            f"--dataset: directory '{root}' has no text ({', '.join(sorted(TEXT_SUFFIXES))}) or data "
            f"({', '.join(DATASET_BUILDERS)}) files"
        )
    return _file_list_source(str(root), data_files, opts)


def _file_list_source(name: str, paths: list[Path], opts: _ReadOptions) -> _Source:
    suffixes = {p.suffix.lower() for p in paths}
    if suffixes <= TEXT_SUFFIXES:
        root = Path(os.path.commonpath([p.parent for p in paths]))
        return _text_source(root, sorted(p.relative_to(root).as_posix() for p in paths), opts)
    builders = {DATASET_BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise UserError(
            f"--dataset: {name!r}: cannot mix or read file types {', '.join(sorted(suffixes))}; use text "
            f"files ({', '.join(sorted(TEXT_SUFFIXES))}) or one of {', '.join(DATASET_BUILDERS)}"
        )
    (builder,) = builders
    assert builder is not None
    entries = _relative_entries(paths)
    stats = [_stat(p) for _, p in entries]
    for (_, p), st in zip(entries, stats, strict=True):
        if st.st_size == 0:
            raise UserError(f"--dataset: file '{p}' is empty")
    # Names relative to the files' common folder, so peers holding copies elsewhere agree.
    source = ";".join(f"{rel}:{st.st_size}" for (rel, _), st in zip(entries, stats, strict=True))
    identity = [f"files:{builder}"] + [
        f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}" for (_, p), st in zip(entries, stats, strict=True)
    ]
    files = [str(p) for _, p in entries]

    def write(writer: CacheWriter, opts: _ReadOptions) -> dict[str, Any]:
        loaded = _call_datasets(
            name,
            lambda ds: ds.load_dataset(
                builder, data_files=files, cache_dir=opts.cache_dir, streaming=True, **STREAM_CHUNKS[builder]
            ),
            local=True,
        )
        return _write_dataset(writer, name, loaded, source=source, opts=opts)

    return _Source(identity, write)


def _hub_source(name: str, opts: _ReadOptions) -> _Source:
    dataset_name, _, config = name.partition(":")
    where = str(Path(opts.cache_dir).resolve()) if opts.cache_dir else ""

    def load(ds: Any) -> Any:
        # Streaming reads the cached files lazily where the dataset supports it; the cached Arrow
        # tables are memory-mapped, so iterating them is constant-memory too.
        try:
            return ds.load_dataset(dataset_name, config or None, cache_dir=opts.cache_dir, streaming=True)
        except Exception:  # any failure: try the prepared cache before giving up
            return ds.load_dataset(dataset_name, config or None, cache_dir=opts.cache_dir)

    def write(writer: CacheWriter, opts: _ReadOptions) -> dict[str, Any]:
        loaded = _call_datasets(name, load, local=False)
        return _write_dataset(writer, name, loaded, source=name, opts=opts)

    return _Source([f"hub:{name}:{where}"], write)


def _relative_entries(paths: Sequence[Path]) -> list[tuple[str, Path]]:
    """(posix path relative to the files' common folder, path), sorted by the relative path."""
    root = Path(os.path.commonpath([p.parent for p in paths]))
    return sorted((p.relative_to(root).as_posix(), p) for p in paths)


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as exc:
        raise UserError(f"--dataset: cannot read '{path}': {exc.strerror or exc}") from exc


def _call_datasets(name: str, load: Callable[[Any], Any], *, local: bool) -> Any:
    ds = import_datasets_offline()
    try:
        return load(ds)
    # datasets raises many unrelated types (ConnectionError, DatasetNotFoundError, ArrowInvalid, ...).
    except Exception as exc:
        if local:
            raise UserError(f"--dataset: cannot read {name!r}: {_one_line(exc)}") from exc
        raise UserError(
            f"--dataset: cannot load {name!r} (not a local path; no network or not cached): {_one_line(exc)}"
        ) from exc


def import_datasets_offline() -> Any:
    """Import `datasets` with the hub switched off unless the user explicitly switched it on.

    Both libraries read HF_HUB_OFFLINE when first imported, so if they already were, their
    module constants are set too; without this an unreachable hub costs ~23 s of retries per load.
    """
    allow_network = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("0", "false", "no")
    if not allow_network:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    import huggingface_hub.constants

    # Per-split progress bars would interleave with the node's one-line log.
    datasets.disable_progress_bars()
    if not allow_network:
        huggingface_hub.constants.HF_HUB_OFFLINE = True
        datasets.config.HF_HUB_OFFLINE = True
    return datasets


def stdlib_files(root: str | Path | None = None) -> list[tuple[str, Path]]:
    """Return (relative posix path, path) of the standard library's .py sources, sorted by path.

    Tests, site-packages/dist-packages, caches and build-specific files are left out.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    entries = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in STDLIB_EXCLUDED_DIRS and not d.startswith(STDLIB_EXCLUDED_PREFIXES)
        ]
        for filename in filenames:
            if filename.endswith(".py") and not filename.startswith(STDLIB_EXCLUDED_PREFIXES):
                path = Path(dirpath, filename)
                entries.append((path.relative_to(base).as_posix(), path))
    return sorted(entries)


# ---- text files -------------------------------------------------------------------------------------


def _stdlib_source(opts: _ReadOptions) -> _Source:
    root = Path(sysconfig.get_paths()["stdlib"])
    return _text_source(root, [rel for rel, _ in stdlib_files(root)], opts)


def _text_source(root: Path, rels: Sequence[str], opts: _ReadOptions) -> _Source:
    """The text files `root/rel` as documents, in the order of `rels` (sorted).

    Under a byte cap, files are taken in hash order of their paths (an unbiased sample) while they
    fit; empty files are left out. Only (path, size, mtime) is kept per file until it is read.
    """
    chosen: list[tuple[str, int, int]] = []
    for rel in rels:
        st = _stat(root / rel)
        if st.st_size > 0:
            chosen.append((rel, st.st_size, st.st_mtime_ns))
    if opts.max_bytes is not None:
        kept, total = set(), 0
        for rel, size, _ in sorted(chosen, key=lambda e: hash_hex(e[0])):
            if total + size <= opts.max_bytes:
                kept.add(rel)
                total += size
        chosen = [e for e in chosen if e[0] in kept]
    identity = itertools.chain(
        [f"text:{root.resolve()}"], (f"{rel}:{size}:{mtime}" for rel, size, mtime in chosen)
    )

    def write(writer: CacheWriter, opts: _ReadOptions) -> dict[str, Any]:
        sep = _separator(opts.tokenizer)
        groups: dict[str, int] = {}
        for rel, _, _ in chosen:
            group = groups.setdefault(_group_of(rel), len(groups))
            for name, data in _file_documents(rel, root / rel):
                tokens = np.concatenate([opts.tokenizer.encode_bytes(data).numpy(), sep])
                writer.add(
                    name=name,
                    key=name_key(name),
                    tokens=tokens,
                    nbytes=len(data),
                    group=group,
                    split=SPLIT_AUTO,
                )
        if not writer.num_docs:
            raise UserError("--dataset: no non-empty text files to train on")
        return {
            "groups": list(groups),
            "row_runs": [],
            "entries": [[rel, size] for rel, size, _ in chosen],
            "source_bytes": sum(size for _, size, _ in chosen),
        }

    return _Source(identity, write)


def _file_documents(rel: str, path: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the file's documents: the whole file, or its segments "rel@k" when large."""
    try:
        with path.open("rb") as f:
            if path.stat().st_size <= SEGMENT_BYTES:
                yield rel, f.read()
                return
            for k, segment in enumerate(_segments(f)):
                yield f"{rel}@{k}", segment
    except OSError as exc:
        raise UserError(f"--dataset: cannot read '{path}': {exc.strerror or exc}") from exc


def _segments(f: BinaryIO) -> Iterator[bytes]:
    """Blocks of at most SEGMENT_BYTES, cut after the last line end (else at a UTF-8 boundary)."""
    pending = b""
    while True:
        block = pending + f.read(SEGMENT_BYTES - len(pending))
        if len(block) < SEGMENT_BYTES:
            if block:
                yield block
            return
        cut = block.rfind(b"\n") + 1 or _utf8_boundary(block)
        yield block[:cut]
        pending = block[cut:]


def _utf8_boundary(block: bytes) -> int:
    """Where to cut `block` so that no UTF-8 character is split: before an incomplete last one."""
    for back in range(1, min(4, len(block)) + 1):
        byte = block[-back]
        if byte & 0xC0 != 0x80:  # ASCII or the lead byte of the last character
            need = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(block) if need <= back else (len(block) - back or len(block))
    return len(block)


# ---- data files and datasets -------------------------------------------------------------------------


def _write_dataset(
    writer: CacheWriter, name: str, loaded: Any, *, source: str, opts: _ReadOptions
) -> dict[str, Any]:
    """Every non-empty row of the training split (and of a validation split if there is one)."""
    train_split, val_split = _pick_splits(name, loaded)
    train_budget = opts.max_bytes
    val_budget = None if opts.max_bytes is None else int(opts.max_bytes * DEFAULT_VAL_PERCENT / 100)
    plan = [(train_split, train_budget, SPLIT_AUTO if val_split is None else SPLIT_TRAIN)]
    if val_split is not None:
        plan.append((val_split, val_budget, SPLIT_VAL))
    runs, entries = [], []
    try:
        for split, budget, flag in plan:
            first = writer.num_docs
            used = _write_rows(writer, loaded[split], split=split, budget=budget, flag=flag, opts=opts)
            runs.append([split, first, writer.num_docs - first])
            entries.append([f"{source}|{split}", used])
    except UserError:
        raise
    except Exception as exc:  # a parse error surfaces while iterating a stream
        raise UserError(f"--dataset: cannot read {name!r}: {_one_line(exc)}") from exc
    if not writer.num_docs:
        raise UserError(f"--dataset: {name!r} has no non-empty {opts.text_field!r} values")
    return {"groups": [], "row_runs": runs, "entries": entries, "source_bytes": sum(e[1] for e in entries)}


def _pick_splits(name: str, loaded: Any) -> tuple[str, str | None]:
    splits = list(loaded.keys())
    if not splits:
        raise UserError(f"--dataset: {name!r} has no splits")
    val_split = next((s for s in VALIDATION_SPLITS if s in splits), None)
    train_split = "train" if "train" in splits else next((s for s in splits if s != val_split), splits[0])
    if train_split == val_split:
        val_split = None
    return train_split, val_split


def _write_rows(
    writer: CacheWriter, rows: Any, *, split: str, budget: int | None, flag: int, opts: _ReadOptions
) -> int:
    """Append the split's non-empty rows in order, up to `budget` bytes of text; return the bytes used.

    A row's key is the hash of its text: the same row is held out on every peer whatever file it
    sits in, in whatever order the files come.
    """
    field_name = opts.text_field
    columns = rows.column_names  # None for a stream whose columns are not known before reading
    if columns is not None:
        if field_name not in columns:
            raise _no_column(field_name, split, columns)
        rows = rows.select_columns([field_name])
    sep = _separator(opts.tokenizer)
    index, total = 0, 0
    for batch in rows.iter(batch_size=ROW_BATCH):
        if field_name not in batch:
            raise _no_column(field_name, split, list(batch))
        for text in batch[field_name]:
            index += 1
            if not isinstance(text, str):
                raise UserError(f"--text-field: column {field_name!r} holds {type(text).__name__}, not text")
            data = text.encode("utf-8")
            if not data.strip():
                continue
            if budget is not None and total + len(data) > budget:
                return total
            total += len(data)
            tokens = np.concatenate([opts.tokenizer.encode_bytes(data).numpy(), sep])
            key = int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
            writer.add(
                name=f"{split}:{index - 1}", key=key, tokens=tokens, nbytes=len(data), group=-1, split=flag
            )
    return total


def _no_column(field_name: str, split: str, columns: Iterable[str]) -> UserError:
    return UserError(
        f"--text-field: no column {field_name!r} in split {split!r}; columns: {', '.join(columns)}"
    )


# ---- the split, from a cache -------------------------------------------------------------------------


def _corpus_from_cache(name: str, cache: TokenCache, *, val_percent: float) -> Corpus:
    """The corpus of an opened cache: every document's split decided from its key (vectorized)."""
    extra = cache.extra
    index = cache.records.read(0, cache.records.size)  # 41 bytes a document, only while this runs
    table = DocTable(
        np.array(index["start"], dtype=np.int64),
        np.array(index["length"], dtype=np.int64),
        np.array(index["key"], dtype=np.uint64),
        np.array(index["group"], dtype=np.int64),
        np.arange(index.size, dtype=np.int64),
    )
    groups = list(extra["groups"])
    for split, first, count in extra["row_runs"]:
        blocks = min(DATASET_GROUPS, count)
        table.group[first : first + count] = len(groups) + np.arange(count) * blocks // max(count, 1)
        groups += [f"{split}:{b:03d}" for b in range(blocks)]
    flags = np.asarray(index["split"])
    train, val = _split(table, flags, val_percent=val_percent)
    if extra["row_runs"]:
        # Rows have no stable position (files may be listed, split or ordered otherwise); files are
        # in path order already, as before, which keeps the default run's validation windows.
        val = val.by_key()
    entries = [(str(rel), int(size)) for rel, size in extra["entries"]]
    return Corpus(
        name,
        cache.tokens,
        train,
        val,
        corpus_fingerprint(entries, val_percent=val_percent),
        tuple(groups),
        cache.name,
        source_bytes=int(extra["source_bytes"]),
        cache_path=cache.path,
    )


def _split(table: DocTable, flags: npt.NDArray[np.uint8], *, val_percent: float) -> tuple[DocTable, DocTable]:
    """Validation iff the source says so, or, for the others, iff the key's bucket is below val_percent.

    With val_percent > 0 neither side is left empty by the hash rule: among too few documents, the
    lowest-key one is held out (or the highest-key one kept for training); a single document gives
    its tail to validation.
    """
    auto = flags == SPLIT_AUTO
    is_val = (flags == SPLIT_VAL) | (auto & (key_bucket(table.key) < val_percent))
    if val_percent > 0 and auto.any() and not (flags != SPLIT_AUTO).any():
        if len(table) == 1:
            return _split_tail(table, val_percent)
        if not is_val.any():
            is_val[np.argmin(table.key)] = True
        elif is_val.all():
            is_val[np.argmax(table.key)] = False
    return table.take(np.flatnonzero(~is_val)), table.take(np.flatnonzero(is_val))


def _split_tail(table: DocTable, val_percent: float) -> tuple[DocTable, DocTable]:
    length = int(table.length[0])
    cut = int(length * (1 - val_percent / 100))
    head = DocTable(table.start, np.array([cut], dtype=np.int64), table.key, table.group, table.record)
    tail = DocTable(table.start + cut, table.length - cut, table.key, table.group, table.record)
    return head, tail


def key_bucket(keys: npt.NDArray[np.uint64]) -> IntArray:
    """A bucket in [0, 100) per key: the first 4 bytes of the name's sha256, mod 100."""
    buckets: IntArray = ((keys >> np.uint64(32)) % np.uint64(100)).astype(np.int64)
    return buckets


def name_key(name: str) -> int:
    """The 64-bit key of a name: the first 8 bytes of its sha256, big-endian."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


def _separator(tokenizer: Tokenizer) -> npt.NDArray[Any]:
    return separator_tokens(tokenizer).numpy()


def separator_tokens(tokenizer: Tokenizer) -> torch.Tensor:
    """Return the ids appended to every document: the EOS token, or a blank line without one."""
    if tokenizer.eos_token_id is not None:
        return torch.tensor([tokenizer.eos_token_id], dtype=tokenizer.encode_bytes(b"").dtype)
    return tokenizer.encode_bytes(b"\n\n")


def corpus_fingerprint(entries: Iterable[tuple[str, int]], *, val_percent: float) -> str:
    """Return a sha256 hex digest over sorted (relative path, size) of the files used and the split."""
    digest = hashlib.sha256(f"val_percent={val_percent:g}".encode())
    for rel, size in sorted(entries):
        digest.update(f"|{rel}:{size}".encode())
    return digest.hexdigest()


def _group_of(rel: str) -> str:
    """Top-level package, or the module's stem for a top-level file ("email/utils.py" -> "email")."""
    head, sep, _ = rel.partition("/")
    return head if sep else Path(head).stem


def _walk(root: Path) -> list[str]:
    """Posix paths relative to `root` of the files under it, hidden files and folders left out, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        folder = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if folder == "." else f"{folder}/"
        found += [prefix + f for f in filenames if not f.startswith(".")]
    return sorted(found)


def _suffix(rel: str) -> str:
    return os.path.splitext(rel)[1].lower()


def hash_hex(text: str) -> str:
    """sha256 hex digest of a name: what every choice peers must agree on is derived from."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _one_line(exc: BaseException) -> str:
    """The message and, when it differs, the root cause's (datasets wraps parse errors generically)."""
    root = exc
    for _ in range(10):  # bounded: a __context__ chain may loop
        nxt = root.__cause__ or root.__context__
        if nxt is None:
            break
        root = nxt
    parts = [str(exc)] + ([f"{type(root).__name__}: {root}"] if root is not exc else [])
    text = " ".join(" - ".join(parts).split())
    return text[:400] or type(exc).__name__
