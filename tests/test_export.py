"""`adloco-node export`: a checkpoint becomes a Hugging Face folder that computes the node's logits.

The checkpoints are what a node writes (`save_checkpoint` of `Peer.state_dict()`, as
node/swarm/ops.py does) after real rounds of the solo trainer; the folder is loaded back with
transformers' own `from_pretrained`, and its logits on a text are compared with the peer's model at θ.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from adloco.node.cli import entry
from adloco.node.operations.checkpoint import TENSORS, list_checkpoints, save_checkpoint
from adloco.node.solo.trainer import train_solo
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.protocol.algorithms.allreduce import reduce_group

TEXT = "def héllo(wörld):\n    return wörld + 1  # 🙂 and some more text\n"
CFG = TrainConfig(seq_len=32, batch_size=2, instances=1, inner_steps=2, b_max=2, max_corpus_mb=0.3)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "1")


def export(checkpoint_dir: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = entry.main(["export", "--checkpoint-dir", str(checkpoint_dir), "--out", str(out)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def node_logits(peer: Peer, theta: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The peer's own model evaluated at `theta` (through its first instance, as its validation)."""
    model = peer.local_instances[0].model
    params = dict(zip(peer.names, theta, strict=True))
    with torch.no_grad():
        model.eval()
        logits: torch.Tensor = torch.func.functional_call(model, params, (ids,)).logits
    return logits


