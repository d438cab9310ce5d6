"""Corpus loading and splitting (training/corpus.py), sharding and sampling (sampling.py), tokenizers."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from adloco.errors import UserError
from adloco.node.training.corpus import Corpus, Document, load_corpus, stdlib_files
from adloco.node.training.sampling import TokenSampler, restore_streams, shard_corpus, validation_batches
from adloco.node.training.tokenizer import ByteTokenizer, load_tokenizer

ROWS = [{"text": f"row {i}: " + "the quick brown fox " * (i % 5 + 1), "id": i} for i in range(120)]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(None, tokenizer=ByteTokenizer())


def _small_corpus(sizes: list[int], groups: list[str] | None = None) -> Corpus:
    groups = groups or [f"g{i}" for i in range(len(sizes))]
    docs = [
        Document(f"d{i}.py", g, torch.full((n,), i % 256, dtype=torch.uint8))
        for i, (n, g) in enumerate(zip(sizes, groups, strict=True))
    ]
    return Corpus("small", docs, [], "fp")


def _all_shards(
    corpus: Corpus, peers: int, instances: int, *, non_iid: bool
) -> dict[tuple[int, int], list[torch.Tensor]]:
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
    corpus = load_corpus(str(tmp_path / "doc.txt"), tokenizer=tok)
    assert corpus.train_docs[0].tokens.dtype == torch.int32
    assert int(corpus.train_docs[0].tokens.max()) < tok.vocab_size


# ---- the embedded corpus ------------------------------------------------------------------------


def test_default_corpus_is_the_stdlib_without_tests(corpus: Corpus) -> None:
    assert corpus.name == "stdlib"
    assert corpus.num_train_tokens > 2_000_000
    assert len(corpus.train_docs) > 100 and len(corpus.val_docs) > 5
    names = [d.name for d in corpus.train_docs + corpus.val_docs]
    assert not any(
        part in {"test", "tests", "site-packages", "__pycache__"} for n in names for part in n.split("/")
    )
    assert not any(n.startswith("_sysconfigdata") for n in names)
    assert {"email", "json", "asyncio", "argparse"} <= set(corpus.groups)
    assert next(d for d in corpus.train_docs + corpus.val_docs if d.name == "json/decoder.py").group == "json"


def test_default_corpus_loads_deterministically(corpus: Corpus) -> None:
    again = load_corpus("stdlib", tokenizer=ByteTokenizer())
    assert again.fingerprint == corpus.fingerprint
    assert [d.name for d in again.val_docs] == [d.name for d in corpus.val_docs]
    assert all(
        torch.equal(a.tokens, b.tokens) for a, b in zip(again.train_docs, corpus.train_docs, strict=True)
    )


def test_validation_split_is_a_hash_of_the_path(corpus: Corpus) -> None:
    import hashlib

    def bucket(name: str) -> int:
        return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100

    assert all(bucket(d.name) < 5 for d in corpus.val_docs)
    assert all(bucket(d.name) >= 5 for d in corpus.train_docs)
    share = corpus.num_val_tokens / (corpus.num_train_tokens + corpus.num_val_tokens)
    assert 0.01 < share < 0.15


def test_max_bytes_and_val_percent_change_the_fingerprint(corpus: Corpus) -> None:
    capped = load_corpus(None, tokenizer=ByteTokenizer(), max_bytes=1_000_000)
    assert 900_000 < capped.source_bytes <= 1_000_000
    assert capped.fingerprint != corpus.fingerprint
    assert load_corpus(None, tokenizer=ByteTokenizer(), val_percent=10).fingerprint != corpus.fingerprint


def test_stdlib_files_are_sorted_relative_paths() -> None:
    files = stdlib_files()
    rels = [rel for rel, _ in files]
    assert rels == sorted(rels) and all(not Path(rel).is_absolute() for rel in rels)


# ---- sharding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("non_iid", [False, True])
def test_shards_are_disjoint_and_cover_the_train_set(corpus: Corpus, non_iid: bool) -> None:
    shards = _all_shards(corpus, 3, 2, non_iid=non_iid)
    ptrs = [t.data_ptr() for shard in shards.values() for t in shard]
    assert all(shards.values())
    assert len(ptrs) == len(set(ptrs)) == len(corpus.train_docs)
    assert sum(t.numel() for shard in shards.values() for t in shard) == corpus.num_train_tokens


def test_non_iid_peers_get_different_groups(corpus: Corpus) -> None:
    group_of = {d.tokens.data_ptr(): d.group for d in corpus.train_docs}
    shards = _all_shards(corpus, 4, 2, non_iid=True)
    groups = [{group_of[t.data_ptr()] for k in range(2) for t in shards[(p, k)]} for p in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not groups[i] & groups[j]
    sizes = [sum(t.numel() for k in range(2) for t in shards[(p, k)]) for p in range(4)]
    assert max(sizes) < 1.5 * min(sizes)


def test_iid_shards_mix_groups_and_depend_on_seed(corpus: Corpus) -> None:
    group_of = {d.tokens.data_ptr(): d.group for d in corpus.train_docs}
    a = shard_corpus(corpus, peer_index=0, num_peers=2, instance_index=0, num_instances=1, seed=0)
    b = shard_corpus(corpus, peer_index=0, num_peers=2, instance_index=0, num_instances=1, seed=1)
    assert len({group_of[t.data_ptr()] for t in a}) > 50
    assert {t.data_ptr() for t in a} != {t.data_ptr() for t in b}


@pytest.mark.parametrize("non_iid", [False, True])
def test_too_few_documents_fall_back_to_contiguous_tokens(non_iid: bool) -> None:
    small = _small_corpus([1000, 10], groups=["a", "a"])
    shards = _all_shards(small, 2, 2, non_iid=non_iid)
    assert all(sum(t.numel() for t in s) > 0 for s in shards.values())
    assert sum(t.numel() for s in shards.values() for t in s) == 1010


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
    assert torch.equal(restored[1].stream, torch.cat([fresh[2].stream, fresh[0].stream]))
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
    corpus = load_corpus(str(tmp_path), tokenizer=ByteTokenizer())
    names = {d.name for d in corpus.train_docs + corpus.val_docs}
    assert len(names) == 25 and "alpha/f0.md" in names and ".hidden.txt" not in names
    assert set(corpus.groups) == {"alpha", "beta", "gamma", "top"}
    assert corpus.val_docs  # never empty while val_percent > 0
    assert corpus.train_docs[0].tokens[-2:].tolist() == [10, 10]  # the blank-line separator


def test_single_text_file_splits_its_tail_for_validation(tmp_path: Path) -> None:
    (tmp_path / "book.txt").write_text("abcdefghij" * 100)
    corpus = load_corpus(str(tmp_path / "book.txt"), tokenizer=ByteTokenizer())
    assert corpus.num_train_tokens + corpus.num_val_tokens == 1002  # text + blank-line separator
    assert 45 <= corpus.num_val_tokens <= 55
    assert (
        corpus.fingerprint == load_corpus(str(tmp_path / "book.txt"), tokenizer=ByteTokenizer()).fingerprint
    )


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "csv"])
def test_data_files_load_through_datasets(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"rows.{suffix}"
    if suffix == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    else:
        import pandas as pd

        frame = pd.DataFrame(ROWS)
        frame.to_parquet(path) if suffix == "parquet" else frame.to_csv(path, index=False)
    corpus = load_corpus(str(path), tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    assert len(corpus.train_docs) + len(corpus.val_docs) == len(ROWS)
    assert corpus.val_docs and len(corpus.val_docs) < 20
    text = ByteTokenizer().decode(corpus.train_docs[0].tokens)
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
    assert len(corpus.train_docs) + len(corpus.val_docs) == len(ROWS)


def test_unknown_dataset_name_fails_fast_and_offline(tmp_path: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(UserError, match="--dataset: cannot load 'no-such/dataset-xyz'"):
        load_corpus("no-such/dataset-xyz", tokenizer=ByteTokenizer(), cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl"])
def test_empty_file_is_a_user_error(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("")
    with pytest.raises(UserError, match="--dataset") as info:
        load_corpus(str(tmp_path / name), tokenizer=ByteTokenizer())
    assert "\n" not in str(info.value)


def test_malformed_and_unreadable_files_are_user_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="--dataset: cannot read"):
        load_corpus(str(tmp_path / "bad.jsonl"), tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(UserError, match="--dataset"):
        load_corpus(str(tmp_path / "data.bin"), tokenizer=ByteTokenizer())
    with pytest.raises(UserError, match="--val-percent"):
        load_corpus(None, tokenizer=ByteTokenizer(), val_percent=80)
