"""The in-process transport: `MemoryAverager`s of one process meet in a `MemoryHub`.

The solo trainer (a group of one), the simulator (many virtual peers, each on its own thread for
the length of a round) and the tests average through it. It keeps the contract of
`averager.Averager` with `allreduce.reduce_group` as the reduction, each part encoded by its
owner's codec as on the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..algorithms.allreduce import Contribution, GroupResult, reduce_group
from ..algorithms.claims import UNBOUNDED, ClaimBounds
from ..algorithms.codecs import Codec, decode
from ..algorithms.parts import DEFAULT_OUTLIER_FACTOR, MEAN, Aggregate, assign_parts, check_outlier_factor
from ..algorithms.scoring import Scorer
from .averager import MemberResult, NotOpened, Traffic

logger = logging.getLogger(__name__)


class _OwnerCodecs(Codec):
    """Encodes each part with its owner's codec, as the network transport does.

    Owners keep their own (stateful, e.g. low-rank warm-started) downlink codec, so in-process
    reduction must route every part through the codec of the member that owns it.
    """

    name = "owners"

    def __init__(self, by_key: Mapping[str, Codec]) -> None:
        self._by_key = dict(by_key)

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Encode with the owner's codec."""
        return self._by_key[key].encode(key, tensor)

    def encode_spans(self, key: str, shape: tuple[int, ...], spans: Iterable[torch.Tensor]) -> bytes:
        """Encode with the owner's codec, span by span where it can."""
        return self._by_key[key].encode_spans(key, shape, spans)

    def for_part(self, key: str) -> Codec:
        """The owner's codec."""
        return self._by_key[key]

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """Not defined: the size depends on which owner's codec a shape goes through."""
        raise NotImplementedError("_OwnerCodecs routes by key; ask the owner's codec")


def owner_codecs(contributions: Sequence[Contribution], codecs: Mapping[str, Codec]) -> Codec:
    """A codec that encodes each part with the codec of its owner under `reduce_group`'s assignment.

    Falls back to any member's codec when the contributions disagree on their tensors (then
    `reduce_group` raises anyway).
    """
    members = sorted(contributions, key=lambda c: c.peer_id)
    keys = list(members[0].payloads)
    if any(list(c.payloads) != keys for c in members):
        return codecs[members[0].peer_id]
    sizes = [max(len(c.payloads[k]) for c in members) for k in keys]
    owner_index = assign_parts(sizes, len(members))
    return _OwnerCodecs({k: codecs[members[i].peer_id] for k, i in zip(keys, owner_index, strict=True)})


@dataclass
class _Gathering:
    """One (prefix, round) on a hub: who joined before `closes_at`, and the reduction once done."""

    closes_at: float
    expected: frozenset[str] | None = None  # set by `MemoryHub.expect`: close once these have joined
    entries: dict[str, tuple[Contribution, Codec, ClaimBounds]] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # every peer that called, including those who left
    reducing: bool = False
    reduced: bool = False
    result: GroupResult | None = None


