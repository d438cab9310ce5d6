"""Data benchmark: building the token cache and sampling from it, on a generated corpus of any size.

Generates a corpus (a tree of text files, or jsonl rows) of `--mb` megabytes of random word lines,
then measures, each step in a fresh interpreter so the memory figures are its own:

- build: `load_corpus` on a cold cache (read, tokenize, write, verify): seconds, source MB/s,
  tokens/s, and how far the peak RSS rose above the RSS after imports (Linux VmHWM, reset with
  /proc/self/clear_refs);
- open: `load_corpus` again on the warm cache (stat the source, verify every file's sha256, map);
- sample: one (peer, instance) shard of `--peers` x `--instances`, `--batches` batches of
  `--batch-size` x `--seq-len` from a `TokenSampler`: batches/s and tokens/s, the anonymous RSS
  added (RssAnon) and the file-backed pages of the map it touched (RssFile: reclaimable page cache);
  then the shard's checkpoint digest (`state_dict`, reads the shard once).

Tokenizer: `bytes` (the default, uint8 ids) or `bpe` (a byte-level BPE trained here on 2 MB of the
corpus, vocabulary `--bpe-vocab`, uint16 ids; needs the `tokenizers` package transformers brings).
Run from the repository root:

    python bench/data.py                                   # 200 MB text tree, bytes, ~1 min here
    python bench/data.py --kind jsonl --mb 200
    python bench/data.py --tokenizer bpe --mb 50
    python bench/data.py --out bench/results/data.json --work /tmp/adloco-data-bench
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

Row = dict[str, Any]

WORDS = [chr(97 + i % 26) * (i % 7 + 1) + chr(97 + i * 7 % 26) for i in range(200)]
FILE_BYTES = 100_000
ROW_BYTES = 2_000


# ---- the corpus --------------------------------------------------------------------------------------


def generate(root: Path, *, kind: str, megabytes: float, seed: int = 0) -> int:
    """Write the corpus under `root`; return its size in bytes."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 14))) for _ in range(20_000)]
    total, target = 0, int(megabytes * 1e6)
    root.mkdir(parents=True, exist_ok=True)
    if kind == "text":
        i = 0
        while total < target:
            path = root / f"pkg{i % 37:02d}" / f"doc{i:06d}.txt"
            path.parent.mkdir(exist_ok=True)
            text = "\n".join(rng.choices(lines, k=FILE_BYTES // 40)) + "\n"
            path.write_text(text)
            total += len(text)
            i += 1
        return total
    with (root / "rows.jsonl").open("w") as f:
        i = 0
        while total < target:
            text = f"row {i}: " + "\n".join(rng.choices(lines, k=ROW_BYTES // 40))
            f.write(json.dumps({"text": text, "id": i}) + "\n")
            total += len(text)
            i += 1
    return total


def train_bpe(root: Path, out: Path, *, vocab: int) -> Path:
    """A byte-level BPE tokenizer.json trained on the first ~2 MB of the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, size = [], 0
    for path in sorted(root.rglob("*")):
        if path.is_file():
            text = path.read_text()[:2_000_000]
            sample.append(text)
            size += len(text)
            if size >= 2_000_000:
                break
    raw = Tokenizer(models.BPE(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(sample, trainer)
    raw.save(str(out))
    return out


# ---- the measured steps (each in its own interpreter) ------------------------------------------------

CHILD = """
import json, sys, time
args = json.loads(sys.argv[1])
import datasets  # noqa: F401 (imported before the measurement, like all the loader needs)
from adloco.node.data.corpus import load_corpus
from adloco.node.data.sampling import TokenSampler, shard_corpus
from adloco.node.data.tokenizer import load_tokenizer

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

tok = load_tokenizer(args["tokenizer"])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
rss0, anon0, file0 = status("VmRSS"), status("RssAnon"), status("RssFile")
start = time.perf_counter()
corpus = load_corpus(args["spec"], tokenizer=tok, cache_dir=args["cache"])
seconds = time.perf_counter() - start
out = {
    "seconds": seconds,
    "tokens": corpus.num_train_tokens + corpus.num_val_tokens,
    "docs": len(corpus.train) + len(corpus.val),
    "source_bytes": corpus.source_bytes,
    "dtype": str(corpus.tokens.dtype),
    "peak_rss_growth": status("VmHWM") - rss0,
}
if args["sample"]:
    shard = shard_corpus(corpus, peer_index=0, num_peers=args["peers"], instance_index=0,
                         num_instances=args["instances"])
    sampler = TokenSampler(shard, seq_len=args["seq_len"], seed=0)
    sampler.next_batch(args["batch_size"])
    anon, file = status("RssAnon"), status("RssFile")
    start = time.perf_counter()
    for _ in range(args["batches"]):
        sampler.next_batch(args["batch_size"])
    sample_s = time.perf_counter() - start
    out.update(
        shard_tokens=shard.num_tokens,
        shard_pieces=int(shard.length.size),
        sample_s=sample_s,
        batches_per_s=args["batches"] / sample_s,
        sample_tokens_per_s=args["batches"] * args["batch_size"] * args["seq_len"] / sample_s,
        sample_anon_growth=status("RssAnon") - anon,
        sample_file_growth=status("RssFile") - file,
    )
    start = time.perf_counter()
    sampler.state_dict()
    out["digest_s"] = time.perf_counter() - start
out["rss_anon_end"] = status("RssAnon")
out["peak_rss_growth_all"] = status("VmHWM") - rss0
print(json.dumps(out))
"""


def child(**args: Any) -> Row:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=3600
    )
    if result.returncode:
        raise SystemExit(f"the measuring child failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def run(args: argparse.Namespace, work: Path) -> Row:
    data = work / f"{args.kind}-{args.mb:g}mb"
    start = time.perf_counter()
    nbytes = generate(data, kind=args.kind, megabytes=args.mb)
    generate_s = time.perf_counter() - start
    tokenizer = "bytes"
    if args.tokenizer == "bpe":
        tokenizer = str(train_bpe(data, work / "tokenizer.json", vocab=args.bpe_vocab))
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    common = {"spec": str(data), "cache": str(cache), "tokenizer": tokenizer}
    sampling = {
        "peers": args.peers,
        "instances": args.instances,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "batches": args.batches,
    }
    build = child(**common, sample=False, **sampling)
    warm = child(**common, sample=True, **sampling)
    cache_bytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    return {
        "kind": args.kind,
        "tokenizer": args.tokenizer,
        "corpus_mb": nbytes / 1e6,
        "generate_s": generate_s,
        "cache_mb": cache_bytes / 1e6,
        "sampling": sampling,
        "build": build,
        "open_and_sample": warm,
    }


def report(row: Row) -> str:
    b, w, s = row["build"], row["open_and_sample"], row["sampling"]
    mb = row["corpus_mb"]
    lines = [
        f"corpus: {row['kind']}, {mb:.0f} MB, {b['docs']} documents, tokenizer {row['tokenizer']}"
        f" ({b['dtype']} ids), {b['tokens'] / 1e6:.1f}M tokens, cache {row['cache_mb']:.0f} MB",
        "",
        "| step | seconds | throughput | peak RSS growth |",
        "|---|---|---|---|",
        f"| build the cache (cold) | {b['seconds']:.1f} | {mb / b['seconds']:.1f} MB/s,"
        f" {b['tokens'] / b['seconds'] / 1e6:.2f}M tokens/s | {b['peak_rss_growth'] / 1e6:.1f} MB |",
        f"| open the cache (warm, verified) | {w['seconds']:.2f} | {mb / w['seconds']:.0f} MB/s verified"
        f" | {w['peak_rss_growth'] / 1e6:.1f} MB |",
        f"| sample {s['batches']} batches {s['batch_size']}x{s['seq_len']} from shard 1 of"
        f" {s['peers'] * s['instances']} ({w['shard_tokens'] / 1e6:.1f}M tokens, {w['shard_pieces']} pieces)"
        f" | {w['sample_s']:.2f} | {w['batches_per_s']:.0f} batches/s, {w['sample_tokens_per_s'] / 1e6:.1f}M"
        f" tokens/s | anon +{w['sample_anon_growth'] / 1e6:.1f} MB, mapped file +"
        f"{w['sample_file_growth'] / 1e6:.1f} MB |",
        f"| shard digest (checkpoint) | {w['digest_s']:.2f} |"
        f" {w['shard_tokens'] / w['digest_s'] / 1e6:.0f}M tokens/s | |",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=["text", "jsonl"], default="text")
    p.add_argument("--mb", type=float, default=200.0, help="corpus size to generate (MB of text)")
    p.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes")
    p.add_argument("--bpe-vocab", type=int, default=8192)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument(
        "--work", type=Path, default=None, help="folder for the corpus and cache (kept; default: temp)"
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir's corpus and cache")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="adloco-data-bench-"))
    try:
        row = run(args, work)
    finally:
        if args.work is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(report(row))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
