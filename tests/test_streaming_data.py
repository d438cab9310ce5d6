"""The token cache and lazy sampling (data/token_cache.py, corpus.py, streams.py, sampling.py).

Memory that does not grow with the corpus, no size cap, shards and validation that do not depend on
file order or on which build made the cache, corrupt caches rebuilt, large files read in segments.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from adloco.errors import UserError
from adloco.node.data import corpus as corpus_module
from adloco.node.data.corpus import SEGMENT_BYTES, Corpus, key_bucket, load_corpus, name_key
from adloco.node.data.sampling import (
    TokenSampler,
    restore_streams,
    shard_corpus,
    validation_batches,
)
from adloco.node.data.streams import TokenFile, TokenStream, digest
from adloco.node.data.token_cache import token_dtype
from adloco.node.data.tokenizer import ByteTokenizer

_WORDS = [chr(97 + i % 26) * (i % 7 + 1) + chr(97 + i * 7 % 26) for i in range(60)]
_pool = random.Random(42)
LINES = [" ".join(_pool.choices(_WORDS, k=_pool.randint(3, 12))) for _ in range(4096)]


def _text(rng: random.Random, nbytes: int) -> str:
    """Random lines of words, about `nbytes` long, newline-terminated."""
    lines, size = [], 0
    while size < nbytes:
        batch = rng.choices(LINES, k=max(1, (nbytes - size) // 40))
        lines += batch
        size += sum(len(line) + 1 for line in batch)
    return "\n".join(lines) + "\n"


def _write_tree(root: Path, *, files: int, file_bytes: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for i in range(files):
        path = root / f"pkg{i % 7}" / f"doc{i:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_text(rng, file_bytes))


def _rows(count: int, *, seed: int = 0, row_bytes: int = 300) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": f"row {i}: " + _text(rng, row_bytes), "id": i} for i in range(count)]


def _load(spec: Path | str, cache: Path, **kwargs: Any) -> Corpus:
    return load_corpus(str(spec), tokenizer=ByteTokenizer(), cache_dir=str(cache), **kwargs)


def _shard_digests(corpus: Corpus, peers: int = 2, instances: int = 2) -> list[str]:
    return [
        digest(
            [
                shard_corpus(
                    corpus, peer_index=p, num_peers=peers, instance_index=k, num_instances=instances, seed=5
                )
            ]
        )
        for p in range(peers)
        for k in range(instances)
    ]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- memory ----------------------------------------------------------------------------------------

# Runs in a fresh interpreter: imports first, then the peak RSS is reset (Linux clear_refs) and the
# corpus is loaded (the cache built): `build` is how far the peak rose above the RSS of then. Then a
# sampler draws batches from a shard: `sample_anon` and `sample_mapped` are how much its anonymous
# and file-backed resident memory grew (a memory-mapped cache would map in every page it touched).
PEAK_SCRIPT = """
import json, sys
import datasets  # noqa: F401  (imported before the measurement, like everything the loader needs)
from adloco.node.data.corpus import load_corpus
from adloco.node.data.sampling import shard_corpus, TokenSampler
from adloco.node.data.tokenizer import ByteTokenizer

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
corpus = load_corpus(sys.argv[1], tokenizer=ByteTokenizer(), cache_dir=sys.argv[2])
build = status("VmHWM") - before
shard = shard_corpus(corpus, peer_index=0, num_peers=2, instance_index=0, num_instances=1)
sampler = TokenSampler(shard, seq_len=128, seed=0)
sampler.next_batch(16)
anon, mapped = status("RssAnon"), status("RssFile")
for _ in range(200):
    sampler.next_batch(16)
