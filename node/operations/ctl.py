"""`adloco-node ctl`: the client of a node's control service (node/operations/control.py).

`ctl_main` is `adloco-node ctl [--address HOST:PORT] [--timeout S] status|drain|checkpoint [--json]`:
`ControlClient` makes the call, `format_status` shows a status to people (`--json`: to machines),
and the exit status is 0 on success, 1 when the node is unreachable, unhealthy (its status names a
problem) or the command failed, 2 on a usage error; the Docker HEALTHCHECK is `adloco-node ctl
status`. The default address is $ADLOCO_CONTROL_ADDRESS, else 127.0.0.1:$ADLOCO_CONTROL_PORT, else
127.0.0.1:7601, so `ctl` finds a node started with the same environment. Neither this module nor
control.py imports torch, so `python -m adloco.node.operations.ctl` starts quickly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import TracebackType
from typing import Any

import grpc

from ...protocol.control import control_pb2 as pb
from ...protocol.control import control_pb2_grpc as pb_grpc
from .control import (
    DEFAULT_CONTROL_HOST,
    DEFAULT_CONTROL_PORT,
    AveragingInfo,
    NodeStatus,
    ScheduleInfo,
    format_address,
)

ADDRESS_ENV = "ADLOCO_CONTROL_ADDRESS"
PORT_ENV = "ADLOCO_CONTROL_PORT"
# Seconds a ctl call waits. A checkpoint is written between two rounds (save_checkpoint cannot run
# during a local round), so checkpoint-now may wait for the current round to end.
DEFAULT_TIMEOUTS_S = {"status": 5.0, "drain": 5.0, "checkpoint": 3600.0}
# A client must not go through an HTTP proxy from the environment to reach a loopback service.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


# ---- the client ---------------------------------------------------------------------------------


class ControlError(Exception):
    """A control call failed: no node at the address, no answer in time, or the node refused."""


class ControlClient:
    """Calls a node's control service at HOST:PORT; every call raises ControlError on failure."""

    def __init__(self, address: str, *, timeout: float | None = None) -> None:
        """timeout: seconds per call; None: DEFAULT_TIMEOUTS_S of the call."""
        self.address, self.timeout = address, timeout
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.ControlStub(self._channel)  # type: ignore[no-untyped-call]

    def status(self) -> NodeStatus:
        return NodeStatus.from_proto(self._call("status", self._stub.Status, pb.StatusRequest()))

    def drain(self) -> tuple[bool, str]:
        """(accepted, the node's message)."""
        reply = self._call("drain", self._stub.Drain, pb.DrainRequest())
        return reply.accepted, reply.message

    def checkpoint(self) -> tuple[int, str]:
        """(round, path) of the checkpoint the node wrote."""
        reply = self._call("checkpoint", self._stub.Checkpoint, pb.CheckpointRequest())
        return reply.round, reply.path

    def _call(self, what: str, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._timeout(what))
        except grpc.RpcError as e:
            raise ControlError(self._describe(what, e)) from None

    def _describe(self, what: str, e: grpc.RpcError) -> str:
        code, details = e.code(), " ".join((e.details() or "").split())
        if code == grpc.StatusCode.UNAVAILABLE:
            return f"no node answers at {self.address} (is it running, with this --control-port?): {details}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            hint = (
                " (it waits for the end of the current round; raise --timeout)"
                if what == "checkpoint"
                else ""
            )
            return f"no {what} answer from {self.address} within {self._timeout(what):g} s{hint}"
        return details or f"{what}: {code.name}"

    def _timeout(self, what: str) -> float:
        return DEFAULT_TIMEOUTS_S[what] if self.timeout is None else self.timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def default_address() -> str:
    """$ADLOCO_CONTROL_ADDRESS, else 127.0.0.1:$ADLOCO_CONTROL_PORT, else 127.0.0.1:7601."""
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV]
    return format_address(DEFAULT_CONTROL_HOST, int(os.environ.get(PORT_ENV) or DEFAULT_CONTROL_PORT))


def parse_address(text: str) -> str:
    """Validate HOST:PORT (IPv6 in brackets) for argparse; returns it unchanged."""
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT (e.g. 127.0.0.1:{DEFAULT_CONTROL_PORT}), got {text!r}"
        )
    return text


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


# ---- adloco-node ctl ----------------------------------------------------------------------------


