"""The averaging contract (STYLE 5), one suite over both transports: in-process and hivemind.

Every implementation of `protocol.averager.Averager` must: give every member that returns a result
the same bytes, equal to `reduce_group` on the same contributions, with the same members and
gathered metadata; leave out a peer that calls after the window without anybody waiting for it;
keep runs with different prefixes apart; screen out a poisoned (NaN or scaled) contribution the
same way everywhere; and (hivemind) survive a member SIGKILLed mid-round (after registering, or
mid-send) with either identical results without it or None everywhere, an owner SIGKILLed before it
reduces with None everywhere and a next try that completes, and an owner's malformed answer with
None, not a crash. Hivemind peers are real DHTs with their own p2pd on loopback, NAT mapping off;
every p2pd this module starts carries a marker in its environment, and after each test none of them
may still be alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from hivemind.utils import get_dht_time

from adloco.node.sim.engine import sum_bomb
from adloco.node.swarm.loop import ROUND_ID_STRIDE
from adloco.protocol.algorithms import codecs
from adloco.protocol.algorithms.allreduce import Contribution, reduce_group
from adloco.protocol.algorithms.codecs import decode_tensors, encode_tensors, make_codec
from adloco.protocol.algorithms.parts import MEAN, SCORED, Aggregate, Clip
from adloco.protocol.algorithms.report import PeerReport
from adloco.protocol.algorithms.trust import WORK_MIN_ROUNDS
from adloco.protocol.transport.averager import Averager, MemberResult, Misconduct, NotOpened
from adloco.protocol.transport.dht import DHT_STALL_S
from adloco.protocol.transport.hivemind_averager import MAX_ASKED_ROUNDS
from adloco.protocol.transport.matchmaking import Caught, RoundFailed
from adloco.protocol.transport.memory import MemoryAverager, MemoryHub

from background import AVERAGER_TEST_MARK
from procs import wait_for

pytestmark = pytest.mark.timeout(60)

WINDOW_S = 1.0
GRACE_S = 0.3
PART_TIMEOUT_S = 2.0
REDUCE_TIMEOUT_S = 1.0
CALL_TIMEOUT_S = 20.0
# Slack for a loaded 2-core machine on top of the protocol's own bounds.
SLACK_S = 2.0
DHT_KWARGS: dict[str, Any] = {
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "nat_port_map": False,
    "auto_nat": False,
    "use_relay": False,
    "use_auto_relay": False,
}
SHAPES = {"embed": (48, 32), "proj": (32, 40), "norm": (32,)}

# Inherited by every DHT process and p2pd started from here (and by the killed member's process).
_MARK = f"{AVERAGER_TEST_MARK}{uuid.uuid4().hex}"
os.environ[_MARK] = "1"


def _live_marked_p2pd() -> list[int]:
    """Pids of p2pd processes started by this module that are still running (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
            if comm != "p2pd" or state == "Z":
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"{_MARK}=1".encode() in environ:
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def no_p2pd_left_behind() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5.0
    while (left := _live_marked_p2pd()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # do not leak them into the next test, but fail this one
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"p2pd processes left running: {left}"


class Swarm:
    """Nodes of one transport; an averager is (node, prefix). Memory nodes are names on one hub."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.hub = MemoryHub(window_s=WINDOW_S)
        self.dhts: list[Any] = []
        self.averagers: list[Averager] = []
        self.nodes = 0

    def add_nodes(self, n: int, *, identities: Sequence[Path] = ()) -> None:
        """n more nodes; hivemind nodes take their peer ids from `identities` where given."""
        if self.kind == "hivemind":
            from adloco.protocol.transport.identity import NodeDHT

            kwargs = [
                {**DHT_KWARGS, "identity_path": str(p), "check_if_identity_free": False} for p in identities
            ]
            kwargs += [DHT_KWARGS] * (n - len(kwargs))
            if not self.dhts:
                self.dhts.append(NodeDHT(start=True, **kwargs.pop(0)))
            peers = self.dhts[0].get_visible_maddrs()
            # Start the others together: each p2pd takes most of a second to come up.
            new = [NodeDHT(initial_peers=peers, start=True, await_ready=False, **kw) for kw in kwargs]
            self.dhts += new
            for dht in new:
                dht.wait_until_ready(timeout=30)
            self.nodes = len(self.dhts)
        else:
            self.nodes += n

    def averager(self, node: int, prefix: str = "run-a", **knobs: Any) -> Averager:
        averager: Averager
        if self.kind == "hivemind":
            from adloco.protocol.transport.hivemind_averager import HivemindAverager

            averager = HivemindAverager(
                self.dhts[node],
                prefix=prefix,
                window_s=WINDOW_S,
                grace_s=GRACE_S,
                **{"part_timeout_s": PART_TIMEOUT_S, "reduce_timeout_s": REDUCE_TIMEOUT_S, **knobs},
            )
        else:
            averager = MemoryAverager(self.hub, f"peer{node}", prefix=prefix)
        self.averagers.append(averager)
        return averager

    def close(self) -> None:
        for averager in self.averagers:
            averager.shutdown()
        for dht in self.dhts:
            dht.shutdown()

    @property
    def round_bound_s(self) -> float:
        """How long a round may take for a member: the window, then grace and the exchange."""
        return WINDOW_S + (GRACE_S if self.kind == "hivemind" else 0.0) + SLACK_S


@pytest.fixture(params=["memory", "hivemind"])
def swarm(request: pytest.FixtureRequest) -> Iterator[Swarm]:
    s = Swarm(request.param)
    try:
        yield s
    finally:
        s.close()


def _contributions(
    averagers: Sequence[Averager], spec: str, *, seed: int, shapes: Mapping[str, tuple[int, ...]] = SHAPES
) -> list[Contribution]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, averager in enumerate(averagers):
        tensors = {k: torch.randn(*shape, generator=g) for k, shape in shapes.items()}
        out.append(
            Contribution(
                peer_id=averager.peer_id,
                payloads=encode_tensors(make_codec(spec), tensors),
                weight=100.0 * (i + 1),
                tokens=100.0,
                metadata=PeerReport(
                    peer_id=averager.peer_id, slot_stats=(None,), b_max=4, tokens=100 * i, base_round=7
                ).encode(),
            )
        )
    return out


@dataclass
class Outcome:
    result: MemberResult | None
    elapsed_s: float


def _average_together(
    averagers: Sequence[Averager],
    contributions: Sequence[Contribution],
    *,
    round: int,
    spec: str,
    bounds: Any = None,
    delays: Sequence[float] | None = None,
    patience_s: float = 0.0,
) -> list[Outcome]:
    """Every averager calls `average` at the same moment from its own thread (as trainers do), or
    `delays[i]` seconds after it."""
    outcomes: list[Outcome | None] = [None] * len(averagers)
    start = threading.Barrier(len(averagers))

    def member(i: int) -> None:
        start.wait()
        if delays is not None:
            time.sleep(delays[i])
        began = time.monotonic()
        result = averagers[i].average(
            contributions[i],
            round=round,
            codec=make_codec(spec),
            timeout=CALL_TIMEOUT_S,
            bounds=bounds,
            patience_s=patience_s,
        )
        assert result is None or isinstance(result, MemberResult)
        outcomes[i] = Outcome(result, time.monotonic() - began)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=CALL_TIMEOUT_S + 10)
    assert all(o is not None for o in outcomes), "a member never returned"
    return [o for o in outcomes if o is not None]


def dealing_order(owners: Mapping[str, str], payloads: Mapping[str, bytes]) -> list[str]:
    """The order in which `parts.assign_parts` dealt the parts to the owners a result names: with
    the tensors largest first, the first owner of each new name. `reduce_group` dealing in this
    order must give every part the same owner (`_assert_matches_reduce_group` checks it), so a
    result whose owners no dealing yields fails there."""
    keys = list(payloads)
    ranked = sorted(range(len(keys)), key=lambda i: (-len(payloads[keys[i]]), i))
    return list(dict.fromkeys(owners[keys[i]] for i in ranked))


def _assert_matches_reduce_group(
    outcomes: Sequence[Outcome],
    contributions: Sequence[Contribution],
    spec: str,
    work_cap: float | None = None,
    aggregate: Aggregate = MEAN,
) -> None:
    first = next((o.result for o in outcomes if o.result is not None), None)
    assert first is not None
    order = dealing_order(first.owners, contributions[0].payloads)
    expected = reduce_group(
        contributions, codec=make_codec(spec), work_cap=work_cap, owners=order, aggregate=aggregate
    )
    for o in outcomes:
        r = o.result
        assert r is not None
        assert r.averaged == expected.averaged
        assert r.members == expected.members == tuple(sorted(c.peer_id for c in contributions))
        assert r.reports == expected.reports and r.malformed == expected.malformed == {}
        assert r.owners == expected.owners
        assert r.rejected == expected.rejected
        assert r.work == expected.work
        # Exact traffic: the payload bytes are reduce_group's count for this member; what went on the
        # wire is at least that, and the result carries it as this member's sent/received bytes.
        t = r.traffic
        assert (t.payload_sent, t.payload_received) == (
            expected.sent_bytes[r.peer_id],
            expected.received_bytes[r.peer_id],
        )
        assert (r.sent_bytes[r.peer_id], r.received_bytes[r.peer_id]) == (t.wire_sent, t.wire_received)
        assert t.wire_sent >= t.payload_sent and t.wire_received >= t.payload_received


@pytest.mark.parametrize("spec", ["int8", "lowrank:2"])
def test_members_hold_identical_bytes_equal_to_reduce_group(swarm: Swarm, spec: str) -> None:
    swarm.add_nodes(3)
    averagers = [swarm.averager(i) for i in range(3)]
    assert all(isinstance(a, Averager) for a in averagers)
    contributions = _contributions(averagers, spec, seed=1)
    outcomes = _average_together(averagers, contributions, round=0, spec=spec)
    _assert_matches_reduce_group(outcomes, contributions, spec)
    assert all(o.elapsed_s < swarm.round_bound_s for o in outcomes)


def test_late_peer_is_left_out_and_nobody_waits_for_it(swarm: Swarm) -> None:
    swarm.add_nodes(4)
    averagers = [swarm.averager(i) for i in range(4)]
    contributions = _contributions(averagers, "int8", seed=2)
    on_time = _average_together(averagers[:3], contributions[:3], round=3, spec="int8")
    # The three closed the round one window after the first registration; none waited for the 4th.
    _assert_matches_reduce_group(on_time, contributions[:3], "int8")
    assert all(o.elapsed_s < swarm.round_bound_s for o in on_time)
    # The 4th arrives after the window: it is told at once (no window of its own), and is not a member.
    began = time.monotonic()
    late = averagers[3].average(contributions[3], round=3, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S)
    assert late is None
    assert time.monotonic() - began < WINDOW_S
    assert all(averagers[3].peer_id not in o.result.members for o in on_time if o.result is not None)


@pytest.mark.parametrize("patience_s", [0.0, 2.5])
def test_a_memory_round_stays_open_for_its_openers_patience(patience_s: float) -> None:
    """The in-process hub keeps a round its first caller opens open for max(window, patience): a peer
    calling 1.5 s later (after the 1 s window) is in the group with a patience of 2.5 s, and left
    out without one. The hub has no expected group to close early on, so the opener waits it out."""
    swarm = Swarm("memory")
    try:
        swarm.add_nodes(2)
        averagers = [swarm.averager(i) for i in range(2)]
        contributions = _contributions(averagers, "int8", seed=17)
        outcomes = _average_together(
            averagers, contributions, round=4, spec="int8", delays=[0.0, 1.5], patience_s=patience_s
        )
    finally:
        swarm.close()
    if patience_s:
        _assert_matches_reduce_group(outcomes, contributions, "int8")
        assert outcomes[0].elapsed_s >= patience_s - 0.05
    else:
        first, late = outcomes
        assert late.result is None
        assert first.result is not None and first.result.members == (averagers[0].peer_id,)
        assert first.elapsed_s < patience_s + WINDOW_S + SLACK_S


def test_join_only_never_opens_a_round_but_joins_one_opened_by_another(swarm: Swarm) -> None:
    swarm.add_nodes(2)
    fresh, late = swarm.averager(0), swarm.averager(1)
    contributions = _contributions([fresh, late], "int8", seed=5)
    # Alone, a join-only call opens nothing: it gives up at its timeout with no result.
    alone = late.average(contributions[1], round=8, codec=make_codec("int8"), timeout=1.5, join_only=True)
    assert alone is None
    # Called first, it waits until the fresh peer opens the round, then both are in one group.
    outcomes: dict[str, MemberResult | None] = {}

    def call_late() -> None:
        outcomes["late"] = late.average(
            contributions[1], round=9, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S, join_only=True
        )

    thread = threading.Thread(target=call_late)
    thread.start()
    time.sleep(1.0)  # the join-only peer is waiting before anyone opened round 9
    outcomes["fresh"] = fresh.average(
        contributions[0], round=9, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S
    )
    thread.join(timeout=CALL_TIMEOUT_S + 10)
    assert outcomes["late"] is not None and outcomes["fresh"] is not None
    assert outcomes["late"].averaged == outcomes["fresh"].averaged
    assert (
        outcomes["late"].members
        == outcomes["fresh"].members
        == tuple(sorted(c.peer_id for c in contributions))
    )


def test_join_only_with_a_bounded_wait_says_no_round_was_opened_and_never_registered(swarm: Swarm) -> None:
    """A join-only call that nobody opens a round for raises NotOpened after its `join_wait_s`, long
    before its timeout, having stored nothing: a fresh peer then opens that round alone."""
    swarm.add_nodes(2)
    fresh, late = swarm.averager(0), swarm.averager(1)
    contributions = _contributions([fresh, late], "int8", seed=6)
    began = time.monotonic()
    with pytest.raises(NotOpened):
        late.average(
            contributions[1],
            round=4,
            codec=make_codec("int8"),
            timeout=CALL_TIMEOUT_S,
            join_only=True,
            join_wait_s=0.5,
        )
    assert time.monotonic() - began < 0.5 + SLACK_S
    alone = fresh.average(contributions[0], round=4, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S)
    assert alone is not None and alone.members == (fresh.peer_id,)


def test_two_prefixes_on_the_same_nodes_never_mix(swarm: Swarm) -> None:
    swarm.add_nodes(3)
    run_a = [swarm.averager(i, prefix="run-a/fp0") for i in range(3)]
    run_b = [swarm.averager(i, prefix="run-b/fp1") for i in (1, 2)]
    contributions_a = _contributions(run_a, "int8", seed=3)
    contributions_b = _contributions(run_b, "int8", seed=4)
    outcomes = _average_together([*run_a, *run_b], [*contributions_a, *contributions_b], round=0, spec="int8")
    _assert_matches_reduce_group(outcomes[:3], contributions_a, "int8")
    _assert_matches_reduce_group(outcomes[3:], contributions_b, "int8")


@pytest.mark.parametrize("poison", ["nan", "scaled"])
def test_a_poisoned_contribution_is_screened_out_identically(swarm: Swarm, poison: str) -> None:
    """One member of three sends NaN (or 1000× scaled) tensors: every owner leaves its parts out."""
    swarm.add_nodes(3)
    averagers = [swarm.averager(i) for i in range(3)]
    contributions = _contributions(averagers, "none", seed=8)
    bad = contributions[1]
    tensors = decode_tensors(dict(bad.payloads))
    poisoned = {k: torch.full_like(t, math.nan) if poison == "nan" else 1000 * t for k, t in tensors.items()}
    contributions[1] = dataclasses.replace(bad, payloads=encode_tensors(make_codec("none"), poisoned))
    outcomes = _average_together(averagers, contributions, round=0, spec="none")
    _assert_matches_reduce_group(outcomes, contributions, "none")
    honest = reduce_group([contributions[0], contributions[2]], codec=make_codec("none"))
    for o in outcomes:
        assert o.result is not None
        assert o.result.averaged == honest.averaged  # bit-identical to the honest members' average
        assert o.result.rejected == {bad.peer_id: len(SHAPES)}
        assert bad.peer_id in o.result.members  # rejection is per part: still a contributor


@pytest.mark.parametrize(
    "metadata",
    [b"{}", b"\x93\x01\x02", b'{"peer_id": "x", "slot_stats": [], "b_max": 1, "tokens": -5}', b"{" * 70_000],
    ids=["empty-object", "not-json", "out-of-bounds", "oversized"],
)
@pytest.mark.parametrize("bad_index", [0, 2])
def test_a_malformed_report_is_dropped_by_every_member_and_the_round_completes(
    swarm: Swarm, metadata: bytes, bad_index: int
) -> None:
    """One member of three sends a report that does not parse: every member drops that entry with
    the same decision and completes the round with all three Δs (the first member in dealing order
    owns the first tensor, so it relays everyone's reports; both positions are tried)."""
    swarm.add_nodes(3)
    averagers = _by_dealing([swarm.averager(i) for i in range(3)], SHAPES)
    contributions = _contributions(averagers, "int8", seed=10)
    bad = contributions[bad_index]
    contributions[bad_index] = dataclasses.replace(bad, metadata=metadata)
    outcomes = _average_together(averagers, contributions, round=0, spec="int8")
    expected = reduce_group(contributions, codec=make_codec("int8"))
    for o in outcomes:
        r = o.result
        assert r is not None, "a malformed report must not fail the round for anyone"
        assert r.averaged == expected.averaged
        assert r.members == expected.members and bad.peer_id in r.members
        assert [rep.peer_id for rep in r.reports] == sorted(  # the members' order
            c.peer_id for c in contributions if c is not contributions[bad_index]
        )
        assert list(r.malformed) == [bad.peer_id]
    assert len({tuple(o.result.malformed.items()) for o in outcomes if o.result is not None}) == 1


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> Counter[bytes]:
    """Count the reads of each payload's values, whole (`codecs.decode`) or span by span
    (`codecs.decoded_spans`), in every module of the package that imported them."""
    counts: Counter[bytes] = Counter()
    lock = threading.Lock()  # owners decode on their own executor threads
    real, real_spans = codecs.decode, codecs.decoded_spans

    def counting(payload: bytes) -> torch.Tensor:
        with lock:
            counts[bytes(payload)] += 1
        return real(payload)

    def counting_spans(payload: bytes, span: int = codecs.SPAN) -> Iterator[torch.Tensor]:
        with lock:
            counts[bytes(payload)] += 1
        return real_spans(payload, span)

    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("adloco."):
            continue
        if getattr(module, "decode", None) is real:
            monkeypatch.setattr(module, "decode", counting)
        if getattr(module, "decoded_spans", None) is real_spans:
            monkeypatch.setattr(module, "decoded_spans", counting_spans)
    return counts


def test_every_payload_is_decoded_as_often_as_its_checks_need(
    swarm: Swarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Owners check what they receive from its header (`codecs.payload_shape`) and read each
    contributed payload's values exactly twice, a span at a time, when they reduce it: its norm for
    the screening, then the mean (holding every decoded payload between the two was the reduction's
    peak memory, issue 28 §2). Over the network every member also reads its own payloads twice (the
    norms it commits to, then its projections: protocol/transport/verification.py) and each answer
    it did not reduce itself once, to check it; nothing else is read in a round."""
    swarm.add_nodes(3)
    averagers = [swarm.averager(i) for i in range(3)]
    contributions = _contributions(averagers, "int8", seed=11)
    decodes = _count_decodes(monkeypatch)
    outcomes = _average_together(averagers, contributions, round=0, spec="int8")
    results = [o.result for o in outcomes]
    assert all(r is not None for r in results)
    contributed = Counter(p for c in contributions for p in c.payloads.values())
    if swarm.kind == "memory":
        assert decodes == Counter({p: 2 * n for p, n in contributed.items()})
        return
    answers = Counter(a for r in results if r is not None for a in r.averaged.values())
    assert all(n == len(averagers) for n in answers.values())  # every member holds every answer
    # Each answer is checked by the members that did not reduce it.
    checked = Counter({a: n - 1 for a, n in answers.items()})
    assert decodes == Counter({p: 4 * n for p, n in contributed.items()}) + checked


def test_alone_timeouts_and_misuse(swarm: Swarm) -> None:
    """A group of one forwards its own bytes; the caller's timeout holds; misuse raises (calling a
    round again is misuse in process; over the DHT a round averaged alone may be taken up again)."""
    swarm.add_nodes(1)
    averager = swarm.averager(0)
    (contribution,) = _contributions([averager], "int8", seed=6)
    began = time.monotonic()
    assert averager.average(contribution, round=0, codec=make_codec("int8"), timeout=0.2) is None
    assert time.monotonic() - began < WINDOW_S
    (alone,) = _average_together([averager], [contribution], round=1, spec="int8")
    assert alone.result is not None
    assert alone.result.averaged == dict(contribution.payloads)  # weight == tokens: forwarded as is
    assert alone.result.members == (averager.peer_id,)
    assert alone.result.traffic.payload_sent == alone.result.traffic.payload_received == 0
    if swarm.kind == "hivemind":
        # Over the DHT a round averaged alone is not spent: a peer that went on alone and took the
        # swarm's state back meets the others at that round (test_matchmaking has the three).
        again = averager.average(contribution, round=1, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S)
        assert again is not None and again.members == (averager.peer_id,)
    else:
        with pytest.raises(ValueError, match="single-use"):
            averager.average(contribution, round=1, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S)
    stranger = Contribution(peer_id="someone-else", payloads=contribution.payloads, weight=1.0)
    with pytest.raises(ValueError, match="someone-else"):
        averager.average(stranger, round=2, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S)
    averager.shutdown()
    with pytest.raises(RuntimeError):
        averager.average(contribution, round=3, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S)


_VICTIM = """
import sys, time
import torch
from hivemind.utils import get_dht_time
from adloco.protocol.algorithms.allreduce import Contribution
from adloco.protocol.algorithms.codecs import encode_tensors, make_codec
from adloco.protocol.transport.hivemind_averager import HivemindAverager
from adloco.protocol.transport.identity import NodeDHT

peer, prefix, stage, round = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
kwargs, shapes, knobs = (eval(arg) for arg in sys.argv[5:8])
dht = NodeDHT(initial_peers=[peer], start=True, **kwargs)

def hang_at(reached, round):
    if reached == stage:
        print("AT", reached, flush=True)
        time.sleep(3600)  # blocks the averager's loop at this stage, until the test kills the group

averager = HivemindAverager(dht, prefix=prefix, on_stage=hang_at, **knobs)
tensors = {k: torch.randn(*s) for k, s in shapes.items()}
contribution = Contribution(averager.peer_id, encode_tensors(make_codec("int8"), tensors), 100.0, 100.0)
print("READY", averager.peer_id, flush=True)
sys.stdin.readline()
result = averager.average(contribution, round=round, codec=make_codec("int8"), timeout=60)
print("RETURNED", result, flush=True)  # never reached unless the hook failed to hold it
"""
# Small chunks for the victim: its payloads (~1.5 kB) take several frames, so "sending" is mid-send.
VICTIM_CHUNK_BYTES = 256
# How long survivors may take when a member dies: their round runs to its part deadline at most,
# then the answers (reduce timeout).
KILLED_BOUND_S = WINDOW_S + GRACE_S + PART_TIMEOUT_S + REDUCE_TIMEOUT_S + SLACK_S


def _read_line(proc: subprocess.Popen[str], expected: str, timeout: float, log: Path) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""))
    reader.start()
    reader.join(timeout)
    said = box[0] if box else "nothing"
    assert said.startswith(expected), (
        f"victim said {said!r}, not {expected}; its log:\n{log.read_text()[-3000:]}"
    )
    return said


def _identities(
    folder: Path, n: int, *, dealing: tuple[Mapping[str, tuple[int, ...]], int] | None = None
) -> list[Path]:
    """n identity files sorted by the peer id they give, or with `dealing` (shapes, round) in the
    order their first round deals those parts (`_dealing_order`), so a test can choose who owns what."""
    from hivemind.p2p import P2P, PeerID

    paths = [folder / f"peer{i}.key" for i in range(n)]
    for path in paths:
        P2P.generate_identity(str(path))
    ids = {p: PeerID.from_identity(p.read_bytes()).to_base58() for p in paths}
    ranked = sorted(paths, key=lambda p: ids[p])
    if dealing is not None:
        order = _dealing_order(list(ids.values()), dealing[0], round=dealing[1])
        ranked.sort(key=lambda p: order.index(ids[p]))
    return ranked


@dataclass
class KilledRound:
    """A round whose victim was SIGKILLed: the survivors (alive, for a retry), what they did."""

    swarm: Swarm
    survivors: list[Averager]
    contributions: list[Contribution]
    outcomes: list[Outcome]
    victim: str  # its peer id
    killed_s: float  # when the kill came, from the survivors' call

    def dropped_by(self, survivor: Averager, round: int) -> set[str]:
        """The members `survivor`, as an owner in `round`, stopped waiting for (broke or died)."""
        future = survivor._rounds[round][1]  # type: ignore[attr-defined]
        state = future.result() if future.done() else None
        return set() if state is None or state.session is None else set(state.session.dropped)

    def report(self, what: str) -> str:
        took = ", ".join(f"{o.elapsed_s:.2f}" for o in self.outcomes)
        return f"{what}: killed after {self.killed_s:.2f} s, survivors returned after {took} s"


@contextlib.contextmanager
def _a_round_with_a_member_killed(
    tmp_path: Path,
    *,
    stage: str,
    victim_owns: str,
    round: int = 0,
    expecting_the_victim: bool = False,
    frozen: bool = False,
    side: int = 32,
    late_reader: float = 0.0,
    **knobs: Any,
) -> Iterator[KilledRound]:
    """SIGKILL a member (its whole process group: python, DHT process, p2pd) when it reaches `stage`
    of `round` (its `on_stage` hook holds it there until the kill). `frozen`: no kill until the
    survivors returned; the hook holds its event loop, so its streams stay open and answer nothing,
    as a killed container's address does (no reset). `side`: the tensors' second dimension (an
    answer larger than the streams' buffers is written as its member reads it). `late_reader`: the
    second survivor reads its answers that many seconds late. `knobs`: the survivors' settings.

    Two tensors of equal size among three members in dealing order: the first two members own one
    each, the third owns nothing. The victim is the third (`victim_owns` "nothing") or the first
    ("a_part"). With `expecting_the_victim`, the survivors expect the three of them at their next
    registration (as after a round completed together). Yields once the survivors' calls returned;
    the swarm is closed and the victim's group killed on the way out, pass or fail.
    """
    shapes = {"embed": (48, side), "proj": (48, side)}
    identities = _identities(tmp_path, 3, dealing=(shapes, round))
    victim_identity = identities.pop(2 if victim_owns == "nothing" else 0)
    swarm = Swarm("hivemind")
    proc: subprocess.Popen[str] | None = None
    log_path = tmp_path / "victim.log"
    log = log_path.open("w")
    try:
        swarm.add_nodes(2, identities=identities)
        late: dict[str, Any] = {"answer_delay": lambda _: late_reader} if late_reader else {}
        survivors = [swarm.averager(0, **knobs), swarm.averager(1, **knobs, **late)]
        victim_knobs = {
            "window_s": WINDOW_S,
            "grace_s": GRACE_S,
            "part_timeout_s": PART_TIMEOUT_S,
            "reduce_timeout_s": REDUCE_TIMEOUT_S,
            "chunk_bytes": VICTIM_CHUNK_BYTES,
        }
        victim_kwargs = {**DHT_KWARGS, "identity_path": str(victim_identity), "check_if_identity_free": False}
        maddr = str(swarm.dhts[0].get_visible_maddrs()[0])
        args = [maddr, "run-a", stage, str(round), repr(victim_kwargs), repr(shapes), repr(victim_knobs)]
        proc = subprocess.Popen(
            [sys.executable, "-c", _VICTIM, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,  # its DHT process and p2pd die with it: the whole machine "fails"
        )
        victim = _read_line(proc, "READY", timeout=40, log=log_path).split()[1]
        contributions = _contributions(survivors, "int8", seed=5, shapes=shapes)
        outcomes: list[Outcome] = []
        runner = threading.Thread(
            target=lambda: outcomes.extend(
                _average_together(survivors, contributions, round=round, spec="int8")
            )
        )
        assert proc.stdin is not None
        began = time.monotonic()
        runner.start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _read_line(proc, f"AT {stage}", timeout=10, log=log_path)
        if expecting_the_victim:  # read at their next registration (this round's group has formed)
            for a in survivors:
                a._matchmaker.expected = (*(b.peer_id for b in survivors), victim)  # type: ignore[attr-defined]
        if not frozen:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        killed_s = time.monotonic() - began
        runner.join(timeout=CALL_TIMEOUT_S + 10)
        assert len(outcomes) == 2, "a survivor never returned"
        yield KilledRound(swarm, survivors, contributions, outcomes, victim, killed_s)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
        swarm.close()


@pytest.mark.parametrize("victim_owns", ["nothing", "a_part"])
@pytest.mark.parametrize("stage", ["registered", "sending"])
def test_member_killed_mid_round_never_stalls_the_others(
    tmp_path: Path, stage: str, victim_owns: str
) -> None:
    """SIGKILL a member after it registered (sent nothing) or mid-send (an owner accepted its
    request header and read one of its chunks; the rest never comes). If it owned nothing the
    survivors complete without it, with reduce_group's bytes over their own contributions. If it
    owned a part, the survivors that cannot open a stream to it ask the member after it in order,
    which reduces its part in its place, and they complete alike; a survivor whose stream to it was
    already open when it died loses that part, and then both return None (nobody may apply a round
    with a part missing). An owner reading the half-sent stream drops the member at once rather
    than waiting for it to the part deadline, and one it never reached is found gone (no stream
    to it opens: `RoundExchange._watch_members`) and dropped too, long before that deadline."""
    with _a_round_with_a_member_killed(tmp_path, stage=stage, victim_owns=victim_owns) as killed:
        print(killed.report(f"member killed at {stage!r}, owning {victim_owns}"))
        outcomes, survivors = killed.outcomes, killed.survivors
        assert all(o.elapsed_s < KILLED_BOUND_S for o in outcomes)
        first, second = (o.result for o in outcomes)
        dropped = [killed.dropped_by(s, 0) for s in survivors]
        # The owner its first chunk went to (one of the survivors if it owned nothing, the one
        # survivor owning a part otherwise) saw the stream break and stopped waiting for it; one it
        # never sent to found no stream opens to it (it died) and stopped waiting too.
        assert any(killed.victim in d for d in dropped), dropped
        if victim_owns == "a_part" and stage == "sending" and None in (first, second):
            # A survivor's stream to it was open when it died: its part is lost to that survivor,
            # which returns None, and nobody may apply a round with a part missing. The other
            # either lost it too, or reached no stream to it after the first had left the round,
            # stood in for it and applied the round of its own Δ alone (the first's parts never
            # reached it): never a round holding the Δ of a survivor that returned None.
            for survivor, outcome in zip(survivors, outcomes, strict=True):
                if outcome.result is not None:
                    assert outcome.result.members == (survivor.peer_id,)
            return
        # Otherwise no stream reached it (it died before the survivors asked it for its part, as
        # it always has after registering): the survivor after it in order stood in for it.
        assert first is not None and second is not None
        assert first.averaged == second.averaged
        assert first.members == second.members == tuple(sorted(a.peer_id for a in survivors))
        expected = reduce_group(killed.contributions, codec=make_codec("int8"))
        assert first.averaged == expected.averaged
        assert first.reports == second.reports == expected.reports
        if stage == "registered":
            # The owners did not hold the round open for the dead victim until the part deadline,
            # as they did before they asked whether it was there (3.4 s here, 2.4 s now).
            deadline_s = WINDOW_S + GRACE_S + PART_TIMEOUT_S
            assert all(o.elapsed_s < deadline_s for o in outcomes), [o.elapsed_s for o in outcomes]
        assert killed.victim not in first.owners.values() and first.owners == second.owners


def test_an_owner_killed_mid_reduce_fails_the_round_everywhere_and_the_retry_completes(
    tmp_path: Path,
) -> None:
    """SIGKILL an owner once every contribution is in and before it reduces (so before it answers):
    both survivors return None within the bound (nothing applied), and the next try of the round
    (the loop's next round id) completes between the two with reduce_group's bytes. The survivors
    expected the three of them; the owner whose stream broke under them is no longer expected, so
    the retry closes once both survivors are in (it waited out the patience, at least
    `dht.DHT_STALL_S`, for the dead owner before: issue 26)."""
    round = 3 * ROUND_ID_STRIDE
    with _a_round_with_a_member_killed(
        tmp_path, stage="reducing", victim_owns="a_part", round=round, expecting_the_victim=True
    ) as killed:
        print(killed.report("owner killed at 'reducing'"))
        assert [o.result for o in killed.outcomes] == [None, None]
        assert all(o.elapsed_s < KILLED_BOUND_S for o in killed.outcomes)
        both = sorted(a.peer_id for a in killed.survivors)
        for a in killed.survivors:
            assert sorted(a._matchmaker.expected) == both  # type: ignore[attr-defined]
        retry = _average_together(killed.survivors, killed.contributions, round=round + 1, spec="int8")
        print(
            f"retry as round id {round + 1}: returned after",
            ", ".join(f"{o.elapsed_s:.2f}" for o in retry),
            "s",
        )
        _assert_matches_reduce_group(retry, killed.contributions, "int8")
        assert all(o.elapsed_s < killed.swarm.round_bound_s for o in retry)


def test_an_owner_frozen_once_one_member_read_its_answer_fails_the_try_for_both_at_once(
    tmp_path: Path,
) -> None:
    """An owner's loop freezes once one member has read its whole answer; its streams stay open and
    answer nothing (as a killed container's address does). The other member gets no answer and
    withdraws, saying it never revealed. The member holding every answer needs that member's
    secret, which then cannot come (nobody can relay a reveal never sent): it fails the try at
    once, not at its reveal deadline a reduction phase later (issue 26 in CI: 45 s there, and the
    other survivor waited as long for its mark). The reduction phase is 8 s here, so the deadline
    would come at least 8 s after the other member gave up."""
    phase_s = 8.0
    with _a_round_with_a_member_killed(
        tmp_path,
        stage="answered",
        victim_owns="a_part",
        frozen=True,
        side=40_000,  # answers of ~2 MB: the second is still being written when the owner freezes
        late_reader=2.0,
        reduce_timeout_s=phase_s,
        bandwidth_bps=1e9,  # loopback: the exchange budget is its floors, within the call's timeout
    ) as frozen:
        print(frozen.report("owner frozen at 'answered'"))
        assert [o.result for o in frozen.outcomes] == [None, None]
        first, last = sorted(o.elapsed_s for o in frozen.outcomes)
        assert last - first < phase_s / 2, (first, last)


Lie = Callable[[Any, Any], Any]  # (the owner's true Answer, its OwnerSession) -> the Answer it gives


@dataclass
class LyingRound:
    """A round of three in which the owner of the largest part (the first part: it also relays the
    reports) answers with a lie of its own making, signed with its own key."""

    averagers: list[Averager]
    liar: Averager
    contributions: list[Contribution]
    outcomes: list[Outcome]
    logs: str
    bystander: Averager | None = None  # a node of the run in no group with the liar

    @property
    def honest(self) -> list[Averager]:
        return [a for a in self.averagers if a is not self.liar]

    def verdicts(self, averager: Averager) -> dict[str, Any]:
        return averager.verdicts()  # type: ignore[attr-defined, no-any-return]


@contextlib.contextmanager
def _round_with_a_lying_owner(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    spec: str,
    seed: int,
    *,
    lie: Lie | None = None,
    per_member: Callable[[Any, Any, str], Any] | None = None,
    aggregate: Aggregate = MEAN,
    contributions_of: Callable[[Sequence[Averager]], list[Contribution]] | None = None,
    bystander: bool = False,
) -> Iterator[LyingRound]:
    """The liar's reductions give `lie(answer, session)` (re-signed: the liar signs its own lie), or
    each member `per_member(answer, session, member)`; the other two are honest. Every owner runs
    `aggregate`; the members contribute `contributions_of(averagers)` (default: `_contributions`).
    With `bystander`, a fourth averager of the run reads the evidence board every 0.5 s and averages
    nothing. Yields once every member returned."""
    from adloco.protocol.transport import owner as owner_module

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(4 if bystander else 3)
        averagers = _by_dealing([swarm.averager(i, aggregate=aggregate) for i in range(3)], SHAPES, spec=spec)
        watching = swarm.averager(3, evidence_every_s=0.5) if bystander else None
        liar = averagers[0]
        real_reduce = owner_module.reduce_owned

        def lying_reduce(*args: Any, **kwargs: Any) -> Any:
            answer, rejections = real_reduce(*args, **kwargs)
            session = kwargs["signed_by"].__self__
            if lie is not None and session.signer.peer_id == liar.peer_id:
                answer = session.restate(lie(answer, session))
            return answer, rejections

        monkeypatch.setattr(owner_module, "reduce_owned", lying_reduce)
        if per_member is not None:
            handler = liar._handler  # type: ignore[attr-defined]
            answer = handler._answer

            async def answer_each(writer: Any, session: Any, meter: Any, peer: str) -> None:
                told = copy.copy(session)
                if session.result is not None:
                    told.result = session.restate(per_member(session.result, session, peer))
                await answer(writer, told, meter, peer)

            handler._answer = answer_each
        contributions = (
            _contributions(averagers, spec, seed=seed)
            if contributions_of is None
            else contributions_of(averagers)
        )
        with caplog.at_level("WARNING"):
            outcomes = _average_together(averagers, contributions, round=0, spec=spec)
        yield LyingRound(averagers, liar, contributions, outcomes, caplog.text, watching)
    finally:
        swarm.close()


def _dealing_order(
    ids: Sequence[str], shapes: Mapping[str, tuple[int, ...]], *, spec: str = "int8", round: int = 0
) -> list[str]:
    """`ids` in the order a first group of them (no work lists yet) at `round` under prefix "run-a"
    deals parts (`matchmaking.form_group`): with k parts of equal size, the first k own one each
    and the rest none; the first owns the first part (the one the reports travel with)."""
    from adloco.protocol.transport.matchmaking import form_group, layout_of

    payloads = encode_tensors(make_codec(spec), {k: torch.zeros(*shape) for k, shape in shapes.items()})
    return list(form_group("run-a", round, sorted(ids), layout_of(payloads), {}).owners)


def _by_dealing(
    averagers: Sequence[Averager], shapes: Mapping[str, tuple[int, ...]], *, spec: str = "int8"
) -> list[Averager]:
    """`averagers` in the order their first round deals parts (`_dealing_order`; in process: by id)."""
    ranked = sorted(averagers, key=lambda a: a.peer_id)
    if not isinstance(ranked[0], MemoryAverager):
        order = _dealing_order([a.peer_id for a in ranked], shapes, spec=spec)
        ranked.sort(key=lambda a: order.index(a.peer_id))
    return ranked


def _scaled(factor: float, spec: str) -> Lie:
    def lie(answer: Any, session: Any) -> Any:
        told = {k: make_codec(spec).encode(k, codecs.decode(p) * factor) for k, p in answer.payloads.items()}
        return dataclasses.replace(answer, payloads=told)

    return lie


def _noise(answer: Any, session: Any) -> Any:
    """Noise of the same norm as the true average, in the same codec ("none")."""
    told = {}
    for key, payload in answer.payloads.items():
        true = codecs.decode(payload)
        noise = torch.randn_like(true)
        told[key] = make_codec("none").encode(key, noise * (float(true.norm()) / float(noise.norm())))
    return dataclasses.replace(answer, payloads=told)


def _assert_caught_by_the_honest(round: LyingRound, why: str) -> None:
    """No honest member applied the round (what the liar does with its own copy is its business);
    every honest member names the liar, shown by its signed statements."""
    print(round.logs)
    assert [o.result for o in round.outcomes[1:]] == [None, None]
    for honest in round.honest:
        verdicts = round.verdicts(honest)
        assert round.liar.peer_id in verdicts, verdicts
        verdict = verdicts[round.liar.peer_id]
        assert verdict.proven and why in verdict.why, verdict


@pytest.mark.parametrize("spec", ["int8", "none"])
def test_an_owner_answering_its_parts_scaled_by_minus_50_is_caught_by_every_member(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, spec: str
) -> None:
    """The issue's attack: the true average of its part scaled by -50, validly encoded and signed.
    It exceeds the norm the contributions allow: every honest member refuses the round and holds
    the liar's signed statement that shows it."""
    with _round_with_a_lying_owner(monkeypatch, caplog, spec, 9, lie=_scaled(-50.0, spec)) as round:
        _assert_caught_by_the_honest(round, "norm")


def test_an_owner_answering_noise_of_the_averages_size_is_caught_by_its_projection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Noise of the true average's norm passes the norm bound; only the projection on the round's
    direction (drawn after the answers were fixed) shows it. Under fp32 the tolerance is the owner's
    float32 arithmetic alone, so it fails but with probability ~1e-6."""
    with _round_with_a_lying_owner(monkeypatch, caplog, "none", 15, lie=_noise) as round:
        assert [o.result for o in round.outcomes[1:]] == [None, None]
        for honest in round.honest:
            verdict = round.verdicts(honest)[round.liar.peer_id]
            assert "projection off" in verdict.why and not verdict.proven  # a colluder could frame it


def test_an_owner_answering_each_member_differently_is_caught_by_its_two_signatures(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner signs and sends each member its own answer (one of them honest): the members'
    reveals carry the answers they got, and the two statements signed by the same key for the same
    parts of the same round prove the lie to anyone."""
    honest_answer_to: list[str] = []

    def each(answer: Any, session: Any, member: str) -> Any:
        if not honest_answer_to:
            honest_answer_to.append(member)
        if member == honest_answer_to[0]:
            return answer
        return _scaled(1.001, "int8")(answer, session)

    with _round_with_a_lying_owner(monkeypatch, caplog, "int8", 16, per_member=each, bystander=True) as round:
        _assert_caught_by_the_honest(round, "otherwise than this peer")
        _assert_convicted_from_the_board(round, "signed two different answers in round 0")


def _assert_convicted_from_the_board(round: LyingRound, why: str) -> None:
    """A node of the run that was in no group with the liar leaves it out too, on the evidence the
    honest members published (`evidence.EvidenceBoard`), within a few reads of the board; and what
    the liar publishes there against an honest member (two statements in its name, signed with the
    liar's key; junk) convicts nobody."""
    from adloco.protocol.transport.evidence import Evidence
    from adloco.protocol.transport.statements import REVEAL, Signer

    bystander: Any = round.bystander
    liar: Any = round.liar
    framed = round.honest[0].peer_id
    forged = [Signer(liar.dht.identity).sign([REVEAL, 0, b"g" * 32, framed, x]) for x in "ab"]
    record = [Evidence.equivocated(REVEAL, *forged).to_wire(), ["junk"], b"junk"]
    liar.dht.store(  # outlives any record the liar's averager stored under its key
        "run-a.evidence", record, expiration_time=get_dht_time() + 3600, subkey=liar.dht.identity.subkey
    )
    deadline = time.monotonic() + 15
    while round.liar.peer_id not in bystander.verdicts() and time.monotonic() < deadline:
        time.sleep(0.1)
    verdict = bystander.verdicts().get(round.liar.peer_id)
    assert verdict is not None, "the bystander never read the evidence"
    assert verdict.proven and why in verdict.why and "evidence published by" in verdict.why, verdict
    assert round.liar.peer_id in bystander.excluded()  # its registrations ask the others to, too
    board = bystander.dht.get("run-a.evidence", latest=True)
    assert board.value[liar.dht.identity.subkey].value == record  # there to be read
    time.sleep(4 * bystander.evidence_every_s)
    assert set(bystander.verdicts()) == {round.liar.peer_id}  # nobody else


def _only_its_own(answer: Any, session: Any) -> Any:
    """The liar's parts answered with its own payloads alone (forwarded: the exact check passes),
    every other contributor stated as left out by a scorer."""
    me = answer.contributors.index(session.signer.peer_id)
    own = session.contributions[session.signer.peer_id].payloads
    others = {i: SCORED for i in range(len(answer.contributors)) if i != me}
    statement = dataclasses.replace(answer.statement, codes=[dict(others) for _ in session.keys])
    rejected = {p: len(session.keys) for i, p in enumerate(answer.contributors) if i != me}
    return dataclasses.replace(
        answer, payloads={k: own[k] for k in session.keys}, statement=statement, rejected=rejected
    )


def test_an_owner_leaving_everyone_else_out_by_a_scorer_the_run_does_not_run_is_caught(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With scoring off (the default), an owner states that its scorer left every other contributor
    out and forwards its own payloads for its parts: a forwarded part checks exactly, and with one
    payload left no norm screening applies, so whatever it committed to would reach every θ. There is
    no scorer in this run to have left anyone out: every honest member convicts it on its statement."""
    with _round_with_a_lying_owner(monkeypatch, caplog, "int8", 17, lie=_only_its_own) as round:
        _assert_caught_by_the_honest(round, "scorer this run does not run")


def test_a_scoring_run_completes_with_its_owners_exclusions_checked() -> None:
    """In a run that scores (every averager has a scorer), the owners' exclusions are accepted: here
    each owner's scorer leaves out the largest Δ over its parts (the flipped one), in every part it
    owns; the round completes with one result on every member, that member's parts rejected by every
    owner, and nobody named."""

    def largest_out(count: int, delta_of: Any) -> dict[int, str]:
        norms = [sum(float(t.norm()) ** 2 for t in delta_of(i).values()) for i in range(count)]
        return {norms.index(max(norms)): "the largest Δ"}

    with _flipped_round(scorer=largest_out) as (averagers, contributions, outcomes):
        results = [o.result for o in outcomes]
        assert all(r is not None for r in results)
        assert len({tuple(sorted(r.averaged.items())) for r in results if r is not None}) == 1
        flipped = contributions[2].peer_id
        first = results[0]
        assert first is not None and first.rejected == {flipped: len(SHAPES)}
        for averager in averagers:
            assert averager.verdicts() == {}  # type: ignore[attr-defined]


def test_an_owner_rewriting_a_report_it_relays_is_caught(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner that relays the reports changes another member's (its tokens) and signs the list:
    the member's own commitment names its report's digest."""

    def rewrite(answer: Any, session: Any) -> Any:
        if answer.metadata is None:
            return answer
        forged = PeerReport.decode(answer.metadata[1])
        metadata = list(answer.metadata)
        metadata[1] = dataclasses.replace(forged, tokens=10**9).encode()
        return dataclasses.replace(answer, metadata=tuple(metadata))

    with _round_with_a_lying_owner(monkeypatch, caplog, "int8", 17, lie=rewrite) as round:
        _assert_caught_by_the_honest(round, "relayed another report")


def test_an_owner_answering_a_malformed_rejected_field_fails_the_round_for_its_members(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner of the largest part lists a non-member as rejected (its statement says nothing of
    it): every member refuses the answer, no crash."""

    def reject(answer: Any, session: Any) -> Any:
        return dataclasses.replace(answer, rejected={"not-a-member": 1})

    with _round_with_a_lying_owner(monkeypatch, caplog, "int8", 9, lie=reject) as round:
        assert [o.result for o in round.outcomes[1:]] == [None, None]
        assert "counted other rejections than its statement" in round.logs or "rejected part" in round.logs
        for honest in round.honest:
            assert round.liar.peer_id in round.verdicts(honest)


def test_an_owner_answering_a_part_of_another_shape_fails_the_round_before_decoding_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner of the largest part answers it as a valid rank-1 payload of shape (760, 760): within
    the answer's byte bound (the fp32 size of the (48, 32) part), 376 times its elements once
    decoded. The others refuse it from its header (before any statement or decode) and return
    None: no result, so no outer step ever decodes it."""
    bomb = encode_tensors(make_codec("lowrank:1"), {"embed": torch.ones(760, 760)})["embed"]
    assert len(bomb) <= 48 * 32 * 4

    def bombing(answer: Any, session: Any) -> Any:
        return dataclasses.replace(answer, payloads={**answer.payloads, "embed": bomb})

    with _round_with_a_lying_owner(monkeypatch, caplog, "none", 15, lie=bombing) as round:
        assert [o.result for o in round.outcomes[1:]] == [None, None]
        assert round.logs.count("answered a part of another shape") == 2


def test_an_owner_answering_a_sum_of_more_payloads_than_contributors_fails_the_round_before_decoding_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 25 §1.3 on the way back: the owner of the largest part answers it as a `sum` payload
    within the answer's byte bound whose ~100 tiny sparse parts each decode to the whole part (the
    checks and the clip's inner products would each decode it). A sum carries one payload per
    contributor: the others refuse it from its header and return None."""
    bomb = sum_bomb(48 * 32 * 4, (48, 32))
    assert codecs.sum_count(bomb) > 3

    def bombing(answer: Any, session: Any) -> Any:
        return dataclasses.replace(answer, payloads={**answer.payloads, "embed": bomb})

    with _round_with_a_lying_owner(monkeypatch, caplog, "none", 15, lie=bombing) as round:
        assert [o.result for o in round.outcomes[1:]] == [None, None]
        assert round.logs.count("answered a sum of more payloads than contributors") == 2


def test_the_next_try_leaves_a_caught_liar_out_and_completes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After the round the liar spoiled, the next try (the loop's next round id) opens at once and
    leaves it out: both honest members ask the others to in their registrations, a majority of its
    peers, so it is in no group (it lies again given the chance). The two complete with
    `reduce_group` over themselves, within a round's bound."""
    with _round_with_a_lying_owner(monkeypatch, caplog, "int8", 9, lie=_scaled(-50.0, "int8")) as round:
        _assert_caught_by_the_honest(round, "norm")
        retry = _average_together(round.averagers, round.contributions, round=1, spec="int8")
        assert retry[0].result is None  # the liar: left out
        _assert_matches_reduce_group(retry[1:], round.contributions[1:], "int8")
        assert all(o.elapsed_s < WINDOW_S + GRACE_S + 2 * SLACK_S for o in retry[1:])
        assert "left out: most of the others caught this peer" in caplog.text


def _drop_in_reductions(monkeypatch: pytest.MonkeyPatch, omitting: Averager, dropped: Averager) -> Any:
    """`omitting`'s reductions leave out `dropped`'s parts (they are taken and receipted as always);
    returns the real `owner.reduce_owned`."""
    from adloco.protocol.transport import owner as owner_module

    real_reduce = owner_module.reduce_owned

    def dropping(keys: Any, contributions: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs["signed_by"].__self__.signer.peer_id == omitting.peer_id:
            contributions = {p: c for p, c in contributions.items() if p != dropped.peer_id}
        return real_reduce(keys, contributions, *args, **kwargs)

    monkeypatch.setattr(owner_module, "reduce_owned", dropping)
    return real_reduce


def test_an_owner_that_drops_a_member_it_signed_a_receipt_for_is_convicted_by_everyone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's "omitting a member": the owner of the largest part takes the third member's parts,
    signs its receipt of them, and reduces without them. The dropped member holds the two
    signatures of the owner that prove the drop: it takes the round all the same, with the very
    bytes the others apply (record 076), and passes the proof on, so every honest member convicts
    the owner, and the next try completes without it."""
    from adloco.protocol.transport import owner as owner_module

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        liar, dropped = averagers[0], averagers[2]
        real_reduce = _drop_in_reductions(monkeypatch, liar, dropped)
        contributions = _contributions(averagers, "int8", seed=23)
        with caplog.at_level("WARNING"):
            first = _average_together(averagers, contributions, round=0, spec="int8")
            results = [o.result for o in first]
            assert all(r is not None for r in results)
            assert results[2].averaged == results[1].averaged == results[0].averaged  # type: ignore[union-attr]
            # The round's members are those every owner admitted: the dropped one's report counts nowhere.
            assert [list(r.members) for r in results] == [sorted(a.peer_id for a in averagers[:2])] * 3  # type: ignore[union-attr]
            honest: Any = averagers[1]
            deadline = time.monotonic() + 10
            while liar.peer_id not in honest.verdicts() and time.monotonic() < deadline:
                time.sleep(0.1)  # the evidence arrives after the others' round
            mine: Any = dropped
            seen, told = mine.verdicts()[liar.peer_id], honest.verdicts()[liar.peer_id]
            assert seen.proven and "left out our contribution" in seen.why
            assert told.proven and "after signing their receipt" in told.why
            monkeypatch.setattr(owner_module, "reduce_owned", real_reduce)
            retry = _average_together(averagers, contributions, round=1, spec="int8")
        assert retry[0].result is None
        _assert_matches_reduce_group(retry[1:], contributions[1:], "int8")
    finally:
        swarm.close()


def test_a_member_an_owner_dropped_by_proof_is_expected_at_the_next_round_by_the_honest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records 072 and 076: the owner of the largest part leaves the third member's parts out of
    round 0. The third takes the round all the same (the drop is proven), so it is level with the
    others: the honest member that completed the round with it expects it at the next round, as
    soon as the accusation reached it, and both honest members expect the same group once they
    leave the liar out (the matchmaker drops the peers it leaves out). Without the proof the third
    failed the round and nobody waited for it (record 072)."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        liar, honest, dropped = (cast(Any, a) for a in averagers)
        _drop_in_reductions(monkeypatch, averagers[0], averagers[2])
        contributions = _contributions(averagers, "int8", seed=29)
        first = _average_together(averagers, contributions, round=0, spec="int8")
        assert all(o.result is not None for o in first)
        everyone = sorted(a.peer_id for a in averagers)
        deadline = time.monotonic() + 10
        while sorted(honest._matchmaker.expected) != everyone and time.monotonic() < deadline:
            time.sleep(0.05)  # the accusation comes with the dropped member's round, not before ours ends
        assert sorted(honest._matchmaker.expected) == everyone
        assert sorted(dropped._matchmaker.expected) == everyone
        assert liar.peer_id in dropped.excluded()
        while liar.peer_id not in honest.excluded() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert liar.peer_id in honest.excluded()
    finally:
        swarm.close()


def test_a_fresh_key_owns_no_part_until_its_work_counted_and_a_weightless_key_never() -> None:
    """Three peers average three rounds (a fresh swarm: all own parts, and their work makes them
    list one another, `trust.WORK_MIN_ROUNDS`), then two fresh keys join them: one with real work,
    one at weight 0. For three rounds only the three own parts; after them the three list the first
    newcomer (its work counted in three rounds) and never the weightless one, so the next round
    deals parts to four owners, never to the key that did no work. Each round holds exactly the
    bytes `reduce_group` gives, dealt to those owners."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(5)
        averagers = [swarm.averager(i) for i in range(5)]
        old, new, idle = averagers[:3], averagers[3], averagers[4]
        shapes = {f"t{i}": (4 * (i + 1), 16) for i in range(10)}
        contributions = _contributions(old, "int8", seed=31, shapes=shapes)
        for round in range(WORK_MIN_ROUNDS):
            outcomes = _average_together(old, contributions, round=round, spec="int8")
            _assert_matches_reduce_group(outcomes, contributions, "int8")
            result = outcomes[0].result
            assert result is not None and set(result.owners.values()) == {a.peer_id for a in old}
        for a in old:  # let the round wait its window for the newcomers (no early close)
            cast(Any, a)._matchmaker.expected = None
        contributions = _contributions(averagers, "int8", seed=32, shapes=shapes)
        contributions[4] = dataclasses.replace(contributions[4], weight=0.0, tokens=0.0)
        joined = WORK_MIN_ROUNDS
        for round in range(joined, joined + WORK_MIN_ROUNDS + 1):
            delays = [NEWCOMERS_FIRST_S] * 3 + [0.0] * 2
            outcomes = _average_together(averagers, contributions, round=round, spec="int8", delays=delays)
            _assert_matches_reduce_group(outcomes, contributions, "int8")
            result = outcomes[0].result
            assert result is not None
            owners = old if round < joined + WORK_MIN_ROUNDS else [*old, new]
            assert set(result.owners.values()) == {a.peer_id for a in owners}, round
            for a in old:
                listed = cast(Any, a).workers()
                assert (new.peer_id in listed) == (round >= joined + WORK_MIN_ROUNDS - 1), round
                assert idle.peer_id not in listed
    finally:
        swarm.close()


# How much later than the keys without a record the peers that list one another call, where a test
# needs those keys in every round: a listed peer's round closes once the peers it lists are in, and
# a key without a record is a member only if it registered by then (`_expected_again`).
NEWCOMERS_FIRST_S = 0.3


def _work_together(averagers: Sequence[Averager], *, seed: int) -> None:
    """`trust.WORK_MIN_ROUNDS` rounds of `averagers` alone: they list one another (they own and seed
    the rounds from then on); then their rounds wait the window for newcomers (no early close)."""
    contributions = _contributions(averagers, "int8", seed=seed)
    for round in range(WORK_MIN_ROUNDS):
        _average_together(averagers, contributions, round=round, spec="int8")
    for a in averagers:
        cast(Any, a)._matchmaker.expected = None


def _slow_part_deadline_trio(swarm: Swarm) -> list[Averager]:
    """Three averagers of a run admitting slow links (a part deadline of 30 s: reveals may come as
    late as ~40 s after the group formed), in peer-id order."""
    return sorted((swarm.averager(i, part_timeout_s=30.0) for i in range(3)), key=lambda a: a.peer_id)


def _mute(monkeypatch: pytest.MonkeyPatch, mute: Any) -> None:
    """`mute` sends its parts and takes the answers, then sends no reveal and no projection."""
    from adloco.protocol.transport import round_exchange, verification

    real = verification.verify_round  # what round_exchange calls, patched there

    async def withheld(**kw: Any) -> dict[str, str]:
        if kw["peer_id"] == mute.peer_id:
            kw = {**kw, "send": lambda *args: None}
        return await real(**kw)

    monkeypatch.setattr(round_exchange, "verify_round", withheld)


def test_a_fresh_key_that_withholds_its_reveal_costs_the_round_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three peers that worked together (they own and seed the round: `trust.seeders`) and a fresh key
    that sends its parts, takes the answers and then reveals and projects nothing. Its secret is not
    needed, so the three complete the round with `reduce_group`'s bytes of all four contributions
    (its part of each check widened by what its projection could have been), not waiting for its
    reveal (a key without a record: `HivemindAverager.newcomers`), nor in the next rounds. Its
    work counts in the round (every member computes the same) but not in the ledgers of those it
    withheld its reveal from: it is never listed, so it never comes to seed a round it could fail.
    Once no round of the last `PARTNER_ROUNDS` shared it, they forget it as a laggard."""

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(4)
        averagers = [swarm.averager(i) for i in range(4)]
        old, mute = averagers[:3], cast(Any, averagers[3])
        _work_together(old, seed=33)
        _mute(monkeypatch, mute)
        contributions = _contributions(averagers, "int8", seed=34)
        rounds = range(WORK_MIN_ROUNDS, 2 * WORK_MIN_ROUNDS + 1)
        for round in rounds:
            delays = [NEWCOMERS_FIRST_S] * 3 + [0.0]
            outcomes = _average_together(averagers, contributions, round=round, spec="int8", delays=delays)
            _assert_matches_reduce_group(outcomes[:3], contributions, "int8")
            result = outcomes[0].result
            assert result is not None and mute.peer_id not in result.owners.values()
            assert result.work[mute.peer_id] > 0
            for a in old:
                assert mute.peer_id not in cast(Any, a).verdicts()
                assert cast(Any, a)._laggards == {mute.peer_id}
                assert mute.peer_id not in cast(Any, a).workers()
            reveal_deadline = old[0]._exchange_budget_s(0)  # type: ignore[attr-defined]
            assert max(o.elapsed_s for o in outcomes[:3]) < WINDOW_S + GRACE_S + reveal_deadline, round
        # Once no round of the last `PARTNER_ROUNDS` shared it, the three forget it: the laggards do
        # not grow with every key made.
        monkeypatch.setattr("adloco.protocol.transport.hivemind_averager.PARTNER_ROUNDS", 1)
        _average_together(old, contributions[:3], round=rounds[-1] + 1, spec="int8")
        assert all(cast(Any, a)._laggards == set() for a in old)
    finally:
        swarm.close()


REVEAL_LATE_S = 2.0  # how long after the others an honest newcomer's reveal goes out, where a test delays it


def test_no_key_without_a_record_is_waited_for_and_an_honest_ones_late_reveal_still_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25 §2 (`bench/robust_swarm.py --attacks mute+rekey`, `mute+fresh`): a key is 0.1 s to
    make, so an attacker can bring a fresh one to each round and withhold its reveal every time; a
    grace for each would cost every round one. Three peers that worked together meet an honest
    newcomer whose reveals go out `REVEAL_LATE_S` after its others' (a slow link), and in two of
    its three rounds one more fresh key that never reveals. Neither is waited for, in any round
    (`HivemindAverager.newcomers`, record 079), every round completes with every contribution, and
    the newcomer's work counts all the same once its reveals come: after its three rounds the three
    list it (`trust.WORK_MIN_ROUNDS`). The mute keys are never listed."""
    from adloco.protocol.transport import round_exchange, verification
    from adloco.protocol.transport.statements import REVEAL

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(6)
        averagers = [swarm.averager(i) for i in range(6)]
        old, new, mutes = averagers[:3], averagers[3], averagers[4:]
        _work_together(old, seed=41)
        real = verification.verify_round
        unwaited: dict[tuple[str, int], set[str]] = {}

        async def recorded(**kw: Any) -> dict[str, str]:
            unwaited[(kw["peer_id"], kw["state"].group.round)] = set(kw["unwaited"])
            if kw["peer_id"] in {m.peer_id for m in mutes}:
                kw = {**kw, "send": lambda *args: None}
            elif kw["peer_id"] == new.peer_id:
                send, loop = kw["send"], asyncio.get_running_loop()

                def late(peer: str, kind: str, signed: Any) -> None:
                    if kind == REVEAL:
                        loop.call_later(REVEAL_LATE_S, send, peer, kind, signed)
                    else:
                        send(peer, kind, signed)

                kw = {**kw, "send": late}
            return await real(**kw)

        monkeypatch.setattr(round_exchange, "verify_round", recorded)
        for i, round in enumerate(range(WORK_MIN_ROUNDS, 2 * WORK_MIN_ROUNDS)):
            group = [*old, new, *(mutes[i - 1 : i] if i else ())]
            contributions = _contributions(group, "int8", seed=42 + round)
            delays = [NEWCOMERS_FIRST_S] * 3 + [0.0] * (len(group) - 3)
            outcomes = _average_together(group, contributions, round=round, spec="int8", delays=delays)
            _assert_matches_reduce_group(outcomes[:4], contributions, "int8")
            fresh = {a.peer_id for a in group[3:]}
            assert all(unwaited[(a.peer_id, round)] == fresh for a in old), round
        deadline = time.monotonic() + REVEAL_LATE_S + 10.0
        while not all(new.peer_id in cast(Any, a).workers() for a in old) and time.monotonic() < deadline:
            time.sleep(0.05)
        for a in old:
            listed = cast(Any, a).workers()
            assert new.peer_id in listed
            assert not {m.peer_id for m in mutes} & set(listed)
    finally:
        swarm.close()


def test_a_key_without_a_record_that_left_is_not_waited_for() -> None:
    """Issue 25 §2 (`bench/robust_swarm.py --attacks mute+fresh`): a fresh key that averages one round
    with three peers that worked together, and leaves (a key is 0.1 s to make). They expected the
    group again, so each next round stayed open for the patience (`DHT_STALL_S`) for a key that was
    gone. Their registrations expect only the peers they list (`HivemindAverager._expected_again`),
    and their next round closes once the three are in."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(4)
        averagers = [swarm.averager(i) for i in range(4)]
        old = averagers[:3]
        _work_together(old, seed=51)
        contributions = _contributions(averagers, "int8", seed=52)
        outcomes = _average_together(averagers, contributions, round=WORK_MIN_ROUNDS, spec="int8")
        assert all(o.result is not None and len(o.result.members) == 4 for o in outcomes)
        three = tuple(sorted(a.peer_id for a in old))
        assert all(cast(Any, a)._matchmaker.expected == three for a in old)
        outcomes = _average_together(old, contributions[:3], round=WORK_MIN_ROUNDS + 1, spec="int8")
        assert all(o.result is not None and len(o.result.members) == 3 for o in outcomes)
        assert max(o.elapsed_s for o in outcomes) < DHT_STALL_S, [o.elapsed_s for o in outcomes]
    finally:
        swarm.close()


def test_the_members_of_a_round_expect_one_group_whatever_their_own_ledgers_say() -> None:
    """Stop 52's first rule read whom to wait for from each peer's own ledger: once one peer no longer
    listed a member (caught as a late owner, say: `WorkLedger.demote`) and the others still did, their
    registrations expected different groups, the early close never came, and each such round waited
    the patience (a founder's backdate: every other round 7 s against 1.3 s). The next registrations
    expect the group's owners, read from the group itself, the same for every member; a member that
    one peer demoted is still an owner while the others list it, so it is still waited for."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(4)
        averagers = [swarm.averager(i) for i in range(4)]
        _work_together(averagers, seed=53)
        demoted = averagers[3]
        cast(Any, averagers[0])._worked.forget(demoted.peer_id)
        contributions = _contributions(averagers, "int8", seed=54)
        _average_together(averagers, contributions, round=WORK_MIN_ROUNDS, spec="int8")
        four = tuple(sorted(a.peer_id for a in averagers))
        assert [cast(Any, a)._matchmaker.expected for a in averagers] == [four] * 4
        late = WINDOW_S + 2 * GRACE_S  # after the others' early close, well within the patience
        delays = [0.0, 0.0, 0.0, late]
        outcomes = _average_together(
            averagers, contributions, round=WORK_MIN_ROUNDS + 1, spec="int8", delays=delays
        )
        assert all(o.result is not None and len(o.result.members) == 4 for o in outcomes)
    finally:
        swarm.close()


def test_a_key_that_stays_two_rounds_and_leaves_is_not_waited_for() -> None:
    """Issue 25 §2 (`bench/robust_swarm.py --attacks mute+fresh2`): a key without a record that stays
    two rounds with three peers that worked together, then leaves. It owns nothing, so their next
    registrations do not expect it, and their round closes once the three are in."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(4)
        averagers = [swarm.averager(i) for i in range(4)]
        old = averagers[:3]
        three = tuple(sorted(a.peer_id for a in old))
        _work_together(old, seed=55)
        delays = [NEWCOMERS_FIRST_S] * 3 + [0.0]
        for round in (WORK_MIN_ROUNDS, WORK_MIN_ROUNDS + 1):
            contributions = _contributions(averagers, "int8", seed=56 + round)
            outcomes = _average_together(averagers, contributions, round=round, spec="int8", delays=delays)
            assert all(o.result is not None and len(o.result.members) == 4 for o in outcomes)
            assert all(cast(Any, a)._matchmaker.expected == three for a in old)
        contributions = _contributions(old, "int8", seed=60)
        outcomes = _average_together(old, contributions, round=WORK_MIN_ROUNDS + 2, spec="int8")
        assert all(o.result is not None and len(o.result.members) == 3 for o in outcomes)
        assert max(o.elapsed_s for o in outcomes) < DHT_STALL_S - 1.0, [o.elapsed_s for o in outcomes]
    finally:
        swarm.close()


def _silent(monkeypatch: pytest.MonkeyPatch, averager: Any) -> None:
    """`averager` joins groups (and, as an owner, reduces and answers) but sends no owner its parts."""
    from adloco.protocol.transport.round_exchange import RoundExchange

    real = RoundExchange._exchange

    async def exchange(self: RoundExchange) -> Any:
        if self.averager is not averager:
            return await real(self)
        await asyncio.sleep(PART_TIMEOUT_S + REDUCE_TIMEOUT_S)
        raise RoundFailed("silent")

    monkeypatch.setattr(RoundExchange, "_exchange", exchange)


def test_an_owner_that_sends_no_other_owner_its_parts_costs_one_try(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh swarm (every member owns): one member answers for its parts and sends the other owners
    none of its own. Every honest member sees that alike from the answers and fails the try, naming
    it as silent; the retry completes without it."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = [swarm.averager(i) for i in range(3)]
        silent: Any = averagers[2]
        _silent(monkeypatch, silent)
        contributions = _contributions(averagers, "int8", seed=35)
        first = _average_together(averagers, contributions, round=0, spec="int8")
        assert [o.result for o in first] == [None, None, None]
        for honest in averagers[:2]:
            assert cast(Any, honest).verdicts()[silent.peer_id].why == "sent no other owner its parts"
        retry = _average_together(averagers, contributions, round=1, spec="int8")
        assert retry[2].result is None
        _assert_matches_reduce_group(retry[:2], contributions[:2], "int8")
    finally:
        swarm.close()


def test_an_owner_reducing_under_another_rule_costs_one_try_not_every_round() -> None:
    """A fresh swarm (every member owns) in which one peer runs another --aggregate than the run's
    (hostile or misconfigured). Its signed answer states the rule it reduced under: every honest
    member convicts it on that statement and the retry completes without it. (It used to fail the
    round for everyone as a configuration mismatch, every round it owned parts in: in a robust-swarm
    run, 85 rounds with no result.)"""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = [swarm.averager(i, aggregate=CLIP if i == 2 else MEAN) for i in range(3)]
        other: Any = averagers[2]
        contributions = _contributions(averagers, "int8", seed=43)
        first = _average_together(averagers, contributions, round=0, spec="int8")
        assert [o.result for o in first] == [None, None, None]
        for honest in averagers[:2]:
            verdict = cast(Any, honest).verdicts()[other.peer_id]
            assert verdict.proven and "reduced under clip:1" in verdict.why
        retry = _average_together(averagers, contributions, round=1, spec="int8")
        assert retry[2].result is None
        _assert_matches_reduce_group(retry[:2], contributions[:2], "int8")
    finally:
        swarm.close()


@pytest.mark.long
def test_a_fresh_key_that_sends_nothing_holds_a_round_a_grace_not_the_deadline_then_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three peers that worked together own the parts; a fresh key joins their group and sends no
    owner anything. The owners wait for it a grace once their own parts are in (`trust.GRACE_S`),
    not to their part deadline (15 s here), and the round completes without it; every member sees it
    in no answer and leaves it out a while (`EXCLUDE_SILENT_S`), so the next round is the three's."""
    from adloco.protocol.transport.conduct import EXCLUDE_SILENT_S

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(4)
        part_deadline_s = 15.0
        averagers = [swarm.averager(i, part_timeout_s=part_deadline_s) for i in range(4)]
        old, silent = averagers[:3], cast(Any, averagers[3])
        _work_together(old, seed=36)
        _silent(monkeypatch, silent)
        everyone = _contributions(averagers, "int8", seed=37)
        held = _average_together(averagers, everyone, round=WORK_MIN_ROUNDS, spec="int8")
        _assert_matches_reduce_group(held[:3], everyone[:3], "int8")
        assert max(o.elapsed_s for o in held[:3]) < part_deadline_s
        for a in old:
            verdict = cast(Any, a).verdicts()[silent.peer_id]
            assert verdict.why == "sent no owner its parts" and not verdict.proven
            assert verdict.until - cast(Any, a)._loop.time() <= EXCLUDE_SILENT_S
        after = _average_together(averagers, everyone, round=WORK_MIN_ROUNDS + 1, spec="int8")
        _assert_matches_reduce_group(after[:3], everyone[:3], "int8")
        assert after[3].result is None
    finally:
        swarm.close()


def test_an_owner_that_takes_the_parts_and_never_answers_costs_one_try(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's staller: it takes every member's parts and never answers. The members give up
    after the exchange budget the bytes give (not the caller's timeout), name it, and the next try
    completes without it."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        staller: Any = averagers[0]

        async def never(*args: Any) -> None:
            await asyncio.sleep(3600)

        staller._handler._answer = never
        contributions = _contributions(averagers, "int8", seed=19)
        with caplog.at_level("WARNING"):
            first = _average_together(averagers, contributions, round=0, spec="int8")
            assert [o.result for o in first[1:]] == [None, None]
            budget = staller._exchange_budget_s(0)
            assert all(o.elapsed_s < WINDOW_S + GRACE_S + budget + SLACK_S for o in first[1:])
            for honest in averagers[1:]:
                assert "gave no answer" in honest.verdicts()[staller.peer_id].why  # type: ignore[attr-defined]
            retry = _average_together(averagers, contributions, round=1, spec="int8")
        assert retry[0].result is None
        _assert_matches_reduce_group(retry[1:], contributions[1:], "int8")
    finally:
        swarm.close()


def test_an_owner_that_refuses_every_member_costs_one_try(caplog: pytest.LogCaptureFixture) -> None:
    """An owner that refuses every member's request at its header (they are members of its group,
    within the round's rules) takes no parts and signs no receipt: nothing convicts it, and from an
    honest owner a refusal is a race (parts too late, another view of the group). Before, nobody
    named it and it failed every try (a founder of robust_swarm's swarm: no round in 309 s). Now a
    refusal is an owner that gave no answer: a key without a record is left out as seen, and the
    next try completes without it; one with a record is demoted and owns nothing at the retry
    (issue 25 §2)."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        refuser: Any = averagers[0]
        refuser._handler._refusal = lambda *args: "refused"
        contributions = _contributions(averagers, "int8", seed=29)
        with caplog.at_level("WARNING"):
            failed = _average_together(averagers, contributions, round=0, spec="int8")
            assert [o.result for o in failed[1:]] == [None, None]
            for honest in averagers[1:]:
                assert "refused" in honest.verdicts()[refuser.peer_id].why  # type: ignore[attr-defined]
            retry = _average_together(averagers, contributions, round=1, spec="int8")
        assert retry[0].result is None
        _assert_matches_reduce_group(retry[1:], contributions[1:], "int8")
    finally:
        swarm.close()

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        refuser = averagers[0]
        _work_together(averagers, seed=33)
        assert all(refuser.peer_id in cast(Any, a).workers() for a in averagers[1:])
        refuser._handler._refusal = lambda *args: "refused"
        contributions = _contributions(averagers, "int8", seed=34)
        refused = _average_together(averagers, contributions, round=WORK_MIN_ROUNDS, spec="int8")
        assert [o.result for o in refused[1:]] == [None, None]
        for honest in averagers[1:]:
            assert refuser.peer_id not in cast(Any, honest).verdicts()  # not left out: demoted
            assert refuser.peer_id not in cast(Any, honest).workers()
        retry = _average_together(averagers, contributions, round=WORK_MIN_ROUNDS + 1, spec="int8")
        result = retry[1].result
        assert result is not None and refuser.peer_id not in set(result.owners.values())
        assert all(o.result is not None for o in retry[1:])
    finally:
        swarm.close()


def test_in_a_pair_a_refusing_owner_is_taken_for_a_departure_before_it_is_left_out() -> None:
    """In a group of two, the member's vote alone is a majority (`matchmaking.outvoted`): leaving an
    honest owner out over a race (its parts too late) would split the pair into two lineages. So
    there a refusal from a key without a record is taken for a departure: not left out the first
    time, left out the second.

    The refuser leaves nobody out, as an attacker that means to hold the pair would: its own check
    sees the honest owner's parts missing from its answer (`member.assemble`, silent) and, in a pair,
    its vote alone would leave the honest peer out of their second round first (a race on which
    peer's answer comes first, seen in CI)."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(2)
        averagers = sorted((swarm.averager(i) for i in range(2)), key=lambda a: a.peer_id)
        refuser: Any = averagers[0]
        honest: Any = averagers[1]
        refuser._handler._refusal = lambda *args: "refused"
        refuser._convict = lambda caught: None
        contributions = _contributions(averagers, "int8", seed=37)
        first = _average_together(averagers, contributions, round=0, spec="int8")
        assert first[1].result is None
        assert refuser.peer_id not in honest.verdicts()
        second = _average_together(averagers, contributions, round=1, spec="int8")
        assert second[1].result is None
        assert "refused" in honest.verdicts()[refuser.peer_id].why
    finally:
        swarm.close()


def test_streams_naming_rounds_nobody_called_hold_a_bounded_number_per_partner_and_rounds_complete() -> None:
    """Issue 25 §1.7: any peer's stream naming a round made this peer hold an entry for it (a future
    the stream waits on, kept for the records' lifetime). Each former partner's streams may open at
    most `MAX_ASKED_ROUNDS` rounds no call here named, and the peers this one never averaged with as
    many in all; beyond, the stream's round is answered at once as one this peer is in no group for.
    Under one bound for all, one key naming a few rounds ahead made this peer refuse its partners'
    next round, and a refusing owner is left out (records 069, 071). The peer's own rounds still
    complete."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        target: Any = averagers[0]
        contributions = _contributions(averagers, "int8", seed=31)
        outcomes = _average_together(averagers, contributions, round=0, spec="int8")
        _assert_matches_reduce_group(outcomes, contributions, "int8")

        async def ask(peer: str, first: int) -> tuple[list[bool], list[bool]]:
            rounds = range(first, first + 3 * MAX_ASKED_ROUNDS)
            asked = [target._round_future(r, asked_by=peer) for r in rounds]
            return [f.done() for f in asked], [f.result() is None for f in asked if f.done()]

        held = [False] * MAX_ASKED_ROUNDS + [True] * (2 * MAX_ASKED_ROUNDS)
        done, none = target._call(ask("stranger", 10**9), timeout=10)
        assert done == held and all(none)
        done, none = target._call(ask("another stranger", 2 * 10**9), timeout=10)
        assert done == [True] * (3 * MAX_ASKED_ROUNDS) and all(none)
        done, _ = target._call(ask(averagers[1].peer_id, 3 * 10**9), timeout=10)
        assert done == held
        assert len(target._asked) == 2 * MAX_ASKED_ROUNDS
        outcomes = _average_together(averagers, contributions, round=1, spec="int8")
        _assert_matches_reduce_group(outcomes, contributions, "int8")
    finally:
        swarm.close()


@pytest.mark.parametrize("other_slow_s", [0.0, 1.5], ids=["others-quick", "budget-before-late-bound"])
def test_a_founder_late_as_an_owner_in_a_fresh_swarm_is_grouped_again_and_owns_nothing_after(
    caplog: pytest.LogCaptureFixture, other_slow_s: float
) -> None:
    """Issue 26: a node killed while it reduced looks to the others like an owner late with its
    answer. In a fresh swarm it is a founder the others list from their first round together
    (`trust.WorkLedger.found`, record 077): they demote it and do not leave it out, so its restart
    under its key is grouped again as soon as it registers before a round closes (a container
    restarted this way chased the survivors for 27 rounds, left out as seen for `EXCLUDE_SEEN_S`;
    the others' next registrations do not wait for it, record 062); demoted, it owns nothing
    after, so it cannot stall another round (before record 077, nobody listed anyone for three
    rounds: it owned again, and was left out as a silence the second time).

    With `other_slow_s`, one honest owner answers that late, so that the other honest member's late
    bound for the dead one (`wire.late_answer_s` of the slow answer) falls past its budget: the
    dead founder is late to it all the same, not silent (on a slow machine the two members once
    decided differently, and one left the restart out: CI, stop 59)."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        victim: Any = averagers[0]
        honest = averagers[1:]
        contributions = _contributions(averagers, "int8", seed=23)
        first = _average_together(averagers, contributions, round=0, spec="int8")
        _assert_matches_reduce_group(first, contributions, "int8")
        for a in averagers:  # a fresh swarm's founders: each lists the other two
            assert sorted(cast(Any, a).workers()) == sorted(p.peer_id for p in averagers if p is not a)
        answer = victim._handler._answer

        async def never(*args: Any) -> None:
            await asyncio.sleep(3600)

        victim._handler._answer = never  # dead while it reduces
        slow: Any = honest[0]
        quick = slow._handler._answer

        async def late(*args: Any) -> Any:
            await asyncio.sleep(other_slow_s)
            return await quick(*args)

        slow._handler._answer = late
        with caplog.at_level("WARNING"):
            died = _average_together(averagers, contributions, round=1, spec="int8")
        slow._handler._answer = quick
        assert [o.result for o in died[1:]] == [None, None]
        for a in honest:
            assert victim.peer_id not in cast(Any, a).excluded()  # not left out ...
            assert victim.peer_id not in cast(Any, a).workers()  # ... demoted
        if other_slow_s:  # the quick member waited its whole budget, with the slow answer in
            assert any(
                "the other 1 answered within 1." in r.getMessage() and slow.peer_id[-8:] not in r.getMessage()
                for r in caplog.records
            ), [r.getMessage() for r in caplog.records]
        victim._handler._answer = answer  # restarted: it answers again
        first_in = [0.0, NEWCOMERS_FIRST_S, NEWCOMERS_FIRST_S]  # the restart registers before a close
        again = _average_together(averagers, contributions, round=2, spec="int8", delays=first_in)
        _assert_matches_reduce_group(again, contributions, "int8")
        result = again[1].result
        assert result is not None and victim.peer_id not in result.owners.values()
        victim._handler._answer = never  # it owns nothing to stall
        last = _average_together(averagers, contributions, round=3, spec="int8", delays=first_in)
        _assert_matches_reduce_group(last, contributions, "int8")
    finally:
        swarm.close()


@pytest.mark.long  # four peers that work together first, then the default floors: ~30 s
def test_an_owner_with_a_record_that_never_answers_costs_a_short_try_and_owns_nothing_after() -> None:
    """Four peers that worked together (they list one another and all own parts), at the node's
    default floors (an exchange budget of 25 s). One of them then takes the parts and never answers.
    Once the other owners have answered, it is late by their times (`wire.late_answer_s`): the try
    fails for everyone long before the budget. The honest three do not leave it out (an honest owner
    may be slow once): they demote it (`trust.WorkLedger.demote`: no longer listed, and records need
    `BAR_GROWTH` times more rounds), and the retry, which it does not come to (it still stalls), deals
    its parts to the three and closes as soon as they are in, not at the patience (6 s) that
    expecting it again took (issue 25 §2: robust_swarm's owner-stall cost an 11 s round), with
    `reduce_group`'s bytes of their contributions."""
    from adloco.protocol.algorithms.trust import BAR_GROWTH
    from adloco.protocol.transport.wire import PART_FLOOR_S, REDUCE_FLOOR_S

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(4)
        floors = {"part_timeout_s": PART_FLOOR_S, "reduce_timeout_s": REDUCE_FLOOR_S}
        at_floors = [swarm.averager(i, "run-a", **floors) for i in range(4)]
        averagers = sorted(at_floors, key=lambda a: a.peer_id)
        staller: Any = averagers[1]
        honest = [a for a in averagers if a is not staller]
        _work_together(averagers, seed=41)
        for a in honest:
            assert staller.peer_id in cast(Any, a).workers()
        for a in averagers:  # as after their last round together: each expects the four again
            cast(Any, a)._matchmaker.expected = tuple(sorted(p.peer_id for p in averagers))

        async def never(*args: Any) -> None:
            await asyncio.sleep(3600)

        staller._handler._answer = never
        # Ten parts for four owners: each owns some (three parts would leave one owner without).
        shapes = {f"t{i}": (4 * (i + 1), 16) for i in range(10)}
        contributions = _contributions(averagers, "int8", seed=42, shapes=shapes)
        stalled = _average_together(averagers, contributions, round=WORK_MIN_ROUNDS, spec="int8")
        assert all(o.result is None for o in stalled)
        budget = staller._exchange_budget_s(0)
        assert budget >= PART_FLOOR_S + REDUCE_FLOOR_S
        for o in stalled:
            assert o.elapsed_s < WINDOW_S + GRACE_S + budget / 2, o.elapsed_s
        for a in honest:
            assert staller.peer_id not in cast(Any, a).verdicts()  # not left out ...
            assert staller.peer_id not in cast(Any, a).workers()  # ... demoted
            assert cast(Any, a)._worked.bar == WORK_MIN_ROUNDS * BAR_GROWTH
        kept = [contributions[averagers.index(a)] for a in honest]
        retry = _average_together(honest, kept, round=WORK_MIN_ROUNDS + 1, spec="int8")
        _assert_matches_reduce_group(retry, kept, "int8")
        result = retry[0].result
        assert result is not None and set(result.owners.values()) == {a.peer_id for a in honest}
        assert set(result.members) == {a.peer_id for a in honest}
        assert max(o.elapsed_s for o in retry) < DHT_STALL_S, [o.elapsed_s for o in retry]
    finally:
        swarm.close()


def test_a_seeder_that_withholds_its_reveal_is_left_out_and_the_round_goes_on_without_its_secret(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In a fresh swarm (nobody has a record: every member owns and seeds, `trust.seeders`), a member
    that sends its parts and takes the answers, then reveals nothing, is late by the others' times
    (`wire.late_answer_s`) long before the end of the budget: the members' part deadline is 30 s (a
    run admitting slow links: the reveals may come as late as ~40 s after the group formed), but
    the others' reveals came within a second (record 057). The two honest members then draw the
    seed from their own secrets, more than half of the seeders', and complete the round with
    `reduce_group`'s bytes of all three contributions (its answers and its parts checked like any,
    its projections not waited for); each names it, and the next round is theirs alone. Before
    record 077 it failed the try for everyone, and the retry cost the exchange again."""

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = _slow_part_deadline_trio(swarm)
        mute: Any = averagers[2]
        _mute(monkeypatch, mute)
        contributions = _contributions(averagers, "int8", seed=20)
        with caplog.at_level("WARNING"):
            first = _average_together(averagers, contributions, round=0, spec="int8")
            _assert_matches_reduce_group(first[:2], contributions, "int8")
            assert all(o.elapsed_s < WINDOW_S + GRACE_S + 10.0 for o in first[:2]), [
                o.elapsed_s for o in first
            ]
            assert caplog.text.count("withheld their reveals past the others' times") == 2
            for honest in averagers[:2]:
                assert "withheld its reveal" in honest.verdicts()[mute.peer_id].why  # type: ignore[attr-defined]
                assert mute.peer_id not in cast(Any, honest)._matchmaker.expected
            after = _average_together(averagers, contributions, round=1, spec="int8")
        assert after[2].result is None
        _assert_matches_reduce_group(after[:2], contributions[:2], "int8")
    finally:
        swarm.close()


def _dies_once_it_holds_the_answers(
    monkeypatch: pytest.MonkeyPatch, holder: Any, cut: Any, dead: Any, *, revealed_to_holder: bool
) -> None:
    """From now on, `dead` dies once it holds a round's answers (after its reveal to `holder` where
    `revealed_to_holder`): it sends nothing more, not even a withdrawal, and no stream reaches it
    from `cut`, nor from `holder` once `holder` had its reveal."""
    from adloco.protocol.transport import round_exchange, verification
    from adloco.protocol.transport.statements import PROJECT, REVEAL

    real = verification.verify_round  # what round_exchange calls, patched there

    async def as_seen(**kw: Any) -> dict[str, str]:
        mail, send = kw["state"].mail, kw["send"]
        if kw["peer_id"] == dead.peer_id:

            def last_words(peer: str, kind: str, signed: Any) -> None:
                if revealed_to_holder and peer == holder.peer_id and kind == REVEAL:
                    send(peer, kind, signed)

            with contextlib.suppress(asyncio.TimeoutError):  # its call ends (the test's own time)
                return await asyncio.wait_for(real(**{**kw, "send": last_words}), 2.0)
            raise RoundFailed("dead")

        def reaching(peer: str, kind: str, signed: Any) -> None:
            dead_to = (REVEAL, PROJECT) if kw["peer_id"] == cut.peer_id else (PROJECT,)
            if peer == dead.peer_id and kind in dead_to:
                mail.lost(peer)
            else:
                send(peer, kind, signed)

        return await real(**{**kw, "send": reaching})

    monkeypatch.setattr(round_exchange, "verify_round", as_seen)
    monkeypatch.setattr(dead, "_withdraw", lambda *args: None)


@pytest.mark.parametrize("revealed_to_holder", [False, True], ids=["revealed-to-nobody", "revealed-to-one"])
def test_a_seeder_that_dies_with_its_answers_read_by_one_member_leaves_both_members_on_one_theta(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, revealed_to_holder: bool
) -> None:
    """Three founders (a first round together: each lists the others). In the next, one dies once it
    holds the answers, as a node killed after one member read its answer and before the other had:
    no stream from the second member (`cut`) reaches it, and it sends no withdrawal. Both members
    complete the round with `reduce_group`'s bytes of the three contributions (record 078):
    - it revealed to nobody: to the first member (`holder`) it is late (record 077: its secret is
      left out of the seed); to `cut` it is gone, and done without, as a late one is, more than half
      of the seeders' secrets being in hand (a departure: not left out, so its restart is grouped
      again; `holder` too finds no stream reaching it once it projects). Before, `cut` failed the
      try while `holder` applied the round, and averaged it again with the dead node's restart: two
      lineages among live nodes until the fork healing (the container kill/restart test, CI of
      stop 58);
    - it revealed to `holder` only, then died: `cut` has its secret from `holder`'s projections."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = _slow_part_deadline_trio(swarm)
        holder, cut, dead = averagers[0], averagers[1], cast(Any, averagers[2])
        contributions = _contributions(averagers, "int8", seed=21)
        _assert_matches_reduce_group(
            _average_together(averagers, contributions, round=0, spec="int8"), contributions, "int8"
        )
        _dies_once_it_holds_the_answers(monkeypatch, holder, cut, dead, revealed_to_holder=revealed_to_holder)
        with caplog.at_level("WARNING"):
            outcomes = _average_together(averagers, contributions, round=1, spec="int8")
        _assert_matches_reduce_group(outcomes[:2], contributions, "int8")
        said = [r.getMessage() for r in caplog.records]
        if not revealed_to_holder:
            gone = "left the round before their reveals reached this peer"
            assert any(m.startswith(f"[{cut.peer_id[-8:]}") and gone in m for m in said), said
        for a in (holder, cut):  # its restart is grouped again
            assert dead.peer_id not in cast(Any, a).excluded()
    finally:
        swarm.close()


def test_a_member_that_fails_a_try_over_a_seeder_late_to_the_others_fails_it_for_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A seeder holds the answers and reveals to nobody; one member (`cut`), having revealed, fails
    the try over it and withdraws naming it (as one that could not reach it with too few secrets in
    hand to do without it). To the other (`holder`) the seeder is late, and the seed could do
    without its secret (record 077), but `holder` hears from every other seeder before it applies
    such a round, reads the withdrawal and fails the try too: both retry from the same θ, where it
    applied the round while `cut` went on without it (record 078)."""
    from adloco.protocol.transport import round_exchange
    from adloco.protocol.transport.statements import REVEAL

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = _slow_part_deadline_trio(swarm)
        holder, cut, mute = averagers[0], averagers[1], cast(Any, averagers[2])
        _mute(monkeypatch, mute)
        real: Callable[..., Awaitable[dict[str, str]]] = vars(round_exchange)["verify_round"]  # `_mute`'s

        async def as_seen(**kw: Any) -> dict[str, str]:
            if kw["peer_id"] != cut.peer_id:
                return await real(**kw)
            revealed = asyncio.Event()

            def send(peer: str, kind: str, signed: Any) -> None:
                kw["send"](peer, kind, signed)
                if kind == REVEAL and peer == holder.peer_id:
                    revealed.set()

            checking = asyncio.ensure_future(real(**{**kw, "send": send}))
            await revealed.wait()
            checking.cancel()
            raise Caught(
                f"{[mute.peer_id[-8:]]} left the round before revealing",
                {mute.peer_id: "left the round (unreachable)"},
                proven=False,
                gone=True,
            )

        monkeypatch.setattr(round_exchange, "verify_round", as_seen)
        contributions = _contributions(averagers, "int8", seed=22)
        with caplog.at_level("WARNING"):
            outcomes = _average_together(averagers, contributions, round=0, spec="int8")
        assert [o.result for o in outcomes[:2]] == [None, None], caplog.text
        said = [r.getMessage() for r in caplog.records]
        assert any(
            m.startswith(f"[{holder.peer_id[-8:]}") and "named by a member that withdrew" in m for m in said
        ), said
    finally:
        swarm.close()


def test_fresh_nodes_retry_a_first_try_a_seeder_failed_without_waiting_a_first_round_s_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nodes just started, as a node calls (asking for its local round's patience): a first
    registration waits at least `DHT_STALL_S` for peers it cannot expect yet (record 066). When an
    owner fails that first try (it takes the parts and never answers: late by the others' times),
    the honest members' retry expects the group the try formed, less the owner they left out, and
    closes once both are in: before, having completed no round, they registered as strangers again
    and waited the 6 s a second time."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        staller: Any = averagers[2]

        async def never(*args: Any) -> None:
            await asyncio.sleep(3600)

        staller._handler._answer = never
        shapes = {f"t{i}": (4 * (i + 1), 16) for i in range(9)}  # parts for each of the three owners
        contributions = _contributions(averagers, "int8", seed=23, shapes=shapes)
        first = _average_together(averagers, contributions, round=0, spec="int8", patience_s=0.5)
        assert [o.result for o in first[:2]] == [None, None]
        retry = _average_together(averagers[:2], contributions[:2], round=1, spec="int8", patience_s=0.5)
        _assert_matches_reduce_group(retry[:2], contributions[:2], "int8")
        waited = [o.elapsed_s for o in retry[:2]]
        assert max(waited) < DHT_STALL_S, waited
        print(f"\nthe honest members' retry took {max(waited):.2f} s (first try {first[0].elapsed_s:.2f} s)")
    finally:
        swarm.close()


def test_a_member_projecting_falsely_to_frame_an_owner_is_shown_up_and_the_round_completes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A member sends everyone doubled projections of its payloads (within its committed norm): the
    honest owners' parts then fail their checks, as if the owners had lied. Each member asks the
    owner, which shows the framer's payloads (they hash to its commitment and project otherwise):
    the round completes with `reduce_group`'s bytes, and every other member convicts the framer."""
    from adloco.protocol.transport import checks, verification

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i) for i in range(3)), key=lambda a: a.peer_id)
        contributions = _contributions(averagers, "none", seed=22)
        framer = contributions[2]
        real = checks.own_projections  # called by verification.verify_round: patched there

        def doubled(payloads: Any, layout: Any, seed: bytes) -> list[float]:
            values = real(payloads, layout, seed)
            return [2 * v for v in values] if payloads is framer.payloads else values

        monkeypatch.setattr(verification, "own_projections", doubled)
        with caplog.at_level("INFO"):
            outcomes = _average_together(averagers, contributions, round=0, spec="none")
        expected = reduce_group(contributions, codec=make_codec("none"))
        for o in outcomes:
            assert o.result is not None  # the owners' shown payloads moved bytes: no exact traffic
            assert o.result.averaged == expected.averaged and o.result.members == expected.members
        for honest in averagers[:2]:
            verdict = honest.verdicts()[framer.peer_id]  # type: ignore[attr-defined]
            assert verdict.proven and "its payload gives" in verdict.why
        assert "owners showed false projections" in caplog.text
    finally:
        swarm.close()


def test_once_its_exchange_is_over_an_owner_holds_its_reductions_inputs_and_answers_on_disk(
    tmp_path: Path,
) -> None:
    """Three averagers with a node's `shelve` (an unnamed file each, record 067). Once its exchange
    is over, each holds of the answers only those of the parts it reduced (the caller's result holds
    the rest), and those answers and its reductions' inputs, kept in case another member's check
    asks to see them, in its file: read back, they are the bytes each contributor sent for those
    parts and the averaged bytes every member got. The round holds reduce_group's bytes."""
    from adloco.node.training.replica import DiskShelf, SpilledPayloads

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        # The checks' length (and so the inputs' stay) is at least the answer phase: 10 s here.
        shelve = DiskShelf(str(tmp_path), "the payloads held for the checks")
        knobs: dict[str, Any] = {"shelve": shelve, "reduce_timeout_s": 10.0}
        averagers = [swarm.averager(i, **knobs) for i in range(3)]
        contributions = _contributions(averagers, "int8", seed=23)
        outcomes = _average_together(averagers, contributions, round=0, spec="int8")
        _assert_matches_reduce_group(outcomes, contributions, "int8")
        sent = {c.peer_id: c.payloads for c in contributions}
        states = [cast(Any, a)._rounds[0][1].result() for a in averagers]
        for state in states:
            reduced = {key for session in state.reductions for key in session.keys}
            assert reduced and {k for a in state.answers.values() for k in a.payloads} <= reduced

        def shelved() -> bool:
            kept = [p for state in states for s in state.reductions for p in s.kept.values()]
            answers = [a.payloads for state in states for a in state.answers.values() if a.payloads]
            return (
                len(kept) == 9
                and len(answers) == 3
                and all(isinstance(p, SpilledPayloads) for p in [*kept, *answers])
            )

        wait_for(shelved, timeout=5.0, what="the reductions' inputs and answers on disk")
        result = outcomes[0].result
        assert result is not None
        averaged = result.averaged
        for state in states:
            for session in state.reductions:
                for peer, payloads in session.kept.items():
                    assert dict(payloads) == {k: sent[peer][k] for k in session.keys}
            for answer in state.answers.values():
                assert dict(answer.payloads) == {k: averaged[k] for k in answer.payloads}
    finally:
        swarm.close()


CLIP = Aggregate.parse("clip:1")


def _flipped_contributions(averagers: Sequence[Averager]) -> list[Contribution]:
    """Two members whose Δs share a direction and a third sending −3 × the first's, claiming twice
    their tokens (the claim-limit attack): CenteredClip clips the third (its ρ ~0.3)."""
    g = torch.Generator().manual_seed(41)
    common = {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}
    honest = [{k: (v + torch.randn(v.shape, generator=g)) * 0.7 for k, v in common.items()} for _ in range(2)]
    tensors = [*honest, {k: v * -3.0 for k, v in honest[0].items()}]
    out = []
    for i, (averager, values) in enumerate(zip(averagers, tensors, strict=True)):
        tokens = 200.0 if i == 2 else 100.0
        payloads = encode_tensors(make_codec("int8"), values)
        report = PeerReport(peer_id=averager.peer_id, slot_stats=(None,), b_max=4, tokens=100, base_round=7)
        out.append(
            Contribution(averager.peer_id, payloads, weight=tokens, tokens=tokens, metadata=report.encode())
        )
    return out


@contextlib.contextmanager
def _flipped_round(**knobs: Any) -> Iterator[tuple[list[Averager], list[Contribution], list[Outcome]]]:
    """Three hivemind averagers with `knobs` (by peer id) average `_flipped_contributions` once."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i, **knobs) for i in range(3)), key=lambda a: a.peer_id)
        contributions = _flipped_contributions(averagers)
        yield averagers, contributions, _average_together(averagers, contributions, round=0, spec="int8")
    finally:
        swarm.close()


def test_a_centered_clip_round_is_checked_and_completes_with_reduce_groups_bytes() -> None:
    """Every owner reduces its parts by CenteredClip and states its clip factors; every member checks
    each answer as the weighted mean they make and the factors against the distances the others'
    inner products give. All honest: the round completes with `reduce_group`'s bytes under the same
    rule, and nobody is named."""
    with _flipped_round(aggregate=CLIP) as (averagers, contributions, outcomes):
        _assert_matches_reduce_group(outcomes, contributions, "int8", aggregate=CLIP)
        for averager in averagers:
            assert averager.verdicts() == {}  # type: ignore[attr-defined]


def test_an_owner_stating_the_attacker_unclipped_under_centered_clip_is_caught(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A colluding owner answers its parts with the plain mean and states every clip factor 1: the
    answer is exactly the weighted mean its statement makes it, so its projection passes; the
    attacker's distance from the answer (from its committed norm and inner product) says its factor
    is ~0.3, so every honest member refuses the round and names the owner (on its own observation:
    the owner shows no payload that proves an inner product false)."""
    from adloco.protocol.transport import owner as owner_module

    real = owner_module.reduce_owned

    def unclipped(answer: Any, session: Any) -> Any:
        mean, _ = real(
            session.keys,
            dict(session.contributions),
            session.codec,
            session.outlier_factor,
            MEAN,
            None,
            session.bounds.reference_tokens,
        )
        clips = [
            None if c is None else Clip(c.tau, dict.fromkeys(c.rhos, 1.0)) for c in answer.statement.clips
        ]
        assert any(c is not None for c in clips)
        statement = dataclasses.replace(answer.statement, clips=clips)
        return dataclasses.replace(answer, payloads=mean.payloads, statement=statement)

    with _round_with_a_lying_owner(
        monkeypatch, caplog, "int8", 0, lie=unclipped, aggregate=CLIP, contributions_of=_flipped_contributions
    ) as round:
        print(round.logs)
        assert [o.result for o in round.outcomes[1:]] == [None, None]
        for honest in round.honest:
            verdict = round.verdicts(honest)[round.liar.peer_id]
            assert "clip factor" in verdict.why and not verdict.proven


def test_a_member_sending_false_inner_products_to_frame_a_clipping_owner_is_shown_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under CenteredClip the attacker sends everyone its inner products with the answers negated
    (within Cauchy–Schwarz, so no one can refuse them on their face): its distance from each answer
    then reads small and the honest owners' clip factors for it (~0.3) look false. Each member asks
    the owner, which shows the framer's payloads (they hash to its commitment and give other inner
    products): the round completes with `reduce_group`'s bytes, and the framer is convicted."""
    from adloco.protocol.transport import checks, verification

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = sorted((swarm.averager(i, aggregate=CLIP) for i in range(3)), key=lambda a: a.peer_id)
        contributions = _flipped_contributions(averagers)
        framer = contributions[2]
        real = checks.own_dots  # called by verification.verify_round: patched there

        def negated(payloads: Any, layout: Any, clipped: Any) -> list[float | None]:
            dots = real(payloads, layout, clipped)
            return [None if d is None else -d for d in dots] if payloads is framer.payloads else dots

        monkeypatch.setattr(verification, "own_dots", negated)
        with caplog.at_level("INFO"):
            outcomes = _average_together(averagers, contributions, round=0, spec="int8")
        expected = reduce_group(contributions, codec=make_codec("int8"), aggregate=CLIP)
        for o in outcomes:
            assert o.result is not None
            assert o.result.averaged == expected.averaged and o.result.members == expected.members
        for honest in averagers[:2]:
            verdict = honest.verdicts()[framer.peer_id]  # type: ignore[attr-defined]
            assert verdict.proven and "its payload gives" in verdict.why
    finally:
        swarm.close()


def test_a_member_sending_a_sum_payload_is_dropped_before_it_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sum payload of the announced size whose parts each decode to the whole tensor (the issue's
    sum bomb: here 39 of them in the bytes of one int8 part) is not the round's codec: its owner
    drops the member once its bytes are in, from the payload's header, before decoding anything, and
    the honest complete. (One part, owned by the first in dealing order: the liar, third, has nothing
    else in the round.)"""
    shapes = {"embed": (48, 32)}
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3, identities=_identities(tmp_path, 3))
        averagers = _by_dealing([swarm.averager(i) for i in range(3)], shapes)
        contributions = _contributions(averagers, "int8", seed=21, shapes=shapes)
        liar = contributions[2]
        forged = dict(liar.payloads)
        forged["embed"] = sum_bomb(len(liar.payloads["embed"]), shapes["embed"])
        assert codecs.sum_count(forged["embed"]) >= 30 and codecs.payload_shape(forged["embed"]) == (48, 32)
        contributions[2] = dataclasses.replace(liar, payloads=forged)
        decodes = _count_decodes(monkeypatch)
        outcomes = _average_together(averagers, contributions, round=0, spec="int8")
        assert outcomes[2].result is None
        # Refused from its header: decoded only by the liar itself (the norm it commits to).
        assert decodes[forged["embed"]] == 1
        expected = reduce_group(contributions[:2], codec=make_codec("int8"))
        for o in outcomes[:2]:  # its owner read its bytes (then refused them): no exact traffic
            assert o.result is not None and o.result.averaged == expected.averaged
            assert o.result.members == expected.members and o.result.reports == expected.reports
        assert any(liar.peer_id in a._handler.banned for a in averagers[:2])  # type: ignore[attr-defined]
    finally:
        swarm.close()


@pytest.mark.parametrize(
    "field, ok",
    [
        (None, True),  # an owner from before screening
        ({}, True),
        ({"a": 2}, True),
        ({"a": 3}, False),  # more parts than the owner owns
        ({"a": 0}, False),
        ({"a": True}, False),
        ({"a": 1.0}, False),
        ({"z": 1}, False),  # not a contributor
        ([["a", 1]], False),
        ("a", False),
    ],
)
def test_rejected_field_parsing(field: Any, ok: bool) -> None:
    from adloco.protocol.transport.member import parse_rejected

    parsed = parse_rejected(field, ("a", "b"), 2)
    assert (parsed is not None) == ok
    if ok:
        assert parsed == (field or {})


SMALL_CHUNK = 64 << 10
BIG_SHAPES = {"embed": (256, 300), "proj": (200, 256), "norm": (64,)}  # fp32: 300 kB, 200 kB, 256 B


def test_parts_of_many_chunks_average_bit_identically_reading_one_chunk_at_a_time() -> None:
    """Chunks of 64 KiB: every part of more than one chunk goes as several frames, both ways. The
    result is `reduce_group`'s to the bit, and no frame body read on any stream exceeded a chunk
    (measured by the frame reader of each peer, over the requests it served and the answers it got)."""
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3)
        averagers = [swarm.averager(i, chunk_bytes=SMALL_CHUNK) for i in range(3)]
        contributions = _contributions(averagers, "none", seed=12, shapes=BIG_SHAPES)
        outcomes = _average_together(averagers, contributions, round=0, spec="none")
        _assert_matches_reduce_group(outcomes, contributions, "none")
        for o in outcomes:
            assert o.result is not None
            t = o.result.traffic
            assert t.payload_received > 3 * SMALL_CHUNK  # many chunks went through this peer
            assert 0 < t.largest_frame_body <= SMALL_CHUNK
    finally:
        swarm.close()


@pytest.mark.parametrize(
    ("weight", "tokens", "why"),
    [
        (1e12, 100.0, "weight"),  # the issue's attack: a normal Δ with an inflated weight
        (2e5, 2e5, "tokens"),  # weight and tokens inflated together, past what the schedule allows
        (math.nan, 100.0, "finite"),  # before the bounds, this failed every owner's reduction
        (100.0, -5.0, "finite"),
    ],
)
def test_a_member_claiming_more_than_the_round_allows_is_left_out_and_the_others_complete(
    swarm: Swarm, tmp_path: Path, weight: float, tokens: float, why: str
) -> None:
    """Three members of two equal parts, bounds of 1000 tokens and a weight of at most 1 per token;
    the third (in dealing order: it owns no part) claims more. Every owner refuses and drops it at its
    header, the two honest members complete with `reduce_group` over themselves, and the liar gets
    no result."""
    from adloco.protocol.algorithms.claims import ClaimBounds

    shapes = {"embed": (48, 32), "proj": (48, 32)}
    swarm.add_nodes(3, identities=_identities(tmp_path, 3) if swarm.kind == "hivemind" else ())
    averagers = _by_dealing([swarm.averager(i) for i in range(3)], shapes)
    contributions = [
        dataclasses.replace(c, weight=100.0 * (i + 1), tokens=100.0 * (i + 1))
        for i, c in enumerate(_contributions(averagers, "int8", seed=14, shapes=shapes))
    ]
    bounds = ClaimBounds(max_tokens=1000.0, max_weight_per_token=1.0)
    assert all(bounds.violation(c.weight, c.tokens) is None for c in contributions)
    contributions[2] = dataclasses.replace(contributions[2], weight=weight, tokens=tokens)
    assert why in str(bounds.violation(weight, tokens))
    outcomes = _average_together(averagers, contributions, round=0, spec="int8", bounds=bounds)
    assert outcomes[2].result is None
    _assert_matches_reduce_group(outcomes[:2], contributions[:2], "int8")


@pytest.mark.parametrize(
    ("third_tokens", "third_scale", "rejected_parts", "rejected_as_the_others"),
    [(30.0, 13.5, 0, 2), (60.0, 15.0, 3, 3)],
    ids=["dylu", "overclaim"],
)
def test_owners_screen_norms_per_claimed_token_capped_at_the_reference_work(
    swarm: Swarm, third_tokens: float, third_scale: float, rejected_parts: int, rejected_as_the_others: int
) -> None:
    """Bounds of 60 tokens (the round's reference work: 30). dylu: two slow members ran 1/15 of the
    steps (2 tokens each), the fast one all of them (30) and its Δ is 13.5x theirs; per token it is
    not an outlier and nothing is rejected (claiming the slow ones' work, two of its three parts are).
    overclaim: two members did the reference work (30) and one claims 60, as the bounds allow, with
    15x their Δ; credited with 30, its parts are 15x the median and all rejected (uncapped, its claim
    would have let them through). Both transports hold reduce_group's bytes under that cap."""
    from adloco.protocol.algorithms.claims import ClaimBounds

    swarm.add_nodes(3)
    averagers = [swarm.averager(i) for i in range(3)]
    others = 2.0 if third_tokens == 30.0 else 30.0
    tokens = [others, others, third_tokens]
    int8 = make_codec("int8")
    contributions = []
    for i, c in enumerate(_contributions(averagers, "int8", seed=18)):
        scale = third_scale if i == 2 else 1.0
        payloads = {k: int8.encode(k, codecs.decode(p) * scale) for k, p in c.payloads.items()}
        contributions.append(dataclasses.replace(c, payloads=payloads, weight=tokens[i], tokens=tokens[i]))
    bounds = ClaimBounds(max_tokens=60.0, max_weight_per_token=1.0)
    claimed_as_the_others = [dataclasses.replace(c, weight=others, tokens=others) for c in contributions]
    as_the_others = reduce_group(claimed_as_the_others, codec=int8).rejected
    assert as_the_others == {averagers[2].peer_id: rejected_as_the_others}
    uncapped = reduce_group(contributions, codec=int8).rejected
    capped = reduce_group(contributions, codec=int8, work_cap=bounds.reference_tokens).rejected
    assert uncapped == {} and capped == ({averagers[2].peer_id: rejected_parts} if rejected_parts else {})
    outcomes = _average_together(averagers, contributions, round=0, spec="int8", bounds=bounds)
    _assert_matches_reduce_group(outcomes, contributions, "int8", work_cap=bounds.reference_tokens)


def test_a_member_that_broke_a_rule_is_refused_by_its_owners_in_the_next_rounds_too(tmp_path: Path) -> None:
    """Round 0: the third member (it owns nothing) claims a weight of 1e12 and is refused. Round 1:
    it claims honestly, and its owners still refuse it (banned for `owner.BAN_S`); the two honest
    members complete both rounds without it. (The in-process hub has no peers to ban.)"""
    from adloco.protocol.algorithms.claims import ClaimBounds

    shapes = {"embed": (48, 32), "proj": (48, 32)}
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3, identities=_identities(tmp_path, 3))
        averagers = _by_dealing([swarm.averager(i) for i in range(3)], shapes)
        bounds = ClaimBounds(max_tokens=1000.0, max_weight_per_token=1.0)
        for round, liar_weight in ((0, 1e12), (1, 300.0)):
            contributions = [
                dataclasses.replace(c, weight=100.0 * (i + 1), tokens=100.0 * (i + 1))
                for i, c in enumerate(_contributions(averagers, "int8", seed=20 + round, shapes=shapes))
            ]
            contributions[2] = dataclasses.replace(contributions[2], weight=liar_weight)
            outcomes = _average_together(averagers, contributions, round=round, spec="int8", bounds=bounds)
            assert outcomes[2].result is None
            _assert_matches_reduce_group(outcomes[:2], contributions[:2], "int8")
        liar = averagers[2].peer_id
        assert all(liar in a._handler.banned for a in averagers[:2])  # type: ignore[attr-defined]
        # What the metrics read: each honest owner counted the rule break once and bans one member.
        caught = [a.misconduct() for a in averagers[:2]]  # type: ignore[attr-defined]
        assert caught == [Misconduct(violations=1, banned=1)] * 2
    finally:
        swarm.close()


def test_a_member_lying_to_one_owner_only_does_not_fail_the_round_for_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The member that owns nothing claims a weight of 1e12 to the owner of "embed" only, after its
    honest exchange with the owner of "proj" has completed. "embed" is refused it and reduced over
    the two honest members, "proj" admitted it: the honest members complete the round with each
    part equal to `reduce_group` over the members its owner admitted, and the round's members (and
    reports) are the two that every owner admitted. Failing the round on the split, as before,
    would let one member stop every round this way."""
    from adloco.protocol.algorithms.claims import ClaimBounds
    from adloco.protocol.transport import member, round_exchange

    shapes = {"embed": (48, 32), "proj": (48, 32)}
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3, identities=_identities(tmp_path, 3))
        averagers = _by_dealing([swarm.averager(i) for i in range(3)], shapes)
        liar = averagers[2].peer_id
        contributions = _contributions(averagers, "int8", seed=31, shapes=shapes)
        real_fetch = member.fetch  # what round_exchange calls, patched there below

        async def lying_fetch(p2p: Any, handler: str, state: Any, **kw: Any) -> Any:
            if kw["peer_id"] == liar and kw["keys"] == ["embed"]:
                await asyncio.sleep(2.0)  # the honest exchange for "proj" completes first
                kw = {**kw, "contribution": dataclasses.replace(kw["contribution"], weight=1e12)}
            return await real_fetch(p2p, handler, state, **kw)

        monkeypatch.setattr(round_exchange, "fetch", lying_fetch)
        bounds = ClaimBounds(max_tokens=1000.0, max_weight_per_token=10.0)
        outcomes = _average_together(averagers, contributions, round=0, spec="int8", bounds=bounds)
        assert outcomes[2].result is None
        honest = reduce_group(contributions[:2], codec=make_codec("int8"))
        everyone = reduce_group(contributions, codec=make_codec("int8"))
        for o in outcomes[:2]:
            r = o.result
            assert r is not None
            assert r.averaged == {"embed": honest.averaged["embed"], "proj": everyone.averaged["proj"]}
            assert r.averaged["proj"] != honest.averaged["proj"]  # the liar's honest part did count
            assert r.members == honest.members and r.reports == honest.reports
    finally:
        swarm.close()


@pytest.mark.parametrize("lie", ["announces_more", "sends_more"])
def test_a_member_announcing_or_sending_more_than_its_parts_is_dropped_and_the_others_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lie: str
) -> None:
    """The member that owns nothing (two equal parts, three members) lies to every owner: it
    announces one byte more per part, or announces the right sizes and sends its first part plus one
    byte in one frame. Every owner refuses it before reading a byte of that payload (it answers the
    oversized announcement with a refusal, or closes the stream on the oversized frame without a
    word) and bans it; the honest members complete the round without it, equal to `reduce_group`
    over them. (The honest members send once the liar has told every owner its lie: else, on a
    loaded machine, an owner could reduce without the liar before its lie arrived.)"""
    from hivemind.p2p import PeerID

    from adloco.protocol.transport import member, round_exchange
    from adloco.protocol.transport.member import request_header
    from adloco.protocol.transport.wire import PROTOCOL_VERSION, read_frame, write_frame

    shapes = {"embed": (48, 32), "proj": (48, 32)}
    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(3, identities=_identities(tmp_path, 3))
        averagers = _by_dealing([swarm.averager(i) for i in range(3)], shapes)
        owners = [a.peer_id for a in averagers[:2]]
        liar = averagers[2]
        contributions = _contributions(averagers, "int8", seed=13, shapes=shapes)
        # owner -> (the go it answered, the bytes that followed on the stream): one per owner that
        # answered the liar's header at all.
        replies: dict[str, tuple[dict[str, Any], bytes]] = {}
        ended: set[str] = set()  # the owners the liar's exchange with has ended
        all_ended: list[asyncio.Event] = []  # made on the liar's loop
        told_everyone = threading.Event()  # the same, for the honest members' loops
        real_fetch = member.fetch  # what round_exchange calls, patched there below

        async def tell(p2p: Any, state: Any, handler: str, owner: str, kw: dict[str, Any]) -> None:
            keys, payloads = kw["keys"], kw["contribution"].payloads
            header = request_header(
                state,
                peer_id=kw["peer_id"],
                keys=keys,
                contribution=kw["contribution"],
                with_metadata=kw["with_metadata"],
            )
            if lie == "announces_more":
                header["s"] = [n + 1 for n in header["s"]]
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(owner), handler)
            try:
                await write_frame(writer, header, [], state.meter)
                go, _ = await read_frame(reader, state.meter, max_body=0)
                rest = b""
                replies[owner] = (go, rest)
                if go.get("ok"):
                    # The owner closes the stream without a word, the payload unread. When the close
                    # arrives decides whether the liar sees the end of the stream or a reset (on its
                    # write's drain or on its read); either way, no byte of an answer.
                    with contextlib.suppress(ConnectionError):
                        await write_frame(
                            writer, {"v": PROTOCOL_VERSION}, [payloads[keys[0]] + b"\0"], state.meter
                        )
                        while chunk := await reader.read(1 << 16):
                            rest += chunk
                    replies[owner] = (go, rest)
            finally:
                writer.close()

        async def lying_fetch(p2p: Any, handler: str, state: Any, **kw: Any) -> Any:
            if kw["peer_id"] != liar.peer_id:
                deadline = time.monotonic() + CALL_TIMEOUT_S / 2
                while not told_everyone.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                return await real_fetch(p2p, handler, state, **kw)
            if not all_ended:
                all_ended.append(asyncio.Event())
            try:
                await tell(p2p, state, handler, kw["owner"], kw)
            finally:
                ended.add(kw["owner"])
                if ended == set(owners):
                    all_ended[0].set()
                    told_everyone.set()
            # The liar's first failed exchange would cancel the others: it fails once it told everyone.
            await all_ended[0].wait()
            raise RoundFailed("the liar is done")

        monkeypatch.setattr(round_exchange, "fetch", lying_fetch)
        outcomes = _average_together(averagers, contributions, round=0, spec="int8")
        honest_outcomes, (liar_outcome,) = outcomes[:2], outcomes[2:]
        assert liar_outcome.result is None
        _assert_matches_reduce_group(honest_outcomes, contributions[:2], "int8")
        assert all(liar.peer_id in a._handler.banned for a in averagers[:2])  # type: ignore[attr-defined]
        assert set(replies) == set(owners)
        for go, rest in replies.values():
            if lie == "announces_more":
                assert go["ok"] is False and "part sizes" in go["e"]
            else:
                assert go["ok"] is True and rest == b""
    finally:
        swarm.close()


def test_an_owner_counts_an_answer_given_only_once_the_member_has_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each node shuts its averager and DHT down as soon as its `average` returns (as a node ending
    its last round does). The second member reads its answers 0.5 s late: the first node's call
    returns only after that member has read the first node's answer, so no p2pd is stopped with
    an answer in flight, and both hold `reduce_group`'s result."""
    import contextvars

    from adloco.protocol.transport import member, round_exchange, wire

    swarm = Swarm("hivemind")
    try:
        swarm.add_nodes(2)
        averagers = [swarm.averager(i) for i in range(2)]
        slow = averagers[1].peer_id
        reading_for: contextvars.ContextVar[str | None] = contextvars.ContextVar("reading_for", default=None)
        read_done: dict[str, float] = {}  # owner -> when the slow member had read its answer
        real_fetch, real_read = member.fetch, wire.read_chunks  # the names patched below

        async def fetch(p2p: Any, handler: str, state: Any, **kw: Any) -> Any:
            reading_for.set(kw["owner"] if kw["peer_id"] == slow else None)
            return await real_fetch(p2p, handler, state, **kw)

        async def read_chunks(reader: Any, sizes: Any, meter: Any) -> Any:
            owner = reading_for.get()
            if owner is None:
                return await real_read(reader, sizes, meter)
            await asyncio.sleep(0.5)
            body = await real_read(reader, sizes, meter)
            read_done[owner] = time.monotonic()
            return body

        monkeypatch.setattr(round_exchange, "fetch", fetch)
        monkeypatch.setattr(member, "read_chunks", read_chunks)
        contributions = _contributions(averagers, "int8", seed=21)
        results: list[MemberResult | None] = [None, None]
        returned = [0.0, 0.0]
        start = threading.Barrier(2)

        def node(i: int) -> None:
            start.wait()
            results[i] = averagers[i].average(
                contributions[i], round=0, codec=make_codec("int8"), timeout=CALL_TIMEOUT_S
            )
            returned[i] = time.monotonic()
            averagers[i].shutdown()
            swarm.dhts[i].shutdown()

        threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=CALL_TIMEOUT_S + 10)
        expected = reduce_group(contributions, codec=make_codec("int8"))
        for r in results:
            assert r is not None and r.averaged == expected.averaged
        first = averagers[0].peer_id
        assert first in read_done, "the slow member read no answer of the first node"
        assert returned[0] >= read_done[first]
    finally:
        swarm.close()
