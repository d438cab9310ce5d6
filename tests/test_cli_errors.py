"""Bad input ends with one line naming the option, exit code 2 and no traceback, for both entry points.

Most cases call `main(argv)` in-process (no new interpreter); one case per entry point runs the
installed console script to show it behaves the same. Every argv starts from tiny sizes, so a case
that wrongly passes validation fails on its exit code in seconds instead of training for minutes.
Our own errors are one line, `PROG: error: --flag: ...`; argparse's own (a flag's type or choices)
are its usage block plus one `PROG: error: argument --flag: ...` line.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adloco.node.cli import entry as node_entry
from adloco.node.cli import node as node_cli
from adloco.node.cli import sim as sim_cli
from adloco.node.data.tokenizer import train_bpe

BIN = Path(sys.executable).parent
MAINS: dict[str, Callable[[list[str]], int]] = {
    "adloco-node": node_cli.main,
    "adloco-sim": sim_cli.main,
    "adloco-node tokenizer": lambda argv: node_entry.main(["tokenizer", *argv]),
    "adloco-node export": lambda argv: node_entry.main(["export", *argv]),
}
TINY = ["--max-corpus-mb", "1", "--rounds", "1", "--inner-steps", "1", "--batch-size", "1", "--seq-len", "32"]
TINY += ["--instances", "1", "--threads", "1"]


def base_argv(prog: str, tmp_path: Path) -> list[str]:
    """Tiny sizes, and for the simulator one peer and an output folder; case flags come after."""
    if prog == "adloco-sim":
        return [*TINY, "--peers", "1", "--quiet", "--out", str(tmp_path / "out")]
    return TINY


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """main() sets env defaults and a SIGTERM handler; keep both out of the rest of the session."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the token caches of the test files
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "1")
    # Unset, and unset again afterwards: the console-script test checks the entry point quiets datasets.
    monkeypatch.setenv("DATASETS_VERBOSITY", "")
    monkeypatch.delenv("DATASETS_VERBOSITY")
    monkeypatch.setattr(signal, "signal", lambda *_: None)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bad (and one tiny) dataset files."""
    d = tmp_path_factory.mktemp("data")
    (d / "empty.txt").write_text("")
    (d / "broken.jsonl").write_text('{"text": "fine"}\n{not json\n')
    (d / "good.jsonl").write_text('{"text": "hello world"}\n{"text": "more text"}\n')
    (d / "no_text").mkdir()
    (d / "no_text" / "image.bin").write_bytes(b"\x00\x01")
    (d / "tiny.txt").write_text(("the quick brown fox jumps over the lazy dog. " * 70)[:3000])
    (d / "bpe300.json").write_text(
        train_bpe(["the quick brown fox jumps over the lazy dog. " * 70], vocab_size=300)
    )
    for vocab in (256, 300, 1000):
        _llama_config(vocab).save_pretrained(d / f"llama{vocab}")
    _jetmoe_config().save_pretrained(d / "jetmoe")
    return d


def _llama_config(vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )


def _jetmoe_config() -> Any:
    """A causal LM that transformers cannot checkpoint (supports_gradient_checkpointing False)."""
    from transformers import JetMoeConfig

    return JetMoeConfig(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=1,
        num_key_value_heads=2,
        kv_channels=16,
        intermediate_size=64,
        num_local_experts=2,
        num_experts_per_tok=1,
    )


def assert_one_line(prog: str, err: str, option: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: {option}:"), err


def assert_argparse_error(prog: str, err: str, option: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("usage: "), err
    assert lines[-1].startswith(f"{prog}: error: argument {option}:"), err
    assert sum(f"{prog}: error:" in line for line in lines) == 1, err


def run_main(prog: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str]:
    try:
        rc: int | str | None = MAINS[prog](argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err


# (option the message must start with, flags after the base argv; "{d}" is the data folder)
DATA_CASES = [
    ("--model", ["--model", "no-such-model"]),
    ("--model", ["--model", "{d}/broken.jsonl"]),
    ("--dataset", ["--dataset", "{d}/empty.txt"]),
    ("--dataset", ["--dataset", "{d}/broken.jsonl"]),
    ("--dataset", ["--dataset", "{d}/missing.txt"]),
    ("--dataset", ["--dataset", "{d}/no_text"]),
    ("--dataset", ["--dataset", "no_such_dataset_xyz"]),
    ("--text-field", ["--dataset", "{d}/good.jsonl", "--text-field", "nope"]),
    ("--batch-size", ["--dataset", "{d}/tiny.txt", "--batch-size", "10000", "--seq-len", "64"]),
    ("--seq-len", ["--dataset", "{d}/tiny.txt", "--seq-len", "100000"]),
    ("--tokenizer", ["--tokenizer", "{d}/missing.json"]),
    ("--tokenizer", ["--tokenizer", "{d}/broken.jsonl"]),
    ("--tokenizer", ["--tokenizer", "no-such-org/no-such-model"]),  # not in the local cache
    # A config file states its vocabulary; it must be the tokenizer's (256 for bytes, 300 here).
    ("--model", ["--model", "{d}/llama1000"]),
    ("--model", ["--model", "{d}/llama256/config.json", "--tokenizer", "{d}/bpe300.json"]),
    ("--model", ["--model", "{d}/llama300", "--tokenizer", "bytes"]),
    ("--activation-checkpointing", ["--model", "{d}/jetmoe", "--activation-checkpointing"]),
]
TRAIN_CASES = [
    ("--codec", ["--codec", "int9"]),
    ("--codec", ["--codec", "lowrank:0"]),
    ("--codec", ["--codec", "lowrank:4:int3"]),
    ("--seq-len", ["--seq-len", "0"]),
    ("--batch-size", ["--batch-size", "0"]),
    ("--inner-steps", ["--inner-steps", "0"]),
    ("--instances", ["--instances", "1", "--min-instances", "2"]),
    ("--inner-lr", ["--inner-lr", "0"]),
    ("--outer-lr", ["--outer-lr", "-1"]),
    ("--outer-momentum", ["--outer-momentum", "1.5"]),
    ("--eta", ["--eta", "0"]),
    ("--outlier-factor", ["--outlier-factor", "-1"]),
    ("--batch-cap", ["--batch-cap", "0"]),
    ("--merge-every", ["--merge-every", "0"]),
    ("--max-rel-error", ["--codec", "adaptive", "--max-rel-error", "0"]),
    ("--b-max", ["--b-max", "0"]),
    ("--max-staleness", ["--max-staleness", "-1"]),
    ("--heloco-c-ok", ["--heloco-c-ok", "1.5"]),
    ("--replay-mb", ["--replay-mb", "-1"]),
    ("--max-corpus-mb", ["--max-corpus-mb", "0"]),
    ("--memory-budget-gb", ["--memory-budget-gb", "-1"]),
    ("--threads", ["--threads", "0"]),
    ("--device", ["--device", "nosuch"]),
    ("--device", ["--device", "cuda:99"]),
    ("--device", ["--device", "mps"]),  # not on this machine
    ("--device", ["--device", "meta"]),
    ("--device", ["--device", "cpu,nosuch"]),  # a list: every entry checked
    ("--device", ["--device", "cuda:0,cuda"]),  # one GPU named twice
    ("--device", ["--device", "cpu,meta"]),
]
SIM_CASES = [
    ("--rounds", ["--rounds", "-1"]),
    ("--rounds", ["--rounds", "0"]),
    ("--peers", ["--peers", "0"]),
    ("--slowdown", ["--slowdown", "garbage"]),
    ("--slowdown", ["--slowdown", "1,,2"]),
    ("--slowdown", ["--slowdown", "1,inf"]),
    ("--slowdown", ["--slowdown", "1,0"]),
    ("--bandwidth-mbps", ["--bandwidth-mbps", "0"]),
    ("--latency-s", ["--latency-s", "-1"]),
    ("--sec-per-sample", ["--sec-per-sample", "-1"]),
    ("--window-s", ["--mode", "async", "--window-s", "-5"]),
]
NODE_CASES = [
    ("--rounds", ["--rounds", "-1"]),
    ("--checkpoint-dir", ["--checkpoint-dir", "{d}/tiny.txt/ckpt"]),  # under a regular file
    ("--checkpoint-dir", ["--checkpoint-dir", "{d}/tiny.txt"]),
    ("--checkpoint-every", ["--checkpoint-every", "-1"]),
    ("--control-port", ["--control-port", "70000"]),
    ("--control-host", ["--control-host", "0.0.0.0"]),  # no auth: loopback unless allowed
    ("--metrics-port", ["--metrics-port", "70000"]),
    ("--peers", ["--peers", "/ip4/1.2.3.4/tcp/notaport"]),
    ("--host-maddrs", ["--host-maddrs", "not-a-multiaddr"]),
    ("--config", ["--config", "{d}/missing.yaml"]),
    ("--config", ["--config", "{d}/broken.jsonl"]),
    ("--state-chunk-mb", ["--state-chunk-mb", "1000"]),
    ("--state-chunk-mb", ["--state-chunk-mb", "0"]),
    ("--state-bandwidth-mbps", ["--state-bandwidth-mbps", "0"]),
    ("--state-timeout-floor-s", ["--state-timeout-floor-s", "-1"]),
    ("--state-donors", ["--state-donors", "0"]),
]
# The run owner's tools: `adloco-node tokenizer` and `adloco-node export` (argv after the command).
TOOL_CASES = [
    ("adloco-node tokenizer", "--vocab-size", ["--vocab-size", "100", "--out", "{t}/tok.json"]),
    ("adloco-node tokenizer", "--vocab-size", ["--vocab-size", "99999999", "--out", "{t}/tok.json"]),
    ("adloco-node tokenizer", "--min-frequency", ["--min-frequency", "0", "--out", "{t}/tok.json"]),
    ("adloco-node tokenizer", "--out", ["--out", "{d}"]),  # a folder
    ("adloco-node tokenizer", "--out", ["--out", "{d}/tiny.txt/tok.json"]),  # under a regular file
    ("adloco-node tokenizer", "--dataset", ["--dataset", "{d}/missing.txt", "--out", "{t}/tok.json"]),
    ("adloco-node tokenizer", "--max-corpus-mb", ["--max-corpus-mb", "0", "--out", "{t}/tok.json"]),
    ("adloco-node export", "--checkpoint-dir", ["--checkpoint-dir", "{d}/nothing", "--out", "{t}/hf"]),
    ("adloco-node export", "--checkpoint-dir", ["--checkpoint-dir", "{d}/no_text", "--out", "{t}/hf"]),
]
ARGPARSE_CASES = [
    ("--rounds", ["--rounds", "abc"]),
    ("--seq-len", ["--seq-len", "1.5"]),
    ("--inner-lr", ["--inner-lr", "nan"]),
    ("--outer-lr", ["--outer-lr", "inf"]),
    ("--batch-test", ["--batch-test", "bogus"]),
    ("--precision", ["--precision", "fp16"]),
]


@pytest.mark.parametrize("option", ["--metrics-port", "--host-maddrs"])
def test_port_in_use(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        flags = {
            "--metrics-port": ["--metrics-port", port, "--metrics-host", "127.0.0.1"],
            "--host-maddrs": ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
        }[option]
        rc, err = run_main("adloco-node", [*TINY, *flags], capsys)
    assert rc == 2, err
    assert_one_line("adloco-node", err, option)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ADLOCO_BATCH_SIZE", "lots"),
        ("ADLOCO_OVERLAP", "always"),
        ("ADLOCO_DYLU", "2"),
        ("ADLOCO_PRECISION", "half"),
        ("ADLOCO_ACTIVATION_CHECKPOINTING", "maybe"),
    ],
)
def test_bad_environment_variable(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(variable, value)
    rc, err = run_main("adloco-node", TINY, capsys)
    assert rc == 2, err
    assert_one_line("adloco-node", err, variable)


def case_id(case: tuple[str, list[str]]) -> str:
    return " ".join(case[1]).replace("{d}/", "")


def argv_of(flags: list[str], data: Path) -> list[str]:
    return [f.replace("{d}", str(data)) for f in flags]


@pytest.mark.parametrize("case", DATA_CASES + TRAIN_CASES + SIM_CASES, ids=case_id)
def test_sim_bad_input(
    case: tuple[str, list[str]], data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    option, flags = case
    rc, err = run_main("adloco-sim", [*base_argv("adloco-sim", tmp_path), *argv_of(flags, data)], capsys)
    assert rc == 2, err
    assert_one_line("adloco-sim", err, option)


@pytest.mark.parametrize("case", DATA_CASES + TRAIN_CASES + NODE_CASES, ids=case_id)
def test_node_bad_input(
    case: tuple[str, list[str]], data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    option, flags = case
    rc, err = run_main("adloco-node", [*base_argv("adloco-node", tmp_path), *argv_of(flags, data)], capsys)
    assert rc == 2, err
    assert_one_line("adloco-node", err, option)


@pytest.mark.parametrize("case", TOOL_CASES, ids=lambda case: f"{case[0]} {case_id(case[1:])}")
def test_tool_bad_input(
    case: tuple[str, str, list[str]], data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, option, flags = case
    argv = [f.replace("{t}", str(tmp_path)) for f in argv_of(flags, data)]
    rc, err = run_main(prog, argv, capsys)
    assert rc == 2, err
    assert_one_line(prog, err, option)
    assert not (tmp_path / "tok.json").exists() and not (tmp_path / "hf").exists()  # nothing written


def test_tool_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_main("adloco-node tokenizer", ["--vocab-size", "lots", "--out", "x.json"], capsys)
    assert rc == 2, err
    assert_argparse_error("adloco-node tokenizer", err, "--vocab-size")
    rc, err = run_main("adloco-node export", ["--out", "x"], capsys)
    assert rc == 2 and "the following arguments are required: --checkpoint-dir" in err, err


@pytest.mark.parametrize("case", ARGPARSE_CASES, ids=case_id)
@pytest.mark.parametrize("prog", ["adloco-sim", "adloco-node"])
def test_argparse_errors(
    prog: str, case: tuple[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    option, flags = case
    rc, err = run_main(prog, [*base_argv(prog, tmp_path), *flags], capsys)
    assert rc == 2, err
    assert_argparse_error(prog, err, option)


def console_script(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


@pytest.mark.parametrize(
    ("prog", "option", "flags"),
    [
        # Data loading through `datasets`: its own error logging must not add lines.
        ("adloco-node", "--dataset", ["--dataset", "{d}/broken.jsonl"]),
        ("adloco-sim", "--model", ["--model", "no-such-model"]),
    ],
)
def test_console_script(prog: str, option: str, flags: list[str], data: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [console_script(prog), *base_argv(prog, tmp_path), *argv_of(flags, data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert_one_line(prog, proc.stderr, option)
