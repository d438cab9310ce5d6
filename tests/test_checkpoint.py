"""Checkpoints: a bit-identical round trip (the next round equals the one never interrupted), MIT merges,
crashes mid-save, corrupt files, retention, the errors a user sees for a wrong directory, the state
tree's flattening, and a peer refusing a malformed state whole."""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from adloco.errors import UserError
from adloco.node.data import sampling
from adloco.node.data.corpus import Corpus
from adloco.node.data.state import IncompatibleState
from adloco.node.data.streams import digest
from adloco.node.operations import checkpoint
from adloco.node.operations.checkpoint import (
    check_checkpoint_dir,
    flatten_state,
    list_checkpoints,
    load_checkpoint,
    peek_checkpoint,
    save_checkpoint,
    unflatten_state,
)
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.allreduce import reduce_group

CFG = TrainConfig(seq_len=32, batch_size=4, instances=2, inner_steps=2, b_max=4, max_corpus_mb=1)
# Low-rank keeps warm starts in both codecs and a large error-feedback residual: all must survive.
LOWRANK = replace(CFG, codec="lowrank:2")
MERGING = replace(
    CFG, instances=3, schedule=replace(CFG.schedule, merge=replace(CFG.schedule.merge, merge_every=1))
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_data(CFG)[0]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # The tiny model gains nothing from two threads, and their spin-waits on a busy 2-core machine
    # made this file 5x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _peer(corpus: Corpus, cfg: TrainConfig = CFG, *, index: int = 0, vocab_size: int = 256) -> Peer:
    return Peer(peer_id="a", index=index, num_peers=2, cfg=cfg, corpus=corpus, vocab_size=vocab_size)


def _save(directory: Path, peer: Peer, **kwargs: Any) -> Path:
    return save_checkpoint(directory, peer.state_dict(), **kwargs)


def _load(directory: Path, peer: Peer) -> dict[str, Any] | None:
    return load_checkpoint(directory, peer.load_state_dict)


def _round(peer: Peer) -> None:
    contribution = peer.contribute(peer.train_round())[0]
    assert contribution is not None  # fresh: never too stale
    peer.apply_round(reduce_group([contribution], codec=peer.downlink_codec(peer.state.schedule.codec)))


def _trained(corpus: Corpus, cfg: TrainConfig = CFG, rounds: int = 2) -> Peer:
    peer = _peer(corpus, cfg)
    for _ in range(rounds):
        _round(peer)
    return peer


def _assert_same(a: Peer, b: Peer) -> None:
    """Everything a checkpoint restores, compared exactly."""
    assert b.state.theta_hash() == a.state.theta_hash()
    assert all(torch.equal(x, y) for x, y in zip(a.state.momentum, b.state.momentum, strict=True))
    assert (b.state.round, b.state.schedule) == (a.state.round, a.state.schedule)
    assert b.state.history == a.state.history  # round, averaged bytes, schedule, merge
    assert (b.phase_round, b.dylu_speed_ratio, b.b_max) == (a.phase_round, a.dylu_speed_ratio, a.b_max)
    assert len(b.local_instances) == len(a.local_instances)
    for x, y in zip(a.local_instances, b.local_instances, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(x.params, y.params, strict=True))
        assert digest([x.sampler.stream]) == digest([y.sampler.stream])
        assert torch.equal(x.sampler.get_state(), y.sampler.get_state())
        sx, sy = x.optimizer_state()["state"], y.optimizer_state()["state"]
        assert sx.keys() == sy.keys()
        for idx in sx:
            assert sx[idx].keys() == sy[idx].keys()
            assert all(torch.equal(sx[idx][f], sy[idx][f]) for f in sx[idx])
    ea, eb = a.error_feedback.state_dict(), b.error_feedback.state_dict()
    assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)
    assert a.codecs.keys() == b.codecs.keys()
    for key, codec in a.codecs.items():
        _assert_tree_equal(b.codecs[key].state_dict(), codec.state_dict())


def _assert_tree_equal(x: Any, y: Any, path: str = "") -> None:
    """Two state trees hold the same structure, leaf types and values (tensors: dtype and bits)."""
    assert type(x) is type(y), path
    if isinstance(x, dict):
        assert x.keys() == y.keys(), path
        for key in x:
            _assert_tree_equal(x[key], y[key], f"{path}/{key}")
    elif isinstance(x, list):
        assert len(x) == len(y), path
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _assert_tree_equal(u, v, f"{path}/{i}")
    elif isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and torch.equal(x, y), path
    else:
        assert x == y, path


