"""Tokenizers as users have them: `adloco-node tokenizer`, `--tokenizer`, and the tokenizer's identity.

The BPE tokenizer these tests use is made by the command itself, on a slice of the embedded corpus,
so nothing is downloaded. Its determinism is checked across processes (the trainer's hash maps are
seeded per process), its file trains a node offline, and its fingerprint keeps peers and
checkpoints of different tokenizers apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from adloco.errors import UserError
from adloco.node.cli import entry
from adloco.node.cli import launcher as sl
from adloco.node.cli import node as node_cli
from adloco.node.data.corpus import Corpus, load_corpus, separator_tokens
from adloco.node.data.state import IncompatibleState
from adloco.node.data.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    Tokenizer,
    byte_level_equivalent,
    load_tokenizer,
    train_bpe,
)
from adloco.node.swarm import node as swarm_node
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.protocol.transport.dht import NetworkConfig

BIN = Path(sys.executable).parent
VOCAB = 512
# The tokenizer command's corpus flags: a 0.3 MB slice of the embedded corpus (a few seconds).
CORPUS_FLAGS = ["--max-corpus-mb", "0.3"]
TINY = ["--max-corpus-mb", "0.3", "--rounds", "1", "--inner-steps", "1", "--batch-size", "1"]
TINY += ["--seq-len", "32", "--instances", "1", "--threads", "1", "--b-max", "1"]
TEXT = "def héllo(wörld):\n\treturn wörld  # 🙂 \r\n\x00 ünïcode  spaces   end"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "1")


def make_tokenizer(out: Path, vocab_size: int = VOCAB) -> Path:
    rc = entry.main(["tokenizer", *CORPUS_FLAGS, "--vocab-size", str(vocab_size), "--out", str(out)])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json made by `adloco-node tokenizer` on the corpus slice the tests train on."""
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok.json")


