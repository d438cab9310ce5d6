"""The control service (node/operations/control.py) and its client (node/operations/ctl.py): a
real gRPC server on loopback, port 0, driven through `ctl_main` exactly as `adloco-node ctl` and the
HEALTHCHECK call it; the node behind it is a few callbacks. Also: the generated code in protocol/ is
what control.proto generates (no drift).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from adloco.errors import UserError
from adloco.node.operations.control import AveragingInfo, ControlServer, NodeStatus, ScheduleInfo
from adloco.node.operations.ctl import ADDRESS_ENV, PORT_ENV, ctl_main, format_status
from adloco.protocol.control import control_pb2 as pb

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[1]
STATUS = NodeStatus(
    peer_id="12D3KooWExamplePeer",
    run_id="run-a",
    round=12,
    phase="training",
    peers_visible=3,
    last_averaging=AveragingInfo(
        round=11,
        ok=True,
        group_size=3,
        staleness=1,
        bytes_sent=1_200_000,
        bytes_received=1_180_000,
        codec="int8",
        seconds=2.5,
    ),
    schedule=ScheduleInfo(batch_sizes=(16, 32), inner_steps=50, accumulation=(1, 2), codec="int8"),
    val_loss=3.5,
    inner_loss=3.25,
    tokens_per_s=12034.0,
    uptime_s=3723.0,
    last_checkpoint_round=10,
    last_checkpoint_path="/ckpt/round-10",
)


@dataclass
class FakeNode:
    """The callbacks a node supplies; `checkpoint_error` makes checkpoint-now fail."""

    status: NodeStatus = STATUS
    drains: int = 0
    checkpoints: int = 0
    checkpoint_error: Exception | None = None
    drain_error: Exception | None = None
    checkpoint_wait: threading.Event | None = None  # checkpoint blocks until it is set
    drained: threading.Event = field(default_factory=threading.Event)

    def get_status(self) -> NodeStatus:
        return self.status

    def drain(self) -> str:
        if self.drain_error is not None:
            raise self.drain_error
        self.drains += 1
        self.drained.set()
        return f"draining: finishing round {self.status.round}, then checkpoint and leave"

    def checkpoint(self) -> tuple[int, str]:
        self.checkpoints += 1
        if self.checkpoint_wait is not None:
            self.checkpoint_wait.wait(10)
        if self.checkpoint_error is not None:
            raise self.checkpoint_error
        return self.status.round, f"/ckpt/round-{self.status.round}"


@pytest.fixture
def node() -> FakeNode:
    return FakeNode()


@pytest.fixture
def address(node: FakeNode) -> Iterator[str]:
    server = ControlServer(status=node.get_status, drain=node.drain, checkpoint=node.checkpoint, port=0)
    server.start()
    try:
        assert server.port > 0
        yield server.address
    finally:
        server.stop(grace=None)


def ctl(address: str, *args: str) -> int:
    return ctl_main(["--address", address, "--timeout", "5", *args])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- status -------------------------------------------------------------------------------------


def test_status_prints_aligned_lines(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl(address, "status") == 0
    out = capsys.readouterr().out
    assert out == format_status(STATUS) + "\n"
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == [
        "peer",
        "phase",
        "averaging",
        "schedule",
        "training",
        "checkpoint",
    ]
    assert len({line.index(line.split()[1]) for line in lines}) == 1  # values start in one column
    assert "training  round 12  3 peers visible  up 1h02m03s" in out
    assert "round 11 ok  group 3  τ=1  sent 1.20 MB  recv 1.18 MB  int8  2.5 s" in out
    assert "b=[16, 32]  H=50  accum=[1, 2]  K=2  codec int8" in out


def test_status_json_round_trips_every_field(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl(address, "status", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(json.dumps(STATUS.to_dict()))
    assert data["schedule"]["instances"] == 2
    assert data["version"]


def test_status_before_the_first_round(
    node: FakeNode, address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    node.status = NodeStatus(peer_id="p", run_id="r", round=0, phase="starting")
    assert ctl(address, "status", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["last_averaging"] is None and data["schedule"] is None
    assert data["val_loss"] is None and data["last_checkpoint_round"] is None
    assert ctl(address, "status") == 0
    assert "averaging   none yet" in capsys.readouterr().out


def test_unhealthy_node_exits_1(node: FakeNode, address: str, capsys: pytest.CaptureFixture[str]) -> None:
    node.status = replace(STATUS, problem="no round applied for 900 s")
    assert ctl(address, "status") == 1
    captured = capsys.readouterr()
    assert "problem     no round applied for 900 s" in captured.out
    assert captured.err == "adloco-node ctl: unhealthy: no round applied for 900 s\n"


def test_failing_status_callback_exits_1(
    node: FakeNode, address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    node.status = replace(STATUS, phase="trainig")
    assert ctl(address, "status") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "status failed: ValueError: NodeStatus.phase must be one of" in err


# ---- drain and checkpoint ----------------------------------------------------------------------


def test_drain_calls_the_node(node: FakeNode, address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl(address, "drain") == 0
    assert node.drained.is_set() and node.drains == 1
    assert capsys.readouterr().out == "draining: finishing round 12, then checkpoint and leave\n"
    assert ctl(address, "drain", "--json") == 0
    assert json.loads(capsys.readouterr().out)["accepted"] is True


def test_refused_drain_exits_1(node: FakeNode, address: str, capsys: pytest.CaptureFixture[str]) -> None:
    node.drain_error = RuntimeError("already stopping")
    assert ctl(address, "drain", "--json") == 1
    assert json.loads(capsys.readouterr().out) == {
        "accepted": False,
        "message": "already stopping",
    }


def test_checkpoint_calls_the_node(node: FakeNode, address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl(address, "checkpoint") == 0
    assert capsys.readouterr().out == "checkpoint of round 12: /ckpt/round-12\n"
    assert ctl(address, "checkpoint", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"round": 12, "path": "/ckpt/round-12"}
    assert node.checkpoints == 2


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            OSError(28, "No space left on device"),
            "checkpoint failed: OSError: [Errno 28] No space left on device",
        ),
        (UserError("--checkpoint-dir is not set"), "checkpoint: --checkpoint-dir is not set"),
    ],
)
def test_checkpoint_error_exits_1_with_the_message(
    node: FakeNode, address: str, capsys: pytest.CaptureFixture[str], error: Exception, message: str
) -> None:
    node.checkpoint_error = error
    assert ctl(address, "checkpoint") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"adloco-node ctl: error: {message}\n"


def test_slow_checkpoint_times_out_with_a_hint(
    node: FakeNode, address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    release = threading.Event()
    node.checkpoint_wait = release
    try:
        assert ctl_main(["--address", address, "--timeout", "0.3", "checkpoint"]) == 1
    finally:
        release.set()
    err = capsys.readouterr().err
    assert (
        "no checkpoint answer from" in err
        and "within 0.3 s (it waits for the end of the current round" in err
    )


# ---- the client's failures and usage --------------------------------------------------------------


def test_unreachable_node_exits_1_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    assert ctl_main(["--address", f"127.0.0.1:{free_port()}", "--timeout", "2", "status"]) == 1
    assert time.monotonic() - t0 < 3
    err = capsys.readouterr().err
    assert err.startswith("adloco-node ctl: error: no node answers at 127.0.0.1:") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["reboot"],
        [],
        ["--address", "localhost", "status"],
        ["--address", "127.0.0.1:99999", "status"],
        ["--timeout", "0", "status"],
        ["status", "--yaml"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl_main(argv) == 2
    assert "adloco-node ctl: error:" in capsys.readouterr().err


def test_default_address_comes_from_the_environment(
    address: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ADDRESS_ENV, address)
    assert ctl_main(["status", "--json"]) == 0
    monkeypatch.delenv(ADDRESS_ENV)
    monkeypatch.setenv(PORT_ENV, address.rpartition(":")[2])
    assert ctl_main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["round"] == 12


def test_ctl_imports_no_torch() -> None:
    """`adloco-node ctl` (the HEALTHCHECK) answers without loading torch: the console script's
    entry dispatches before importing the node."""
    code = (
        "import sys; from adloco.node.cli.entry import main;"
        "code = main(['ctl', '--address', '127.0.0.1:1', '--timeout', '0.5', 'status']);"
        "sys.exit(10 + code if 'torch' in sys.modules else code)"
    )
    result = subprocess.run([sys.executable, "-c", code], timeout=25, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr  # unreachable node: 1; torch loaded: 11


# ---- binding ------------------------------------------------------------------------------------


def _server(node: FakeNode, **kwargs: Any) -> ControlServer:
    return ControlServer(status=node.get_status, drain=node.drain, checkpoint=node.checkpoint, **kwargs)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "example.org", "::"])
def test_remote_bind_is_refused(node: FakeNode, host: str) -> None:
    with pytest.raises(UserError, match=r"--control-host: .* --control-allow-remote"):
        _server(node, host=host, port=0)


def test_remote_bind_when_allowed(node: FakeNode, capsys: pytest.CaptureFixture[str]) -> None:
    with _server(node, host="0.0.0.0", port=0, allow_remote=True) as server:
        assert ctl(f"127.0.0.1:{server.port}", "status", "--json") == 0
    assert json.loads(capsys.readouterr().out)["peer_id"] == STATUS.peer_id


def test_port_in_use_names_the_option(node: FakeNode) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"--control-port: cannot listen on 127.0.0.1:{port}"):
            _server(node, port=port).start()


def test_second_node_on_the_same_port_is_refused(node: FakeNode) -> None:
    # gRPC's default SO_REUSEPORT would let both bind and split the calls between them.
    with _server(node, port=0) as first, pytest.raises(UserError, match="--control-port"):
        _server(node, port=first.port).start()


# ---- the generated code -------------------------------------------------------------------------


def test_status_proto_round_trip_and_unknown_phase() -> None:
    wire = STATUS.to_proto().SerializeToString()
    assert NodeStatus.from_proto(pb.StatusReply.FromString(wire)) == STATUS
    newer = pb.StatusReply(peer_id="p", phase=99)  # type: ignore[arg-type]  # a phase added by a newer node
    assert NodeStatus.from_proto(newer).phase == "unknown"


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed")
def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    from adloco.protocol.control.gen import OUTPUTS, generate

    generate(tmp_path)
    stale = [
        n for n in OUTPUTS if (tmp_path / n).read_text() != (ROOT / "protocol" / "control" / n).read_text()
    ]
    assert not stale, f"{stale} differ from control.proto: run `python -m adloco.protocol.control.gen`"


def test_generated_code_loads_next_to_hivemind() -> None:
    """Both register files in protobuf's default descriptor pool; the runtime must accept our gencode."""
    code = (
        "import hivemind, google.protobuf as p;"
        "from adloco.protocol.control import control_pb2, control_pb2_grpc;"
        "print(p.__version__, control_pb2.DESCRIPTOR.name)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1] == "adloco/protocol/control/control.proto"
