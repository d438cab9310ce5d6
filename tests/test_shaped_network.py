"""Real nodes on separate hosts behind 20 Mbit/s links: they agree on θ every round, and the bytes
each one puts on its streams are the int8 payload the part-ownership plan predicts plus a small
protocol overhead. Run once without and once with one-step-delay overlap; each prints the seconds
per round and the share of it the nodes sat idle waiting for communication (`pytest -s` shows it).

Topology (`tests/netns.py`, `Star`): a 'hub' namespace bridging five host namespaces on 10.77.0.0/24
— .1 the DHT bootstrap, .2-.4 three nodes, .5 a probe sink — each host's veth shaped with tbf at
20 Mbit/s on both ends (upload and download).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import netns
from procs import FAST_NODE_ARGS, Procs, read_events, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

RATE_MBIT = 20
NODES = 3
ROUNDS = 3  # the first includes start-up: rounds 2 and 3 are the steady state
BOOTSTRAP, PROBE = 0, NODES + 1  # host indices; nodes are 1..NODES

# With overlap, local rounds of a few seconds, so there is compute for the transfer to hide behind;
# without, the compute hides nothing and a quarter of it will do.
INNER_STEPS = {"off": "12", "mix": "48"}

# Receives everything on a TCP port, then answers one byte: the sender's clock then covers delivery.
SINK = """
import socket, sys
s = socket.create_server((sys.argv[1], 5001))
print("ready", flush=True)
c, _ = s.accept()
while c.recv(1 << 16):
    pass
c.sendall(b"k")
"""
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5001))
data = bytes(int(sys.argv[2]))
t0 = time.perf_counter()
c.sendall(data)
c.shutdown(socket.SHUT_WR)
assert c.recv(1) == b"k"
print(time.perf_counter() - t0)
"""


@pytest.fixture
def star(procs: Procs) -> Iterator[netns.Star]:
    with netns.star_lan(procs, NODES + 2, rate_mbit=RATE_MBIT) as lan:
        yield lan


def _expected_sent() -> tuple[list[list[int]], int, int]:
    """Payload bytes member i (in peer-id order) sends in a round of NODES, for each order in which
    the group may deal its parts (`matchmaking.form_group` draws one per round, which this test
    cannot recompute: the run's prefix and round ids are the node's), one Δ's int8 size, and its
    number of parts."""
    from adloco.node.model.model import build_model
    from adloco.protocol.algorithms.codecs import make_codec
    from adloco.protocol.algorithms.parts import assign_parts, round_traffic

    codec = make_codec("int8")
    model = build_model(None)
    sizes = [codec.wire_bytes(tuple(p.shape)) for p in model.parameters() if p.requires_grad]
    plans = []
    for order in itertools.permutations(range(NODES)):
        owners = [order[i] for i in assign_parts(sizes, NODES)]
        sent, _ = round_traffic(owners, [sizes] * NODES, sizes, NODES)
        plans.append(sent)
    return plans, sum(sizes), len(sizes)


def _checks_bound(parts: int, n: int) -> int:
    """The most bytes of the answers' checks a member sends in a round of n (statements.py): its
    commitment to each other owner; as an owner, its statement and the n commitments to each other
    member; its reveal (every owner's statement) and its projections to each other member. Each
    statement lists at most 80 bytes per part (a name, a digest, a norm or projection) and 1.5 kB of
    signature, key and ids. They grow with parts and members, not with the payload."""
    statement = 80 * parts + 1500
    return (n - 1) * (1 + (1 + n) + n + 1) * statement


def _check_link_is_shaped(star: netns.Star, procs: Procs) -> None:
    """A bulk TCP transfer between two hosts takes at least its size over the link rate."""
    sink = star.start(procs, PROBE, "sink", [sys.executable, "-c", SINK, star.addrs[PROBE]])
    wait_for(lambda: "ready" in procs.log("sink"), timeout=30, what="probe sink")
    size = 5_000_000
    done = star.run(BOOTSTRAP, [sys.executable, "-c", SOURCE, star.addrs[PROBE], str(size)], timeout=60)
    assert done.returncode == 0, done.stderr
    seconds = float(done.stdout)
    floor = size * 8 / (RATE_MBIT * 1e6)
    print(f"probe: {size / 1e6:.0f} MB in {seconds:.2f} s = {size * 8 / seconds / 1e6:.1f} Mbit/s")
    assert seconds >= 0.95 * floor, "the link is not shaped"
    assert seconds <= 3 * floor, "the shaped link is far slower than its rate"
    assert sink.wait(timeout=10) == 0


