"""The training corpus: loaded, tokenized and split by document into training and validation sets.

The embedded default corpus ("stdlib") is the Python standard library's own source, present on every
machine that runs the node: ~12 MB of code and docstrings in ~730 files, tests and site-packages
excluded. Local text files, local json/jsonl/parquet/csv files and cached `datasets` datasets are
also accepted; nothing is downloaded unless the user sets HF_HUB_OFFLINE=0 and HF_DATASETS_OFFLINE=0.
Every choice peers must agree on is a pure function of names, never of the machine (a file goes to
validation iff a hash of its relative path says so), and `Corpus.fingerprint` names exactly which
files were used, since peers on different Python versions see slightly different stdlib files.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ...errors import UserError
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "stdlib"
# All of the 3.11 stdlib without tests is ~12 MB and loads in well under a second; the cap only
# bounds large local or hub datasets, which are read whole into memory.
DEFAULT_MAX_BYTES = 24_000_000
DEFAULT_VAL_PERCENT = 5.0

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
VALIDATION_SPLITS = ("validation", "valid", "test")
# Rows of a dataset have no package to group by; contiguous blocks of rows stand in for it (datasets
# are often stored sorted by source), giving non-IID peers different regions of the dataset.
DATASET_GROUPS = 64


class Document(NamedTuple):
    """One source document: where it came from, its group for non-IID sharding, its token ids.

    `tokens` already ends with the document separator (the tokenizer's EOS, or a blank line for
    the byte tokenizer), so documents can be concatenated as they are.
    """

    name: str
    group: str
    tokens: torch.Tensor


@dataclass
class Corpus:
    """A tokenized corpus split by document into training and validation sets."""

    name: str
    train_docs: list[Document]
    val_docs: list[Document]
    fingerprint: str
    source_bytes: int = 0
    groups: list[str] = field(default_factory=list)

    @property
    def num_train_tokens(self) -> int:
        """Tokens in the training documents (separators included)."""
        return sum(int(doc.tokens.numel()) for doc in self.train_docs)

    @property
    def num_val_tokens(self) -> int:
        """Tokens in the validation documents (separators included)."""
        return sum(int(doc.tokens.numel()) for doc in self.val_docs)


def load_corpus(
    spec: str | None = None,
    *,
    tokenizer: Tokenizer,
    text_field: str = "text",
    max_bytes: int | None = None,
    val_percent: float = DEFAULT_VAL_PERCENT,
    cache_dir: str | None = None,
) -> Corpus:
    """Load, tokenize and split the corpus named by `spec`.

    Args:
        spec: None or "stdlib" for the embedded corpus; a local directory of text files; a local
            file or glob of text (.txt, .md, .py, ...) or data (.json, .jsonl, .parquet, .csv)
            files; otherwise the name of a `datasets` dataset already in the local cache, with an
            optional config as "name:config".
        tokenizer: turns each document's bytes into ids.
        text_field: the column holding the text in data files and datasets.
        max_bytes: stop adding documents past this many source bytes (default `DEFAULT_MAX_BYTES`).
        val_percent: share of documents (by hash of their name) held out for validation, 0 to 50.
        cache_dir: where `datasets` keeps its cache (its default when None).

    Raises:
        UserError: the corpus cannot be found or read, or holds no tokens.
    """
    if not 0 <= val_percent <= 50:
        raise UserError(f"--val-percent: must be between 0 and 50, got {val_percent}")
    budget = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if budget <= 0:
        raise UserError(f"--max-bytes: must be positive, got {budget}")
    name = spec or DEFAULT_CORPUS
    opts = _ReadOptions(tokenizer, text_field, budget, val_percent, cache_dir)
    corpus = (
        _corpus_from_files(name, stdlib_files(), opts) if name == DEFAULT_CORPUS else _load_named(name, opts)
    )
    if not corpus.train_docs:
        raise UserError(f"--dataset: {name!r} holds no text to train on")
    logger.info(
        "corpus %s: %d train docs (%d tokens), %d val docs (%d tokens)",
        name,
        len(corpus.train_docs),
        corpus.num_train_tokens,
        len(corpus.val_docs),
        corpus.num_val_tokens,
    )
    return corpus


@dataclass(frozen=True)
class _ReadOptions:
    tokenizer: Tokenizer
    text_field: str
    max_bytes: int
    val_percent: float
    cache_dir: str | None


def _load_named(name: str, opts: _ReadOptions) -> Corpus:
    path = Path(name).expanduser()
    if path.is_dir():
        return _load_directory(path, opts)
    if glob.has_magic(name):
        paths = [Path(p) for p in sorted(glob.glob(str(path))) if Path(p).is_file()]
    else:
        paths = [path] if path.exists() else []
    return _load_file_list(name, paths, opts) if paths else _load_hub(name, opts)


def _load_directory(root: Path, opts: _ReadOptions) -> Corpus:
    files = sorted(p for p in root.rglob("*") if p.is_file() and not _is_hidden(p.relative_to(root)))
    text_files = [p for p in files if p.suffix.lower() in TEXT_SUFFIXES]
    if text_files:
        return _corpus_from_files(str(root), _relative_entries(text_files), opts)
    data_files = [p for p in files if p.suffix.lower() in DATASET_BUILDERS]
    if not data_files:
        raise UserError(
            f"--dataset: directory '{root}' has no text ({', '.join(sorted(TEXT_SUFFIXES))}) or data "
            f"({', '.join(DATASET_BUILDERS)}) files"
        )
    return _load_file_list(str(root), data_files, opts)


def _load_file_list(name: str, paths: list[Path], opts: _ReadOptions) -> Corpus:
    suffixes = {p.suffix.lower() for p in paths}
    if suffixes <= TEXT_SUFFIXES:
        return _corpus_from_files(name, _relative_entries(paths), opts)
    builders = {DATASET_BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise UserError(
            f"--dataset: {name!r}: cannot mix or read file types {', '.join(sorted(suffixes))}; use text "
            f"files ({', '.join(sorted(TEXT_SUFFIXES))}) or one of {', '.join(DATASET_BUILDERS)}"
        )
    (builder,) = builders
    for p in paths:
        if p.stat().st_size == 0:
            raise UserError(f"--dataset: file '{p}' is empty")
    # Names relative to the files' common folder, so peers holding copies elsewhere agree.
    source = ";".join(f"{rel}:{p.stat().st_size}" for rel, p in _relative_entries(paths))
    files = [str(p) for p in paths]
    loaded = _call_datasets(
        name, lambda ds: ds.load_dataset(builder, data_files=files, cache_dir=opts.cache_dir), local=True
    )
    return _corpus_from_dataset(name, loaded, source=source, opts=opts)


def _load_hub(name: str, opts: _ReadOptions) -> Corpus:
    dataset_name, _, config = name.partition(":")
    loaded = _call_datasets(
        name, lambda ds: ds.load_dataset(dataset_name, config or None, cache_dir=opts.cache_dir), local=False
    )
    return _corpus_from_dataset(name, loaded, source=name, opts=opts)


def _relative_entries(paths: Sequence[Path]) -> list[tuple[str, Path]]:
    root = Path(os.path.commonpath([p.parent for p in paths]))
    return [(p.relative_to(root).as_posix(), p) for p in paths]


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


def _corpus_from_files(name: str, entries: Sequence[tuple[str, Path]], opts: _ReadOptions) -> Corpus:
    """Read files as documents. Under a byte cap, files are taken in hash order, an unbiased sample."""
    sep = separator_tokens(opts.tokenizer)
    chosen: list[tuple[str, bytes]] = []
    total = 0
    for rel, path in sorted(entries, key=lambda e: hash_hex(e[0])):
        data = _read_file(path)
        if data and total + len(data) <= opts.max_bytes:
            chosen.append((rel, data))
            total += len(data)
    chosen.sort()
    docs = [
        Document(rel, _group_of(rel), torch.cat([opts.tokenizer.encode_bytes(data), sep]))
        for rel, data in chosen
    ]
    train, val = _split(docs, val_percent=opts.val_percent)
    fingerprint = corpus_fingerprint([(rel, len(data)) for rel, data in chosen], val_percent=opts.val_percent)
    return Corpus(name, train, val, fingerprint, source_bytes=total, groups=sorted({d.group for d in docs}))


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UserError(f"--dataset: cannot read '{path}': {exc.strerror or exc}") from exc


def _corpus_from_dataset(name: str, loaded: Any, *, source: str, opts: _ReadOptions) -> Corpus:
    train_split, val_split = _pick_splits(name, loaded)
    train, train_bytes = _dataset_documents(
        loaded[train_split], split=train_split, opts=opts, max_bytes=opts.max_bytes
    )
    entries = [(f"{source}|{train_split}", train_bytes)]
    if val_split is not None:
        val_budget = int(opts.max_bytes * max(opts.val_percent, 1.0) / 100)
        val, val_bytes = _dataset_documents(
            loaded[val_split], split=val_split, opts=opts, max_bytes=val_budget
        )
        entries.append((f"{source}|{val_split}", val_bytes))
    else:
        train, val = _split(train, val_percent=opts.val_percent)
    if not train and not val:
        raise UserError(f"--dataset: {name!r} has no non-empty {opts.text_field!r} values")
    fingerprint = corpus_fingerprint(entries, val_percent=opts.val_percent)
    nbytes = sum(size for _, size in entries)
    groups = sorted({d.group for d in train + val})
    return Corpus(name, train, val, fingerprint, source_bytes=nbytes, groups=groups)


def _pick_splits(name: str, loaded: Any) -> tuple[str, str | None]:
    splits = list(loaded.keys())
    if not splits:
        raise UserError(f"--dataset: {name!r} has no splits")
    val_split = next((s for s in VALIDATION_SPLITS if s in splits), None)
    train_split = "train" if "train" in splits else next((s for s in splits if s != val_split), splits[0])
    if train_split == val_split:
        val_split = None
    return train_split, val_split


def _dataset_documents(
    rows: datasets.Dataset, *, split: str, opts: _ReadOptions, max_bytes: int
) -> tuple[list[Document], int]:
    """Non-empty rows as documents, in row order, up to `max_bytes` of text; also the bytes used."""
    field_name = opts.text_field
    if field_name not in rows.column_names:
        raise UserError(
            f"--text-field: no column {field_name!r} in split {split!r}; "
            f"columns: {', '.join(rows.column_names)}"
        )
    sep = separator_tokens(opts.tokenizer)
    block = max(1, -(-len(rows) // DATASET_GROUPS))
    docs, total = [], 0
    for index, text in enumerate(rows[field_name]):
        if not isinstance(text, str):
            raise UserError(f"--text-field: column {field_name!r} holds {type(text).__name__}, not text")
        data = text.encode("utf-8")
        if not data.strip():
            continue
        if total + len(data) > max_bytes:
            break
        total += len(data)
        tokens = torch.cat([opts.tokenizer.encode_bytes(data), sep])
        docs.append(Document(f"{split}:{index}", f"{split}:{index // block:03d}", tokens))
    return docs, total


def _split(docs: list[Document], *, val_percent: float) -> tuple[list[Document], list[Document]]:
    """Validation iff the hash bucket of the document's name is below val_percent.

    With val_percent > 0 neither side is left empty: among too few documents for the rule, the
    lowest-hash one is held out (or the highest-hash one kept for training); a single document
    gives its tail to validation.
    """
    train = [d for d in docs if _hash_bucket(d.name) >= val_percent]
    val = [d for d in docs if _hash_bucket(d.name) < val_percent]
    if val_percent <= 0 or not docs or (train and val):
        return train, val
    if len(docs) == 1:
        (doc,) = docs
        cut = int(doc.tokens.numel() * (1 - val_percent / 100))
        return [doc._replace(tokens=doc.tokens[:cut])], [
            doc._replace(name=f"{doc.name}#val", tokens=doc.tokens[cut:])
        ]
    ranked = sorted(docs, key=lambda d: hash_hex(d.name))
    if not val:
        return [d for d in docs if d is not ranked[0]], [ranked[0]]
    return [ranked[-1]], [d for d in docs if d is not ranked[-1]]


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


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def hash_hex(text: str) -> str:
    """sha256 hex digest of a name: what every choice peers must agree on is derived from."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _hash_bucket(text: str) -> int:
    """A bucket in [0, 100) from the name alone, the same on every machine and Python version."""
    return int(hash_hex(text)[:8], 16) % 100


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
