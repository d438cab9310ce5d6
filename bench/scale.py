"""Issue 11 §6, scale: rounds complete as the number of peers grows, and each peer's bytes stay flat.

1. Simulator: N virtual peers (the real peer code, in-memory transport) for a few sync rounds, at
   each N of `--sim-peers`. Per N: whether every round completed with all N in the group, the wall
   seconds per round on this machine (all N peers train on its cores in turn, so this grows with N),
   and the bytes each peer sends per round (the group's wire bytes over N) against 2(N−1)/N times
   one contribution W: its parts to their owners, (N−1)/N·W, and, as owner of 1/N of the model, the
   average of that part to the N−1 others. So a peer sends less than 2W whatever N: flat in N.
2. Real swarm: `adloco-swarm --nodes N` (a bootstrap peer and N node processes over the real p2pd,
   loopback) for a few rounds, at each N of `--swarm-nodes`. Per N: rounds every node completed,
   whether every node that applied a round holds the same θ, the median round seconds and group
   size, and the median bytes a node sends per round (`round_bytes`, framing included) against its
   contribution's size. All N nodes share this machine's CPU: seconds grow with N here.

Every run uses a fixed batch (no batch test, one MIT instance) and the int8 codec, so per-peer
bytes are comparable across N. `run(quick, seeds, out)` is what `adloco-bench` calls.

    python bench/scale.py --out /tmp/scale                # sim 4, 16, 64; swarm 3, 8
    python bench/scale.py --quick --out /tmp/scale
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from adloco.node.sim.engine import SimConfig, Simulator
from adloco.node.training.config import TrainConfig
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.schedule import ScheduleConfig

# The node flags of every swarm run (also the simulator's configuration).
SEQ_LEN, BATCH, INNER_STEPS = 64, 4, 5
NODE_ARGS = [
    "--seq-len",
    str(SEQ_LEN),
    "--batch-size",
    str(BATCH),
    "--inner-steps",
    str(INNER_STEPS),
    "--instances",
    "1",
    "--batch-test",
    "none",
    "--codec",
    "int8",
]


def sim_point(peers: int, rounds: int, seed: int) -> dict[str, Any]:
    cfg = TrainConfig(
        seq_len=SEQ_LEN,
        batch_size=BATCH,
        instances=1,
        inner_steps=INNER_STEPS,
        schedule=replace(ScheduleConfig(), test="none"),
        codec="int8",
        val_sequences=8,
        seed=seed,
        device="cpu",
        precision="fp32",
    )
    corpus, tokenizer = load_data(cfg)
    t0 = time.perf_counter()
    sim = Simulator(SimConfig(peers=peers, rounds=rounds, train=cfg), corpus, vocab_size=tokenizer.vocab_size)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = sim.run()
    wall = time.perf_counter() - t0
    per_peer = [r.round_bytes / r.group_size for r in records]
    contribution = records[0].contribution_bytes if records else 0
    return {
        "peers": peers,
        "rounds_done": len(records),
        "all_in_every_group": all(r.group_size == peers for r in records),
        "build_s": build_s,
        "wall_s_per_round": wall / max(len(records), 1),
        "bytes_sent_per_peer_round": statistics.median(per_peer),
        "contribution_bytes": contribution,
        "bytes_over_2(n-1)/n_w": statistics.median(per_peer) / (2 * (peers - 1) / peers * contribution)
        if peers > 1 and contribution
        else None,
        "final_val_loss": records[-1].val_loss if records else None,
    }


def swarm_point(nodes: int, rounds: int, seed: int, work: Path) -> dict[str, Any]:
    out = work / f"swarm-{nodes}"
    cmd = [
        sys.executable,
        "-m",
        "adloco.node.cli.launcher",
        "--nodes",
        str(nodes),
        "--rounds",
        str(rounds),
        "--out",
        str(out),
        "--",
        *NODE_ARGS,
        "--seed",
        str(seed),
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300 + 60 * nodes * rounds, check=False)
    wall = time.perf_counter() - t0
    summary_path = out / "summary.json"
    if not summary_path.is_file():
        raise RuntimeError(
            f"adloco-swarm --nodes {nodes} wrote no summary (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    summary = json.loads(summary_path.read_text())
    records = []
    for node in summary["nodes"]:
        status = out / node["name"] / "status.jsonl"
        for line in status.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "round":
                records.append(event)
    after_first = [r for r in records if r["round"] > 1] or records
    agree = summary["all_hashes_agree_per_round"]
    return {
        "nodes": nodes,
        "exit_code": done.returncode,
        "rounds_done_min": min(n["rounds_done"] for n in summary["nodes"]),
        "theta_agreed_every_round": bool(agree) and all(agree.values()),
        "round_s_median": statistics.median(r["round_s"] for r in after_first),
        "group_size_median": statistics.median(r["group_size"] for r in records),
        "bytes_sent_per_node_round": statistics.median(r["round_bytes"] for r in after_first),
        "contribution_bytes": statistics.median(r["contribution_bytes"] for r in records),
        "wall_s": wall,
    }


def run(
    quick: bool,
    seeds: list[int],
    out: Path,
    *,
    sim_peers: tuple[int, ...] | None = None,
    swarm_nodes: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The simulator and swarm sweeps (seeds[0]: these are counts and bytes, not losses)."""
    seed = seeds[0]
    sim_peers = sim_peers or ((2, 4) if quick else (4, 16, 64))
    # --quick leaves the swarm out: its node processes take half a minute to start on 2 cores.
    swarm_nodes = swarm_nodes if swarm_nodes is not None else (() if quick else (3, 8))
    rounds = 1 if quick else 2
    sims = []
    for n in sim_peers:
        point = sim_point(n, rounds, seed)
        print(f"scale: sim {n} peers: {point}", flush=True)
        sims.append(point)
    swarms = []
    with tempfile.TemporaryDirectory(prefix="adloco-scale-") as tmp:
        for n in swarm_nodes:
            point = swarm_point(n, rounds, seed, Path(tmp))
            print(f"scale: swarm {n} nodes: {point}", flush=True)
            swarms.append(point)
    sim_ok = [p["peers"] for p in sims if p["rounds_done"] == rounds and p["all_in_every_group"]]
    swarm_ok = [
        p["nodes"]
        for p in swarms
        if p["exit_code"] == 0 and p["rounds_done_min"] == rounds and p["theta_agreed_every_round"]
    ]
    ratios = [p["bytes_over_2(n-1)/n_w"] for p in sims if p["bytes_over_2(n-1)/n_w"] is not None]
    result = {
        "sim_peers_max": max(sim_ok, default=0),
        "swarm_nodes_max": max(swarm_ok, default=0) if swarms else None,
        # Flat in N: each peer's bytes per round over 2(N−1)/N·W, the largest across the simulated N.
        "sim_bytes_over_bound_max": max(ratios, default=None),
        "rounds": rounds,
        "skipped": {"swarm_nodes_max": "--quick leaves the swarm out"} if not swarms else {},
        "table": [{"where": "simulator", **p} for p in sims] + [{"where": "swarm", **p} for p in swarms],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim-peers", default=None, help="comma-separated N (default 4,16,64)")
    ap.add_argument("--swarm-nodes", default=None, help="comma-separated N (default 3,8; none with --quick)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    def counts(text: str | None) -> tuple[int, ...] | None:
        return tuple(int(x) for x in text.split(",")) if text else None

    t0 = time.perf_counter()
    result = run(
        args.quick,
        [args.seed],
        args.out,
        sim_peers=counts(args.sim_peers),
        swarm_nodes=counts(args.swarm_nodes),
    )
    print(json.dumps({k: v for k, v in result.items() if k != "table"}, indent=1))
    print(f"scale: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
