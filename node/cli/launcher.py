"""`adloco-swarm`: a local swarm on one machine, a bootstrap peer and N nodes as real processes.

    adloco-swarm --nodes 3 --rounds 20 --out runs/swarm -- --inner-steps 5 --codec int8

It starts `adloco-bootstrap`, waits for its multiaddrs, starts the nodes against it (arguments after
`--` go to every node), and prints one line per node whenever the node's status file shows a new
round (node/cli/progress.py). It ends when every node has exited or applied its rounds, or on
Ctrl-C/SIGTERM, stops every process group it started (node/cli/processes.py) and writes
DIR/summary.json. Exit status: 0 when every node applied all rounds and exited 0, 1 otherwise, 2 for
bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import UserError
from .processes import Child, SwarmError, describe_exit, find_script, log_tail, stop_children
from .progress import NodeView, StatusTail, build_summary, print_summary, swarm_succeeded

PROG = "adloco-swarm"
BOOTSTRAP_TIMEOUT_S = 60.0  # a cold start imports torch and hivemind and launches p2pd: ~5-20 s here
FINISH_GRACE_S = 30.0  # a node that applied its last round still leaves the swarm before exiting
POLL_S = 1.0
HEARTBEAT_S = 30.0  # a CI log shows the swarm is alive even while a round takes long
STAGGER_S = 0.5
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
    tokenizer: str | None = None


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
    p.add_argument(
        "--tokenizer",
        default=None,
        help="every node's --tokenizer (a tokenizer.json, a save_pretrained folder, or a cached model"
        " name; default: bytes)",
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
        if arg.split("=", 1)[0] == "--tokenizer" and args.tokenizer is not None:
            raise UserError("--tokenizer: given both before and after --; give it once")
    check_writable(args.out)
    return SwarmOptions(
        nodes=args.nodes,
        rounds=args.rounds,
        out=args.out,
        run_id=args.run_id or f"swarm-{secrets.token_hex(4)}",
        base_port=args.base_port,
        node_args=tuple(extra),
        tokenizer=node_tokenizer(args.tokenizer),
    )


def node_tokenizer(spec: str | None) -> str | None:
    """--tokenizer as the nodes get it: a path that exists made absolute, else as given (a model name
    in the cache, which the nodes look up; a wrong one makes every node exit with one line)."""
    if spec is None:
        return None
    if not spec.strip():
        raise UserError("--tokenizer: must not be empty")
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


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
        *(["--tokenizer", opts.tokenizer] if opts.tokenizer is not None else []),
        *opts.node_args,
    ]


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
        print_summary(summary, path, swarm.say)
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
