"""Issue 11 §4, the real system: compute utilization of real nodes behind shaped links.

Three `adloco-node` processes and a DHT bootstrap, each in its own network namespace on one bridge
(`tests/netns.py`, `Star`), every host link shaped with tbf at 10 or 100 Mbit/s in both directions.
The nodes train small-llama (4.3M parameters; an int8 Δ is ~4.4 MB, so at 10 Mbit/s an exchange
takes about as long as a local round here) with a fixed batch, for `rounds` rounds, with and without
one-step-delay overlap: at 10 Mbit/s with the int8 and the sparse codec, at 100 Mbit/s with int8.
The matchmaking window is the node's default (3 s).

Utilization of a node = the time it spent in inner steps (its rounds' `compute_s`) over the wall
time, from its first applied round to its last (round 1, with start-up, is left out). The figure is
the median over the three nodes; seconds per round and bytes a node sends per round likewise. Under
overlap a round's update lands while the next round trains, so this window starts inside round 2's
training and ends with the wait for round R's update: the two nearly cancel, and a figure may read a
point or two over 100 %. A key of the section takes the better of the two codecs at its rate. All
three nodes share this machine's cores (one torch thread each), as volunteers' nodes would not:
their compute is slower than alone, and so the link's share of a round is smaller than it would be.
A run whose nodes did not hold one θ after every round keeps their logs and status files in
out/disagreed/runN.

Needs root (network namespaces). From the repository root:

    python bench/system.py --out /tmp/system            # 6 runs, ~15 min on 2 cores
    python bench/system.py --quick --out /tmp/system    # one run at 100 Mbit/s, ~1 min
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from adloco.node.training.config import PUBLIC_AGGREGATE
from adloco.protocol.transport.identity import create_identity

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import netns  # the test suite's namespaces and process groups
from procs import Procs, wait_for

NODES = 3
NODE_ARGS = [
    *("--seq-len", "128", "--batch-size", "8", "--instances", "1", "--batch-test", "none"),
    *("--threads", "1", "--no-nat-port-map", "--control-port", "0"),
    *("--data-shards", str(NODES), "--max-corpus-mb", "4"),
]
FULL = {"model": "small-llama", "inner_steps": 30, "rounds": 5}
QUICK = {"model": "tiny-llama", "inner_steps": 5, "rounds": 2}


class Unavailable(Exception):
    """This machine cannot run the benchmark (no root, no iproute2)."""


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_run(
    *, rate_mbit: float, overlap: str, codec: str, model: str, inner_steps: int, rounds: int, work: Path
) -> dict[str, Any]:
    """One swarm behind links of `rate_mbit`; its figures per node and their medians."""
    work.mkdir(parents=True, exist_ok=True)
    procs = Procs(work)
    netns.remove_stale()
    lan = netns.Star(NODES + 1, rate_mbit=rate_mbit)
    try:
        maddrs_file = work / "bootstrap.json"
        lan.start(
            procs,
            0,
            "bootstrap",
            [
                "adloco-bootstrap",
                *("--identity-path", str(work / "b.key")),
                *("--host-maddrs", f"/ip4/{lan.addrs[0]}/tcp/0"),
                "--no-nat-port-map",
                *("--maddrs-file", str(maddrs_file)),
            ],
        )
        wait_for(maddrs_file.exists, timeout=120, what="bootstrap")
        peers = [m for m in json.loads(maddrs_file.read_text()) if f"/ip4/{lan.addrs[0]}/" in m]
        # A private run, each node admitting the others, under a public run's rule: a public run
        # refuses the sparse codec under it (re-encoded answers are checked by their norm only,
        # record 069), and a private one would reduce by the mean (the sparse answers gathered).
        keys = [work / f"node{host}.key" for host in range(1, NODES + 1)]
        allowlist = work / "peers.txt"
        allowlist.write_text("".join(f"{create_identity(str(key)).peer_id}\n" for key in keys))
        nodes = []
        for host in range(1, NODES + 1):
            status = work / f"node{host}.jsonl"
            argv = [
                "adloco-node",
                *("--peers", *peers),
                *("--identity-path", str(keys[host - 1]), "--allow-peers", str(allowlist)),
                *("--aggregate", PUBLIC_AGGREGATE),
                *("--run-id", "system", "--rounds", str(rounds)),
                *("--host-maddrs", f"/ip4/{lan.addrs[host]}/tcp/0"),
                *("--status-file", str(status), "--data-shard", str(host - 1)),
                *("--model", model, "--inner-steps", str(inner_steps)),
                *("--codec", codec, "--overlap", overlap),
                *NODE_ARGS,
            ]
            nodes.append((lan.start(procs, host, f"node{host}", argv), status))
        for i, (proc, _) in enumerate(nodes, start=1):
            code = proc.wait(timeout=120 + 60 * rounds)
            if code != 0:
                raise RuntimeError(f"node{i} exited {code}:\n{procs.log(f'node{i}')[-3000:]}")
    finally:
        leftover = procs.reap()
        lan.close()
        if leftover:
            raise RuntimeError(f"processes survived their group's SIGKILL: {leftover}")
    per_node = []
    hashes: dict[int, set[str]] = {}
    for _, status in nodes:
        records = [e for e in _events(status) if e["event"] == "round"]
        if len(records) < 2:
            raise RuntimeError(f"{status.name}: {len(records)} rounds recorded, need 2 or more")
        for r in records:
            hashes.setdefault(r["round"], set()).add(r["theta_hash"])
        steady = records[1:]
        wall = steady[-1]["time"] - records[0]["time"]
        per_node.append(
            {
                "utilization": sum(r["compute_s"] for r in steady) / wall,
                "round_s": statistics.median(r["round_s"] for r in steady),
                "compute_s": statistics.median(r["compute_s"] for r in steady),
                "bytes_sent_per_round": statistics.median(r["round_bytes"] for r in steady),
                "contribution_bytes": records[-1]["contribution_bytes"],
                "group_sizes": sorted({r["group_size"] for r in records}),
            }
        )
    return {
        "rate_mbit": rate_mbit,
        "overlap": overlap,
        "codec": codec,
        "utilization": statistics.median(n["utilization"] for n in per_node),
        "utilization_min": min(n["utilization"] for n in per_node),
        "round_s": statistics.median(n["round_s"] for n in per_node),
        "compute_s": statistics.median(n["compute_s"] for n in per_node),
        "bytes_sent_per_round": statistics.median(n["bytes_sent_per_round"] for n in per_node),
        "link_s_per_round": statistics.median(n["bytes_sent_per_round"] for n in per_node)
        * 8
        / (rate_mbit * 1e6),
        "theta_agreed_every_round": all(len(h) == 1 for h in hashes.values()),
        "nodes": per_node,
    }


def run(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    """Every (rate, overlap, codec) of the sweep (`quick`: one), into out/system.json."""
    why = netns.available()
    if why is not None:
        raise Unavailable(why)
    size = QUICK if quick else FULL
    grid = (
        [(100.0, "mix", "int8")]
        if quick
        else [
            *((10.0, overlap, codec) for codec in ("int8", "sparse") for overlap in ("off", "mix")),
            *((100.0, overlap, "int8") for overlap in ("off", "mix")),
        ]
    )
    runs = []
    with tempfile.TemporaryDirectory(prefix="adloco-system-") as tmp:
        for i, (rate, overlap, codec) in enumerate(grid):
            t0 = time.perf_counter()
            result = one_run(
                rate_mbit=rate,
                overlap=overlap,
                codec=codec,
                model=str(size["model"]),
                inner_steps=int(size["inner_steps"]),
                rounds=int(size["rounds"]),
                work=Path(tmp) / f"run{i}",
            )
            result["wall_s"] = time.perf_counter() - t0
            if not result["theta_agreed_every_round"]:
                # The swarm split somewhere: keep what its nodes said, which the temporary folder loses.
                kept = out / "disagreed" / f"run{i}"
                kept.mkdir(parents=True, exist_ok=True)
                for name in [*Path(tmp, f"run{i}").glob("*.log"), *Path(tmp, f"run{i}").glob("*.jsonl")]:
                    shutil.copy2(name, kept / name.name)
                result["logs"] = str(kept)
            print(
                f"system: {rate:g} Mbit/s, overlap {overlap}, {codec}:"
                f" utilization {result['utilization']:.1%},"
                f" round {result['round_s']:.2f} s (compute {result['compute_s']:.2f} s),"
                f" {result['bytes_sent_per_round'] / 1e6:.2f} MB sent per round",
                flush=True,
            )
            runs.append(result)

    def pick(rate: float, overlap: str) -> float | None:
        """The best utilization at this rate and overlap over the codecs."""
        found = [r["utilization"] for r in runs if r["rate_mbit"] == rate and r["overlap"] == overlap]
        return max(found) if found else None

    result = {
        "utilization_overlap_10mbit": pick(10.0, "mix"),
        "utilization_no_overlap_10mbit": pick(10.0, "off"),
        "utilization_overlap_100mbit": pick(100.0, "mix"),
        "model": size["model"],
        "inner_steps": size["inner_steps"],
        "rounds": size["rounds"],
        "table": [{k: v for k, v in r.items() if k != "nodes"} for r in runs],
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "system.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        result = run(args.quick, [0], args.out)
    except Unavailable as e:
        sys.exit(f"bench/system.py: {e}")
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "table")}, indent=1))
    print(f"system: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