def build_ctl_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adloco-node ctl",
        description="Talk to a running node's local control service.",
    )
    p.add_argument(
        "--address",
        type=parse_address,
        default=None,
        help=f"the node's control HOST:PORT (default: ${ADDRESS_ENV}, else 127.0.0.1:${PORT_ENV},"
        f" else 127.0.0.1:{DEFAULT_CONTROL_PORT})",
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=None,
        help="seconds to wait for the answer (default: 5; checkpoint: 3600, as it waits for the round's end)",
    )
    commands = p.add_subparsers(dest="command", required=True, metavar="{status,drain,checkpoint}")
    for name, text in (
        ("status", "round, phase, peers, last averaging, schedule (exit 1: unreachable or unhealthy)"),
        ("drain", "finish the round, write a checkpoint, leave the swarm and exit"),
        ("checkpoint", "write a checkpoint now and print its path"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("--json", action="store_true", help="one JSON object on stdout, for machines")
    return p


def ctl_main(argv: list[str]) -> int:
    """`adloco-node ctl ...`: 0 ok, 1 unreachable / unhealthy / failed, 2 usage error."""
    try:
        args = build_ctl_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    try:
        address = args.address or parse_address(default_address())
    except argparse.ArgumentTypeError as e:
        print(f"adloco-node ctl: error: ${ADDRESS_ENV}/${PORT_ENV}: {e}", file=sys.stderr)
        return 2
    except ValueError:
        print(f"adloco-node ctl: error: ${PORT_ENV}: not a port number", file=sys.stderr)
        return 2
    try:
        with ControlClient(address, timeout=args.timeout) as client:
            return _run_command(client, args.command, as_json=args.json)
    except ControlError as e:
        print(f"adloco-node ctl: error: {e}", file=sys.stderr)
        return 1


def _run_command(client: ControlClient, command: str, *, as_json: bool) -> int:
    if command == "status":
        status = client.status()
        print(json.dumps(status.to_dict()) if as_json else format_status(status), flush=True)
        if status.problem:
            print(f"adloco-node ctl: unhealthy: {status.problem}", file=sys.stderr)
            return 1
        return 0
    if command == "drain":
        accepted, message = client.drain()
        print(json.dumps({"accepted": accepted, "message": message}) if as_json else message, flush=True)
        return 0 if accepted else 1
    round_, path = client.checkpoint()
    text = json.dumps({"round": round_, "path": path}) if as_json else f"checkpoint of round {round_}: {path}"
    print(text, flush=True)
    return 0


def format_status(s: NodeStatus) -> str:
    """A few aligned lines for people."""
    rows = [
        ("peer", f"{s.peer_id}  run {s.run_id}  adloco-node {s.version}"),
        ("phase", f"{s.phase}  round {s.round}  {s.peers_visible} peers visible  up {_duration(s.uptime_s)}"),
        ("averaging", _format_averaging(s.last_averaging)),
        ("schedule", _format_schedule(s.schedule)),
        ("training", _format_training(s)),
        (
            "checkpoint",
            "none yet"
            if s.last_checkpoint_round is None
            else f"round {s.last_checkpoint_round}  {s.last_checkpoint_path}",
        ),
    ]
    if s.problem:
        rows.append(("problem", s.problem))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}".rstrip() for name, value in rows)


def _format_averaging(a: AveragingInfo | None) -> str:
    if a is None:
        return "none yet"
    outcome = "ok" if a.ok else f"failed ({a.error or 'no group'})"
    return (
        f"round {a.round} {outcome}  group {a.group_size}  τ={a.staleness}"
        f"  sent {a.bytes_sent / 1e6:.2f} MB  recv {a.bytes_received / 1e6:.2f} MB"
        f"  {a.codec}  {a.seconds:.1f} s"
    )


def _format_schedule(s: ScheduleInfo | None) -> str:
    if s is None:
        return "none yet"
    accumulation = f"  accum={list(s.accumulation)}" if s.accumulation else ""
    return f"b={list(s.batch_sizes)}  H={s.inner_steps}{accumulation}  K={s.instances}  codec {s.codec}"


def _format_training(s: NodeStatus) -> str:
    def loss(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    return f"val {loss(s.val_loss)}  inner {loss(s.inner_loss)}  {s.tokens_per_s:.0f} tok/s"


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


if __name__ == "__main__":
    sys.exit(ctl_main(sys.argv[1:]))
