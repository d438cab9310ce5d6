"""`adloco-node tokenizer` and `adloco-node export`: a run owner's offline tools, no networking.

    adloco-node tokenizer --dataset data/ --vocab-size 8192 --out tok.json
    adloco-node export --checkpoint-dir /data/ckpt --out hf-model

`tokenizer` trains a byte-level BPE tokenizer on the training documents of the corpus the same
corpus flags give a node (`--dataset`, `--text-field`, `--max-corpus-mb`; the validation documents
are left out) and writes its tokenizer.json, for every node's `--tokenizer`. `export` writes the θ of
the newest usable checkpoint as a Hugging Face folder (node/model/export.py). Bad input ends with
one line naming the option and exit code 2, as for the node.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...errors import UserError
from ..data.corpus import Corpus
from ..data.tokenizer import check_bpe_settings, load_tokenizer, train_bpe
from ..model.export import check_exportable, describe, export_pretrained
from ..operations.checkpoint import load_checkpoint
from ..training.config import TrainConfig
from ..training.runtime import load_data, offline_hub
from .options import config_error, finite_float

DEFAULT_VOCAB_SIZE = 8192


def tokenizer_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adloco-node tokenizer",
        description="Train a byte-level BPE tokenizer on the run's corpus and write its tokenizer.json"
        " (for --tokenizer). The corpus flags are the node's; only training documents are used.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dataset", default=None, help="local files or datasets name (default: embedded corpus)")
    p.add_argument("--text-field", default="text", help="text column of a json/parquet/datasets source")
    p.add_argument("--max-corpus-mb", type=finite_float, default=None, help="cap on the corpus read")
    p.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="tokens, EOS and the 256 bytes included"
    )
    p.add_argument("--min-frequency", type=int, default=2, help="merge only pairs seen this often")
    p.add_argument("--out", type=Path, required=True, help="the tokenizer.json to write")
    return p


def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adloco-node export",
        description="Write θ of the newest usable checkpoint as a Hugging Face folder (config.json,"
        " model.safetensors, tokenizer files) that AutoModelForCausalLM.from_pretrained loads.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint-dir", type=Path, required=True, help="a node's --checkpoint-dir")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (new or empty)")
    return p


def tokenizer_main(argv: list[str]) -> int:
    """`adloco-node tokenizer ...`; returns the exit status."""
    args = tokenizer_parser().parse_args(argv)
    return _guarded("adloco-node tokenizer", lambda: make_tokenizer(args))


def export_main(argv: list[str]) -> int:
    """`adloco-node export ...`; returns the exit status."""
    args = export_parser().parse_args(argv)
    return _guarded("adloco-node export", lambda: export_checkpoint(args.checkpoint_dir, args.out))


def _guarded(prog: str, work: Callable[[], str]) -> int:
    """Run `work` and print its line; a UserError is one line and exit code 2, as for the node."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        print(f"{prog}: {work()}", flush=True)
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0


def make_tokenizer(args: argparse.Namespace) -> str:
    """Train the tokenizer the flags describe, write it, and say what was written."""
    check_bpe_settings(vocab_size=args.vocab_size, min_frequency=args.min_frequency)
    _check_writable_file(args.out)
    try:
        cfg = TrainConfig(dataset=args.dataset, text_field=args.text_field, max_corpus_mb=args.max_corpus_mb)
    except ValueError as e:
        raise config_error(e, args) from None
    t0 = time.perf_counter()
    corpus, _ = load_data(cfg)  # the byte tokenizer: each document's tokens are its bytes
    text = train_bpe(corpus_texts(corpus), vocab_size=args.vocab_size, min_frequency=args.min_frequency)
    tmp = args.out.with_name(f".{args.out.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, args.out)
    tokenizer = load_tokenizer(str(args.out))
    sample = b"".join(doc.tokens.numpy().tobytes() for doc in corpus.documents(corpus.val))
    ids = len(tokenizer.encode_bytes(sample))
    ratio = f"; {len(sample) / ids:.2f} bytes per token on the validation text" if ids else ""
    return (
        f"wrote {args.out}: {tokenizer.vocab_size} tokens (byte-level BPE on {len(corpus.train)}"
        f" documents, {time.perf_counter() - t0:.0f}s{ratio}); use it with --tokenizer {args.out}"
    )


def corpus_texts(corpus: Corpus) -> Iterator[str]:
    """The text of each training document of a corpus loaded with the byte tokenizer, in order."""
    for doc in corpus.documents(corpus.train):
        yield doc.tokens.numpy().tobytes().decode("utf-8", errors="replace")


def _check_writable_file(out: Path) -> None:
    """Fail before the corpus is read if `out` cannot be written (a folder, no permission)."""
    if out.is_dir():
        raise UserError(f"--out: {out} is a folder; give the tokenizer.json file to write")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise UserError(f"--out: cannot write {out}: {e.strerror or e}") from None


def export_checkpoint(checkpoint_dir: Path, out: Path) -> str:
    """Export the newest usable checkpoint in `checkpoint_dir` to `out`; say what was written."""
    if not checkpoint_dir.is_dir():
        raise UserError(f"--checkpoint-dir: {checkpoint_dir} is not a folder")
    offline_hub()
    taken: dict[str, Any] = {}

    def take(state: dict[str, Any]) -> None:
        check_exportable(state)  # ValueError: corrupt, so load_checkpoint tries the previous one
        taken.update(state)

    if load_checkpoint(checkpoint_dir, take) is None:
        raise UserError(f"--checkpoint-dir: no usable checkpoint in {checkpoint_dir}")
    try:
        info = export_pretrained(taken, out)
    except ValueError as e:
        raise UserError(f"--checkpoint-dir: cannot export the checkpoint: {e}") from None
    return describe(info, out)