@pytest.mark.long
@pytest.mark.parametrize("overlap", ["off", "mix"])
def test_nodes_behind_shaped_links_agree_and_send_the_codec_payload(
    star: netns.Star, procs: Procs, tmp_path: Path, overlap: str
) -> None:
    t_start = time.monotonic()
    _check_link_is_shaped(star, procs)

    maddrs_file = tmp_path / "bootstrap.json"
    boot = star.start(
        procs,
        BOOTSTRAP,
        "bootstrap",
        [
            "adloco-bootstrap",
            "--identity-path",
            str(tmp_path / "b.key"),
            "--host-maddrs",
            f"/ip4/{star.addrs[BOOTSTRAP]}/tcp/0",
            "--no-nat-port-map",
            "--maddrs-file",
            str(maddrs_file),
        ],
    )
    # `ip netns exec` exec'd: the pid we hold is the bootstrap itself, in its own namespace.
    netns.wait_exec(boot.pid, "adloco-bootstrap")
    assert netns.netns_of(boot.pid) != netns.netns_of(os.getpid())
    wait_for(maddrs_file.exists, timeout=60, what="bootstrap")
    peers = [m for m in json.loads(maddrs_file.read_text()) if f"/ip4/{star.addrs[BOOTSTRAP]}/" in m]
    assert peers, maddrs_file.read_text()

    nodes = {}
    for host in range(1, NODES + 1):
        status = tmp_path / f"node{host}.jsonl"
        argv = [
            "adloco-node",
            "--peers",
            *peers,
            "--run-id",
            "shaped",
            "--rounds",
            str(ROUNDS),
            "--host-maddrs",
            f"/ip4/{star.addrs[host]}/tcp/0",
            "--status-file",
            str(status),
            "--data-shard",
            str(host - 1),
            *FAST_NODE_ARGS,
            "--inner-steps",
            INNER_STEPS[overlap],
            "--overlap",
            overlap,
        ]
        proc = star.start(procs, host, f"node{host}", argv)
        netns.wait_exec(proc.pid, "adloco-node")
        assert netns.netns_of(proc.pid) not in (netns.netns_of(os.getpid()), netns.netns_of(boot.pid))
        nodes[host] = (proc, status)
    for host, (proc, _) in nodes.items():
        assert proc.wait(timeout=180) == 0, procs.log(f"node{host}")

    events = {host: read_events(status) for host, (_, status) in nodes.items()}
    peer_ids = {host: next(e["peer_id"] for e in ev if e["event"] == "start") for host, ev in events.items()}
    rounds = {host: [e for e in ev if e["event"] == "round"] for host, ev in events.items()}
    for host, records in rounds.items():
        assert [r["round"] for r in records] == list(range(1, ROUNDS + 1)), procs.log(f"node{host}")
        assert all(r["group_size"] == NODES for r in records), [r["group_size"] for r in records]
    for r in range(ROUNDS):
        hashes = {records[r]["theta_hash"] for records in rounds.values()}
        assert len(hashes) == 1, f"round {r + 1}: nodes hold different θ"

    plans, delta_bytes, parts = _expected_sent()
    order = sorted(peer_ids.values())
    print(
        f"\nint8 Δ {delta_bytes} B; payload sent per round by member, per dealing order: {plans} "
        f"(~2(n-1)/n x Δ = {2 * (NODES - 1) * delta_bytes // NODES} B)"
    )
    # The node's own split: every round, the encoded tensor bytes the members sent are exactly what
    # part ownership predicts for one dealing order, the same for all of them.
    hosts = sorted(rounds, key=lambda h: order.index(peer_ids[h]))
    payloads = [
        [r["payload_sent"] - (rounds[h][i - 1]["payload_sent"] if i else 0) for i, r in enumerate(rounds[h])]
        for h in hosts
    ]
    for i in range(ROUNDS):
        assert [payloads[m][i] for m in range(NODES)] in plans, (i + 1, [p[i] for p in payloads])
    for host, records in rounds.items():
        member = order.index(peer_ids[host])
        previous = previous_payload = previous_checks = 0
        for record in records:
            sent = record["bytes_sent"] - previous
            previous = record["bytes_sent"]
            want = record["payload_sent"] - previous_payload
            previous_payload = record["payload_sent"]
            checks = record["checks_sent"] - previous_checks
            previous_checks = record["checks_sent"]
            overhead = sent - want - checks
            floor_s = sent * 8 / (RATE_MBIT * 1e6)
            print(
                f"node{host} (member {member}) round {record['round']}: sent {sent} B, payload {want} B, "
                f"checks {checks} B ({100 * checks / want:.2f}%), framing {overhead} B "
                f"({100 * overhead / want:.2f}%), round {record['round_s']:.2f} s "
                f"(link floor {floor_s:.2f} s)"
            )
            assert 0 <= overhead <= 0.02 * want, (sent, want, checks)
            assert 0 < checks <= _checks_bound(parts, NODES), (checks, parts)
            # The exchange cannot beat the shaped uplink.
            assert record["round_s"] >= floor_s
    # Round 1 includes start-up; the steady state is rounds 2 and later.
    steady = [r for records in rounds.values() for r in records[1:]]
    round_s = sorted(r["round_s"] for r in steady)[len(steady) // 2]
    wait_s = sorted(r["wait_s"] for r in steady)[len(steady) // 2]
    compute_s = sorted(r["compute_s"] for r in steady)[len(steady) // 2]
    print(
        f"overlap={overlap}: median round {round_s:.2f} s, local compute {compute_s:.2f} s, idle waiting for"
        f" communication {wait_s:.2f} s ({100 * wait_s / round_s:.0f}% of the round)"
    )
    print(f"total {time.monotonic() - t_start:.1f} s")