def _cloned(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _cloned(v) for key, v in tree.items()}
    if isinstance(tree, list):
        return [_cloned(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


@pytest.mark.parametrize("cfg", [LOWRANK, replace(CFG, overlap="rebase")], ids=["lowrank", "overlap"])
def test_round_trip_is_exact_and_the_next_round_matches(
    corpus: Corpus, tmp_path: Path, cfg: TrainConfig
) -> None:
    a = _trained(corpus, cfg)
    a.dylu_speed_ratio = 0.75
    path = _save(tmp_path, a, extra={"applied": 2, "shard": 0})
    assert path == tmp_path / "round-00000002"
    assert (tmp_path / "latest").read_text().strip() == path.name
    b = _peer(corpus, cfg)
    assert _load(tmp_path, b) == {"applied": 2, "shard": 0}
    _assert_same(a, b)
    # Nothing the next round depends on was lost: it comes out bit-identical.
    _round(a)
    _round(b)
    assert b.state.theta_hash() == a.state.theta_hash()
    _assert_same(a, b)


def test_round_trip_after_a_merge_rebuilds_the_survivor_stream(corpus: Corpus, tmp_path: Path) -> None:
    a = _trained(corpus, MERGING, rounds=1)
    assert len(a.local_instances) == 2  # one MIT merge happened
    _save(tmp_path, a)
    b = _peer(corpus, MERGING)
    assert len(b.local_instances) == 3
    assert _load(tmp_path, b) == {}
    _assert_same(a, b)  # the survivor's stream is the concatenation of the merged shards
    _round(a)
    _round(b)
    assert b.state.theta_hash() == a.state.theta_hash()


def test_other_data_shard_resumes_with_a_warning(
    corpus: Corpus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a = _trained(corpus, MERGING, rounds=1)
    _save(tmp_path, a)
    b = _peer(corpus, MERGING, index=1)
    with caplog.at_level(logging.WARNING, logger=sampling.__name__):
        _load(tmp_path, b)
    assert "do not match this node's data shards" in caplog.text
    assert len(b.local_instances) == 2 and b.state.theta_hash() == a.state.theta_hash()
    _round(b)  # trains on, on its own shards


@pytest.mark.parametrize("stage", ["tensors", "manifest", "rename", "latest"])
def test_crash_during_save_leaves_a_loadable_checkpoint(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    a = _trained(corpus, rounds=1)
    _save(tmp_path, a)
    hashes = {1: a.state.theta_hash()}
    _round(a)
    hashes[2] = a.state.theta_hash()

    def crash(*args: object) -> None:
        if stage == "tensors":  # a torn file, then the crash
            Path(str(args[0])).write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")

    if stage == "manifest":
        real = checkpoint._write_json
        monkeypatch.setattr(
            checkpoint, "_write_json", lambda p, o: crash() if p.name == checkpoint.MANIFEST else real(p, o)
        )
    else:
        module = checkpoint if stage == "tensors" else os
        name = {"tensors": "_write_safetensors", "rename": "rename", "latest": "replace"}[stage]
        monkeypatch.setattr(module, name, crash)
    with pytest.raises(OSError, match="No space"):
        _save(tmp_path, a)
    monkeypatch.undo()
    # A save killed outright (kill -9) leaves its temporary directory behind as well.
    leftover = tmp_path / ".tmp-round-00000002-1-dead"
    leftover.mkdir()
    (leftover / checkpoint.TENSORS).write_bytes(b"torn")
    b = _peer(corpus)
    _load(tmp_path, b)
    # Only a crash after the rename (while repointing `latest`) leaves the new checkpoint in place.
    expected = 2 if stage == "latest" else 1
    assert b.state.round == expected and b.state.theta_hash() == hashes[expected]
    assert len(list_checkpoints(tmp_path)) == (2 if stage == "latest" else 1)
    latest = _save(tmp_path, a)  # the next save cleans up
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "latest") == sorted(
        p.name for p in list_checkpoints(tmp_path)
    )
    assert (tmp_path / "latest").read_text().strip() == latest.name


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "meta"])
def test_corrupt_newest_falls_back_to_the_previous(
    corpus: Corpus, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    a = _trained(corpus, rounds=1)
    _save(tmp_path, a, extra={"n": 1})
    saved_hash = a.state.theta_hash()
    _round(a)
    newest = _save(tmp_path, a, extra={"n": 2})
    tensors = newest / checkpoint.TENSORS
    data = tensors.read_bytes()
    if damage == "truncate":
        tensors.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        tensors.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "manifest":
        (newest / checkpoint.MANIFEST).write_text(f'{{"format": {checkpoint.FORMAT}, "fi')
    else:
        (newest / checkpoint.META).write_text("{}")
    b = _peer(corpus)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert _load(tmp_path, b) == {"n": 1}
    assert f"checkpoint {newest} is unusable" in caplog.text
    assert b.state.round == 1 and b.state.theta_hash() == saved_hash


def test_nothing_usable_starts_fresh(corpus: Corpus, tmp_path: Path) -> None:
    b = _peer(corpus)
    assert _load(tmp_path / "missing", b) is None
    assert _load(tmp_path, b) is None
    assert peek_checkpoint(tmp_path) is None
    path = _save(tmp_path, b)
    (path / checkpoint.TENSORS).write_bytes(b"")
    assert _load(tmp_path, b) is None and b.state.round == 0


def test_keeps_the_newest_and_drops_stale_ones(corpus: Corpus, tmp_path: Path) -> None:
    a = _peer(corpus)
    names = [_save(tmp_path, a, keep=2).name for _ in range(3)]
    assert names == ["round-00000000", "round-00000000.1", "round-00000000.2"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00000000.2", "round-00000000.1"]
    _round(a)
    _save(tmp_path, a, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00000001"]
    info = peek_checkpoint(tmp_path)
    assert info is not None and info.round == 1 and info.path.name == "round-00000001"
    # A fresh start in the same directory: the higher round it did not resume from is stale.
    _save(tmp_path, _peer(corpus), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00000000"]
    assert (tmp_path / "latest").read_text().strip() == "round-00000000"


def test_checkpoint_of_another_model_or_instance_count_is_refused(corpus: Corpus, tmp_path: Path) -> None:
    _save(tmp_path, _peer(corpus, MERGING))
    with pytest.raises(UserError, match=r"--checkpoint-dir: .* another model"):
        _load(tmp_path, _peer(corpus, MERGING, vocab_size=300))
    with pytest.raises(UserError, match=r"--checkpoint-dir: .* 3 MIT instances.* --instances 3"):
        _load(tmp_path, _peer(corpus))


def test_unknown_format_is_refused(corpus: Corpus, tmp_path: Path) -> None:
    path = _save(tmp_path, _peer(corpus))
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    (path / checkpoint.MANIFEST).write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(UserError, match=r"--checkpoint-dir: .* format 99"):
        _load(tmp_path, _peer(corpus))


def test_save_refuses_a_non_json_extra_and_a_round_in_progress(corpus: Corpus, tmp_path: Path) -> None:
    peer = _peer(corpus)
    with pytest.raises(ValueError, match="JSON"):
        _save(tmp_path, peer, extra={"x": object()})
    with pytest.raises(ValueError, match="integer round"):
        save_checkpoint(tmp_path, {"theta": [torch.zeros(2)]})
    peer._in_round = True
    with pytest.raises(RuntimeError, match="during a local round"):
        _save(tmp_path, peer)
    with pytest.raises(RuntimeError, match="during a local round"):
        peer.load_state_dict(_peer(corpus).state_dict())
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_dir_must_be_a_writable_directory(tmp_path: Path) -> None:
    check_checkpoint_dir(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match=r"--checkpoint-dir: .*not a directory"):
        check_checkpoint_dir(blocker)
    with pytest.raises(UserError, match="--checkpoint-dir: cannot create"):
        check_checkpoint_dir(blocker / "sub")


# ---- the state tree ----------------------------------------------------------------------------------

TREE: dict[str, Any] = {
    "round": 7,
    "weights": [torch.randn(3, 2), torch.arange(5, dtype=torch.int64), torch.tensor(2.5)],
    "half": torch.randn(4, dtype=torch.bfloat16),
    "payloads": {"a/b": b"\x00\xffxyz", "~c": b""},
    "nested": {"none": None, "flag": True, "ratio": 0.75, "name": "int8/avg", "pair": (3, 4), "empty": []},
}


def test_flatten_round_trips_every_leaf_type_through_the_disk(tmp_path: Path) -> None:
    skeleton, tensors = flatten_state(TREE)
    # Tensor keys are the leaves' JSON pointers, so a "/" or "~" in a dict key cannot collide.
    assert {"/weights/0", "/half", "/payloads/a~1b", "/payloads/~0c"} <= tensors.keys()
    assert skeleton["payloads"]["a/b"] == {"$bytes": "/payloads/a~1b"}
    expected = {**TREE, "nested": {**TREE["nested"], "pair": [3, 4]}}  # tuples come back as lists
    _assert_tree_equal(unflatten_state(skeleton, tensors), expected)
    save_checkpoint(tmp_path, TREE, extra={"k": 1})
    loaded: list[dict[str, Any]] = []
    assert load_checkpoint(tmp_path, loaded.append) == {"k": 1}
    _assert_tree_equal(loaded[0], expected)
    info = peek_checkpoint(tmp_path)
    assert info is not None and (info.round, info.model_fingerprint) == (7, None)


def _anon_bytes() -> int:
    """The process's resident anonymous memory (RssAnon): what it allocated, not pages of files."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_a_checkpoint_is_handed_over_mapped_from_its_file_not_read_into_memory(tmp_path: Path) -> None:
    """The state `load` receives is mapped from the checkpoint's file (safetensors' `load_file` maps
    it): reading all of a 64 MB tensor in it adds no anonymous memory to the process (a read of the
    file into memory would add 64 MB), and its values are the saved ones."""
    big = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0))
    save_checkpoint(tmp_path, {"round": 0, "big": big})
    seen: list[tuple[int, bool]] = []

    def load(state: dict[str, Any]) -> None:
        equal = torch.equal(state["big"], big)  # (every page of the file read)
        seen.append((_anon_bytes() - before, equal))

    before = _anon_bytes()
    assert load_checkpoint(tmp_path, load) == {}
    [(grown, equal)] = seen
    assert equal
    assert grown < 16 << 20, f"{grown / 2**20:.0f} MiB of anonymous memory for a 64 MiB checkpoint"


def test_a_peer_restored_from_a_checkpoint_keeps_no_mapping_of_it(corpus: Corpus, tmp_path: Path) -> None:
    """The peer copies what it keeps of a checkpoint's mapped state: once it is loaded, no mapping of
    the checkpoint's file is left in the process (a tensor kept as a view would hold the whole
    file's mapping, and the disk space of a checkpoint pruned later)."""
    path = _save(tmp_path, _trained(corpus))
    peer = _peer(corpus)
    assert _load(tmp_path, peer) is not None
    gc.collect()
    tensors = str((path / checkpoint.TENSORS).resolve())
    assert tensors not in Path("/proc/self/maps").read_text()
    _assert_same(_trained(corpus), peer)


def test_flatten_copies_tensors_that_share_memory(tmp_path: Path) -> None:
    base = torch.arange(6.0)
    save_checkpoint(tmp_path, {"round": 0, "a": base, "b": base, "view": base[2:4]})
    loaded: list[dict[str, Any]] = []
    load_checkpoint(tmp_path, loaded.append)
    assert torch.equal(loaded[0]["b"], base) and torch.equal(loaded[0]["view"], base[2:4])


@pytest.mark.parametrize(
    "tree",
    [
        {"round": 0, "x": object()},
        {"round": 0, "x": [1.0, float("nan")]},
        {"round": 0, "$tensor": "x"},
        {"round": 0, "x": {1: torch.zeros(1)}},
    ],
    ids=["object", "nan", "marker-key", "int-key"],
)
def test_save_refuses_a_tree_that_is_no_state_dict(tmp_path: Path, tree: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, tree)
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "skeleton",
    [{"x": {"$tensor": "/missing"}}, {"x": {"$bytes": "/f"}}, {"x": {"$tensor": "/t", "y": 1}}, [1]],
    ids=["missing", "bytes-of-float", "marker-with-keys", "not-a-dict"],
)
def test_unflatten_refuses_a_skeleton_that_does_not_fit(skeleton: Any) -> None:
    with pytest.raises(ValueError):
        unflatten_state(skeleton, {"/t": torch.zeros(2, dtype=torch.uint8), "/f": torch.zeros(2)})


def test_a_loader_refusing_the_newest_falls_back_and_a_user_error_propagates(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"round": 1, "ok": True}, extra={"n": 1})
    save_checkpoint(tmp_path, {"round": 2, "ok": False}, extra={"n": 2})
    seen: list[int] = []

    def load(state: dict[str, Any]) -> None:
        seen.append(state["round"])
        if not state["ok"]:
            raise ValueError("malformed")

    assert load_checkpoint(tmp_path, load) == {"n": 1} and seen == [2, 1]

    def refuse(state: dict[str, Any]) -> None:
        raise IncompatibleState("this state is of another model")

    with pytest.raises(
        UserError, match=r"--checkpoint-dir: .*round-00000002: this state is of another model"
    ):
        load_checkpoint(tmp_path, refuse)


# ---- Peer.load_state_dict ----------------------------------------------------------------------------


def _corrupt_theta(state: dict[str, Any]) -> None:
    state["theta"][0] = state["theta"][0] + 1


def _corrupt_rng(state: dict[str, Any]) -> None:
    state["instances"][-1]["sampler"]["rng"] = torch.zeros(3, dtype=torch.uint8)


def _corrupt_codec(state: dict[str, Any]) -> None:
    state["codecs"]["lowrank:2"] = {"w": torch.zeros(3)}


def _corrupt_optimizer(state: dict[str, Any]) -> None:
    state["instances"][-1]["optimizer"]["0"]["exp_avg"] = torch.zeros(1)


def _corrupt_history(state: dict[str, Any]) -> None:
    del state["history"][-1]["averaged"]


def _corrupt_ratio(state: dict[str, Any]) -> None:
    state["dylu_speed_ratio"] = "fast"


@pytest.mark.parametrize(
    "corrupt",
    [_corrupt_theta, _corrupt_history, _corrupt_optimizer, _corrupt_rng, _corrupt_codec, _corrupt_ratio],
    ids=lambda f: f.__name__.removeprefix("_corrupt_"),
)
def test_a_malformed_state_is_refused_and_the_peer_left_unchanged(
    corpus: Corpus, corrupt: Callable[[dict[str, Any]], None]
) -> None:
    cfg = replace(MERGING, codec="lowrank:2")
    state = _trained(corpus, cfg, rounds=1).state_dict()
    assert len(state["instances"]) == 2 and "lowrank:2" in state["codecs"]
    corrupt(state)
    b = _peer(corpus, cfg)
    before = _cloned(b.state_dict())
    with pytest.raises(ValueError):
        b.load_state_dict(state)
    # A half-applied state would show here: θ, the third instance, the codecs are checked first.
    _assert_tree_equal(b.state_dict(), before)


def test_an_incompatible_state_is_refused_and_the_peer_left_unchanged(corpus: Corpus) -> None:
    state = _trained(corpus, MERGING, rounds=1).state_dict()
    b = _peer(corpus, MERGING, vocab_size=300)
    before = _cloned(b.state_dict())
    with pytest.raises(IncompatibleState, match="another model"):
        b.load_state_dict(state)
    _assert_tree_equal(b.state_dict(), before)
    with pytest.raises(IncompatibleState, match=r"2 MIT instances.*--instances 2"):
        _peer(corpus, replace(CFG, instances=1)).load_state_dict(state)


@pytest.mark.parametrize(
    ("codec", "saved", "resumed"), [("sparse", "feedback", "encode"), ("lowrank:2", "encode", "feedback")]
)
def test_a_checkpoint_resumes_under_another_downlink(
    corpus: Corpus,
    tmp_path: Path,
    codec: str,
    saved: Literal["encode", "feedback"],
    resumed: Literal["encode", "feedback"],
) -> None:
    """--downlink is a setting of the run, not of the state: a node restarted with another one
    resumes from its checkpoint at its round and trains on."""
    source = _trained(corpus, replace(CFG, codec=codec, downlink=saved))
    _save(tmp_path, source)
    peer = _peer(corpus, replace(CFG, codec=codec, downlink=resumed))
    assert _load(tmp_path, peer) is not None
    assert peer.state.round == source.state.round
    assert peer.state.theta_hash() == source.state.theta_hash()
    _round(peer)
    assert peer.state.round == source.state.round + 1
