"""Every option as a flag, an ADLOCO_* variable and a --config key: precedence and clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from adloco.errors import UserError
from adloco.node.cli.node import build_parser
from adloco.settings import parse_settings


def _parse(argv: list[str], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return parse_settings(build_parser(), argv, environ=env or {})


def test_flag_beats_environment_beats_config_beats_default(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("batch-size: 16\ninner_steps: 7\nrounds: 3\npeers: [/ip4/1.2.3.4/tcp/1/p2p/QmA]\n")
    args = _parse(["--config", str(config), "--rounds", "9"], {"ADLOCO_INNER_STEPS": "5"})
    assert args.rounds == 9  # flag
    assert args.inner_steps == 5  # environment over the file
    assert args.batch_size == 16  # file over the default
    assert args.peers == ["/ip4/1.2.3.4/tcp/1/p2p/QmA"]
    assert args.seq_len == 128  # default


def test_every_option_has_an_environment_variable() -> None:
    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        assert action.option_strings[-1] == "--" + action.dest.replace("_", "-"), action.option_strings


@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({"ADLOCO_OFFLINE": "yes"}, {"offline": True}),
        ({"ADLOCO_OFFLINE": "0"}, {"offline": False}),
        ({"ADLOCO_NO_RELAY": "true"}, {"no_relay": True}),
        (
            {"ADLOCO_PEERS": "/ip4/1.2.3.4/tcp/1 /ip4/5.6.7.8/tcp/2"},
            {"peers": ["/ip4/1.2.3.4/tcp/1", "/ip4/5.6.7.8/tcp/2"]},
        ),
        ({"ADLOCO_CODEC": "int4", "ADLOCO_OUTER_LR": "0.5"}, {"codec": "int4", "outer_lr": 0.5}),
        ({"ADLOCO_CHECKPOINT_DIR": "/tmp/x"}, {"checkpoint_dir": Path("/tmp/x")}),
    ],
)
def test_environment_values_are_typed_like_flags(env: dict[str, str], args: dict[str, object]) -> None:
    parsed = vars(_parse([], env))
    for key, value in args.items():
        assert parsed[key] == value


@pytest.mark.parametrize(
    ("env", "config", "fragment"),
    [
        ({"ADLOCO_BATCH_SIZE": "many"}, None, "ADLOCO_BATCH_SIZE: invalid value 'many'"),
        ({"ADLOCO_OUTER_LR": "nan"}, None, "ADLOCO_OUTER_LR: expected a finite number"),
        ({"ADLOCO_OVERLAP": "sometimes"}, None, "ADLOCO_OVERLAP: 'sometimes' is not one of off, auto"),
        ({"ADLOCO_OFFLINE": "maybe"}, None, "ADLOCO_OFFLINE: expected 1/0"),
        ({}, "bacth-size: 4\n", "unknown setting 'bacth-size'"),
        ({}, "batch-size: [4, 8]\n", "batch-size: takes one value, got a list"),
        ({}, "- a list\n", "must be a mapping"),
        ({}, "batch-size: [\n", "is not valid YAML"),
    ],
)
def test_bad_settings_name_the_variable_or_key(
    tmp_path: Path, env: dict[str, str], config: str | None, fragment: str
) -> None:
    argv = []
    if config is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(config)
        argv = ["--config", str(path)]
    with pytest.raises(UserError, match=None) as caught:
        _parse(argv, env)
    assert fragment in str(caught.value)


def test_missing_config_file_is_a_one_line_error_with_exit_2(tmp_path: Path) -> None:
    script = str(Path(sys.executable).parent / "adloco-node")
    done = subprocess.run(
        [script, "--config", str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--config: cannot read" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_bootstrap_reads_the_same_variables_and_config(tmp_path: Path) -> None:
    from adloco.dht_bootstrap.main import build_parser as bootstrap_parser

    config = tmp_path / "bootstrap.yaml"
    config.write_text("run-id: from-file\npoll-s: 2.5\n")
    env = {"ADLOCO_RUN_ID": "from-env", "ADLOCO_METRICS_PORT": "9401", "ADLOCO_CHECKPOINT_DIR": "/ignored"}
    args = parse_settings(bootstrap_parser(), ["--config", str(config)], environ=env)
    assert (args.run_id, args.metrics_port, args.poll_s) == ("from-env", 9401, 2.5)
    with pytest.raises(UserError, match="ADLOCO_POLL_S: invalid value"):
        parse_settings(bootstrap_parser(), [], environ={"ADLOCO_POLL_S": "soon"})


def test_trusted_peers_default_to_the_ids_in_peers_and_a_bad_id_is_named() -> None:
    from adloco.node.cli.node import swarm_from_args

    peer, chosen = "QmTd8RcjvSfpwd6VPP3YoVuP1MCziZWeRzR2Mei2wu2SS6", "Qm" + "a" * 44
    joined = swarm_from_args(_parse(["--peers", f"/ip4/1.2.3.4/tcp/31337/p2p/{peer}", "/ip4/5.6.7.8/tcp/1"]))
    assert joined.trusted_peers == {peer}
    assert swarm_from_args(_parse(["--trust-peers"])).trusted_peers == set()
    told = swarm_from_args(_parse(["--peers", f"/ip4/1.2.3.4/tcp/1/p2p/{peer}", "--trust-peers", chosen]))
    assert told.trusted_peers == {chosen}
    with pytest.raises(UserError, match="--trust-peers: 'x!' is not a peer id"):
        swarm_from_args(_parse(["--trust-peers", "x!"]))
