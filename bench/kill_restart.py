"""Benchmark: a node killed mid-round and restarted on its volume, issue 26. Three `adloco-node`
processes (real p2pd, loopback, each with its key and checkpoints) train together; in round
`--kill-round` one of them dies with its p2pd (SIGKILL of its process group, at an averaging stage
drawn from `--stages` per run: `ADLOCO_FAULT_DIE_AT`, see node/swarm/node.py), and `--restart-s`
later it starts again with the same key and checkpoint folder, as a container restarted on its
volume does. Per run, printed and written to bench/results/kill_restart.json:

- `fork`: a round two nodes applied with different θ while both survivors ran (there must be none);
- `survivors_lost_s`: seconds from the kill to the survivors' next applied round, against their
  median round (`round_s`): what the dead peer cost them;
- `rejoin_s`: seconds from the restart (the process start, model and DHT start-up included) to the
  first round it applied in a group of three, on the survivors' θ, and that in their rounds;
  `up_s`: from the restart to its first status event (started, resumed from its checkpoint), and
  `rejoin_after_up_rounds`: from then to that round, in the survivors' rounds.

    python bench/kill_restart.py                        # 10 runs, ~15 min on 2 cores
    python bench/kill_restart.py --runs 2 --stages answered --out /tmp/k.json

`--containers` runs the same fault over real containers as volunteers run them: the image that
tests/test_container.py builds (localhost/adloco-node:cpu), the bootstrap and the three node services
of docker/compose.yaml started with podman (tests/containers.py), each node behind its own link of
`--rate-mbit` (20) Mbit/s both ways (tbf on its veth's two ends), checkpoints every 2 rounds on its
volume. The victim dies at its stage as above (its process group killed with SIGKILL inside the
container: the container exits 137), is removed, and `--restart-s` later runs again from the same
volume (same key, same checkpoints), as `docker run -v node3-data:/data ...` does. Needs root,
podman and the built image; results in bench/results/kill_restart_containers.json.

    python bench/kill_restart.py --containers           # 10 runs, ~25 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from robust_swarm import TRAIN
from swarm import NET, Node, _finish, _wait

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import containers  # the test suite's podman helpers and compose services (tests/containers.py)

RESULTS = Path(__file__).resolve().parent / "results" / "kill_restart.json"
CONTAINER_RESULTS = RESULTS.with_name("kill_restart_containers.json")
DIE_AT_ENV = "ADLOCO_FAULT_DIE_AT"  # node/swarm/node.py's test knob
VICTIM = containers.NODES[-1]
# The process runs' training settings, as the containers' environment (ADLOCO_<OPTION>), and the
# same seed: rounds of about 2 s.
CONTAINER_ENV = {
    **{
        f"ADLOCO_{flag[2:].upper().replace('-', '_')}": value
        for flag, value in zip(TRAIN[::2], TRAIN[1::2], strict=True)
    },
    "ADLOCO_SEED": "0",
    "ADLOCO_CHECKPOINT_EVERY": "2",
    "ADLOCO_STATUS_FILE": "/data/status.jsonl",
}
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
    # Up: its first status event, once its model, data and DHT have started (and it has resumed).
    up_s = min(e["time"] for e in containers.status_events(nodes[3].status)) - restarted_at
    run = {"stage": stage, "kill_round": kill_round, "seed": seed, "restart_s": restart_s}
    victim_rounds = {e["round"]: e for e in victim.rounds()}
    return run | measure(
        survivors, victim_rounds, restarted, killed_at=killed_at, restarted_at=restarted_at, up_s=up_s
    )


def measure(
    survivors: list[dict[int, dict[str, Any]]],
    victim: dict[int, dict[str, Any]],
    restarted: dict[int, dict[str, Any]],
    *,
    killed_at: float,
    restarted_at: float,
    up_s: float,
) -> dict[str, Any]:
    """What the kill cost, from the round events (round -> status event) of the two survivors, the
    victim before its death and the node started again. A fork is a round two of them applied with
    different θ while all the survivors ran: once one has applied its last round and stopped, the
    others go on alone (as a node left behind by peers that have gone does: a survivor still
    chasing the others' rounds, or the restarted node), and a round they apply then is not one."""
    ended = min(max(e["time"] for e in s.values()) for s in survivors)
    during = [{r: e for r, e in rounds.items() if e["time"] <= ended} for rounds in (*survivors, restarted)]
    applied = [*during, victim]
    forks = sorted(
        r for r in set().union(*applied) if len({a[r]["theta_hash"] for a in applied if r in a}) > 1
    )
    after = sorted(e["time"] for e in survivors[0].values() if e["time"] > killed_at)
    times = sorted(e["time"] for e in survivors[0].values())
    round_s = statistics.median(b - a for a, b in itertools.pairwise(times[1:]))  # the first: start-up
    together = sorted(e["time"] for r, e in restarted.items() if e["group_size"] == 3 and r in survivors[0])
    rejoin_s = together[0] - restarted_at if together else None
    # The first round it applied with the survivors' θ, in whatever group.
    agreed = sorted(
        e["time"]
        for r, e in restarted.items()
        if r in survivors[0] and e["theta_hash"] == survivors[0][r]["theta_hash"]
    )
    lost_s = after[0] - killed_at if after else None
    return {
        "fork": forks,
        "round_s": round(round_s, 2),
        "survivors_lost_s": None if lost_s is None else round(lost_s, 2),
        "survivors_lost_rounds": None if lost_s is None else round(lost_s / round_s, 1),
        "survivors_rounds": [len(s) for s in survivors],
        "agree_s": round(agreed[0] - restarted_at, 1) if agreed else None,
        "agree_after_up_rounds": round((agreed[0] - restarted_at - up_s) / round_s, 1) if agreed else None,
        "rejoin_s": None if rejoin_s is None else round(rejoin_s, 1),
        "rejoin_rounds": None if rejoin_s is None else round(rejoin_s / round_s, 1),
        "up_s": round(up_s, 1),
        "rejoin_after_up_rounds": None if rejoin_s is None else round((rejoin_s - up_s) / round_s, 1),
        "rounds_together": len(together),
    }


def one_container_run(
    work: Path, *, stage: str, kill_round: int, rounds: int, restart_s: float, seed: int, rate_mbit: float,
    image: str, node_env: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """One run over containers (the module doc); the containers' logs are copied to `work`."""
    compose = containers.load_compose()
    services = compose["services"]
    named = set(compose.get("volumes") or {})
    ulimits = _rlimits_settable(image)
    env = {**CONTAINER_ENV, "ADLOCO_ROUNDS": str(rounds), **node_env}
    with containers.new_stack() as stack:

        def start(service: str, extra: dict[str, str]) -> None:
            spec = services[service]
            containers.run_service(
                stack, service, spec, named=named, image=image, ulimits=ulimits, extra_env=extra
            )
            if service in containers.NODES:
                containers.shape_link(stack, service, rate_mbit)

        def state(service: str) -> tuple[str, int]:
            return containers.container_state(stack, service)

        def done(service: str) -> bool:  # exited (not "stopping": its exit code is not known yet)
            return state(service)[0] in ("exited", "stopped")

        def wait(what: str, ok: Callable[[], bool], timeout_s: float, watch: tuple[str, ...]) -> None:
            deadline = time.time() + timeout_s
            while not ok():
                failed = {n: state(n) for n in watch if state(n)[0] != "running"}
                if failed:
                    raise SystemExit(f"{what}: {failed} stopped\n{_logs(stack, work)}")
                if time.time() > deadline:
                    raise SystemExit(f"{what}: not within {timeout_s:.0f} s\n{_logs(stack, work)}")
                time.sleep(0.25)

        try:
            containers.podman("network", "create", stack.network)
            start("bootstrap", {})
            survivors = tuple(n for n in containers.NODES if n != VICTIM)
            for node in survivors:
                start(node, env)
            start(VICTIM, {**env, DIE_AT_ENV: f"{stage}:{kill_round}"})
            wait("the kill", lambda: done(VICTIM), 600, ("bootstrap", *survivors))
            killed_at = time.time()
            if state(VICTIM)[1] != 128 + signal.SIGKILL:
                raise SystemExit(f"the victim is {state(VICTIM)}, not killed\n{_logs(stack, work)}")
            shutil.copy(_status(stack, services, VICTIM), work / "victim.jsonl")
            time.sleep(restart_s)
            containers.podman("rm", "-f", "-t", "0", stack.name(VICTIM))  # the volume stays
            restarted_at = time.time()
            start(VICTIM, env)
            wait("the survivors' rounds", lambda: all(done(n) for n in survivors), 900, ("bootstrap",))
            if any(state(n)[1] != 0 for n in survivors):
                raise SystemExit(f"survivors: { {n: state(n) for n in survivors} }\n{_logs(stack, work)}")
            # The restarted node runs to the same round; a short wait, then it is stopped as compose does.
            with contextlib.suppress(SystemExit):
                wait("the restarted node's rounds", lambda: done(VICTIM), 30, ())
            if not done(VICTIM):
                containers.stop(stack, VICTIM, 40)
            for node in containers.NODES:  # read from here, and kept with the logs (`--keep`)
                shutil.copy(_status(stack, services, node), work / f"{node}.jsonl")
            _logs(stack, work)
        finally:
            stack.down()
    events = {n: containers.status_events(work / f"{n}.jsonl") for n in containers.NODES}
    victim_events = containers.status_events(work / "victim.jsonl")
    after = [e for e in events[VICTIM] if e["time"] >= restarted_at]
    up_s = min(e["time"] for e in after) - restarted_at
    rounds_of = lambda evs: {e["round"]: e for e in evs if e["event"] == "round"}  # noqa: E731
    run = {
        "stage": stage,
        "kill_round": kill_round,
        "seed": seed,
        "restart_s": restart_s,
        "rate_mbit": rate_mbit,
    }
    # Its key and checkpoints on the volume: the same peer id, and the round it resumed from.
    starts = [e["peer_id"] for e in [*victim_events, *after] if e["event"] == "start"]
    resumed = [e["round"] for e in after if e["event"] == "resumed"]
    run |= {
        "peer_id_kept": len(starts) == 2 and len(set(starts)) == 1,
        "resumed_from": (resumed or [None])[0],
    }
    return run | measure(
        [rounds_of(events[n]) for n in survivors],
        rounds_of(victim_events),
        rounds_of(after),
        killed_at=killed_at,
        restarted_at=restarted_at,
        up_s=up_s,
    )


@functools.cache
def _rlimits_settable(image: str) -> bool:
    return containers.rlimits_settable(image)


def _status(stack: Any, services: dict[str, Any], node: str) -> Path:
    return containers.data_dir(stack, services[node]) / "status.jsonl"


def _logs(stack: Any, work: Path) -> str:
    """Every container's log written to `work`; the last lines of each, to print."""
    tails = []
    for name in stack.containers:
        done = containers.podman("logs", name, check=False)
        (work / f"{name.removeprefix(stack.prefix)}.log").write_text(
            containers.quiet(done.stdout + done.stderr)
        )
        tails.append(stack.logs(name.removeprefix(stack.prefix), lines=15))
    return "\n".join(tails)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--kill-round", type=int, default=3)
    p.add_argument("--rounds", type=int, default=30, help="the survivors' rounds")
    p.add_argument("--restart-s", type=float, default=2.0)
    p.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/kill_restart[_containers].json"
    )
    p.add_argument("--keep", type=Path, default=None, help="copy the folders of odd runs here")
    p.add_argument("--keep-all", action="store_true", help="with --keep: every run's folder")
    p.add_argument("--containers", action="store_true", help="containers of the image (module doc)")
    p.add_argument("--image", default=containers.CPU_IMAGE, help="with --containers: the image")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="with --containers: each node's link")
    p.add_argument(
        "--node-env", action="append", default=[], metavar="KEY=VALUE",
        help="with --containers: more environment for the nodes (e.g. ADLOCO_LOG_LEVEL=INFO)",
    )  # fmt: skip
    args = p.parse_args()
    if args.out is None:
        args.out = CONTAINER_RESULTS if args.containers else RESULTS
    if args.containers:
        why = _containers_unusable(args.image)
        if why is not None:
            raise SystemExit(f"--containers: {why}")
    runs = []
    t0 = time.time()
    for i in range(args.runs):
        stage = args.stages[i % len(args.stages)]
        with tempfile.TemporaryDirectory(prefix="kill-") as tmp:
            try:
                common = {"stage": stage, "kill_round": args.kill_round, "rounds": args.rounds, "seed": i}
                if args.containers:
                    run = one_container_run(
                        Path(tmp),
                        **common,
                        restart_s=args.restart_s,
                        rate_mbit=args.rate_mbit,
                        image=args.image,
                        node_env=dict(kv.split("=", 1) for kv in args.node_env),
                    )
                else:
                    run = one_run(Path(tmp), **common, restart_s=args.restart_s)
                lost = run["survivors_lost_s"] or 0
                odd = bool(run["fork"]) or run["rejoin_s"] is None or lost > 4 * run["round_s"]
            except SystemExit as e:  # a node that failed: recorded, and the next run goes on
                run, odd = {"stage": stage, "error": str(e)}, True
            if (odd or args.keep_all) and args.keep is not None:  # the logs and status files, to read
                shutil.copytree(tmp, args.keep / f"run{i}")
        runs.append(run)
        print(json.dumps(run), flush=True)
    summary = summarize(runs)
    summary["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "summary": summary, "runs": runs}
    args.out.write_text(json.dumps(record, indent=1))


def _containers_unusable(image: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root (podman with runc, as tools/container-build runs it)"
    if containers.podman("image", "exists", image, check=False).returncode != 0:
        return f"no image {image}: build it first (pytest -m long tests/test_container.py builds it)"
    return None


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