def hf_logits(out: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        logits: torch.Tensor = model(ids).logits
    return logits


def hf_ids(out: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(out))(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    assert entry.main(["tokenizer", "--max-corpus-mb", "0.3", "--vocab-size", "400", "--out", str(path)]) == 0
    return path


@pytest.mark.parametrize("model", ["tiny-llama", "bloom"])  # bloom ties its input and output embeddings
def test_export_round_trip_with_a_bpe_tokenizer(
    model: str, bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = TrainConfig(**{**CFG.__dict__, "model": model, "tokenizer": str(bpe)})
    peer, _ = train_solo(cfg, rounds=1)
    save_checkpoint(tmp_path / "ckpt", peer.state_dict())
    theta = [t.clone() for t in peer.state.theta]
    rc, out, err = export(tmp_path / "ckpt", tmp_path / "hf", capsys)
    assert rc == 0, err
    assert "θ of round 1" in out and "from_pretrained" in out
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # The tokenizer's EOS, whatever the preset or the type's defaults said (bloom's is 2).
    assert config["vocab_size"] == 400 and config["eos_token_id"] == 0
    # The folder's tokenizer gives the node's ids; its model, the node's logits at θ.
    ids = peer.tokenizer.encode(TEXT)
    assert hf_ids(tmp_path / "hf", TEXT) == ids
    batch = torch.tensor([ids])
    torch.testing.assert_close(
        hf_logits(tmp_path / "hf", batch), node_logits(peer, theta, batch), rtol=0, atol=1e-5
    )


def _two_checkpoints(directory: Path) -> tuple[Peer, list[torch.Tensor]]:
    """Checkpoints of rounds 1 and 2 of a byte-tokenizer run; returns the peer and θ of round 1."""
    peer, _ = train_solo(CFG, rounds=1)
    save_checkpoint(directory, peer.state_dict())
    theta1 = [t.clone() for t in peer.state.theta]
    contribution, _ = peer.contribute(peer.train_round())
    assert contribution is not None
    peer.apply_round(reduce_group([contribution], codec=peer.downlink_codec(peer.state.schedule.codec)))
    assert peer.state.round == 2
    save_checkpoint(directory, peer.state_dict())
    return peer, theta1


def test_export_takes_the_newest_valid_checkpoint_and_the_byte_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    peer, theta1 = _two_checkpoints(tmp_path / "ckpt")
    newest = list_checkpoints(tmp_path / "ckpt")[0]
    batch = torch.tensor([peer.tokenizer.encode(TEXT)])

    rc, out, err = export(tmp_path / "ckpt", tmp_path / "hf2", capsys)
    assert rc == 0 and "θ of round 2" in out, err
    torch.testing.assert_close(
        hf_logits(tmp_path / "hf2", batch), node_logits(peer, peer.state.theta, batch), rtol=0, atol=1e-5
    )
    # The byte tokenizer is exported as a transformers tokenizer with the same ids: its bytes.
    assert hf_ids(tmp_path / "hf2", TEXT) == list(TEXT.encode())

    # A corrupt newest checkpoint (a flipped byte in its tensors): the one before it is exported.
    data = bytearray((newest / TENSORS).read_bytes())
    data[-1] ^= 0xFF
    (newest / TENSORS).write_bytes(bytes(data))
    rc, out, err = export(tmp_path / "ckpt", tmp_path / "hf1", capsys)
    assert rc == 0 and "θ of round 1" in out, err
    torch.testing.assert_close(
        hf_logits(tmp_path / "hf1", batch), node_logits(peer, theta1, batch), rtol=0, atol=1e-5
    )


def test_old_checkpoints_and_a_used_out_folder_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    peer, _ = train_solo(CFG, rounds=1)
    state: dict[str, Any] = peer.state_dict()
    save_checkpoint(tmp_path / "new", state)
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    rc, _, err = export(tmp_path / "new", used, capsys)
    assert rc == 2 and err.startswith("adloco-node export: error: --out: ") and err.count("\n") == 1, err
    # A checkpoint written before checkpoints recorded the model config and tokenizer.
    old = {
        k: v
        for k, v in state.items()
        if k not in ("model_config", "tokenizer_fingerprint", "tokenizer_files")
    }
    save_checkpoint(tmp_path / "old", old)
    rc, _, err = export(tmp_path / "old", tmp_path / "hf", capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("adloco-node export: error: --checkpoint-dir: ") and "resume the run" in err, err
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_records_what_rebuilds_the_model(tmp_path: Path) -> None:
    peer, _ = train_solo(CFG, rounds=1)
    state = peer.state_dict()
    from transformers import AutoModelForCausalLM

    from adloco.node.model.model import config_from_json, model_fingerprint

    rebuilt = AutoModelForCausalLM.from_config(config_from_json(state["model_config"]))
    assert model_fingerprint(rebuilt) == state["model_fingerprint"]
    assert json.loads(state["model_config"])["vocab_size"] == 256
    assert set(state["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json"}


OFFLINE = ["--offline", "--max-corpus-mb", "0.3", "--seq-len", "32", "--batch-size", "2", "--instances", "1"]
OFFLINE += ["--inner-steps", "2", "--b-max", "2", "--threads", "1"]


def test_an_offline_node_checkpoints_resumes_and_its_checkpoint_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`adloco-node --offline --checkpoint-dir` keeps its work as a swarm node does (it wrote nothing
    before): a run of 3 rounds with a checkpoint every 2 leaves rounds 2 and 3; the next run resumes
    at round 3 and trains its 2 rounds on from there; `export` turns the newest (round 5) into a
    folder that transformers loads."""
    ckpt = tmp_path / "ckpt"
    flags = [*OFFLINE, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    assert entry.main([*flags, "--rounds", "3"]) == 0
    assert sorted(
        int(json.loads((p / "meta.json").read_text())["round"]) for p in list_checkpoints(ckpt)
    ) == [2, 3]
    capsys.readouterr()
    assert entry.main([*flags, "--rounds", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[local round=")]
    assert [ln.split("]")[0] for ln in lines] == ["[local round=4", "[local round=5"], lines
    rc, out, err = export(ckpt, tmp_path / "hf", capsys)
    assert rc == 0 and "θ of round 5" in out, err
    ids = torch.tensor([list(TEXT.encode())])
    assert hf_logits(tmp_path / "hf", ids).shape[-1] == 256


@pytest.mark.parametrize(
    "flags",
    [
        ["--peers", "/ip4/127.0.0.1/tcp/1/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"],
        ["--run-id", "r"],
        ["--metrics-port", "9100"],
        ["--status-file", "s.jsonl"],
        ["--overlap", "mix"],
        ["--replay-mb", "64"],
    ],
)
def test_an_offline_node_refuses_a_flag_it_cannot_honour_in_one_line(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A flag of a networked node given with --offline was silently ignored; it is refused, naming
    it, before anything trains (the values training alone does honour pass: --overlap off,
    --replay-mb 0)."""
    assert entry.main([*OFFLINE, "--rounds", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"adloco-node: error: {flags[0]}: an --offline node") and err.count("\n") == 1


def test_sigterm_stops_an_offline_node_after_its_round_with_that_round_checkpointed(tmp_path: Path) -> None:
    """SIGTERM to `adloco-node --offline --rounds 0` (train until stopped): it finishes the round it
    is in, writes that round's checkpoint and exits 0."""
    ckpt = tmp_path / "ckpt"
    cmd = [
        sys.executable,
        "-m",
        "adloco.node.cli.entry",
        *OFFLINE,
        "--rounds",
        "0",
        "--checkpoint-dir",
        str(ckpt),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("[local round=1]"), first
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0
    last = [ln for ln in [first, *rest.splitlines()] if ln.startswith("[local round=")][-1]
    newest = list_checkpoints(ckpt)[0]
    assert last.startswith(f"[local round={int(newest.name.split('-')[1])}]"), (last, newest)
