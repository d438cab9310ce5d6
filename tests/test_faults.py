"""Faults survived by real nodes with their real p2pd (issue 10 §5): an owner that leaves while a
member still reads its answer.

Every test starts a bootstrap and three `adloco-node` processes as process-group leaders (the
`procs` fixture reaps every group). `pytest -s` shows the measured figures.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from procs import FAST_NODE_ARGS, Procs, wait_for

LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rounds(path: Path) -> dict[int, dict]:
    return {e["round"]: e for e in _events(path) if e["event"] == "round"}


def _bootstrap(procs: Procs, tmp_path: Path, host_maddrs: list[str]) -> list[str]:
    maddrs = tmp_path / "bootstrap.json"
    procs.start(
        "bootstrap",
        ["adloco-bootstrap", "--identity-path", str(tmp_path / "b.key"), *host_maddrs, "--no-nat-port-map",
         "--maddrs-file", str(maddrs)],
    )  # fmt: skip
    wait_for(maddrs.exists, timeout=60, what="bootstrap")
    return json.loads(maddrs.read_text())


def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, float]:
    """The exit code and the wall time the process was seen gone (to 0.05 s)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {proc.pid} still running after {timeout} s")
        time.sleep(0.05)
    return proc.returncode, time.time()


# The leaving owner: answers big enough that neither side's buffers hold a whole one (the small
# model's fp32 Δ, ~5.8 MB per owner in a group of three: smaller ones sit whole in the slow member's
# p2pd before the owner leaves, and the race is not run), and phase deadlines at their floors (a
# fast exchange rate), so the owner's own wait for its answers to be read (`member.assemble`'s, the
# reduce floor of 1 s) is shorter than the member's delay.
LEAVER_ARGS = [
    *FAST_NODE_ARGS, *LOOPBACK, "--model", "small-llama", "--codec", "none", "--inner-steps", "1",
    "--reduce-timeout-s", "1", "--exchange-bandwidth-mbps", "800", "--run-id", "leave", "--b-max", "64",
]  # fmt: skip
SLOW_READ_S = 3.0


@pytest.mark.timeout(180)
def test_an_owner_leaving_after_its_last_round_delivers_the_answers_a_slow_member_still_reads(
    procs: Procs, tmp_path: Path
) -> None:
    """Three nodes; the leaver stops after round 2, the others go on to round 3. In round 2 one of
    the others reads its owners' answers 3 s late (`ADLOCO_FAULT_SLOW_ANSWERS`, a stalled member),
    so the leaver has applied its last round and is leaving while that member has yet to read the
    leaver's answer. The leaver delivers it before its p2pd stops (`HivemindAverager.shutdown`), and
    round 2 completes for all three with one θ; the two go on together. Before, the leaver waited at
    most its reduce floor: the slow member's round 2 failed with "exchange with owner ... broke:
    IncompleteReadError" (and it then averaged it alone, a fork)."""
    t0 = time.monotonic()
    peers = _bootstrap(procs, tmp_path, LOOPBACK)
    slow_env = {"ADLOCO_FAULT_SLOW_ANSWERS": f"2:{SLOW_READ_S}"}
    nodes = {}
    for name, rounds, env in [("leaver", 2, None), ("slow", 3, slow_env), ("other", 3, None)]:
        status = tmp_path / f"{name}.jsonl"
        argv = ["adloco-node", "--peers", *peers, "--rounds", str(rounds), "--status-file", str(status),
                "--data-shard", str(len(nodes)), "--log-level", "INFO", *LEAVER_ARGS]  # fmt: skip
        nodes[name] = (procs.start(name, argv, env=env), status)
    code, left_at = _wait_exit(nodes["leaver"][0], timeout=150)
    assert code == 0, procs.log("leaver")
    for name in ("slow", "other"):
        assert nodes[name][0].wait(timeout=120) == 0, procs.log(name)

    rounds = {name: _rounds(status) for name, (_, status) in nodes.items()}
    assert sorted(rounds["leaver"]) == [1, 2], procs.log("leaver")
    for name in ("slow", "other"):
        assert sorted(rounds[name]) == [1, 2, 3], procs.log(name)
    # The leaver's last round was averaged by all three, and all three hold its θ.
    for r in (1, 2):
        assert {rounds[name][r]["group_size"] for name in nodes} == {3}, r
        assert len({rounds[name][r]["theta_hash"] for name in nodes}) == 1, f"round {r}: θ differs"
    assert rounds["slow"][3]["theta_hash"] == rounds["other"][3]["theta_hash"]
    assert rounds["slow"][3]["group_size"] == 2
    # The race was run: the leaver still owed the slow member its answer when it left.
    assert "leaving: delivering the answers owed" in procs.log("leaver"), procs.log("leaver")
    for name in nodes:
        assert "broke" not in procs.log(name), procs.log(name)
    applied = rounds["leaver"][2]["time"]
    print(
        f"\nleaver: the slow member applied it {rounds['slow'][2]['time'] - applied:.1f} s later (its reads"
        f" {SLOW_READ_S:.0f} s late); the leaver exited {left_at - applied:.1f} s after its last round;"
        f" test {time.monotonic() - t0:.1f} s"
    )
