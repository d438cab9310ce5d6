"""The node's local control service: the gRPC server of protocol/control.proto and what it reports.

`ControlServer` answers Status, Drain and Checkpoint by calling back into the node (the callbacks
run on the server's worker threads, so they must be thread-safe); `NodeStatus`, with
`AveragingInfo` and `ScheduleInfo`, is what Status reports, and `PHASES` the phases a node is in.
The server binds 127.0.0.1:7601 by default and refuses a non-loopback address unless `allow_remote`
is set (`check_bind`, which the node's CLI also calls before any networking starts): the service has
no authentication, and anyone who reaches it can drain the node. Its client, `adloco-node ctl`, is
node/operations/ctl.py, which imports this module for the status types; so this module imports no
torch.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import metadata
from types import TracebackType
from typing import Any, TypeVar

import grpc

from ...errors import UserError
from ...protocol.control import control_pb2 as pb
from ...protocol.control import control_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

DEFAULT_CONTROL_HOST = "127.0.0.1"
DEFAULT_CONTROL_PORT = 7601
PHASES = ("starting", "training", "averaging", "waiting", "draining", "stopped")
# gRPC sets SO_REUSEPORT by default, which lets a second node bind the same port and silently
# receive half of the calls; with it off, a port in use is an error.
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]

T = TypeVar("T")


def package_version() -> str:
    try:
        return metadata.version("adloco-node")
    except metadata.PackageNotFoundError:
        return "unknown"


# ---- what Status reports ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AveragingInfo:
    """The node's last averaging attempt: group size (this node included), staleness τ, bytes on
    the wire (framing included), the codec, how long it took, and why it failed when not ok."""

    round: int
    ok: bool
    group_size: int = 0
    staleness: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    codec: str = ""
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class ScheduleInfo:
    """The schedule the node runs: b per instance slot, H, this node's accumulation per slot, K."""

    batch_sizes: tuple[int, ...]
    inner_steps: int
    accumulation: tuple[int, ...] = ()
    instances: int = 0  # 0: len(batch_sizes)
    codec: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        object.__setattr__(self, "accumulation", tuple(self.accumulation))
        if self.instances == 0:
            object.__setattr__(self, "instances", len(self.batch_sizes))


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    """What `ctl status` shows. phase is one of PHASES ("unknown" only when decoding a newer node's
    reply). problem: empty when healthy, else why not (`ctl status` then exits 1). None: not yet."""

    peer_id: str
    run_id: str
    round: int
    phase: str
    peers_visible: int = 0
    last_averaging: AveragingInfo | None = None
    schedule: ScheduleInfo | None = None
    val_loss: float | None = None
    inner_loss: float | None = None
    tokens_per_s: float = 0.0
    uptime_s: float = 0.0
    last_checkpoint_round: int | None = None
    last_checkpoint_path: str = ""
    version: str = field(default_factory=package_version)
    problem: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (what `ctl status --json` prints)."""
        return asdict(self)

    def to_proto(self) -> pb.StatusReply:
        if self.phase not in PHASES:
            raise ValueError(f"NodeStatus.phase must be one of {PHASES}, got {self.phase!r}")
        reply = pb.StatusReply(
            peer_id=self.peer_id,
            run_id=self.run_id,
            round=self.round,
            phase=pb.Phase.Value("PHASE_" + self.phase.upper()),
            peers_visible=self.peers_visible,
            val_loss=self.val_loss,
            inner_loss=self.inner_loss,
            tokens_per_s=self.tokens_per_s,
            uptime_s=self.uptime_s,
            last_checkpoint_round=self.last_checkpoint_round,
            last_checkpoint_path=self.last_checkpoint_path,
            version=self.version,
            problem=self.problem,
        )
        if self.last_averaging is not None:
            reply.last_averaging.CopyFrom(pb.AveragingResult(**asdict(self.last_averaging)))
        if self.schedule is not None:
            reply.schedule.CopyFrom(pb.ScheduleInfo(**asdict(self.schedule)))
        return reply

    @classmethod
    def from_proto(cls, reply: pb.StatusReply) -> NodeStatus:
        def optional(name: str) -> Any:
            return getattr(reply, name) if reply.HasField(name) else None

        return cls(
            peer_id=reply.peer_id,
            run_id=reply.run_id,
            round=reply.round,
            phase=_phase_name(reply.phase),
            peers_visible=reply.peers_visible,
            last_averaging=_averaging_info(reply),
            schedule=_schedule_info(reply),
            val_loss=optional("val_loss"),
            inner_loss=optional("inner_loss"),
            tokens_per_s=reply.tokens_per_s,
            uptime_s=reply.uptime_s,
            last_checkpoint_round=optional("last_checkpoint_round"),
            last_checkpoint_path=reply.last_checkpoint_path,
            version=reply.version,
            problem=reply.problem,
        )


def _averaging_info(reply: pb.StatusReply) -> AveragingInfo | None:
    if not reply.HasField("last_averaging"):
        return None
    a = reply.last_averaging
    return AveragingInfo(
        round=a.round,
        ok=a.ok,
        group_size=a.group_size,
        staleness=a.staleness,
        bytes_sent=a.bytes_sent,
        bytes_received=a.bytes_received,
        codec=a.codec,
        seconds=a.seconds,
        error=a.error,
    )


def _schedule_info(reply: pb.StatusReply) -> ScheduleInfo | None:
    if not reply.HasField("schedule"):
        return None
    s = reply.schedule
    return ScheduleInfo(
        batch_sizes=tuple(s.batch_sizes),
        inner_steps=s.inner_steps,
        accumulation=tuple(s.accumulation),
        instances=s.instances,
        codec=s.codec,
    )


def _phase_name(value: int) -> str:
    name = pb.Phase.Name(value) if value in pb.Phase.values() else "PHASE_UNKNOWN"
    phase = name.removeprefix("PHASE_").lower()
    return phase if phase in PHASES else "unknown"


# ---- the server ---------------------------------------------------------------------------------


class _Servicer(pb_grpc.ControlServicer):
    def __init__(
        self,
        status: Callable[[], NodeStatus],
        drain: Callable[[], str],
        checkpoint: Callable[[], tuple[int, str]],
    ) -> None:
        self._status, self._drain, self._checkpoint = status, drain, checkpoint

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return _answer(context, "status", lambda: self._status().to_proto())

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainReply:
        try:
            return pb.DrainReply(accepted=True, message=self._drain())
        except Exception as e:  # e.g. already stopping: refused, not an RPC failure
            return pb.DrainReply(accepted=False, message=_one_line(e, with_type=False))

    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointReply:
        round_, path = _answer(context, "checkpoint", self._checkpoint)
        return pb.CheckpointReply(round=round_, path=str(path))


def _answer(context: grpc.ServicerContext, what: str, call: Callable[[], T]) -> T:
    """`call()`, with its exception turned into a gRPC status whose details say what went wrong:
    FAILED_PRECONDITION for a UserError (e.g. no checkpoint directory), INTERNAL for anything else."""
    try:
        return call()
    except UserError as e:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: {_one_line(e)}")
    except Exception as e:
        logger.exception("control: %s failed", what)
        context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {_one_line(e)}")
    raise AssertionError("unreachable: context.abort raises")


def _one_line(e: BaseException, *, with_type: bool = True) -> str:
    """The exception's message on one line, after its type unless it is a UserError (written for users)."""
    text = " ".join(str(e).split())
    if isinstance(e, UserError) or (text and not with_type):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class ControlServer:
    """The control service on `host:port` (port 0: any free port; `port` holds the bound one once
    started). Callbacks, each run on one of `max_workers` threads:
    `status()` -> NodeStatus: cheap and non-blocking (a HEALTHCHECK polls it).
    `drain()` -> a message: asks the node to finish the round, checkpoint and leave, and returns at
        once; raise to refuse (e.g. already stopping).
    `checkpoint()` -> (round, path) once written; may block until the round ends (the training
        thread writes it), so share one pending request between concurrent calls and fail it when
        the node stops. Raise UserError for "cannot" (e.g. no --checkpoint-dir).
    Start it after the DHT has forked its process: gRPC's threads and fork do not mix.
    """

    def __init__(
        self,
        *,
        status: Callable[[], NodeStatus],
        drain: Callable[[], str],
        checkpoint: Callable[[], tuple[int, str]],
        host: str = DEFAULT_CONTROL_HOST,
        port: int = DEFAULT_CONTROL_PORT,
        allow_remote: bool = False,
        max_workers: int = 4,
    ) -> None:
        host = check_bind(host, port, allow_remote=allow_remote)
        self.host = host
        self.port = port
        self._servicer = _Servicer(status, drain, checkpoint)
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def address(self) -> str:
        """HOST:PORT for `adloco-node ctl --address` (the bound port once started)."""
        return format_address(self.host, self.port)

    def start(self) -> None:
        """Bind and serve; raises UserError naming --control-port if the port is taken."""
        if self._server is not None:
            raise RuntimeError("ControlServer already started")
        if self.port != 0:
            # Checked first with a plain socket: gRPC's own failure logs a C-level line to stderr.
            _require_free(self.host, self.port)
        pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="adloco-control")
        server = grpc.server(pool, options=SERVER_OPTIONS)
        pb_grpc.add_ControlServicer_to_server(self._servicer, server)  # type: ignore[no-untyped-call]
        try:
            bound = server.add_insecure_port(self.address)
        except RuntimeError:  # grpcio >= 1.60 raises; older versions returned 0
            bound = 0
        if bound == 0:
            server.stop(None)
            pool.shutdown(wait=False)
            raise UserError(_port_in_use(self.host, self.port))
        server.start()
        self.port, self._server, self._pool = bound, server, pool
        logger.info("control service listening on %s", self.address)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; calls in progress get `grace` seconds to finish (None: cancelled at once)."""
        server, pool = self._server, self._pool
        self._server = self._pool = None
        if server is not None:
            server.stop(grace).wait()
        if pool is not None:
            pool.shutdown(wait=False)

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def check_bind(host: str, port: int, *, allow_remote: bool) -> str:
    """The host to bind (brackets of an IPv6 literal removed); UserError naming the flag otherwise.

    Called by the node's CLI before any networking starts, and again by `ControlServer`.
    """
    host = host.strip("[]")
    if not allow_remote and not is_loopback(host):
        raise UserError(
            f"--control-host: {host!r} is not a loopback address, and the control service has no"
            " authentication (anyone who reaches it can drain the node); use 127.0.0.1, or pass"
            " --control-allow-remote to expose it anyway"
        )
    if not 0 <= port <= 65535:
        raise UserError(f"--control-port: must be in [0, 65535] (0: any free port), got {port}")
    return host


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or "localhost"; a name that resolves elsewhere is not loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def format_address(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _require_free(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--control-host: cannot resolve {host!r}: {e.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            # As gRPC does: a port left in TIME_WAIT by a node that just exited is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError:
                raise UserError(_port_in_use(host, port)) from None


def _port_in_use(host: str, port: int) -> str:
    return (
        f"--control-port: cannot listen on {format_address(host, port)} (in use, perhaps by another"
        " node on this machine); pick another port, or 0 for any free one"
    )
