"""Corpus loading and splitting (data/corpus.py), sharding and sampling (sampling.py), tokenizers."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from adloco.errors import UserError
from adloco.node.data.corpus import Corpus, DocTable, Document, load_corpus, stdlib_files
from adloco.node.data.sampling import (
    TokenSampler,
    corpus_stream,
    restore_streams,
    shard_corpus,
    shard_documents,
    validation_batches,
)
from adloco.node.data.streams import TokenFile, TokenStream, digest
from adloco.node.data.token_cache import token_dtype
from adloco.node.data.tokenizer import ByteTokenizer, load_tokenizer

ROWS = [{"text": f"row {i}: " + "the quick brown fox " * (i % 5 + 1), "id": i} for i in range(120)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return load_corpus(None, tokenizer=ByteTokenizer(), cache_dir=str(tmp_path_factory.mktemp("cache")))


def _small_corpus(sizes: list[int], groups: list[str] | None = None) -> Corpus:
    groups = groups or [f"g{i}" for i in range(len(sizes))]
    docs = [
        Document(f"d{i}.py", g, torch.full((n,), i % 256, dtype=torch.uint8))
        for i, (n, g) in enumerate(zip(sizes, groups, strict=True))
    ]
    return Corpus.from_documents("small", docs, [], fingerprint="fp")


def _all_shards(
    corpus: Corpus, peers: int, instances: int, *, non_iid: bool
) -> dict[tuple[int, int], TokenStream]:
    return {
        (p, k): shard_corpus(
            corpus,
            peer_index=p,
            num_peers=peers,
            instance_index=k,
            num_instances=instances,
            non_iid=non_iid,
            seed=3,
        )
        for p in range(peers)
        for k in range(instances)
    }


def _shard_docs(
    corpus: Corpus, peers: int, instances: int, *, non_iid: bool, seed: int = 3
) -> list[DocTable]:
    """The documents of every (peer, instance) shard, peer-major; none may be a cut of documents."""
    tables = [
        shard_documents(
            corpus,
            peer_index=p,
            num_peers=peers,
            instance_index=k,
            num_instances=instances,
            non_iid=non_iid,
            seed=seed,
        )
        for p in range(peers)
        for k in range(instances)
    ]
    assert all(t is not None for t in tables)
    return [t for t in tables if t is not None]


def _names(corpus: Corpus, table: DocTable) -> list[str]:
    return [corpus.names(int(r)) for r in table.record]


def _first_doc(corpus: Corpus) -> Document:
    return next(corpus.documents(corpus.train))


# ---- tokenizer ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld — 🙂\n"
    assert tok.vocab_size == 256
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_bytes(text.encode()).tolist() == tok.encode(text)
    assert tok.decode(torch.tensor([0xFF, 0x41])) == "\ufffdA"


def test_load_tokenizer_default_and_errors(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    with pytest.raises(UserError, match="--tokenizer"):
        load_tokenizer("gpt2-from-the-hub")
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(UserError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "broken.json"))


def test_local_tokenizer_json_loads_a_corpus(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        [r["text"] for r in ROWS], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"])
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.decode(tok.encode("the quick fox")).strip() == "the quick fox"
    (tmp_path / "doc.txt").write_text("the quick brown fox\n" * 200)
    corpus = load_corpus(str(tmp_path / "doc.txt"), tokenizer=tok, cache_dir=str(tmp_path / "cache"))
    assert corpus.tokens.dtype == token_dtype(tok.vocab_size)  # the smallest that holds the vocabulary
    assert int(_first_doc(corpus).tokens.max()) < tok.vocab_size


# ---- the embedded corpus ------------------------------------------------------------------------


def test_default_corpus_is_the_stdlib_without_tests(corpus: Corpus) -> None:
    assert corpus.name == "stdlib"
    assert corpus.num_train_tokens > 2_000_000
    assert len(corpus.train) > 100 and len(corpus.val) > 5
    names = _names(corpus, corpus.train) + _names(corpus, corpus.val)
    assert not any(
        part in {"test", "tests", "site-packages", "__pycache__"} for n in names for part in n.split("/")
    )
    assert not any(n.startswith("_sysconfigdata") for n in names)
    assert {"email", "json", "asyncio", "argparse"} <= set(corpus.groups)
    doc = next(
        d for t in (corpus.train, corpus.val) for d in corpus.documents(t) if d.name == "json/decoder.py"
    )
    assert doc.group == "json"
    assert isinstance(corpus.tokens, TokenFile)  # read from the token cache, not held in memory


def test_default_corpus_loads_deterministically(corpus: Corpus, tmp_path: Path) -> None:
    again = load_corpus("stdlib", tokenizer=ByteTokenizer(), cache_dir=str(tmp_path))  # a second build
    assert again.fingerprint == corpus.fingerprint
    assert _names(again, again.val) == _names(corpus, corpus.val)
    assert digest([corpus_stream(again, again.train)]) == digest([corpus_stream(corpus, corpus.train)])


def test_validation_split_is_a_hash_of_the_path(corpus: Corpus) -> None:
    import hashlib

    def bucket(name: str) -> int:
        return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100

    assert all(bucket(n) < 5 for n in _names(corpus, corpus.val))
    assert all(bucket(n) >= 5 for n in _names(corpus, corpus.train))
    share = corpus.num_val_tokens / (corpus.num_train_tokens + corpus.num_val_tokens)
    assert 0.01 < share < 0.15


def test_max_bytes_and_val_percent_change_the_fingerprint(corpus: Corpus) -> None:
    cache = str(corpus.cache_path.parents[1]) if corpus.cache_path else None
    capped = load_corpus(None, tokenizer=ByteTokenizer(), max_bytes=1_000_000, cache_dir=cache)
    assert 900_000 < capped.source_bytes <= 1_000_000
    assert capped.fingerprint != corpus.fingerprint
    ten = load_corpus(None, tokenizer=ByteTokenizer(), val_percent=10, cache_dir=cache)
    assert ten.fingerprint != corpus.fingerprint
    assert ten.cache_path == corpus.cache_path  # the split is decided when the cache is opened
    assert set(_names(corpus, corpus.val)) < set(_names(ten, ten.val))


def test_stdlib_files_are_sorted_relative_paths() -> None:
    files = stdlib_files()
    rels = [rel for rel, _ in files]
    assert rels == sorted(rels) and all(not Path(rel).is_absolute() for rel in rels)


# ---- sharding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("non_iid", [False, True])
def test_shards_are_disjoint_and_cover_the_train_set(corpus: Corpus, non_iid: bool) -> None:
    tables = _shard_docs(corpus, 3, 2, non_iid=non_iid)
    records = np.concatenate([t.record for t in tables])
    assert all(len(t) for t in tables)
    assert len(records) == len(set(records.tolist())) == len(corpus.train)
    assert set(records.tolist()) == set(corpus.train.record.tolist())
    shards = _all_shards(corpus, 3, 2, non_iid=non_iid)
    assert sum(s.num_tokens for s in shards.values()) == corpus.num_train_tokens
    # Each stream is its documents' tokens, in the order of the table.
    table, stream = tables[1], shards[(0, 1)]
    assert digest([stream]) == digest([corpus_stream(corpus, table)])
    assert isinstance(stream.sources[0], TokenFile)


def test_non_iid_peers_get_different_groups(corpus: Corpus) -> None:
    tables = _shard_docs(corpus, 4, 2, non_iid=True)
    groups = [{int(g) for k in range(2) for g in tables[p * 2 + k].group} for p in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not groups[i] & groups[j]
    sizes = [tables[p * 2].num_tokens + tables[p * 2 + 1].num_tokens for p in range(4)]
    assert max(sizes) < 1.5 * min(sizes)


def test_iid_shards_mix_groups_balance_tokens_and_depend_on_seed(corpus: Corpus) -> None:
    (a, _) = _shard_docs(corpus, 2, 1, non_iid=False, seed=0)
    (b, _) = _shard_docs(corpus, 2, 1, non_iid=False, seed=1)
    assert len(set(a.group.tolist())) > 50
    assert set(a.record.tolist()) != set(b.record.tolist())
    sizes = [t.num_tokens for t in _shard_docs(corpus, 3, 2, non_iid=False)]
    assert max(sizes) - min(sizes) <= 2 * int(corpus.train.length.max())


@pytest.mark.parametrize("non_iid", [False, True])
def test_too_few_documents_fall_back_to_contiguous_tokens(non_iid: bool) -> None:
    small = _small_corpus([1000, 10], groups=["a", "a"])
    shards = _all_shards(small, 2, 2, non_iid=non_iid)
    assert all(s.num_tokens > 0 for s in shards.values())
    assert sum(s.num_tokens for s in shards.values()) == 1010
    whole = torch.cat([s.to_tensor() for s in shards.values()])
    assert sorted(whole.tolist()) == [0] * 1000 + [1] * 10


def test_shard_index_out_of_range() -> None:
    with pytest.raises(ValueError):
        shard_corpus(_small_corpus([10]), peer_index=2, num_peers=2, instance_index=0, num_instances=1)


# ---- sampling and validation ---------------------------------------------------------------------


def test_sampler_is_deterministic_and_well_shaped() -> None:
    docs = [torch.arange(0, 200, dtype=torch.int32), torch.arange(200, 500, dtype=torch.int32)]
    a, b = (TokenSampler(docs, seq_len=16, seed=7) for _ in range(2))
    x = a.next_batch(8)
    assert x.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x, b.next_batch(8))
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(8, 15, dtype=torch.int64))  # windows of the stream
    assert not torch.equal(TokenSampler(docs, seq_len=16, seed=8).next_batch(8), x)
    state = a.get_state()
    y = a.next_batch(4)
    a.set_state(state)
    assert torch.equal(a.next_batch(4), y)
    merged = a.merged_with(TokenSampler([torch.arange(500, 600)], seq_len=16, seed=0))
    assert merged.num_tokens == 600


def test_sampler_state_dict_continues_the_sequence_and_names_its_stream() -> None:
    a = TokenSampler([torch.arange(300)], seq_len=16, seed=3)
    a.next_batch(2)
    state = a.state_dict()
    assert state["stream"]["tokens"] == 300 and torch.equal(state["stream"]["probe"], torch.arange(300))
    b = TokenSampler([torch.arange(300)], seq_len=16, seed=4)
    b.load_state_dict(state)
    assert torch.equal(b.next_batch(4), a.next_batch(4))
    with pytest.raises(ValueError):
        b.load_state_dict({"rng": torch.zeros(3, dtype=torch.uint8)})
    with pytest.raises(ValueError):
        b.load_state_dict({})


def test_restore_streams_rebuilds_merged_streams_or_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    fresh = [
        TokenSampler([torch.arange(k * 100, k * 100 + 50 + 10 * k)], seq_len=8, seed=k) for k in range(3)
    ]
    merged = fresh[2].merged_with(fresh[0])  # slot 0 merged into slot 2
    restored = restore_streams(fresh, [fresh[1].state_dict(), merged.state_dict()])
    assert restored[0] is fresh[1]
    assert torch.equal(
        restored[1].stream.to_tensor(), torch.cat([fresh[2].stream.to_tensor(), fresh[0].stream.to_tensor()])
    )
    assert not caplog.records
    other = [TokenSampler([torch.arange(1000, 1000 + 60 + k)], seq_len=8, seed=k) for k in range(3)]
    with caplog.at_level(logging.WARNING):
        restored = restore_streams(other, [fresh[1].state_dict(), merged.state_dict()])
    assert "do not match this node's data shards" in caplog.text
    # The two smallest merge, the smaller absorbed, as a state download merges instances.
    assert [s.num_tokens for s in restored] == [61 + 60, 62]
    with pytest.raises(ValueError):
        restore_streams(fresh, [{"stream": {"tokens": "many"}}])


def test_sequence_longer_than_shard_is_a_user_error() -> None:
    with pytest.raises(UserError, match="--seq-len"):
        TokenSampler([torch.arange(10)], seq_len=64, seed=0)
    with pytest.raises(UserError, match="--seq-len"):
        TokenSampler([], seq_len=8, seed=0)


def test_validation_batches_are_fixed(corpus: Corpus) -> None:
    v = validation_batches(corpus, seq_len=64, num_sequences=12)
    assert v.shape == (12, 64) and v.dtype == torch.int64
    assert torch.equal(v, validation_batches(corpus, seq_len=64, num_sequences=12))
    assert not torch.equal(v, validation_batches(corpus, seq_len=64, num_sequences=12, seed=1))
    with pytest.raises(UserError, match="--val-percent"):
        validation_batches(_small_corpus([100]), seq_len=8, num_sequences=2)


# ---- local files and datasets ---------------------------------------------------------------------


def test_directory_of_text_files(tmp_path: Path) -> None:
    for pkg in ("alpha", "beta", "gamma"):
        (tmp_path / pkg).mkdir()
        for i in range(8):
            (tmp_path / pkg / f"f{i}.md").write_text(f"# {pkg} {i}\n" + "some words here\n" * 20)
    (tmp_path / "top.txt").write_text("top level\n" * 30)
    (tmp_path / ".hidden.txt").write_text("secret")
    corpus = load_corpus(str(tmp_path), tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / ".cache"))
    names = set(_names(corpus, corpus.train) + _names(corpus, corpus.val))
    assert len(names) == 25 and "alpha/f0.md" in names and ".hidden.txt" not in names
    assert set(corpus.groups) == {"alpha", "beta", "gamma", "top"}
    assert len(corpus.val)  # never empty while val_percent > 0
    assert _first_doc(corpus).tokens[-2:].tolist() == [10, 10]  # the blank-line separator


def test_single_text_file_splits_its_tail_for_validation(tmp_path: Path) -> None:
    (tmp_path / "book.txt").write_text("abcdefghij" * 100)
    cache = str(tmp_path / "cache")
    corpus = load_corpus(str(tmp_path / "book.txt"), tokenizer=ByteTokenizer(), cache_dir=cache)
    assert corpus.num_train_tokens + corpus.num_val_tokens == 1002  # text + blank-line separator
    assert 45 <= corpus.num_val_tokens <= 55
    again = load_corpus(str(tmp_path / "book.txt"), tokenizer=ByteTokenizer(), cache_dir=cache)
    assert corpus.fingerprint == again.fingerprint


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "csv"])
def test_data_files_load_through_datasets(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"rows.{suffix}"
    if suffix == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    else:
        import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs installed

        frame = pd.DataFrame(ROWS)
        frame.to_parquet(path) if suffix == "parquet" else frame.to_csv(path, index=False)
    corpus = load_corpus(str(path), tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    assert len(corpus.train) + len(corpus.val) == len(ROWS)
    assert 0 < len(corpus.val) < 20
    text = ByteTokenizer().decode(_first_doc(corpus).tokens)
    assert text.startswith("row ") and "fox" in text
    with pytest.raises(UserError, match="--text-field"):
        load_corpus(
            str(path), tokenizer=ByteTokenizer(), text_field="body", cache_dir=str(tmp_path / "cache")
        )


def test_glob_of_jsonl_files(tmp_path: Path) -> None:
    for part in range(2):
        rows = ROWS[part * 60 : (part + 1) * 60]
        (tmp_path / f"part{part}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    corpus = load_corpus(
        str(tmp_path / "part*.jsonl"), tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / "c")
    )
    assert len(corpus.train) + len(corpus.val) == len(ROWS)


def test_unknown_dataset_name_fails_fast_and_offline(tmp_path: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(UserError, match="--dataset: cannot load 'no-such/dataset-xyz'"):
        load_corpus("no-such/dataset-xyz", tokenizer=ByteTokenizer(), cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl"])
def test_empty_file_is_a_user_error(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("")
    with pytest.raises(UserError, match="--dataset") as info:
        load_corpus(str(tmp_path / name), tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(info.value)


def test_malformed_and_unreadable_files_are_user_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="--dataset: cannot read"):
        load_corpus(str(tmp_path / "bad.jsonl"), tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(UserError, match="--dataset"):
        load_corpus(str(tmp_path / "data.bin"), tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match="--val-percent"):
        load_corpus(None, tokenizer=ByteTokenizer(), val_percent=80)