@pytest.fixture(scope="module")
def other_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another BPE of exactly the same size: the same model shapes, different ids."""
    path = tmp_path_factory.mktemp("other") / "other.json"
    corpus = _corpus(ByteTokenizer())
    texts = [
        d.tokens.numpy().tobytes().decode("utf-8", errors="replace")[::-1]
        for d in corpus.documents(corpus.train)
    ]
    path.write_text(train_bpe(texts, vocab_size=VOCAB))
    return path


# ---- adloco-node tokenizer -----------------------------------------------------------------------


def test_the_command_writes_a_byte_level_bpe_with_eos(bpe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(bpe.read_text())
    assert data["model"]["type"] == "BPE" and data["pre_tokenizer"]["type"] == "ByteLevel"
    assert [t["content"] for t in data["added_tokens"]] == [EOS_TOKEN]
    tok = load_tokenizer(str(bpe))
    assert tok.vocab_size == VOCAB and tok.eos_token_id == 0  # EOS is id 0 and separates documents
    assert separator_tokens(tok).tolist() == [0]
    assert tok.decode(tok.encode(TEXT)) == TEXT  # byte-level: any text, no unknown token
    assert len(tok.encode(TEXT)) < len(TEXT.encode())  # and it merges


def test_the_command_is_deterministic_across_processes(bpe: Path, tmp_path: Path) -> None:
    # The trainer counts pairs in hash maps seeded per process (and per map): equal output from
    # another run in this process and from a fresh interpreter is the determinism that matters.
    again = make_tokenizer(tmp_path / "again.json")
    script = str(BIN / "adloco-node")
    fresh = tmp_path / "fresh.json"
    argv = [script, "tokenizer", *CORPUS_FLAGS, "--vocab-size", str(VOCAB), "--out", str(fresh)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {fresh}: {VOCAB} tokens" in proc.stdout
    assert again.read_bytes() == bpe.read_bytes() == fresh.read_bytes()
    # The settings matter: another size is another file.
    other = make_tokenizer(tmp_path / "other.json", vocab_size=VOCAB + 1)
    assert other.read_bytes() != bpe.read_bytes()


def test_train_bpe_trains_on_the_given_text_in_order() -> None:
    texts = ["aaaa bbbb aaaa bbbb " * 50, "cccc dddd " * 80]
    assert train_bpe(texts, vocab_size=280) == train_bpe(texts, vocab_size=280)
    assert train_bpe(texts, vocab_size=280) != train_bpe(texts[1:], vocab_size=280)
    with pytest.raises(UserError, match="--vocab-size"):
        train_bpe(texts, vocab_size=256)


# ---- loading: files, folders, the local cache, identity ------------------------------------------


def test_byte_tokenizer_has_a_transformers_equivalent() -> None:
    raw = byte_level_equivalent()
    assert raw.get_vocab_size() == 256
    for text in (TEXT, "", " ", "\n\n", "".join(map(chr, range(1, 300)))):
        assert raw.encode(text).ids == ByteTokenizer().encode(text), text
        assert raw.decode(ByteTokenizer().encode(text)) == text


def test_fingerprint_is_the_tokenization_not_the_path(bpe: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(bpe))
    tok.save_pretrained(tmp_path / "folder")
    (tmp_path / "copy.json").write_bytes(bpe.read_bytes())
    assert load_tokenizer(str(tmp_path / "folder")).fingerprint == tok.fingerprint
    assert load_tokenizer(str(tmp_path / "copy.json")).fingerprint == tok.fingerprint
    # The same size trained on other text is another tokenizer.
    other = tmp_path / "other.json"
    other.write_text(train_bpe(["zyx wvu tsr " * 300], vocab_size=VOCAB, min_frequency=1))
    assert load_tokenizer(str(other)).fingerprint != tok.fingerprint
    assert tok.fingerprint != ByteTokenizer.fingerprint == load_tokenizer("bytes").fingerprint


def test_a_model_name_in_the_local_cache(bpe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # The hub cache's layout, as a download leaves it: refs/main names the snapshot.
    repo = tmp_path / "hub" / "models--someorg--tiny-bpe"
    snapshot = repo / "snapshots" / ("0" * 40)
    load_tokenizer(str(bpe)).save_pretrained(snapshot)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": VOCAB}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_tokenizer("someorg/tiny-bpe").fingerprint == load_tokenizer(str(bpe)).fingerprint
    with pytest.raises(
        UserError, match="--tokenizer: 'someorg/other' is no file or folder here and no model"
    ):
        load_tokenizer("someorg/other")


# ---- training with it ------------------------------------------------------------------------------


def _vocab_config(folder: Path, vocab_size: int) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    config.save_pretrained(folder)
    return folder / "config.json"


def test_an_offline_run_trains_with_the_tokenizer(
    bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    monkeypatch.setattr(signal, "signal", lambda *_: None)
    # A config of the tokenizer's size: a node that ignored --tokenizer (bytes, 256) would refuse it.
    config = _vocab_config(tmp_path / "model", VOCAB)
    rc = node_cli.main(["--offline", *TINY, "--model", str(config), "--tokenizer", str(bpe)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "[local round=1] val " in out


def _corpus(tokenizer: Tokenizer) -> Corpus:
    return load_corpus(None, tokenizer=tokenizer, max_bytes=300_000)


CFG = TrainConfig(seq_len=32, batch_size=2, instances=1, inner_steps=1, b_max=2)


def _peer(tokenizer: Tokenizer) -> Peer:
    return Peer(
        peer_id="p",
        index=0,
        num_peers=1,
        cfg=CFG,
        corpus=_corpus(tokenizer),
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer,
    )


@pytest.fixture(scope="module")
def two_tokenizers(bpe: Path, other_bpe: Path) -> tuple[Tokenizer, Tokenizer]:
    a, b = load_tokenizer(str(bpe)), load_tokenizer(str(other_bpe))
    assert a.vocab_size == b.vocab_size == VOCAB
    return a, b


def test_peers_of_different_tokenizers_do_not_mix(two_tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    a, b = (_peer(t) for t in two_tokenizers)
    assert a.state_dict()["model_fingerprint"] == b.state_dict()["model_fingerprint"]
    assert a.fingerprint != b.fingerprint  # so their run prefixes, DHT keys and groups differ
    with pytest.raises(IncompatibleState, match=r"another tokenizer.*--tokenizer"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict(_peer(two_tokenizers[1]).state_dict())  # its own tokenizer's state loads


def test_a_checkpoint_from_before_the_tokenizer_was_recorded_is_a_byte_one(
    two_tokenizers: tuple[Tokenizer, Tokenizer],
) -> None:
    def old(state: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in state.items() if k not in ("tokenizer_fingerprint", "tokenizer_files")}

    byte_peer = _peer(ByteTokenizer())
    byte_peer.load_state_dict(old(_peer(ByteTokenizer()).state_dict()))
    bpe_peer = _peer(two_tokenizers[0])
    with pytest.raises(IncompatibleState, match="another tokenizer"):
        bpe_peer.load_state_dict(old(_peer(two_tokenizers[0]).state_dict()))


def test_the_swarm_prefix_includes_the_tokenizer(
    two_tokenizers: tuple[Tokenizer, Tokenizer], bpe: Path, other_bpe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Build SwarmNode up to joining the swarm (no DHT started): the prefix it namespaces the run with.
    seen: list[str] = []

    class Stop(Exception):
        pass

    class NoDHT:
        def shutdown(self) -> None:
            pass

    def no_join(node: swarm_node.SwarmNode) -> None:
        raise Stop

    def recorded_prefix(run_id: str, fingerprint: str) -> str:
        seen.append(fingerprint)
        return "p"

    monkeypatch.setattr(swarm_node, "run_prefix", recorded_prefix)
    monkeypatch.setattr(swarm_node, "start_dht", lambda net: NoDHT())
    monkeypatch.setattr(swarm_node.SwarmNode, "_join", no_join)
    for spec in (bpe, other_bpe):
        cfg = TrainConfig(
            tokenizer=str(spec),
            seq_len=32,
            batch_size=2,
            instances=1,
            inner_steps=1,
            b_max=2,
            max_corpus_mb=0.3,
        )
        with pytest.raises(Stop):
            swarm_node.SwarmNode(cfg, NetworkConfig(), swarm_node.SwarmConfig(data_shards=1))
    expected = [_peer(t).fingerprint for t in two_tokenizers]
    assert seen == expected and seen[0] != seen[1]


# ---- adloco-swarm --tokenizer ----------------------------------------------------------------------


def test_the_swarm_gives_every_node_the_tokenizer(
    bpe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(bpe.parent)
    argv = ["--nodes", "2", "--rounds", "1", "--out", str(tmp_path)]
    opts = sl.parse_options([*argv, "--tokenizer", bpe.name, "--", "--codec", "int8"])
    node = sl.node_argv(opts, 0, ["/ip4/1.2.3.4/tcp/5/p2p/Qm"], threads=1)
    assert node[-4:] == ["--tokenizer", str(bpe.resolve()), "--codec", "int8"]  # absolute: any cwd
    cached = sl.parse_options([*argv, "--tokenizer", "someorg/tiny-bpe"])
    assert sl.node_argv(cached, 1, [], threads=1)[-2:] == ["--tokenizer", "someorg/tiny-bpe"]
    with pytest.raises(UserError, match="--tokenizer: given both before and after --"):
        sl.parse_options([*argv, "--tokenizer", "a.json", "--", "--tokenizer", "b.json"])
    assert "--tokenizer" not in sl.node_argv(sl.parse_options(argv), 0, [], threads=1)


def test_bytes_per_token(bpe: Path) -> None:
    # What the tokenizer buys: the same sequence length covers several times more text.
    tok = load_tokenizer(str(bpe))
    corpus = _corpus(ByteTokenizer())
    text = b"".join(d.tokens.numpy().tobytes() for d in corpus.documents(corpus.val))
    assert len(text) / len(tok.encode_bytes(text)) > 2.0
    assert tok.encode_bytes(text).dtype == torch.int32
