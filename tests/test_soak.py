"""Soak (issue 10 §5): a 4-node swarm under random kill -9 for half an hour, each killed node restarted
from its checkpoint. Not in the default run (`-m slow`); ADLOCO_SOAK_MINUTES sets the length
(default 30; 5 validates it). Writes bench/results/soak.json and prints the same figures.

Asserts: no hung round (every live node's round advances within a bound derived from the averaging
timeouts, `_hang_bound_s`), and θ agreed by all four at a common round once the kills stop. Reports
each node's memory (RSS of the node's process group, from /proc) at the start and end of each life.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from adloco.node.cli.processes import group_members

from procs import FAST_NODE_ARGS, Procs, read_events, wait_for

MINUTES = float(os.environ.get("ADLOCO_SOAK_MINUTES", "30"))
NODES = 4
KILL_EVERY_S = (45.0, 75.0)  # uniform: about one kill a minute
CALM_ROUNDS = 4  # rounds every node applies after the last kill before θ is compared
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "soak.json"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(MINUTES * 60) + 900)]


def _hang_bound_s() -> float:
    """How long a live node may go without its round advancing: a failed try (one averaging call,
    `HivemindAverager.call_timeout_s` at the defaults and FAST_NODE_ARGS' window), the wait until
    that try is over (at most another call, `RoundLoop._settle`), the retry (a third), plus a minute
    for the local round, a catch-up and a restarted node's start."""
    from adloco.node.model.model import build_model
    from adloco.protocol.transport.matchmaking import matchmaking_bound_s
    from adloco.protocol.transport.wire import bytes_timeout

    exchange = 2 * 4 * sum(p.numel() for p in build_model(None).parameters())  # fp32 both ways
    rate, slack = 10e6 / 8, 4.0  # --exchange-bandwidth-mbps 10; the averager's slack
    answers = bytes_timeout(exchange, rate, slack=slack, floor_s=10.0)  # --reduce-timeout-s
    parts = bytes_timeout(exchange, rate, slack=slack, floor_s=15.0)  # --part-timeout-s
    call = matchmaking_bound_s(2.0, 0.5) + parts + 2 * answers  # --window-s 2, --grace-s 0.5
    return 3 * call + 60.0


def _rss_mb(pid: int) -> tuple[float, float]:
    """RSS of the node process, and of its whole group (node, DHT process, p2pd), in MiB."""

    def one(p: int) -> float:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    return one(pid), sum(one(p) for p in group_members(pid))


class Node:
    """One soak node across its lives: the same identity, checkpoints and status file."""

    def __init__(self, index: int, tmp_path: Path, peers: list[str]) -> None:
        self.index, self.name = index, f"n{index}"
        self.status = tmp_path / f"{self.name}.jsonl"
        self.argv = [
            "adloco-node", "--peers", *peers, "--run-id", "soak", "--rounds", "0",
            "--status-file", str(self.status), "--data-shard", str(index),
            "--identity-path", str(tmp_path / f"{self.name}.key"),
            "--checkpoint-dir", str(tmp_path / f"{self.name}-ckpt"), "--checkpoint-every", "1",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *FAST_NODE_ARGS,
        ]  # fmt: skip
        self.lives: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.longest_stall_s = 0.0

    def start(self, procs: Procs) -> None:
        self.proc = procs.start(f"{self.name}-life{len(self.lives)}", self.argv)
        self.lives.append({"started": time.time(), "rss_start_mb": None, "rounds": []})
        self.progress_at = time.monotonic()
        self.progress = self.round()

    def round(self) -> int:
        """The round this node holds now (applied, caught up to, or resumed)."""
        rounds = [
            e["round"]
            for e in read_events(self.status)
            if e["event"] in ("round", "catch_up", "state_download", "resumed")
        ]
        return rounds[-1] if rounds else 0

    def poll(self) -> None:
        """Record progress, and the RSS once the life has applied its first round."""
        life, now = self.lives[-1], time.monotonic()
        current = self.round()
        if current != self.progress:
            self.longest_stall_s = max(self.longest_stall_s, now - self.progress_at)
            self.progress, self.progress_at = current, now
        assert self.proc is not None
        if life["rss_start_mb"] is None and current > 0 and self.applied_in_life():
            life["rss_start_mb"], life["group_rss_start_mb"] = _rss_mb(self.proc.pid)

    def applied_in_life(self) -> list[dict[str, Any]]:
        started = self.lives[-1]["started"]
        return [e for e in read_events(self.status) if e["event"] == "round" and e["time"] >= started]

    def stalled_s(self) -> float:
        return time.monotonic() - self.progress_at

    def end_life(self, how: signal.Signals) -> int:
        """Measure, then end this life with `how` (SIGKILL: the whole group, as a crash)."""
        assert self.proc is not None
        life = self.lives[-1]
        life["rss_end_mb"], life["group_rss_end_mb"] = _rss_mb(self.proc.pid)
        life["seconds"] = round(time.time() - life["started"], 1)
        life["rounds"] = [e["round"] for e in self.applied_in_life()]
        life["resumed"] = [
            e["round"]
            for e in read_events(self.status)
            if e["event"] == "resumed" and e["time"] >= life["started"]
        ]
        life["ended_by"] = how.name
        if how == signal.SIGKILL:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(how)
        code = self.proc.wait(timeout=60)
        wait_for(lambda: not group_members(self.proc.pid), timeout=10, what="the killed group gone")  # type: ignore[union-attr]
        self.longest_stall_s = max(self.longest_stall_s, self.stalled_s())
        return code


def test_soak_kill_9_and_restart_from_checkpoints(procs: Procs, tmp_path: Path) -> None:
    seed = int(os.environ.get("ADLOCO_SOAK_SEED", str(time.time_ns() % 10**6)))
    rng = random.Random(seed)
    bound = _hang_bound_s()
    maddrs = tmp_path / "bootstrap.json"
    procs.start(
        "bootstrap",
        ["adloco-bootstrap", "--identity-path", str(tmp_path / "b.key"), "--host-maddrs",
         "/ip4/127.0.0.1/tcp/0", "--no-nat-port-map", "--maddrs-file", str(maddrs)],
    )  # fmt: skip
    wait_for(maddrs.exists, timeout=60, what="bootstrap")
    peers = json.loads(maddrs.read_text())
    nodes = [Node(i, tmp_path, peers) for i in range(NODES)]
    for node in nodes:
        node.start(procs)
    print(f"\nsoak: {MINUTES:g} min, seed {seed}, hang bound {bound:.0f} s")

    t0 = time.monotonic()
    end = t0 + MINUTES * 60
    next_kill = t0 + rng.uniform(*KILL_EVERY_S)
    kills: list[dict[str, Any]] = []
    while time.monotonic() < end:
        time.sleep(1.0)
        for node in nodes:
            node.poll()
            assert node.proc is not None and node.proc.poll() is None, procs.log(
                f"{node.name}-life{len(node.lives) - 1}"
            )
            assert node.stalled_s() < bound, (
                f"{node.name} held round {node.progress} for {node.stalled_s():.0f} s (bound {bound:.0f} s): "
                + procs.log(f"{node.name}-life{len(node.lives) - 1}")[-4000:]
            )
        if time.monotonic() >= next_kill:
            victim = rng.choice(nodes)
            at = victim.round()
            victim.end_life(signal.SIGKILL)
            victim.start(procs)
            kills.append({"at_s": round(time.monotonic() - t0, 1), "node": victim.name, "round": at})
            print(f"  +{kills[-1]['at_s']:.0f} s: kill -9 {victim.name} at round {at}, restarted", flush=True)
            next_kill = time.monotonic() + rng.uniform(*KILL_EVERY_S)

    # Calm: no more kills; every node applies CALM_ROUNDS more rounds, then all four must agree.
    marks = {node.name: len(node.applied_in_life()) for node in nodes}

    def calm() -> bool:
        for node in nodes:
            node.poll()
        return all(len(node.applied_in_life()) >= marks[node.name] + CALM_ROUNDS for node in nodes)

    wait_for(
        calm, timeout=bound + 120, interval=1.0, what=f"{CALM_ROUNDS} rounds on every node after the kills"
    )
    applied = [{e["round"]: e["theta_hash"] for e in node.applied_in_life()} for node in nodes]
    common = sorted(set.intersection(*(set(a) for a in applied)))
    agreed = [r for r in common if len({a[r] for a in applied}) == 1]
    codes = [node.end_life(signal.SIGTERM) for node in nodes]

    result = {
        "minutes": MINUTES,
        "seed": seed,
        "nodes": NODES,
        "kills": kills,
        "hang_bound_s": round(bound, 1),
        "common_rounds_at_end": common,
        "agreed_rounds_at_end": agreed,
        "exit_codes": codes,
        "per_node": {
            node.name: {
                "longest_stall_s": round(node.longest_stall_s, 1),
                "lives": node.lives,
                "rss_growth_mb_per_life": [
                    None
                    if life.get("rss_start_mb") is None
                    else round(life["rss_end_mb"] - life["rss_start_mb"], 1)
                    for life in node.lives
                ],
            }
            for node in nodes
        },
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    for node in nodes:
        lives = [
            f"{life['seconds']:.0f} s, rounds {life['rounds'][:1] + life['rounds'][-1:]}, RSS"
            f" {life.get('rss_start_mb') or 0:.0f}->{life['rss_end_mb']:.0f} MiB (group"
            f" {life.get('group_rss_start_mb') or 0:.0f}->{life['group_rss_end_mb']:.0f})"
            for life in node.lives
        ]
        print(f"  {node.name}: longest stall {node.longest_stall_s:.0f} s; lives: {'; '.join(lives)}")
    print(
        f"  {len(kills)} kills; agreed θ at rounds {agreed[-3:]} of the common {common[-3:]}; wrote {RESULTS}"
    )
    assert codes == [0] * NODES
    assert common and common[-1] in agreed, f"θ differs at the last common round {common[-1:]}"
