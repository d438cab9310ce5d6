"""adloco-swarm: status-file tailing and summary building on files written here, bad input, and the
real launcher with the real bootstrap and real nodes (a crashing swarm, a training swarm, a training
swarm stopped by SIGTERM).

The process tests give the launcher an environment marker that every descendant inherits (p2pd
included), so "nothing survives" is checked over every process the run started, whatever group it
ended up in, and anything found is killed by pid before the assertion fails.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from adloco.node.cli import launcher as sl
from adloco.node.cli import processes, progress
from adloco.node.cli.processes import group_members
from adloco.node.training.rounds import RoundRecord

from procs import Procs, wait_for

BIN = Path(sys.executable).parent
MARKER = "SWARM_TEST_MARKER"  # not ADLOCO_*: the node rejects unknown ADLOCO_ variables
TINY_NODE = ["--max-corpus-mb", "1", "--inner-steps", "1", "--batch-size", "1", "--seq-len", "32"]
TINY_NODE += ["--instances", "1", "--b-max", "1"]


def round_record(number: int, theta: str, **overrides: object) -> dict[str, object]:
    """A round event as a node writes it to its status file."""
    record = RoundRecord(
        round=number,
        val_loss=3.21,
        inner_loss=3.4,
        theta_hash=theta,
        tokens=4096,
        tokens_total=4096 * number,
        tokens_per_s=2450.0,
        batch_sizes=[8, 8],
        accum_steps=1,
        instances=2,
        inner_steps=10,
        codec="int8",
        group_size=3,
        staleness=0,
        bytes_sent=1_200_000 * number,
        bytes_received=1_100_000 * number,
        round_bytes=1_200_000,
        round_s=4.2,
        wait_s=0.8,
        compute_s=3.1,
        contribution_bytes=627_705,
    )
    return {"event": "round", "time": 1.0, **record.to_dict(), **overrides}


def jsonl(*records: dict[str, object]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


# ---- status files --------------------------------------------------------------------------------


def test_parse_keeps_the_unterminated_rest_and_reports_malformed_lines() -> None:
    data = jsonl({"event": "start", "peer_id": "A"}) + b"\n{not json\n[1, 2]\n" + b'{"event": "ro'
    records, bad, rest = progress.parse_status_lines(data)
    assert records == [{"event": "start", "peer_id": "A"}]
    assert bad == ["{not json", "[1, 2]"]
    assert rest == b'{"event": "ro'


def test_tail_reads_only_what_was_appended_and_waits_for_the_newline(tmp_path: Path) -> None:
    path = tmp_path / "status.jsonl"
    tail = progress.StatusTail(path)
    assert tail.read() == ([], [])  # the node has not created it yet

    line = jsonl(round_record(1, "h1"))
    path.write_bytes(jsonl({"event": "start", "peer_id": "A"}) + line[:10])
    assert tail.read() == ([{"event": "start", "peer_id": "A"}], [])
    assert tail.read() == ([], [])  # half a line is not a record
    with path.open("ab") as f:
        f.write(line[10:] + b'{"event": "done", "rounds": 1}')
    assert tail.read() == ([round_record(1, "h1")], [])
    # The writer is gone: a whole record without its newline still counts.
    assert tail.finish() == ([{"event": "done", "rounds": 1}], [])
    assert tail.finish() == ([], [])


def test_tail_finish_reports_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "status.jsonl"
    path.write_bytes(b'{"event": "round", "rou')
    tail = progress.StatusTail(path)
    assert tail.read() == ([], [])
    assert tail.finish() == ([], ['{"event": "round", "rou'])


def test_tail_starts_over_when_the_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "status.jsonl"
    path.write_bytes(jsonl(round_record(1, "h1"), round_record(2, "h2")))
    tail = progress.StatusTail(path)
    assert len(tail.read()[0]) == 2
    path.write_bytes(jsonl({"event": "start", "peer_id": "B"}))
    assert tail.read() == ([{"event": "start", "peer_id": "B"}], [])


def test_view_prints_one_line_for_the_latest_round_and_counts_rounds() -> None:
    view = progress.NodeView("node2")
    lines = view.apply([{"event": "start", "peer_id": "QmA"}])
    assert lines == ["[node2] started as QmA"]
    assert view.apply([]) == []
    lines = view.apply([round_record(2, "aa"), round_record(3, "ab12cd34ef", tokens_per_s=2450.4)])
    assert lines == [
        "[node2 round=3] val 3.210 inner 3.400 2450 tok/s b=[8, 8] a=1 K=2 int8 Δ 627.71kB group=3 τ=0"
        " sent 3.60MB recv 3.30MB 4.2s (waited 0.8s) θ=ab12cd34"
    ]
    assert (view.rounds_done, view.reached(2), view.reached(3)) == (2, True, False)
    assert view.apply([{"event": "done", "rounds": 5}]) == ["[node2] done after 5 rounds"]
    assert (view.rounds_done, view.reached(9)) == (5, True)


def test_an_unreadable_round_record_is_said_and_skipped_not_a_crash() -> None:
    view = progress.NodeView("node0")
    lines = view.apply([{"event": "round", "round": 1, "val_loss": float("nan"), "bytes_sent": 999}])
    assert len(lines) == 1 and lines[0].startswith("[node0] unreadable round record (TypeError")
    assert view.rounds == []
    lines = view.apply([round_record(1, "cd", val_loss=float("nan"))])
    assert lines[0].startswith("[node0 round=1] val nan inner 3.400")


# ---- summary -------------------------------------------------------------------------------------


def views_of(*rounds_per_node: list[dict[str, object]]) -> list[progress.NodeView]:
    views = []
    for i, rounds in enumerate(rounds_per_node):
        view = progress.NodeView(f"node{i}")
        view.apply([{"event": "start", "peer_id": f"peer{i}"}, *rounds])
        views.append(view)
    return views


def test_hashes_agree_per_round_among_the_nodes_that_applied_it() -> None:
    views = views_of(
        [round_record(1, "a"), round_record(2, "b"), round_record(3, "c")],
        [round_record(1, "a"), round_record(2, "X")],  # diverged at round 2, then crashed
        [round_record(1, "a"), round_record(2, "b"), round_record(3, "c")],
    )
    assert progress.hashes_agree(views) == {1: True, 2: False, 3: True}


def test_summary_has_every_field_per_node_and_round() -> None:
    views = views_of(
        [round_record(1, "a"), round_record(2, "b", val_loss=2.5), {"event": "done", "rounds": 2}],
        [round_record(1, "a")],
    )
    views[0].exit_code, views[1].exit_code = 0, -9
    summary = progress.build_summary(
        run_id="r1",
        views=views,
        pids=[101, 102],
        wall_s=12.34567,
        bootstrap={"pid": 100, "exit_code": 0, "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/Qm"]},
        survivors=[],
    )
    assert json.loads(json.dumps(summary)) == {
        "run_id": "r1",
        "nodes": [
            {
                "name": "node0",
                "peer_id": "peer0",
                "rounds_done": 2,
                "final_val_loss": 2.5,
                "theta_hashes": ["a", "b"],
                "bytes_sent": 2_400_000,  # the node's counters are cumulative: the last round's
                "bytes_received": 2_200_000,
                "exit_code": 0,
                "pid": 101,
            },
            {
                "name": "node1",
                "peer_id": "peer1",
                "rounds_done": 1,
                "final_val_loss": 3.21,
                "theta_hashes": ["a"],
                "bytes_sent": 1_200_000,
                "bytes_received": 1_100_000,
                "exit_code": -9,
                "pid": 102,
            },
        ],
        "all_hashes_agree_per_round": {"1": True, "2": True},
        "wall_s": 12.346,
        "bootstrap": {"pid": 100, "exit_code": 0, "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/Qm"]},
        "survivors": [],
    }
    assert not progress.swarm_succeeded(views, 2, [])  # node1 was killed after 1 round
    assert not progress.swarm_succeeded(views[:1], 3, [])
    assert progress.swarm_succeeded(views[:1], 2, [])
    assert not progress.swarm_succeeded(views[:1], 2, [4242])


def test_summary_of_a_node_that_never_started() -> None:
    node = progress.node_summary(progress.NodeView("node0"), pid=None)
    assert node == {
        "name": "node0",
        "peer_id": None,
        "rounds_done": 0,
        "final_val_loss": None,
        "theta_hashes": [],
        "bytes_sent": 0,
        "bytes_received": 0,
        "exit_code": None,
        "pid": None,
    }


# ---- command lines -------------------------------------------------------------------------------


def test_node_command_line_follows_the_contract(tmp_path: Path) -> None:
    argv = ["--nodes", "3", "--rounds", "5", "--out", str(tmp_path), "--run-id", "r"]
    opts = sl.parse_options([*argv, "--base-port", "4000", "--", "--codec", "int8"])
    assert sl.node_argv(opts, 1, ["/ip4/1.2.3.4/tcp/5/p2p/Qm"], threads=2) == [
        "--peers",
        "/ip4/1.2.3.4/tcp/5/p2p/Qm",
        "--run-id",
        "r",
        "--rounds",
        "5",
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/4002",
        "--no-nat-port-map",
        "--status-file",
        str(tmp_path / "node1" / "status.jsonl"),
        "--checkpoint-dir",
        str(tmp_path / "node1" / "checkpoints"),
        "--control-port",
        "0",
        "--data-shard",
        "1",
        "--data-shards",
        "3",
        "--threads",
        "2",
        "--codec",
        "int8",
    ]
    assert sl.bootstrap_argv(opts) == [
        "--identity-path",
        str(tmp_path / "bootstrap.key"),
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/4000",
        "--no-nat-port-map",
        "--maddrs-file",
        str(tmp_path / "bootstrap.json"),
    ]
    assert sl.host_maddr(0, 3) == "/ip4/127.0.0.1/tcp/0"
    assert [sl.threads_per_node(n, 2) for n in (1, 2, 3)] == [2, 1, 1]
    defaults = sl.parse_options(argv[:-2])
    assert (defaults.run_id.startswith("swarm-"), defaults.base_port, defaults.node_args) == (True, 0, ())


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--nodes", "0", "--rounds", "1"], "--nodes"),
        (["--nodes", "2", "--rounds", "-1"], "--rounds"),
        (["--nodes", "2", "--rounds", "0"], "--rounds"),
        (["--nodes", "2", "--rounds", "1", "--base-port", "80"], "--base-port"),
        (["--nodes", "2", "--rounds", "1", "--run-id", " "], "--run-id"),
        (["--nodes", "2", "--rounds", "1", "--", "--status-file=x"], "--"),
        (["--nodes", "2", "--rounds", "1", "--", "--codec", "int8", "--peers", "p"], "--"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rc = sl.main([*argv[:4], "--out", str(out), *argv[4:]])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith(f"adloco-swarm: error: {option}: "), err
    assert not (out / "bootstrap.log").exists()  # nothing was started


def test_unwritable_out_is_one_line_from_the_console_script(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run(
        [str(BIN / "adloco-swarm"), "--nodes", "1", "--rounds", "1", "--out", str(blocker / "sub")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"adloco-swarm: error: --out: cannot write to {blocker / 'sub'}: Not a directory"
    ]


# ---- the real launcher ---------------------------------------------------------------------------


def marked_processes(token: str) -> list[int]:
    """Pids of live processes whose environment carries MARKER=token (every process of one run)."""
    needle = f"{MARKER}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            pids.append(int(entry.name))
    return pids


def run_swarm(procs: Procs, out: Path, argv: list[str], *, timeout: float) -> tuple[int, str, list[int]]:
    """Run adloco-swarm to its end; returns (exit status, its output, pids of the run still alive)."""
    token = uuid.uuid4().hex
    proc = procs.start("swarm", ["adloco-swarm", "--out", str(out), *argv], env={MARKER: token})
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        survivors = reap_marked(token)
    return rc, procs.log("swarm"), survivors


def reap_marked(token: str) -> list[int]:
    """Pids of the run still alive 10 s after its end, killed so no peer leaks into the session."""
    # torch_shm_manager (torch's shared-memory daemon, started under hivemind) leaves every group
    # with setsid and exits by itself ~2 s after its last client: give it that time.
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not marked_processes(token), timeout=10, what="the run's processes to exit")
    survivors = marked_processes(token)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return survivors


def assert_groups_gone(summary: dict[str, Any]) -> None:  # summary.json, as read back
    pids = [n["pid"] for n in summary["nodes"]] + [summary["bootstrap"]["pid"]]
    assert all(isinstance(pid, int) for pid in pids)
    assert summary["survivors"] == []
    assert [group_members(pid) for pid in pids] == [[] for _ in pids]


@pytest.mark.timeout(120)
def test_stop_reaps_what_a_killed_leader_left_behind(tmp_path: Path) -> None:
    """A bootstrap SIGKILLed alone leaves its DHT process and p2pd in its group; stopping kills them."""
    opts = sl.parse_options(["--nodes", "1", "--rounds", "1", "--out", str(tmp_path)])
    argv = [processes.find_script("adloco-bootstrap"), *sl.bootstrap_argv(opts)]
    child = processes.Child.start("bootstrap", argv, tmp_path / "bootstrap.log")
    try:
        wait_for((tmp_path / "bootstrap.json").exists, timeout=60, what="the bootstrap's multiaddrs")
        assert len(child.members()) >= 2  # python, its DHT process, p2pd
        child.proc.kill()
        assert processes.stop_children([child], hurry=threading.Event()) == []
        assert child.proc.returncode == -signal.SIGKILL
        assert group_members(child.proc.pid) == []
    finally:
        child.signal_group(signal.SIGKILL)


@pytest.mark.timeout(150)
def test_crashing_nodes_are_reported_and_everything_is_reaped(procs: Procs, tmp_path: Path) -> None:
    """Real bootstrap, real nodes that reject their arguments: the launcher reports and cleans up."""
    out = tmp_path / "swarm"
    argv = ["--nodes", "2", "--rounds", "1", "--run-id", "crash", "--", "--batch-test", "bogus"]
    rc, log, survivors = run_swarm(procs, out, argv, timeout=120)
    assert survivors == [], log
    assert rc == 1, log
    summary = json.loads((out / "summary.json").read_text())
    assert [(n["name"], n["exit_code"], n["rounds_done"]) for n in summary["nodes"]] == [
        ("node0", 2, 0),
        ("node1", 2, 0),
    ]
    assert summary["bootstrap"]["exit_code"] == 0 and summary["bootstrap"]["maddrs"]
    assert summary["all_hashes_agree_per_round"] == {}
    assert_groups_gone(summary)
    # The crash report carries the tail of the node's log, where its own error is.
    assert "[node0] CRASHED with exit code 2" in log and "--batch-test" in log, log


@functools.cache
def node_help_words() -> frozenset[str]:
    """The words of `adloco-node --help` (run once per session: it imports torch)."""
    node = BIN / "adloco-node"
    assert node.exists(), f"adloco-swarm starts {node}, which is not installed"
    help_text = subprocess.run([str(node), "--help"], capture_output=True, text=True, timeout=120).stdout
    return frozenset(help_text.split())


def assert_node_takes_the_launcher_flags() -> None:
    """A flag the launcher sets for every node that adloco-node does not take fails the test, not skips it."""
    missing = [flag for flag in sl.MANAGED_NODE_FLAGS if flag not in node_help_words()]
    assert not missing, (
        f"adloco-swarm passes {' '.join(missing)} to every node, but `adloco-node --help` does not"
        " list it: rename it in node/cli/launcher.py (MANAGED_NODE_FLAGS, node_argv) or restore it"
    )


@pytest.mark.long
@pytest.mark.timeout(300)
def test_two_nodes_train_one_round_and_stop_cleanly(procs: Procs, tmp_path: Path) -> None:
    assert_node_takes_the_launcher_flags()
    out = tmp_path / "swarm"
    argv = ["--nodes", "2", "--rounds", "1", "--run-id", "itest", "--", *TINY_NODE]
    rc, log, survivors = run_swarm(procs, out, argv, timeout=270)
    assert survivors == [], log
    assert rc == 0, log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_id"] == "itest"
    assert 0 < summary["wall_s"] < 270
    nodes = summary["nodes"]
    assert [n["name"] for n in nodes] == ["node0", "node1"]
    for node in nodes:
        assert (node["rounds_done"], node["exit_code"]) == (1, 0), log
        assert isinstance(node["peer_id"], str) and node["peer_id"]
        assert math.isfinite(node["final_val_loss"])
        assert len(node["theta_hashes"]) == 1 and isinstance(node["theta_hashes"][0], str)
        assert node["bytes_sent"] >= 0 and node["bytes_received"] >= 0
    assert nodes[0]["peer_id"] != nodes[1]["peer_id"]
    # Both applied the same round and hold the same parameters after it.
    assert nodes[0]["theta_hashes"] == nodes[1]["theta_hashes"]
    assert list(summary["all_hashes_agree_per_round"].values()) == [True]
    assert_groups_gone(summary)
    assert "[node0 round=" in log and "[node1 round=" in log


@pytest.mark.long
@pytest.mark.timeout(300)
def test_sigterm_stops_a_training_swarm_gracefully(procs: Procs, tmp_path: Path) -> None:
    assert_node_takes_the_launcher_flags()
    out = tmp_path / "swarm"
    token = uuid.uuid4().hex
    argv = ["adloco-swarm", "--out", str(out), "--nodes", "2", "--rounds", "1000", "--", *TINY_NODE]
    proc = procs.start("swarm", argv, env={MARKER: token})
    try:
        statuses = [out / f"node{i}" / "status.jsonl" for i in range(2)]
        wait_for(
            lambda: all(p.exists() and '"event": "round"' in p.read_text() for p in statuses),
            timeout=200,
            interval=0.5,
            what="a round from both nodes",
        )
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        survivors = reap_marked(token)
    log = procs.log("swarm")
    assert survivors == [], log
    assert rc == 1, log  # stopped before the rounds were done
    summary = json.loads((out / "summary.json").read_text())
    # Each node left on SIGTERM by itself (exit 0, its done record written) after at least one round.
    assert [(n["exit_code"], n["rounds_done"] >= 1) for n in summary["nodes"]] == [(0, True), (0, True)], log
    assert all(summary["all_hashes_agree_per_round"].values())
    assert_groups_gone(summary)
    assert "[swarm] interrupted: stopping the nodes" in log
