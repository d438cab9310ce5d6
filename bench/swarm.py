"""Benchmark: a swarm of real nodes training the GPT-2 124M config on this machine, and a late joiner.

A bootstrap peer and `--nodes` `adloco-node` processes (real p2pd, loopback) train `--rounds`
rounds together; once the first node has applied `--join-at` rounds, one more node starts, too far
behind to replay the few kept updates (124M int8 updates are ~125 MB each; `--replay-mb` keeps two),
so it downloads the state in chunks from the others and then trains with them. Measured and printed:

- seconds per round (median of every node's rounds after the first, which includes start-up);
- bytes per round per node (wire bytes sent, and the codec payload);
- peak resident memory per node process (VmHWM, sampled until it exits) and of its DHT and p2pd
  children, in GiB and bytes per parameter;
- the join: seconds from the joiner's start to its state download, the download's own seconds and
  the chunks each donor served, and seconds to its first applied round;
- whether every node that applied a round holds the same θ hash for it.

Every figure is measured when the script runs; all nodes share this machine's CPU, so seconds are
those of 2 cores split across the nodes. From the repository root:

    python bench/swarm.py                              # 3 nodes + joiner, 124M, ~20 GB, ~15 min on 2 cores
    python bench/swarm.py --model tiny-llama --join-at 3 --out /tmp/swarm.json   # a quick check
    python bench/swarm.py --nodes 2 --phases --out /tmp/swarm.json   # and each node's memory by phase
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from memory import GPT2_124M, TRAIN_ARGS, PeakWatcher, count_parameters, make_tokenizer

RESULTS = Path(__file__).resolve().parent / "results" / "swarm_124m.json"
NET = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--no-nat-port-map", "--control-port", "0"]


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Node:
    """One node process (its own process group: node, DHT process and p2pd), with its peak watcher."""

    def __init__(self, name: str, cmd: list[str], work: Path, *, status: bool = True) -> None:
        self.name, self.status = name, work / f"{name}.jsonl"
        self.log_path = work / f"{name}.log"
        self.log = self.log_path.open("w")
        self.started = time.time()
        self.proc = subprocess.Popen(
            [*cmd, "--status-file", str(self.status)] if status else cmd,
            cwd=work,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.watcher = PeakWatcher(self.proc.pid, interval_s=0.2)

    def rounds(self) -> list[dict]:
        return [e for e in _events(self.status) if e["event"] == "round"]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


# `--phases`: each node runs under bench/memory_phases.py, which reports its resident memory by phase.
PHASES = [sys.executable, str(Path(__file__).resolve().parent / "memory_phases.py")]


def _node_cmd(
    peers: list[str],
    model: list[str],
    *,
    rounds: int,
    shard: int,
    work: Path,
    name: str,
    extra: list[str],
    phases: bool = False,
) -> list[str]:
    return [
        *(PHASES if phases else ["adloco-node"]),
        "--peers", *peers, "--run-id", "bench", "--rounds", str(rounds),
        "--data-shard", str(shard), "--data-shards", "8", "--model", *model, *TRAIN_ARGS,
        "--threads", "1", "--checkpoint-dir", str(work / f"ckpt-{name}"), *NET, *extra,
    ]  # fmt: skip


def _node_args(args: argparse.Namespace) -> list[str]:
    """What every node gets on top of the benchmark's own arguments."""
    replay = [] if args.replay_mb is None else ["--replay-mb", str(args.replay_mb)]
    return [*args.node_arg, *replay]


