"""adloco-bootstrap as a real process: prints its multiaddrs, serves the DHT, keeps its identity,
stops on SIGTERM within seconds and leaves no p2pd behind."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import hivemind
import pytest
from hivemind.utils import get_dht_time

from adloco.node.cli.processes import group_members

from procs import Procs, wait_for

pytestmark = pytest.mark.timeout(120)


def _start(procs: Procs, tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.Popen[bytes], list[str]]:
    maddrs_file = tmp_path / f"{name}.json"
    proc = procs.start(
        name,
        [
            "adloco-bootstrap",
            "--identity-path",
            str(tmp_path / "id" / "bootstrap.key"),
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--no-nat-port-map",
            "--maddrs-file",
            str(maddrs_file),
            *extra,
        ],
    )
    wait_for(maddrs_file.exists, timeout=60, what="the bootstrap's multiaddrs")
    return proc, json.loads(maddrs_file.read_text())


def test_bootstrap_serves_keeps_identity_and_stops_cleanly(procs: Procs, tmp_path: Path) -> None:
    proc, maddrs = _start(procs, tmp_path, "first")
    assert maddrs and all("/p2p/" in m for m in maddrs)
    assert "--peers " + " ".join(maddrs) in procs.log("first")
    peer_id = maddrs[0].rsplit("/p2p/", 1)[1]

    # A DHT peer joins through it and the two exchange a record.
    a = hivemind.DHT(
        initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True
    )
    b = hivemind.DHT(
        initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True
    )
    try:
        assert a.store("k", "v", expiration_time=get_dht_time() + 30)
        assert b.get("k", latest=True).value == "v"
    finally:
        a.shutdown()
        b.shutdown()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert group_members(proc.pid) == []  # its p2pd went with it

    _, again = _start(procs, tmp_path, "second")
    assert again[0].rsplit("/p2p/", 1)[1] == peer_id


def test_malformed_multiaddr_is_a_one_line_error(procs: Procs, tmp_path: Path) -> None:
    proc = procs.start(
        "bad",
        [
            "adloco-bootstrap",
            "--identity-path",
            str(tmp_path / "k"),
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/notaport",
        ],
    )
    assert proc.wait(timeout=60) == 2
    out = procs.log("bad").strip().splitlines()
    assert out == [out[0]] and out[0].startswith("adloco-bootstrap: error: --host-maddrs:")