tokens = corpus.num_train_tokens + corpus.num_val_tokens
grown = {"sample_anon": status("RssAnon") - anon, "sample_mapped": status("RssFile") - mapped}
print(json.dumps({"build": build, "tokens": tokens, **grown}))
"""


def _peak_growth(spec: Path, cache: Path) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(spec), str(cache)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_building_the_cache_takes_memory_independent_of_the_corpus_size(tmp_path: Path, kind: str) -> None:
    """A corpus 10x larger (50 MB instead of 5 MB) raises the peak RSS of a load by under 12 MB.

    The whole-read loader this replaced held the text and its tokens, 2 bytes or more per byte of
    corpus (up to its 24 MB cap). Sampling 200 batches from a shard adds no resident memory.
    """
    measured = {}
    for name, megabytes in (("small", 5), ("large", 50)):
        root = tmp_path / name
        root.mkdir()
        if kind == "text":
            _write_tree(root, files=megabytes * 50, file_bytes=20_000)
        else:
            rows = _rows(megabytes * 500, row_bytes=2_000)
            (root / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        measured[name] = _peak_growth(root, tmp_path / f"cache-{name}")
        assert measured[name]["tokens"] > megabytes * 0.95e6
        assert measured[name]["sample_anon"] < 2e6 and measured[name]["sample_mapped"] < 2e6, measured
    # Measured here: text +4.5 MB (per-file metadata), jsonl +7 MB; the old loader +40 and +95 MB.
    assert measured["large"]["build"] - measured["small"]["build"] < 12e6, measured


def test_no_size_cap_by_default_and_an_explicit_cap_still_applies(tmp_path: Path) -> None:
    # 30 files of 1 MB: more than the 24 MB the old loader stopped at.
    _write_tree(tmp_path / "big", files=30, file_bytes=1_000_000)
    total = sum(p.stat().st_size for p in (tmp_path / "big").rglob("*.txt"))
    corpus = _load(tmp_path / "big", tmp_path / "cache")
    assert corpus.source_bytes == total > 30e6
    assert corpus.num_train_tokens + corpus.num_val_tokens == total + 2 * 30  # + the separators
    capped = _load(tmp_path / "big", tmp_path / "cache", max_bytes=5_000_000)
    assert 4_000_000 < capped.source_bytes <= 5_000_000
    with pytest.raises(UserError, match="--max-corpus-mb"):
        _load(tmp_path / "big", tmp_path / "cache", max_bytes=0)


# ---- determinism and the split ---------------------------------------------------------------------


def test_two_builds_give_identical_caches_shards_and_validation(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", files=60, file_bytes=3_000)
    a, b = _load(tmp_path / "src", tmp_path / "c1"), _load(tmp_path / "src", tmp_path / "c2")
    assert a.cache_path is not None and b.cache_path is not None and a.cache_path != b.cache_path
    for name in ("tokens.bin", "index.bin", "names.bin"):
        assert _sha256(a.cache_path / name) == _sha256(b.cache_path / name)
    assert _shard_digests(a) == _shard_digests(b)
    batches = [validation_batches(c, seq_len=32, num_sequences=8) for c in (a, b)]
    assert torch.equal(*batches)


def test_rows_are_split_and_sharded_alike_whatever_files_hold_them(tmp_path: Path) -> None:
    """The same rows as 2 jsonl files, or shuffled into 3 parquet files named otherwise."""
    import pandas as pd  # type: ignore[import-untyped]  # no stubs (a dependency of datasets)

    rows = _rows(400)
    (tmp_path / "a").mkdir()
    for part in range(2):
        chunk = rows[part * 200 : (part + 1) * 200]
        (tmp_path / "a" / f"part{part}.jsonl").write_text("\n".join(json.dumps(r) for r in chunk))
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    (tmp_path / "b").mkdir()
    for part in range(3):
        pd.DataFrame(shuffled[part::3]).to_parquet(tmp_path / "b" / f"z{2 - part}.parquet")
    a, b = _load(tmp_path / "a", tmp_path / "cache"), _load(tmp_path / "b", tmp_path / "cache")
    assert sorted(a.val.key.tolist()) == sorted(b.val.key.tolist()) and len(a.val) > 5
    assert np.all(key_bucket(a.val.key) < 5) and np.all(key_bucket(a.train.key) >= 5)
    assert torch.equal(
        validation_batches(a, seq_len=32, num_sequences=8), validation_batches(b, seq_len=32, num_sequences=8)
    )
    assert _shard_digests(a) == _shard_digests(b)
    samplers = [
        TokenSampler(
            shard_corpus(c, peer_index=1, num_peers=2, instance_index=0, num_instances=1), seq_len=16, seed=3
        )
        for c in (a, b)
    ]
    assert torch.equal(samplers[0].next_batch(4), samplers[1].next_batch(4))


def test_text_files_written_in_another_order_elsewhere_give_the_same_shards(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", files=40, file_bytes=2_000)
    files = sorted((tmp_path / "src").rglob("*.txt"))
    for path in reversed(files):  # another creation order, another folder, other mtimes
        target = tmp_path / "copy" / path.relative_to(tmp_path / "src")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    a, b = _load(tmp_path / "src", tmp_path / "cache"), _load(tmp_path / "copy", tmp_path / "cache")
    assert a.cache_path != b.cache_path
    assert a.fingerprint == b.fingerprint
    assert _shard_digests(a) == _shard_digests(b)
    non_iid = [
        digest([shard_corpus(c, peer_index=1, num_peers=3, instance_index=0, num_instances=1, non_iid=True)])
        for c in (a, b)
    ]
    assert non_iid[0] == non_iid[1]


def test_a_documents_side_of_the_split_depends_on_its_name_alone(tmp_path: Path) -> None:
    _write_tree(tmp_path / "few", files=80, file_bytes=500)
    _write_tree(tmp_path / "many", files=200, file_bytes=500)  # the same 80 first files, and more
    few, many = _load(tmp_path / "few", tmp_path / "cache"), _load(tmp_path / "many", tmp_path / "cache")

    def val_names(c: Corpus) -> set[str]:
        return {c.names(int(r)) for r in c.val.record}

    names_few = {few.names(int(r)) for r in np.concatenate([few.train.record, few.val.record])}
    assert val_names(few) == val_names(many) & names_few
    assert all(key_bucket(np.array([name_key(n)], dtype=np.uint64))[0] < 5 for n in val_names(many))


# ---- the cache ------------------------------------------------------------------------------------


def test_the_cache_is_reused_until_the_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_tree(tmp_path / "src", files=10, file_bytes=1_000)
    first = _load(tmp_path / "src", tmp_path / "cache")

    def unreadable(*args: Any) -> Any:
        raise AssertionError("the source was read again")

    with monkeypatch.context() as m:
        m.setattr(corpus_module, "_file_documents", unreadable)
        again = _load(tmp_path / "src", tmp_path / "cache")
    assert again.cache_path == first.cache_path
    path = next((tmp_path / "src").rglob("*.txt"))
    path.write_text(path.read_text() + "one more line\n")
    changed = _load(tmp_path / "src", tmp_path / "cache")
    assert changed.cache_path != first.cache_path
    assert (
        changed.num_train_tokens + changed.num_val_tokens
        == first.num_train_tokens + first.num_val_tokens + 14
    )


@pytest.mark.parametrize(
    "damage", ["truncate tokens", "flip a token", "flip an index byte", "garble meta", "no meta"]
)
def test_a_corrupt_or_truncated_cache_is_rebuilt(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    _write_tree(tmp_path / "src", files=30, file_bytes=2_000)
    sources = {p: _sha256(p) for p in (tmp_path / "src").rglob("*.txt")}
    good = _load(tmp_path / "src", tmp_path / "cache")
    expected = (_shard_digests(good), validation_batches(good, seq_len=16, num_sequences=4))
    assert good.cache_path is not None
    target = {
        "truncate tokens": "tokens.bin",
        "flip a token": "tokens.bin",
        "flip an index byte": "index.bin",
        "garble meta": "meta.json",
        "no meta": "meta.json",
    }[damage]
    path = good.cache_path / target
    data = bytearray(path.read_bytes())
    if damage == "truncate tokens":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "no meta":
        path.unlink()  # a build that died before its last write
    else:
        data[len(data) // 3] ^= 0x20
        path.write_bytes(bytes(data))
    (tmp_path / "cache" / "tokens" / f"{good.cache_path.name}.tmp-999999").mkdir()  # a crashed build
    with caplog.at_level(logging.WARNING):
        rebuilt = _load(tmp_path / "src", tmp_path / "cache")
    assert "rebuilding it from the source" in caplog.text
    assert rebuilt.cache_path == good.cache_path
    assert _shard_digests(rebuilt) == expected[0]
    assert torch.equal(validation_batches(rebuilt, seq_len=16, num_sequences=4), expected[1])
    assert {p: _sha256(p) for p in sources} == sources  # the source is only ever read
    assert sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()) == [
        good.cache_path.name
    ]


def test_concurrent_loads_build_the_cache_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write_tree(tmp_path / "src", files=50, file_bytes=5_000)
    results: list[Corpus] = []
    with caplog.at_level(logging.INFO, logger="adloco.node.data.token_cache"):
        threads = [
            threading.Thread(target=lambda: results.append(_load(tmp_path / "src", tmp_path / "cache")))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert len(results) == 3
    assert caplog.text.count("built in") == 1
    assert len({_shard_digests(c)[0] for c in results}) == 1


def test_a_failed_build_leaves_no_cache(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in _rows(20)))
    with pytest.raises(UserError, match="--text-field"):
        _load(tmp_path / "rows.jsonl", tmp_path / "cache", text_field="body")
    assert not [p for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()]


# ---- reading ---------------------------------------------------------------------------------------


def test_a_large_text_file_is_read_in_segments_cut_at_line_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(corpus_module, "SEGMENT_BYTES", 1_000)
    text = _text(random.Random(0), 20_000)
    (tmp_path / "book.txt").write_text(text)
    corpus = _load(tmp_path / "book.txt", tmp_path / "cache")
    docs = sorted(
        (d for t in (corpus.train, corpus.val) for d in corpus.documents(t)),
        key=lambda d: int(d.name.rpartition("@")[2]),
    )
    assert len(docs) > 19 and all(d.name.startswith("book.txt@") for d in docs)
    assert len(corpus.val) and len(corpus.train)
    bodies = [ByteTokenizer().decode(d.tokens[:-2]) for d in docs]  # without the separator
    assert all(len(b.encode()) <= 1_000 and b.endswith("\n") for b in bodies[:-1])
    assert "".join(bodies) == text
    assert corpus_module.SEGMENT_BYTES != SEGMENT_BYTES  # the cache key covers the segment size


def test_segments_never_split_a_utf8_character(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(corpus_module, "SEGMENT_BYTES", 10)
    data = "aé€🙂" * 20  # no line ends at all: cut at character boundaries
    segments = list(corpus_module._segments(io.BytesIO(data.encode())))
    assert all(len(s) <= 10 for s in segments)
    assert "".join(s.decode("utf-8") for s in segments) == data


def test_data_rows_from_a_dataset_with_its_own_validation_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `datasets` name (faked: no hub here) is streamed, and its validation split is kept as such."""
    import datasets

    def fake_load_dataset(name: str, config: str | None, *, cache_dir: str | None, streaming: bool) -> Any:
        assert (name, config, streaming) == ("someone/corpus", "en", True)
        splits = {"train": _rows(50, seed=1), "validation": _rows(10, seed=2)}
        return datasets.IterableDatasetDict(
            {k: datasets.Dataset.from_list(v).to_iterable_dataset() for k, v in splits.items()}
        )

    class FakeDatasets:
        load_dataset = staticmethod(fake_load_dataset)

    monkeypatch.setattr(corpus_module, "import_datasets_offline", lambda: FakeDatasets)
    corpus = _load("someone/corpus:en", tmp_path / "cache")
    assert (len(corpus.train), len(corpus.val)) == (50, 10)
    assert {corpus.names(int(r)).partition(":")[0] for r in corpus.val.record} == {"validation"}