def _wait(what: str, ok: Callable[[], bool], timeout_s: float, nodes: list[Node]) -> None:
    deadline = time.time() + timeout_s
    while not ok():
        failed = [n.name for n in nodes if n.proc.poll() not in (None, 0)]
        if failed:
            raise SystemExit(f"{what}: {failed} exited with an error (logs in the work folder)")
        if time.time() > deadline:
            raise SystemExit(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(1.0)


def _finish(nodes: list[Node], work: Path, what: str, timeout_s: float = 600) -> None:
    """Wait for each of `nodes` to exit (the others failing ends the wait); SystemExit naming those
    that exited with an error."""
    for node in nodes:
        _wait(f"{node.name} done", lambda n=node: n.proc.poll() is not None, timeout_s, nodes)
    failed = {n.name: n.proc.returncode for n in nodes if n.proc.returncode != 0}
    if failed:
        raise SystemExit(f"{what} failed: {failed} (logs in {work})")


def _peaks(node: Node, params: int) -> dict[str, float]:
    peaks = node.watcher.stop()
    own = peaks.get(node.proc.pid, ("", 0))[1]
    children = sum(hwm for pid, (_, hwm) in peaks.items() if pid != node.proc.pid)
    return {
        "node_gib": own / 2**30,
        "node_bytes_per_param": own / params,
        "dht_and_p2pd_gib": children / 2**30,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, object]:
    model, extra = args.model, []
    if model == "gpt2-124m":
        config = work / "gpt2-124m.json"
        config.write_text(json.dumps(GPT2_124M))
        model, params = str(config), count_parameters(config)
        extra = ["--tokenizer", str(make_tokenizer(work))]  # the config's vocabulary, as memory.py
    else:
        from adloco.node.model.model import build_model

        params = sum(p.numel() for p in build_model(model, vocab_size=256).parameters())
    node_args = _node_args(args)
    maddrs = work / "bootstrap.json"
    boot_cmd = ["adloco-bootstrap", "--identity-path", str(work / "b.key"), *NET[:3]]
    bootstrap = Node("bootstrap", [*boot_cmd, "--maddrs-file", str(maddrs)], work, status=False)
    nodes: list[Node] = []
    try:
        _wait("bootstrap", maddrs.exists, 120, [bootstrap])
        peers = json.loads(maddrs.read_text())
        for i in range(args.nodes):
            cmd = _node_cmd(
                peers,
                [model, *extra],
                rounds=args.rounds,
                shard=i,
                work=work,
                name=f"n{i}",
                extra=node_args,
                phases=args.phases,
            )
            nodes.append(Node(f"n{i}", cmd, work))
        _wait(f"round {args.join_at}", lambda: len(nodes[0].rounds()) >= args.join_at, args.timeout_s, nodes)
        cmd = _node_cmd(
            peers,
            [model, *extra],
            rounds=args.joiner_rounds,
            shard=args.nodes,
            work=work,
            name="joiner",
            extra=node_args,
            phases=args.phases,
        )
        joiner = Node("joiner", cmd, work)
        nodes.append(joiner)
        for node in nodes:
            _wait(f"{node.name} done", lambda n=node: n.proc.poll() is not None, args.timeout_s, nodes)
        failed = {n.name: n.proc.returncode for n in nodes if n.proc.returncode != 0}
        if failed:
            raise SystemExit(f"nodes failed: {failed} (logs in {work})")
    finally:
        for node in [*nodes, bootstrap]:
            node.kill()
    return summarize(nodes, joiner, params, args)


def summarize(nodes: list[Node], joiner: Node, params: int, args: argparse.Namespace) -> dict[str, object]:
    per_node: dict[str, object] = {}
    hashes: dict[int, set[str]] = {}
    round_s, sent, payload = [], [], []
    for node in nodes:
        rounds = node.rounds()
        for e in rounds:
            hashes.setdefault(e["round"], set()).add(e["theta_hash"])
        later = rounds[1:]
        round_s += [e["round_s"] for e in later]
        sent += [e["round_bytes"] for e in later]
        payload += [e["contribution_bytes"] for e in later]
        per_node[node.name] = {
            "rounds": [e["round"] for e in rounds],
            "group_sizes": [e["group_size"] for e in rounds],
            "round_s": [round(e["round_s"], 2) for e in rounds],
            **_peaks(node, params),
        }
        if args.phases:  # memory_phases.py's report, the node's last lines
            lines = node.log_path.read_text().splitlines()
            per_node[node.name]["phases"] = [ln for ln in lines if " peak " in ln or ln.startswith("VmHWM")]
    events = _events(joiner.status)
    download = next((e for e in events if e["event"] == "state_download"), None)
    first = next((e for e in events if e["event"] == "round"), None)
    joined = {
        "download_round": download and download["round"],
        "download_s": download and download["seconds"],
        "chunks_by_donor": download and download["chunks"],
        "start_to_download_done_s": download and download["time"] - joiner.started,
        "start_to_first_round_s": first and first["time"] - joiner.started,
        "first_round_group_size": first and first["group_size"],
        "caught_up_how": [e.get("how") for e in events if e["event"] in ("catch_up", "fork_healed")],
    }
    return {
        "params": params,
        "nodes": args.nodes,
        "rounds": args.rounds,
        "train_args": TRAIN_ARGS,
        "node_args": _node_args(args),
        "median_round_s": statistics.median(round_s) if round_s else None,
        "median_round_wire_bytes_sent": statistics.median(sent) if sent else None,
        "contribution_bytes": statistics.median(payload) if payload else None,
        "theta_agrees_every_round": all(len(h) == 1 for h in hashes.values()),
        "rounds_with_hashes": {r: len(h) for r, h in sorted(hashes.items())},
        "per_node": per_node,
        "join": joined,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m", help="gpt2-124m (default) or any --model spec")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--join-at", type=int, default=3, help="start the joiner after this many rounds")
    ap.add_argument("--joiner-rounds", type=int, default=2)
    ap.add_argument(
        "--replay-mb",
        type=float,
        help="every node's --replay-mb (0: no kept updates, so the joiner must download the state)",
    )
    ap.add_argument(
        "--node-arg", action="append", default=[], help="one more argument for every node (repeatable)"
    )
    ap.add_argument(
        "--phases", action="store_true", help="run each node under memory_phases.py: memory by phase"
    )
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="give up on any one wait after this")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="adloco-swarm-bench-"))
    result = run(args, work)  # a failure leaves the folder, with every node's log, behind
    shutil.rmtree(work)
    params = result["params"]
    print(json.dumps(result["per_node"], indent=1))
    print(
        f"{args.nodes} nodes + joiner, {params:,} params: median round {result['median_round_s']:.1f} s,"
        f" {result['median_round_wire_bytes_sent'] / 2**20:.1f} MiB sent per node per round"
        f" (Δ {result['contribution_bytes'] / 2**20:.1f} MiB encoded),"
        f" θ agrees: {result['theta_agrees_every_round']}"
    )
    print(f"join: {result['join']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