class MemoryHub:
    """Where `MemoryAverager` threads of one process meet: one group per (prefix, round).

    The first call for a (prefix, round) opens it for `window_s` seconds; calls within the window
    join, a later call gets None at once. A driver that decides the group itself (the simulator,
    whose peers are ready in simulated time) calls `expect` first: the round then closes as soon as
    those members have joined. At the close the first thread to wake reduces the group
    with `reduce_group` (each part encoded by its owner's codec) and every member receives the same
    result. Rounds older than `ttl_s` are forgotten (a call after that opens a new group).
    `outlier_factor` is the owners' outlier test (`parts.DEFAULT_OUTLIER_FACTOR`; 0 or None turns
    it off): in process one hub reduces for every owner, so the knob lives here. A `scorer`
    (`scoring.Scorer`, e.g. the simulator's loss test) judges every contribution's whole Δ at the
    close; the ones it excludes are left out of the round as a refused claim is (logged; their
    callers get None), which in process is every owner excluding them from all of its parts.
    """

    def __init__(
        self,
        *,
        window_s: float = 3.0,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
        aggregate: Aggregate = MEAN,
        scorer: Scorer | None = None,
    ) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self.ttl_s = ttl_s
        self.outlier_factor = check_outlier_factor(outlier_factor)
        self.aggregate = aggregate
        self.scorer = scorer
        self._clock = clock
        self._cond = threading.Condition()
        self._rounds: dict[tuple[str, int], _Gathering] = {}

    @property
    def matchmaking_s(self) -> float:
        return self.window_s

    def expect(self, prefix: str, round: int, members: Collection[str]) -> None:
        """Open (prefix, round) now for exactly `members`: it closes when all of them have joined
        (or its window ends first). Raises ValueError if the round is already open."""
        with self._cond:
            if (prefix, round) in self._rounds:
                raise ValueError(f"round {round} is already open")
            gathering, _ = self._open(prefix, round)
            gathering.expected = frozenset(members)

    def join(
        self,
        prefix: str,
        round: int,
        contribution: Contribution,
        codec: Codec,
        *,
        timeout: float,
        join_only: bool = False,
        join_wait_s: float | None = None,
        bounds: ClaimBounds | None = None,
        patience_s: float = 0.0,
    ) -> MemberResult | None:
        """Join (or open) the group of (prefix, round); block until it is reduced or `timeout`.
        A round this call opens stays open for max(window, `patience_s`) unless it is complete.

        With `join_only`, wait (within `timeout`, and `join_wait_s` if given) until another peer
        has opened the round: None when the timeout ends the wait, `NotOpened` when join_wait_s does.
        """
        deadline = self._clock() + timeout
        peer = contribution.peer_id
        with self._cond:
            if join_only:
                wait = max(0.0, deadline - self._clock())
                bounded = join_wait_s is not None and join_wait_s < wait
                if not self._cond.wait_for(
                    lambda: (prefix, round) in self._rounds, timeout=join_wait_s if bounded else wait
                ):
                    if bounded:
                        raise NotOpened(f"round {round}: no peer opened it within {join_wait_s:.1f} s")
                    return None
            gathering, opened = self._open(prefix, round, 0.0 if join_only else patience_s)
            if peer in gathering.seen:
                raise ValueError(f"peer {peer} already called round {round}; rounds are single-use")
            gathering.seen.add(peer)
            if not opened and self._clock() >= gathering.closes_at:
                logger.info("[%s round=%d] arrived after the window closed; not in the group", peer, round)
                return None
            gathering.entries[peer] = (contribution, codec, bounds or UNBOUNDED)
            if not self._wait_for_close(gathering, deadline):
                del gathering.entries[peer]  # gave up before the close: leave the group cleanly
                return None
            must_reduce = not gathering.reducing
            gathering.reducing = True
        if must_reduce:
            self._reduce(gathering)
        with self._cond:
            if not self._cond.wait_for(lambda: gathering.reduced, timeout=max(0.0, deadline - self._clock())):
                return None
            result = gathering.result
        if result is None or peer not in result.members:
            return None
        return _member_view(result, peer)

    def _open(self, prefix: str, round: int, patience_s: float = 0.0) -> tuple[_Gathering, bool]:
        """The gathering of (prefix, round), and whether this call opened it (its window: the larger
        of the hub's and `patience_s`)."""
        now = self._clock()
        for key in [k for k, g in self._rounds.items() if now - g.closes_at > self.ttl_s]:
            del self._rounds[key]
        gathering = self._rounds.get((prefix, round))
        if gathering is not None:
            return gathering, False
        gathering = self._rounds[(prefix, round)] = _Gathering(closes_at=now + max(self.window_s, patience_s))
        self._cond.notify_all()  # join_only callers wait for a round to be opened
        return gathering, True

    def _wait_for_close(self, gathering: _Gathering, deadline: float) -> bool:
        """Wait (lock held) until the window closes; False if the caller's deadline comes first."""
        while True:
            now = self._clock()
            complete = gathering.expected is not None and gathering.expected <= gathering.entries.keys()
            if now >= gathering.closes_at or gathering.reducing or complete:
                self._cond.notify_all()  # the others waiting for this close
                return True
            if now >= deadline:
                return False
            self._cond.wait(min(gathering.closes_at, deadline) - now)

    def _reduce(self, gathering: _Gathering) -> None:
        # As every owner of the network transport does: a claim another member's bounds refuse
        # leaves its maker out of the round (honest members agree on the bounds: one schedule).
        entries = gathering.entries.values()
        contributions = []
        for c, _, _ in entries:
            why = next((w for _, _, b in entries if (w := b.violation(c.weight, c.tokens))), None)
            if why is None:
                contributions.append(c)
            else:
                logger.warning("%s left out of the round: %s", c.peer_id, why)
        codecs = {peer: codec for peer, (_, codec, _) in gathering.entries.items()}
        result: GroupResult | None
        try:
            contributions = self._scored(contributions)
            result = reduce_group(
                contributions,
                codec=owner_codecs(contributions, codecs),
                outlier_factor=self.outlier_factor,
                aggregate=self.aggregate,
                work_cap=_work_cap([b for _, _, b in entries]),
            )
        except ValueError as e:  # a malformed contribution fails the round for everyone
            logger.warning("round failed: %s", e)
            result = None
        with self._cond:
            gathering.result = result
            gathering.reduced = True
            # Reduced: the contributions' payloads are not read again, and a hub keeps its rounds for
            # ttl_s (a solo node's whole next round), so let them go now.
            gathering.entries.clear()
            self._cond.notify_all()

    def _scored(self, contributions: list[Contribution]) -> list[Contribution]:
        """`contributions` less those the scorer excludes (each logged); all of them without one."""
        if self.scorer is None or not contributions:
            return contributions
        ordered = sorted(contributions, key=lambda c: c.peer_id)
        excluded = self.scorer(len(ordered), lambda i: {k: decode(p) for k, p in ordered[i].payloads.items()})
        for i, why in excluded.items():
            logger.warning("%s left out of the round by the scorer: %s", ordered[i].peer_id, why)
        return [c for i, c in enumerate(ordered) if i not in excluded]


