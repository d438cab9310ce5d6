"""Benchmark: a node killed mid-round and restarted on its volume, issue 26. Three `adloco-node`
processes (real p2pd, loopback, each with its key and checkpoints) train together; in round
`--kill-round` one of them dies with its p2pd (SIGKILL of its process group, at an averaging stage
drawn from `--stages` per run: `ADLOCO_FAULT_DIE_AT`, see node/swarm/node.py), and `--restart-s`
later it starts again with the same key and checkpoint folder, as a container restarted on its
volume does. Per run, printed and written to bench/results/kill_restart.json:

- `fork`: a round two nodes applied with different θ (there must be none);
- `survivors_lost_s`: seconds from the kill to the survivors' next applied round, against their
  median round (`round_s`): what the dead peer cost them;
- `rejoin_s`: seconds from the restart (the process start, model and DHT start-up included) to the
  first round it applied in a group of three, on the survivors' θ, and that in their rounds;
  `up_s`: from the restart to its first status event (started, resumed from its checkpoint), and
  `rejoin_after_up_rounds`: from then to that round, in the survivors' rounds.

    python bench/kill_restart.py                        # 10 runs, ~15 min on 2 cores
    python bench/kill_restart.py --runs 2 --stages answered --out /tmp/k.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from robust_swarm import TRAIN
from swarm import NET, Node, _finish, _wait

RESULTS = Path(__file__).resolve().parent / "results" / "kill_restart.json"
STAGES = ("grouped", "sending", "reducing", "answered")


def one_run(
    work: Path, *, stage: str, kill_round: int, rounds: int, restart_s: float, seed: int
) -> dict[str, Any]:
    maddrs = work / "bootstrap.json"
    boot = [
        "adloco-bootstrap",
        "--identity-path",
        str(work / "b.key"),
        *NET[:3],
        "--maddrs-file",
        str(maddrs),
    ]
    bootstrap = Node("bootstrap", boot, work, status=False)
    nodes: list[Node] = []
    try:
        _wait("bootstrap", maddrs.exists, 120, [bootstrap])
        peers = json.loads(maddrs.read_text())

        def cmd(i: int) -> list[str]:
            # --seed 0 for every run (a run id of its own): some seeds deal this small corpus's four
            # shards so unevenly that one holds 40 tokens, and its node refuses to start.
            return ["adloco-node", "--peers", *peers, "--run-id", f"kill-{seed}", "--seed", "0",
                    "--rounds", str(rounds), "--data-shard", str(i),
                    "--identity-path", str(work / f"n{i}.key"), "--checkpoint-dir", str(work / f"ck{i}"),
                    "--checkpoint-every", "1", *TRAIN, *NET]  # fmt: skip

        victim = Node("n2", ["env", f"ADLOCO_FAULT_DIE_AT={stage}:{kill_round}", *cmd(2)], work)
        nodes = [Node("n0", cmd(0), work), Node("n1", cmd(1), work), victim]
        _wait("the kill", lambda: victim.proc.poll() is not None, 300, nodes[:2])
        killed_at = time.time()
        if victim.proc.returncode != -signal.SIGKILL:
            raise SystemExit(f"the victim exited {victim.proc.returncode}, not killed (logs in {work})")
        time.sleep(restart_s)
        back = Node("n2b", cmd(2), work)
        restarted_at = time.time()
        nodes.append(back)
        _finish(nodes[:2], work, "survivors")
    finally:
        for node in [*nodes, bootstrap]:
            node.kill()
    survivors = [{e["round"]: e for e in n.rounds()} for n in nodes[:2]]
    restarted = {e["round"]: e for e in nodes[3].rounds()}
    applied = [*survivors, {e["round"]: e for e in victim.rounds()}, restarted]
    forks = sorted(
        r for r in set().union(*applied) if len({a[r]["theta_hash"] for a in applied if r in a}) > 1
    )
    after = sorted(e["time"] for e in survivors[0].values() if e["time"] > killed_at)
    times = sorted(e["time"] for e in survivors[0].values())
    round_s = statistics.median(b - a for a, b in itertools.pairwise(times[1:]))  # the first: start-up
    together = sorted(e["time"] for r, e in restarted.items() if e["group_size"] == 3 and r in survivors[0])
    rejoin_s = together[0] - restarted_at if together else None
    # Up: its first status event, once its model, data and DHT have started (and it has resumed).
    up_s = min(e["time"] for e in _all_events(nodes[3])) - restarted_at
    return {
        "stage": stage,
        "kill_round": kill_round,
        "seed": seed,
        "fork": forks,
        "round_s": round(round_s, 2),
        "survivors_lost_s": round(after[0] - killed_at, 2) if after else None,
        "survivors_rounds": [len(s) for s in survivors],
        "restart_s": restart_s,
        "rejoin_s": None if rejoin_s is None else round(rejoin_s, 1),
        "rejoin_rounds": None if rejoin_s is None else round(rejoin_s / round_s, 1),
        "up_s": round(up_s, 1),
        "rejoin_after_up_rounds": None if rejoin_s is None else round((rejoin_s - up_s) / round_s, 1),
        "rounds_together": len(together),
    }


def _all_events(node: Node) -> list[dict[str, Any]]:
    return [json.loads(line) for line in node.status.read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--kill-round", type=int, default=3)
    p.add_argument("--rounds", type=int, default=30, help="the survivors' rounds")
    p.add_argument("--restart-s", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep", type=Path, default=None, help="copy the folders of odd runs here")
    args = p.parse_args()
    runs = []
    t0 = time.time()
    for i in range(args.runs):
        stage = args.stages[i % len(args.stages)]
        with tempfile.TemporaryDirectory(prefix="kill-") as tmp:
            try:
                run = one_run(
                    Path(tmp), stage=stage, kill_round=args.kill_round, rounds=args.rounds,
                    restart_s=args.restart_s, seed=i,
                )  # fmt: skip
                lost = run["survivors_lost_s"] or 0
                odd = bool(run["fork"]) or run["rejoin_s"] is None or lost > 4 * run["round_s"]
            except SystemExit as e:  # a node that failed: recorded, and the next run goes on
                run, odd = {"stage": stage, "error": str(e)}, True
            if odd and args.keep is not None:  # the logs and status files, to read
                shutil.copytree(tmp, args.keep / f"run{i}")
        runs.append(run)
        print(json.dumps(run), flush=True)
    summary = summarize(runs)
    summary["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "summary": summary, "runs": runs}
    args.out.write_text(json.dumps(record, indent=1))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in runs if "error" not in r]

    def median(key: str) -> float | None:
        values = [r[key] for r in done if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "runs": len(runs),
        "failed": len(runs) - len(done),
        "forks": sum(1 for r in done if r["fork"]),
        "rejoined": sum(1 for r in done if r["rejoin_s"] is not None),
        **{f"{key}_median": median(key) for key in ("survivors_lost_s", "round_s", "rejoin_s", "up_s")},
        **{f"{key}_median": median(key) for key in ("rejoin_rounds", "rejoin_after_up_rounds")},
        "rejoin_after_up_rounds_max": max(
            (r["rejoin_after_up_rounds"] for r in done if r["rejoin_after_up_rounds"] is not None),
            default=None,
        ),
    }


if __name__ == "__main__":
    main()