def test_token_dtype_is_the_smallest_that_holds_the_vocabulary() -> None:
    assert [token_dtype(v).itemsize for v in (256, 257, 65536, 65537, 200_000)] == [1, 2, 2, 4, 4]


def test_sampler_windows_are_the_streams_and_merged_streams_restore(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", files=40, file_bytes=3_000)
    corpus = _load(tmp_path / "src", tmp_path / "cache")
    shards = [
        shard_corpus(corpus, peer_index=0, num_peers=1, instance_index=k, num_instances=3) for k in range(3)
    ]
    assert all(isinstance(s.sources[0], TokenFile) for s in shards)
    sampler = TokenSampler(shards[0], seq_len=24, seed=0)
    whole = shards[0].to_tensor()
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, whole.numel() - 24 + 1, (6,), generator=generator)
    assert torch.equal(sampler.next_batch(6), whole[starts[:, None] + torch.arange(24)])
    fresh = [TokenSampler(s, seq_len=24, seed=k) for k, s in enumerate(shards)]
    merged = fresh[2].merged_with(fresh[0])
    assert len(merged.stream.sources) == 1  # the same token file, not a copy
    restored = restore_streams(fresh, [fresh[1].state_dict(), merged.state_dict()])
    assert restored[0] is fresh[1]
    assert digest([restored[1].stream]) == digest([shards[2], shards[0]])


def test_stream_slices_and_concatenation() -> None:
    base = np.arange(100, dtype=np.uint16)
    stream = TokenStream.of(base, np.array([50, 0, 10]), np.array([10, 5, 20]))
    expected = np.concatenate([base[50:60], base[0:5], base[10:30]])
    assert stream.num_tokens == 35 and np.array_equal(stream.to_tensor().numpy(), expected)
    assert np.array_equal(stream.slice(7, 31).to_tensor().numpy(), expected[7:31])
    assert stream.slice(5, 5).num_tokens == 0
    other = TokenStream.of_tensors([torch.arange(1000, 1003)])
    both = stream.concat(other).concat(stream)
    assert np.array_equal(both.to_tensor().numpy(), np.concatenate([expected, [1000, 1001, 1002], expected]))
    assert stream.dtype == "torch.uint16"
