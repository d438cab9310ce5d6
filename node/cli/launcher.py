"""`adloco-swarm`: a local swarm on one machine, a bootstrap peer and N nodes as real processes.

    adloco-swarm --nodes 3 --rounds 20 --out runs/swarm -- --inner-steps 5 --codec int8

It starts `adloco-bootstrap`, waits for its multiaddrs, starts the nodes against it (arguments after
`--` go to every node), and prints one line per node whenever the node's status file
(DIR/node{i}/status.jsonl, one JSON object per line) shows a new round. It ends when every node has
exited or applied its rounds, or on Ctrl-C/SIGTERM, and writes DIR/summary.json (per node: rounds,
final validation loss, the θ hash of every round, bytes; per round: whether all θ hashes agree).

Every child leads its own session, because a peer's p2pd outlives its parent: stopping sends SIGTERM
to each group leader (the node shuts its DHT, averager and p2pd down itself), waits up to 30 s, then
SIGKILLs the whole group, and checks /proc that nothing of any group is left. Exit status: 0 when
every node applied all rounds and exited 0, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ...errors import UserError

PROG = "adloco-swarm"
BOOTSTRAP_TIMEOUT_S = 60.0  # a cold start imports torch and hivemind and launches p2pd: ~5-20 s here
STOP_TIMEOUT_S = 30.0  # DESIGN §4: a node exits 0 within 30 s of SIGTERM
KILL_TIMEOUT_S = 10.0  # after SIGKILL only the kernel is left to wait for
ORPHAN_GRACE_S = 5.0  # a group whose leader exited: p2pd may still be on its way out
FINISH_GRACE_S = 30.0  # a node that applied its last round still leaves the swarm before exiting
POLL_S = 1.0
HEARTBEAT_S = 30.0  # a CI log shows the swarm is alive even while a round takes long
STAGGER_S = 0.5
LOG_TAIL_LINES = 20
# Set by the launcher for every node; a pass-through copy would silently replace ours (argparse keeps
# the last), e.g. a second --status-file would blind the progress view.
MANAGED_NODE_FLAGS = (
    "--peers",
    "--run-id",
    "--rounds",
    "--host-maddrs",
    "--no-nat-port-map",
    "--status-file",
    "--checkpoint-dir",
    "--control-port",
    "--data-shard",
    "--data-shards",
)


# ---- options -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwarmOptions:
    nodes: int
    rounds: int
    out: Path
    run_id: str
    base_port: int
    node_args: tuple[str, ...]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Start a bootstrap peer and N adloco nodes on this machine and show their progress."
        " Arguments after -- are passed to every node.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nodes", type=int, required=True, help="number of node processes")
    p.add_argument("--rounds", type=int, required=True, help="rounds every node trains before exiting")
    p.add_argument("--out", type=Path, required=True, help="folder for logs, status files and summary.json")
    p.add_argument("--run-id", default=None, help="run id of the swarm (default: a fresh random one)")
    p.add_argument(
        "--base-port",
        type=int,
        default=0,
        help="0: every process picks a free port; P: bootstrap on P, node i on P+1+i",
    )
    return p


def parse_options(argv: Sequence[str]) -> SwarmOptions:
    """Parse and validate; bad values raise UserError naming the flag (argparse's own errors exit 2)."""
    argv = list(argv)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    if args.nodes < 1:
        raise UserError(f"--nodes: must be >= 1, got {args.nodes}")
    if args.rounds < 1:
        raise UserError(f"--rounds: must be >= 1, got {args.rounds}")
    if args.base_port != 0 and not 1024 <= args.base_port <= 65535 - args.nodes:
        raise UserError(f"--base-port: must be 0 or in 1024..{65535 - args.nodes}, got {args.base_port}")
    if args.run_id is not None and not args.run_id.strip():
        raise UserError("--run-id: must not be empty")
    for arg in extra:
        if arg.split("=", 1)[0] in MANAGED_NODE_FLAGS:
            raise UserError(f"--: {arg.split('=', 1)[0]} is set by {PROG} for every node; remove it")
    check_writable(args.out)
    return SwarmOptions(
        nodes=args.nodes,
        rounds=args.rounds,
        out=args.out,
        run_id=args.run_id or f"swarm-{secrets.token_hex(4)}",
        base_port=args.base_port,
        node_args=tuple(extra),
    )


def check_writable(out: Path) -> None:
    """Create --out and prove a file can be written there, before any process starts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise UserError(f"--out: cannot write to {out}: {e.strerror or e}") from None


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_node(nodes: int, cpus: int) -> int:
    return max(1, cpus // nodes)


def host_maddr(base_port: int, slot: int) -> str:
    """Listen address of slot 0 (the bootstrap) or 1+i (node i)."""
    return f"/ip4/127.0.0.1/tcp/{base_port + slot if base_port else 0}"


def bootstrap_argv(opts: SwarmOptions) -> list[str]:
    return [
        "--identity-path",
        str(opts.out / "bootstrap.key"),
        "--host-maddrs",
        host_maddr(opts.base_port, 0),
        "--no-nat-port-map",
        "--maddrs-file",
        str(opts.out / "bootstrap.json"),
    ]


def node_argv(opts: SwarmOptions, index: int, peers: Sequence[str], *, threads: int) -> list[str]:
    """Arguments of node `index`; the pass-through arguments come last (so they may override --threads)."""
    node_dir = opts.out / f"node{index}"
    return [
        "--peers",
        *peers,
        "--run-id",
        opts.run_id,
        "--rounds",
        str(opts.rounds),
        "--host-maddrs",
        host_maddr(opts.base_port, 1 + index),
        "--no-nat-port-map",
        "--status-file",
        str(node_dir / "status.jsonl"),
        "--checkpoint-dir",
        str(node_dir / "checkpoints"),
        # Any free port: the nodes share this machine (`adloco-node ctl --address` from the log).
        "--control-port",
        "0",
        # Node i trains shard i of N: together the nodes cover the corpus, without overlap.
        "--data-shard",
        str(index),
        "--data-shards",
        str(opts.nodes),
        "--threads",
        str(threads),
        *opts.node_args,
    ]


# ---- status files --------------------------------------------------------------------------------


def parse_status_lines(data: bytes) -> tuple[list[dict[str, Any]], list[str], bytes]:
    """Split appended bytes into (records, malformed lines, unterminated rest to keep for next time)."""
    *lines, rest = data.split(b"\n")
    records: list[dict[str, Any]] = []
    bad: list[str] = []
    for raw in lines:
        if not raw.strip():
            continue
        record = _decode(raw)
        if record is None:
            bad.append(raw.decode(errors="replace"))
        else:
            records.append(record)
    return records, bad, rest


def _decode(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@dataclass
class StatusTail:
    """Reads a growing JSON-lines file incrementally; a line counts only once its newline is written."""

    path: Path
    offset: int = 0
    partial: bytes = b""

    def read(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Records and malformed lines appended since the last call (none while the file is missing)."""
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # truncated or replaced: start over
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return [], []
        self.offset += len(data)
        records, bad, self.partial = parse_status_lines(self.partial + data)
        return records, bad

    def finish(self) -> tuple[list[dict[str, Any]], list[str]]:
        """After the writer exited: also take an unterminated last line if it is a whole record."""
        records, bad = self.read()
        if self.partial.strip():
            record = _decode(self.partial)
            if record is None:
                bad.append(self.partial.decode(errors="replace"))
            else:
                records.append(record)
        self.partial = b""
        return records, bad


@dataclass
class NodeView:
    """What the status file of one node has said so far."""

    name: str
    peer_id: str | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    done_rounds: int | None = None
    exit_code: int | None = None

    def apply(self, records: Sequence[dict[str, Any]]) -> list[str]:
        """Fold new records in; returns the progress lines they call for (at most one round line)."""
        lines = []
        new_rounds = []
        for rec in records:
            event = rec.get("event")
            if event == "start":
                self.peer_id = str(rec.get("peer_id"))
                lines.append(f"[{self.name}] started as {self.peer_id}")
            elif event == "round":
                self.rounds.append(rec)
                new_rounds.append(rec)
            elif event == "done":
                self.done_rounds = _int(rec.get("rounds"))
            elif event in ("catch_up", "state_download"):
                lines.append(f"[{self.name}] {event} to round {rec.get('round')} from {rec.get('source')}")
        if new_rounds:
            lines.append(format_round(self.name, new_rounds[-1]))
        if self.done_rounds is not None and any(r.get("event") == "done" for r in records):
            lines.append(f"[{self.name}] done after {self.done_rounds} rounds")
        return lines

    @property
    def rounds_done(self) -> int:
        return self.done_rounds if self.done_rounds is not None else len(self.rounds)

    def reached(self, rounds: int) -> bool:
        return self.done_rounds is not None or len(self.rounds) >= rounds


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _fmt(value: Any, spec: str) -> str:
    number = _num(value)
    return "?" if number is None else format(number, spec)


def format_bytes(value: Any) -> str:
    number = _num(value)
    if number is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if number >= scale:
            return f"{number / scale:.1f}{unit}"
    return f"{number:.0f}B"


def format_round(name: str, rec: dict[str, Any]) -> str:
    """One progress line, e.g. `[node2 round=3] val 3.210 inner 3.400 2450 tok/s sent 1.2MB ...`."""
    theta = str(rec.get("theta_hash", "?"))[:8]
    return (
        f"[{name} round={rec.get('round', '?')}] val {_fmt(rec.get('val_loss'), '.3f')}"
        f" inner {_fmt(rec.get('inner_loss'), '.3f')} {_fmt(rec.get('tokens_per_s'), '.0f')} tok/s"
        f" sent {format_bytes(rec.get('bytes_sent'))} recv {format_bytes(rec.get('bytes_received'))}"
        f" group={rec.get('group_size', '?')} τ={rec.get('staleness', '?')}"
        f" {_fmt(rec.get('round_s'), '.1f')}s θ={theta}"
    )


# ---- summary -------------------------------------------------------------------------------------


def hashes_agree(views: Sequence[NodeView]) -> dict[int, bool]:
    """Per round number: whether every node that applied that round reported the same θ hash."""
    seen: dict[int, set[str]] = {}
    for view in views:
        for rec in view.rounds:
            number = _int(rec.get("round"))
            if number is not None:
                seen.setdefault(number, set()).add(str(rec.get("theta_hash")))
    return {number: len(hashes) == 1 for number, hashes in sorted(seen.items())}


def node_summary(view: NodeView, *, pid: int | None) -> dict[str, Any]:
    """One node's entry; bytes are the node's cumulative counters as of its last round."""
    last = view.rounds[-1] if view.rounds else {}
    return {
        "name": view.name,
        "peer_id": view.peer_id,
        "rounds_done": view.rounds_done,
        "final_val_loss": _num(last.get("val_loss")),
        "theta_hashes": [rec.get("theta_hash") for rec in view.rounds],
        "bytes_sent": _int(last.get("bytes_sent")) or 0,
        "bytes_received": _int(last.get("bytes_received")) or 0,
        "exit_code": view.exit_code,
        "pid": pid,
    }


def build_summary(
    *,
    run_id: str,
    views: Sequence[NodeView],
    pids: Sequence[int | None],
    wall_s: float,
    bootstrap: dict[str, Any],
    survivors: Sequence[int],
) -> dict[str, Any]:
    """summary.json; `all_hashes_agree_per_round` keys are round numbers (strings once in JSON)."""
    return {
        "run_id": run_id,
        "nodes": [node_summary(view, pid=pid) for view, pid in zip(views, pids, strict=True)],
        "all_hashes_agree_per_round": hashes_agree(views),
        "wall_s": round(wall_s, 3),
        "bootstrap": bootstrap,
        "survivors": list(survivors),
    }


def swarm_succeeded(views: Sequence[NodeView], rounds: int, survivors: Sequence[int]) -> bool:
    """Every node applied `rounds` rounds and exited 0, and no process outlived its group's stop."""
    return not survivors and all(v.rounds_done >= rounds and v.exit_code == 0 for v in views)


# ---- processes -----------------------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group `pgid`, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command: state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def find_script(name: str) -> str:
    """A console script of this installation (next to the interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise SwarmError(f"{name} not found next to {sys.executable} or on PATH; is adloco-node installed?")
    return found


def describe_pids(pids: Sequence[int]) -> str:
    """`123 (p2pd), 456 (python3)`: what each pid is, from /proc."""
    names = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            name = "gone"
        names.append(f"{pid} ({name})")
    return ", ".join(names)


def describe_exit(code: int) -> str:
    """Popen's return code in words: `2`, or `-9 (SIGKILL)` for a death by signal."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"    (no log: {e.strerror})"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


class SwarmError(Exception):
    """The swarm could not be brought up (not the user's input): `adloco-swarm: error: ...`, exit 1."""


@dataclass
class Child:
    """A started process that leads its own session (pgid == pid), with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    orphaned_at: float | None = None
    killed: bool = False

    @classmethod
    def start(cls, name: str, argv: Sequence[str], log_path: Path) -> Child:
        log_file = log_path.open("wb")
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return cls(name, proc, log_path, log_file)

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def members(self) -> list[int]:
        self.proc.poll()  # reap the leader so it does not linger as a zombie
        return group_members(self.proc.pid)

    def kill_orphans(self) -> None:
        """SIGKILL the group once its leader has been gone for ORPHAN_GRACE_S (e.g. a p2pd left behind)."""
        if self.proc.returncode is None or self.killed:
            return
        if self.orphaned_at is None:
            self.orphaned_at = time.monotonic()
        elif time.monotonic() - self.orphaned_at > ORPHAN_GRACE_S and (left := self.members()):
            print(f"[{self.name}] exited but left {describe_pids(left)} running: SIGKILL", flush=True)
            self.signal_group(signal.SIGKILL)
            self.killed = True


def stop_children(children: Sequence[Child], *, hurry: threading.Event) -> list[int]:
    """SIGTERM each leader, wait up to STOP_TIMEOUT_S, SIGKILL what is left of each group.

    Only the leader gets SIGTERM: hivemind's DHT and averager processes and p2pd share its group and
    must stay up while the node leaves the swarm and writes its checkpoint. What a leader leaves behind
    when it exits has no one left to stop it and is killed after ORPHAN_GRACE_S. Returns the pids
    still alive after the SIGKILL (should be none).
    """
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    live = _live(children)
    while live and time.monotonic() < deadline and not hurry.is_set():
        for child in live:
            child.kill_orphans()
        time.sleep(0.1)
        live = _live(children)
    for child in live:
        print(f"[{child.name}] still running {STOP_TIMEOUT_S:.0f}s after SIGTERM: SIGKILL", flush=True)
        child.signal_group(signal.SIGKILL)
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while _live(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=1)
        child.log_file.close()
    return [pid for child in children for pid in child.members()]


def _live(children: Sequence[Child]) -> list[Child]:
    return [child for child in children if child.members()]


# ---- the swarm -----------------------------------------------------------------------------------


class Swarm:
    """Owns the bootstrap and node processes of one run, their views and the progress output."""

    def __init__(self, opts: SwarmOptions, *, stop: threading.Event, hurry: threading.Event) -> None:
        self.opts, self.stop, self.hurry = opts, stop, hurry
        self.bootstrap: Child | None = None
        self.bootstrap_maddrs: list[str] = []
        self.nodes: list[Child] = []
        self.views = [NodeView(f"node{i}") for i in range(opts.nodes)]
        self.tails = [StatusTail(opts.out / f"node{i}" / "status.jsonl") for i in range(opts.nodes)]
        self.reported_exit: set[int] = set()
        self.stopping = False  # nodes exiting from here on were stopped by us, not crashed
        self.last_output = time.monotonic()

    def say(self, line: str, *, err: bool = False) -> None:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
        self.last_output = time.monotonic()

    def prepare_out(self) -> None:
        """Remove what a previous run in the same folder left, so no stale record is read as new and
        no node resumes from an old checkpoint (every launch is a new swarm)."""
        out = self.opts.out
        for stale in [out / "bootstrap.json", out / "summary.json", *(t.path for t in self.tails)]:
            stale.unlink(missing_ok=True)
        for i in range(self.opts.nodes):
            (out / f"node{i}").mkdir(exist_ok=True)
            shutil.rmtree(out / f"node{i}" / "checkpoints", ignore_errors=True)

    def start_bootstrap(self) -> None:
        argv = [find_script("adloco-bootstrap"), *bootstrap_argv(self.opts)]
        self.bootstrap = Child.start("bootstrap", argv, self.opts.out / "bootstrap.log")
        self.bootstrap_maddrs = self.wait_for_maddrs(self.bootstrap, self.opts.out / "bootstrap.json")
        self.say(f"[swarm] bootstrap up (pid {self.bootstrap.proc.pid}): {' '.join(self.bootstrap_maddrs)}")

    def wait_for_maddrs(self, child: Child, path: Path) -> list[str]:
        deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
        while time.monotonic() < deadline and not self.stop.is_set():
            if path.exists():  # written atomically by the bootstrap
                return list(json.loads(path.read_text()))
            if child.proc.poll() is not None:
                raise SwarmError(
                    f"the bootstrap exited with code {child.proc.returncode} before publishing its "
                    f"multiaddrs; end of {child.log_path}:\n{log_tail(child.log_path)}"
                )
            time.sleep(0.1)
        if self.stop.is_set():
            raise SwarmError("interrupted while waiting for the bootstrap")
        raise SwarmError(
            f"the bootstrap did not publish its multiaddrs within {BOOTSTRAP_TIMEOUT_S:.0f}s; "
            f"end of {child.log_path}:\n{log_tail(child.log_path)}"
        )

    def start_nodes(self) -> None:
        script = find_script("adloco-node")
        threads = threads_per_node(self.opts.nodes, cpu_count())
        for i in range(self.opts.nodes):
            if i and self.stop.wait(STAGGER_S):
                return
            argv = [script, *node_argv(self.opts, i, self.bootstrap_maddrs, threads=threads)]
            child = Child.start(f"node{i}", argv, self.opts.out / f"node{i}" / "log.txt")
            self.nodes.append(child)
            self.say(f"[node{i}] pid {child.proc.pid}, log {child.log_path}")

    def monitor(self) -> None:
        """Show progress until every node exited, or applied its rounds (plus a grace to exit), or stop."""
        finished_at: float | None = None
        while not self.stop.wait(POLL_S):
            self.poll()
            alive = [i for i, c in enumerate(self.nodes) if c.proc.returncode is None]
            if not alive:
                return
            if all(self.views[i].reached(self.opts.rounds) for i in alive):
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > FINISH_GRACE_S:
                    self.say(
                        f"[swarm] nodes finished but still running after {FINISH_GRACE_S:.0f}s: stopping"
                    )
                    return
            if time.monotonic() - self.last_output > HEARTBEAT_S:
                self.heartbeat(len(alive))

    def poll(self, *, final: bool = False) -> None:
        """Read new status records, print progress lines, report nodes that exited."""
        for i, (tail, view) in enumerate(zip(self.tails, self.views, strict=True)):
            records, bad = tail.finish() if final else tail.read()
            for line in bad:
                self.say(f"[{view.name}] ignoring a malformed status line: {line[:200]!r}", err=True)
            for line in view.apply(records):
                self.say(line)
            if i < len(self.nodes):
                self.report_exit(i)
                self.nodes[i].kill_orphans()  # a crashed node's p2pd must not linger in the swarm

    def report_exit(self, i: int) -> None:
        child, view = self.nodes[i], self.views[i]
        code = child.proc.poll()
        if code is None or i in self.reported_exit:
            return
        self.reported_exit.add(i)
        view.exit_code = code
        if code == 0:
            self.say(f"[{view.name}] exited 0")
        elif self.stopping:
            self.say(f"[{view.name}] stopped with exit code {describe_exit(code)}")
        else:
            alive = sum(c.proc.returncode is None for c in self.nodes)
            self.say(
                f"[{view.name}] CRASHED with exit code {describe_exit(code)} after {view.rounds_done} rounds"
                f" ({alive} of {len(self.nodes)} nodes still running); end of {child.log_path}:\n"
                f"{log_tail(child.log_path)}",
                err=True,
            )

    def heartbeat(self, alive: int) -> None:
        rounds = " ".join(f"{v.name}={len(v.rounds)}" for v in self.views)
        self.say(f"[swarm] {alive}/{len(self.nodes)} nodes running; rounds applied: {rounds}")

    def shutdown(self) -> list[int]:
        """Stop the nodes, then the bootstrap (the nodes may need it to leave); returns survivors."""
        self.stopping = True
        survivors = stop_children(self.nodes, hurry=self.hurry)
        self.poll(final=True)
        for i, child in enumerate(self.nodes):
            self.views[i].exit_code = child.proc.returncode
        if self.bootstrap is not None:
            survivors += stop_children([self.bootstrap], hurry=self.hurry)
            code = self.bootstrap.proc.returncode
            if code not in (0, None):
                self.say(
                    f"[bootstrap] exited with code {code}; end of its log:\n"
                    f"{log_tail(self.bootstrap.log_path)}",
                    err=True,
                )
        return survivors

    def summary(self, *, wall_s: float, survivors: Sequence[int]) -> dict[str, Any]:
        pids = [c.proc.pid for c in self.nodes] + [None] * (len(self.views) - len(self.nodes))
        boot = self.bootstrap
        return build_summary(
            run_id=self.opts.run_id,
            views=self.views,
            pids=pids,
            wall_s=wall_s,
            bootstrap={
                "pid": boot.proc.pid if boot else None,
                "exit_code": boot.proc.returncode if boot else None,
                "maddrs": self.bootstrap_maddrs,
            },
            survivors=survivors,
        )


def print_summary(swarm: Swarm, summary: dict[str, Any], path: Path) -> None:
    for node in summary["nodes"]:
        val = _fmt(node["final_val_loss"], ".3f")
        swarm.say(
            f"[swarm] {node['name']}: {node['rounds_done']} rounds, val {val}, sent"
            f" {format_bytes(node['bytes_sent'])} recv {format_bytes(node['bytes_received'])},"
            f" exit {node['exit_code']}"
        )
    agree = summary["all_hashes_agree_per_round"]
    disagree = [number for number, ok in agree.items() if not ok]
    if not agree:
        swarm.say("[swarm] no round was applied")
    elif disagree:
        swarm.say(f"[swarm] θ hashes DISAGREE in rounds {disagree}")
    else:
        swarm.say(f"[swarm] θ hashes agree in all {len(agree)} rounds")
    if summary["survivors"]:
        swarm.say(
            f"[swarm] ERROR: survived the SIGKILL of their group: {describe_pids(summary['survivors'])}",
            err=True,
        )
    swarm.say(f"[swarm] wrote {path} ({summary['wall_s']:.1f}s)")


def run(opts: SwarmOptions, *, stop: threading.Event, hurry: threading.Event) -> int:
    """Bring the swarm up, watch it, always stop it and write summary.json; returns the exit status."""
    t0 = time.monotonic()
    swarm = Swarm(opts, stop=stop, hurry=hurry)
    threads = threads_per_node(opts.nodes, cpu_count())
    swarm.say(
        f"[swarm] run {opts.run_id}: {opts.nodes} nodes x {opts.rounds} rounds,"
        f" {threads} threads each, output in {opts.out}"
    )
    survivors: list[int] = []
    try:
        swarm.prepare_out()
        swarm.start_bootstrap()
        swarm.start_nodes()
        swarm.monitor()
        if stop.is_set():
            swarm.say("[swarm] interrupted: stopping the nodes")
    except SwarmError as e:
        swarm.say(f"{PROG}: error: {e}", err=True)
    finally:
        survivors = swarm.shutdown()
        summary = swarm.summary(wall_s=time.monotonic() - t0, survivors=survivors)
        path = opts.out / "summary.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")
        print_summary(swarm, summary, path)
    return 0 if swarm_succeeded(swarm.views, opts.rounds, survivors) else 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        # A second Ctrl-C skips the 30 s grace and goes straight to SIGKILL.
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return run(opts, stop=stop, hurry=hurry)


if __name__ == "__main__":
    sys.exit(main())