def _work_cap(bounds: Collection[ClaimBounds]) -> float | None:
    """The reference work the screening caps claims at: the smallest any member's bounds give (honest
    members agree on one schedule, so on one bound); None if none bounds the tokens."""
    caps = [cap for b in bounds if (cap := b.reference_tokens) is not None and cap > 0]
    return min(caps) if caps else None


def _member_view(result: GroupResult, peer: str) -> MemberResult:
    sent, received = result.sent_bytes[peer], result.received_bytes[peer]
    return MemberResult(
        averaged=result.averaged,
        reports=result.reports,
        malformed=result.malformed,
        members=result.members,
        owners=result.owners,
        sent_bytes=result.sent_bytes,
        received_bytes=result.received_bytes,
        rejected=result.rejected,
        work=result.work,
        peer_id=peer,
        # In process nothing is framed: the wire carries exactly the payloads.
        traffic=Traffic(payload_sent=sent, payload_received=received, wire_sent=sent, wire_received=received),
    )


class MemoryAverager:
    """An `Averager` for threads of one process (simulator, tests): members meet in a `MemoryHub`."""

    def __init__(self, hub: MemoryHub, peer_id: str, *, prefix: str = "") -> None:
        self._hub = hub
        self._peer_id = peer_id
        self._prefix = prefix
        self._closed = False

    @property
    def peer_id(self) -> str:
        """The id given at construction."""
        return self._peer_id

    @property
    def matchmaking_s(self) -> float:
        """The hub's window."""
        return self._hub.matchmaking_s

    def average(
        self,
        contribution: Contribution,
        *,
        round: int,
        codec: Codec,
        timeout: float,
        join_only: bool = False,
        join_wait_s: float | None = None,
        bounds: ClaimBounds | None = None,
        patience_s: float = 0.0,
    ) -> MemberResult | None:
        """Join the hub's group for (prefix, `round`); see `MemoryHub.join`."""
        if self._closed:
            raise RuntimeError("average() after shutdown()")
        if contribution.peer_id != self._peer_id:
            raise ValueError(f"contribution of {contribution.peer_id!r} given to averager {self._peer_id!r}")
        return self._hub.join(
            self._prefix,
            round,
            contribution,
            codec,
            timeout=timeout,
            join_only=join_only,
            join_wait_s=join_wait_s,
            bounds=bounds,
            patience_s=patience_s,
        )

    def shutdown(self) -> None:
        """Refuse further rounds (there is nothing to release in process)."""
        self._closed = True

    def __enter__(self) -> MemoryAverager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
