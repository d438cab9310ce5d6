"""Pseudo-gradient averaging over hivemind's P2P: our all-reduce, hivemind's DHT for matchmaking.

`HivemindAverager` implements `averager.Averager` between peers of a hivemind DHT. Everything is
namespaced by `prefix` (run id + model/run fingerprint): the DHT key and the stream handler name, so
peers of another run or model never mix, even on one DHT.

**Matchmaking** (no leader, bounded). `average(round=r)` stores a readiness record under the DHT key
f"{prefix}.round{r}", subkey = this peer id, value = (registration time, peer id) in DHT time,
expiring after `record_ttl_s`. It reads the key back: the round closes at T = (earliest registration
seen) + `window_s`; a peer registered after T is late and gets None at once. At T + `grace_s` the
peer reads the key again and takes as the group the peers registered at a time <= T (T recomputed
from this read), sorted by peer id; group_id = hash(prefix, r, members, tensor layout). Peers whose
reads agree compute the same group without talking; clocks are assumed synchronized to well
within `grace_s` (hivemind's DHT time is the wall clock).

**Exchange** (`reduce_group` semantics, `protocol/allreduce.py`). Each tensor has one owner
(`assign_parts` over the sender's payload sizes, members in peer-id order). Every member opens one
stream to each other owner and sends its payloads of that owner's parts, weight and tokens; the owner
of the first tensor also receives everyone's metadata. An owner collects contributions until all
members have sent or `part_timeout_s` has passed since it formed the group, reduces each part once
(Σ weight·Δ / Σ tokens via `parts.reduce_part`, after screening out non-finite and outlier
payloads, `outlier_factor`), encodes it once with its codec, and answers every member that
contributed in time with the same bytes plus the sorted list of contributors it included, how many
of each one's parts it rejected (and, for the metadata owner, their metadata). A rejected part does
not remove its sender from the contributors, so members still agree on them. The owner's own parts
never touch the wire.

**Failure rule.** Invariant: every member that returns a result returns bit-identical `averaged`
bytes, identical `members` and `gathered`. A member returns a result only if it received every
part, all parts name the same contributor set, and that set contains itself; otherwise None.
Owners reject requests whose group_id differs from theirs (different view of the group, different
layout), from non-members, with the wrong parts, or whose payloads do not decode to the owner's
shapes; a rejected member returns None. Members that return results therefore share one group_id
and hold the bytes each owner sent to all. Consequences, all accepted for now:
- a member that dies or stalls before sending is dropped after `part_timeout_s` and the others
  complete without it, provided it owned no part;
- an owner that dies takes its parts with it: everyone returns None for that round (consistent);
- a member that reaches some owners in time and others not makes the contributor sets differ:
  everyone returns None;
- a member can return None while the others apply a round that includes its Δ (e.g. its own
  `timeout` fired, or one owner's answer got lost on its way to it); None is therefore "not applied
  here", never "not applied anywhere", and the caller must re-check θ against the group's;
- two disjoint groups can both complete if the DHT views partition (each is internally
  consistent); the θ hash every peer publishes for r+1 reveals it.

**Wire format** (one stream per member → owner pair, one request and one response)::

    frame    = u32 big-endian header length | header (MSGPack map) | body (payloads back to back)
    request  = v, r round, g group id, p sender, w weight, t tokens, k part keys, n part lengths,
               m MSGPack metadata (only to the owner of the first tensor, else nil)
    response = v, ok, e error text (when not ok), c contributors (sorted), k, n,
               gm contributors' MSGPack metadata (only from the owner of the first tensor),
               x {contributor: number of its parts rejected} (absent from older owners: none)

`MemberResult.traffic` counts payload bytes and every byte written to / read from these streams;
libp2p's own framing and encryption below the stream are not counted.

Threads: all asyncio work runs on one event loop thread owned by the averager (hivemind's P2P is
asyncio); reductions run on a one-thread executor; `average` blocks the calling thread. The
averager attaches its own P2P replica to the DHT's p2pd and never owns a p2pd process: shutting
the DHT down stops p2pd.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import math
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from ..algorithms.allreduce import Contribution
from ..algorithms.codecs import Codec, decode
from ..algorithms.parts import DEFAULT_OUTLIER_FACTOR, assign_parts, check_outlier_factor, reduce_part
from .averager import MemberResult
from .wire import (
    PROTOCOL_VERSION,
    Meter,
    daemon_listen_maddr,
    read_frame,
    write_frame,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


# --- group formation (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """The members of one round as this peer sees them; peers with equal group_id agree on all of it."""

    round: int
    members: tuple[str, ...]
    group_id: bytes


def close_and_members(records: Mapping[str, float], window_s: float) -> tuple[float, tuple[str, ...]]:
    """Close time T = earliest registration + window, and the peers registered at or before T, sorted."""
    if not records:
        raise ValueError("no registrations")
    close = min(records.values()) + window_s
    return close, tuple(sorted(peer for peer, t in records.items() if t <= close))


def layout_of(payloads: Mapping[str, bytes]) -> bytes:
    """Digest of the tensor names, their order and payload sizes: part ownership depends on them."""
    spec = [[key, len(payload)] for key, payload in payloads.items()]
    return hashlib.sha256(MSGPackSerializer.dumps(spec)).digest()[:16]


def group_id_of(prefix: str, round: int, members: Sequence[str], layout: bytes) -> bytes:
    """Identifier of a group: equal on two peers iff they agree on run, round, members and layout."""
    return hashlib.sha256(MSGPackSerializer.dumps([prefix, round, list(members), layout])).digest()[:16]


def _parse_records(value: Any) -> dict[str, float]:
    """Registration time per peer from a DHT dictionary value; malformed entries are ignored."""
    records: dict[str, float] = {}
    if not isinstance(value, dict):
        return records
    for subkey, item in value.items():
        record = getattr(item, "value", None)
        if (
            isinstance(subkey, str)
            and isinstance(record, (list, tuple))
            and len(record) == 2
            and isinstance(record[0], (int, float))
            and math.isfinite(record[0])
            and record[1] == subkey
        ):
            records[subkey] = float(record[0])
    return records


# --- framing -------------------------------------------------------------------------------------


def _str_list(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {type(value).__name__}")
    return value


def _is_bytes_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, bytes) for v in value)


def _parse_rejected(value: Any, contributors: Sequence[str], num_parts: int) -> dict[str, int] | None:
    """An owner's "x" field: rejected parts per contributor, or None if it is malformed.

    Absent (an owner from before screening) means none. Every key must be a contributor and every
    count in 1..num_parts (the owner cannot reject more parts than it owns).
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        return None
    for peer, count in value.items():
        if peer not in contributors or type(count) is not int or not 1 <= count <= num_parts:
            return None
    return dict(value)


@dataclass(frozen=True)
class _Request:
    round: int
    group_id: bytes
    peer: str
    weight: float
    tokens: float
    payloads: dict[str, bytes]
    metadata: bytes | None

    @classmethod
    def parse(cls, header: dict[str, Any], body: list[bytes]) -> _Request:
        keys = _str_list(header.get("k"))
        fields = (header.get("r"), header.get("g"), header.get("p"), header.get("w"), header.get("t"))
        round, group_id, peer, weight, tokens = fields
        metadata = header.get("m")
        if not (
            isinstance(round, int)
            and isinstance(group_id, bytes)
            and isinstance(peer, str)
            and isinstance(weight, (int, float))
            and isinstance(tokens, (int, float))
            and (metadata is None or isinstance(metadata, bytes))
            and len(keys) == len(body)
        ):
            raise ValueError("malformed request header")
        return cls(
            round, group_id, peer, float(weight), float(tokens), dict(zip(keys, body, strict=True)), metadata
        )


# --- the owner's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Incoming:
    """One member's contribution to the parts of one owner."""

    weight: float
    tokens: float
    payloads: dict[str, bytes]
    metadata: bytes | None


@dataclass(frozen=True)
class _Reduced:
    """An owner's answer: the contributors it included, its averaged parts, their metadata.

    `rejected`: contributor -> how many of its parts this owner screened out (none: absent).
    """

    contributors: tuple[str, ...]
    payloads: dict[str, bytes]
    metadata: tuple[bytes, ...] | None
    rejected: dict[str, int] = field(default_factory=dict)


_DROPPED = _Incoming(0.0, 0.0, {}, None)


class _RoundFailed(Exception):
    """This member cannot return a result for the round (the reason is logged)."""


def _reduce_parts(
    keys: Sequence[str],
    contributions: Mapping[str, _Incoming],
    codec: Codec,
    outlier_factor: float | None,
) -> tuple[_Reduced, list[tuple[str, str, str]]]:
    """`reduce_group`'s arithmetic for the owned parts over the contributors that arrived.

    Also returns (part, peer, reason) for every payload the screening rejected, for the owner's log.
    """
    contributors = tuple(sorted(contributions))
    entries = [contributions[peer] for peer in contributors]
    weights = [e.weight for e in entries]
    tokens = [e.tokens for e in entries]
    payloads: dict[str, bytes] = {}
    rejections: list[tuple[str, str, str]] = []
    for key in keys:
        part = reduce_part(
            [e.payloads[key] for e in entries],
            weights,
            codec,
            key,
            tokens=tokens,
            outlier_factor=outlier_factor,
        )
        payloads[key] = part.payload
        rejections += [(key, contributors[i], reason) for i, reason in part.rejected.items()]
    rejected: dict[str, int] = {}
    for _, peer, _ in rejections:
        rejected[peer] = rejected.get(peer, 0) + 1
    metadata = tuple(e.metadata or b"" for e in entries)
    return _Reduced(contributors, payloads, metadata, dict(sorted(rejected.items()))), rejections


def _shape_error(payloads: Mapping[str, bytes], shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why these payloads cannot be averaged with the owner's (None if they can)."""
    for key, payload in payloads.items():
        try:
            shape = tuple(decode(payload).shape)
        except ValueError as e:
            return f"{key}: {e}"
        if shape != shapes[key]:
            return f"{key}: shape {shape} instead of {shapes[key]}"
    return None


class _OwnerSession:
    """The parts this peer owns in one group: collect contributions, reduce once, answer everyone."""

    def __init__(
        self,
        *,
        group: Group,
        keys: list[str],
        shapes: dict[str, tuple[int, ...]],
        codec: Codec,
        outlier_factor: float | None,
        with_metadata: bool,
        deadline: float,
    ) -> None:
        self.group = group
        self.keys = keys
        self.shapes = shapes
        self.codec = codec
        self.outlier_factor = outlier_factor
        self.with_metadata = with_metadata
        self.deadline = deadline
        self.contributions: dict[str, _Incoming] = {}
        self.closed = False
        self.result: _Reduced | None = None
        self.done = asyncio.Event()
        self.idle = asyncio.Event()  # done, and every admitted member has been answered
        self._all_in = asyncio.Event()
        self._answering = 0

    def admit(self, peer: str, incoming: _Incoming) -> bool:
        """Take a contribution; False once the session has closed or for a second one from `peer`."""
        if self.closed or peer in self.contributions:
            return False
        self.contributions[peer] = incoming
        self._answering += 1
        if len(self.contributions) == len(self.group.members):
            self._all_in.set()
        return True

    def answered(self) -> None:
        self._answering -= 1
        self._update_idle()

    async def run(self, executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._all_in.wait(), timeout=max(0.0, self.deadline - loop.time()))
        except asyncio.TimeoutError:
            missing = sorted(set(self.group.members) - set(self.contributions))
            logger.info("round %d: owner reduces without %s (part timeout)", self.group.round, missing)
        self.closed = True
        try:
            contributions = dict(self.contributions)
            self.result, rejections = await loop.run_in_executor(
                executor, _reduce_parts, self.keys, contributions, self.codec, self.outlier_factor
            )
            for key, peer, reason in rejections:
                logger.warning(
                    "round %d: rejected part %r of %s: %s", self.group.round, key, peer[-8:], reason
                )
        except ValueError as e:
            logger.warning("round %d: reduction failed: %s", self.group.round, e)
        finally:
            self.contributions = {peer: _DROPPED for peer in self.contributions}  # free the payloads
            self.done.set()
            self._update_idle()

    def _update_idle(self) -> None:
        if self.done.is_set() and self._answering <= 0:
            self.idle.set()
            self.result = None  # everyone who needed it holds it; the round state outlives it


@dataclass
class _RoundState:
    """This peer's part in one round, shared by its own `average` call and the stream handler."""

    group: Group
    session: _OwnerSession | None
    meter: Meter = field(default_factory=Meter)


# --- the averager --------------------------------------------------------------------------------


class HivemindAverager:
    """An `Averager` between peers of a hivemind DHT; see the module docstring for the protocol.

    Knobs:
    - `window_s`: how long a round stays open after its first registration. Raise it when peers that
      finish their local phase together keep missing each other's groups; lower it to cut idle time.
    - `grace_s`: wait after the close before reading the group, so late-propagating registrations
      are seen. Must exceed DHT store latency plus clock skew; symptom of too small: rounds where
      members return None with "group mismatch".
    - `part_timeout_s`: how long an owner waits for members' parts after forming the group before it
      reduces without the missing ones. Must exceed the slowest member's upload of its parts.
    - `reduce_timeout_s`: how much longer a member waits for the owners' answers (the reduction
      itself and the download of the averaged parts).
    - `record_ttl_s`: lifetime of readiness records; a call for a round older than this opens a
      new group instead of being late.
    - `outlier_factor`: this peer, as an owner, rejects a member's part whose L2 norm exceeds this
      many times the part's median norm (3+ finite payloads; `parts.DEFAULT_OUTLIER_FACTOR`); 0 or
      None turns the test off, non-finite parts are rejected regardless. Symptom of too low: honest
      peers named in "rejected part" warnings every round; of too high: loss spikes after rounds.
    - `on_stage`: fault-injection hook, called on the event-loop thread as on_stage(stage, round) at
      "registered" (record stored) and "grouped" (group read); tests block or kill the peer there.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        prefix: str,
        window_s: float = 3.0,
        grace_s: float = 0.5,
        part_timeout_s: float = 10.0,
        reduce_timeout_s: float = 5.0,
        record_ttl_s: float = 120.0,
        outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
        on_stage: Callable[[str, int], None] | None = None,
    ) -> None:
        if not prefix:
            raise ValueError("prefix must name the run and model (e.g. run id + fingerprint)")
        if min(window_s, grace_s, part_timeout_s, reduce_timeout_s) < 0:
            raise ValueError("window_s, grace_s, part_timeout_s and reduce_timeout_s must be >= 0")
        if record_ttl_s <= window_s + grace_s + part_timeout_s + reduce_timeout_s:
            raise ValueError("record_ttl_s must outlast a whole round (window + grace + timeouts)")
        self.dht = dht
        self.prefix = prefix
        self.window_s = window_s
        self.grace_s = grace_s
        self.part_timeout_s = part_timeout_s
        self.reduce_timeout_s = reduce_timeout_s
        self.record_ttl_s = record_ttl_s
        self.outlier_factor = check_outlier_factor(outlier_factor)
        self._on_stage = on_stage
        digest = hashlib.sha256(prefix.encode()).hexdigest()[:24]
        self._handler_name = f"adloco.allreduce.v{PROTOCOL_VERSION}.{digest}"
        self._rounds: dict[int, tuple[float, asyncio.Future[_RoundState | None]]] = {}
        self._joined: set[int] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adloco-reduce")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="adloco-averager", daemon=True)
        self._thread.start()
        try:
            maddr = dht.run_coroutine(daemon_listen_maddr)
            self._p2p: P2P = self._call(P2P.replicate(maddr), timeout=30)
            self._peer_id: str = str(self._p2p.peer_id.to_base58())
            self._call(self._p2p.add_binary_stream_handler(self._handler_name, self._serve), timeout=30)
        except BaseException:
            self._stop_loop()
            raise

    @property
    def peer_id(self) -> str:
        """This peer's libp2p id (base58), the id contributions must carry."""
        return self._peer_id

    def average(
        self, contribution: Contribution, *, round: int, codec: Codec, timeout: float, join_only: bool = False
    ) -> MemberResult | None:
        """Register for `round`, form the group, exchange parts; see the module docstring.

        Raises ValueError for a contribution of another peer, with no tensors, or with metadata that
        MSGPack cannot carry, and for a second call with the same round; RuntimeError after shutdown.
        """
        if self._closed:
            raise RuntimeError("average() after shutdown()")
        if threading.current_thread() is self._thread:
            raise RuntimeError("average() blocks: call it from another thread than the averager's loop")
        if contribution.peer_id != self._peer_id:
            raise ValueError(f"contribution of {contribution.peer_id!r} given to averager {self._peer_id!r}")
        if not contribution.payloads:
            raise ValueError("a contribution needs at least one tensor")
        try:
            metadata = MSGPackSerializer.dumps(dict(contribution.metadata))
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata cannot be sent: {e}") from e
        coro = self._average(contribution, metadata, round, codec, timeout, join_only)
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # The coroutine bounds itself by `timeout`; the margin only guards against a stuck loop.
            return future.result(timeout=timeout + 5.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return None
        except concurrent.futures.CancelledError:  # shutdown() cancelled the round
            return None

    def shutdown(self) -> None:
        """Remove the stream handler, drop this averager's P2P replica and stop its loop thread.

        The DHT (and its p2pd) stays up: whoever created it shuts it down.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._close(), timeout=10)
        except Exception as e:  # the DHT may already be gone; nothing else to release then
            logger.debug("averager shutdown: %r", e)
        finally:
            self._stop_loop()

    def __enter__(self) -> HivemindAverager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- plumbing --------------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T], *, timeout: float) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _close(self) -> None:
        try:
            await asyncio.wait_for(self._p2p.remove_binary_stream_handler(self._handler_name), timeout=5)
        except Exception as e:  # p2pd already gone with its DHT: there is no handler left to remove
            logger.debug("removing the averaging handler: %r", e)
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)
        await self._p2p.shutdown()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _stage(self, stage: str, round: int) -> None:
        if self._on_stage is not None:
            self._on_stage(stage, round)

    def _log(self, round: int, message: str, *args: object, level: int = logging.INFO) -> None:
        logger.log(level, f"[{self._peer_id[-8:]} round={round}] {message}", *args)

    def _round_future(self, round: int) -> asyncio.Future[_RoundState | None]:
        """The future that resolves to this peer's state for `round` once its group is known."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for old in [r for r, (t, _) in self._rounds.items() if now - t > self.record_ttl_s]:
            _, stale = self._rounds.pop(old)
            if not stale.done():
                stale.set_result(None)
        if round not in self._rounds:
            self._rounds[round] = (now, loop.create_future())
        return self._rounds[round][1]

    # ---- one round, member side ------------------------------------------------------------------

    async def _average(
        self,
        contribution: Contribution,
        metadata: bytes,
        round: int,
        codec: Codec,
        timeout: float,
        join_only: bool = False,
    ) -> MemberResult | None:
        if round in self._joined:
            raise ValueError(f"round {round} was already averaged by this peer; rounds are single-use")
        self._joined.add(round)
        ready = self._round_future(round)
        try:
            return await asyncio.wait_for(
                self._run_round(contribution, metadata, round, codec, ready, join_only), timeout
            )
        except asyncio.TimeoutError:
            self._log(round, "gave up after the caller's timeout of %.1f s", timeout, level=logging.WARNING)
            return None
        except _RoundFailed as e:
            self._log(round, "no result: %s", e, level=logging.WARNING)
            return None
        finally:
            if not ready.done():
                ready.set_result(None)

    async def _run_round(
        self,
        contribution: Contribution,
        metadata: bytes,
        round: int,
        codec: Codec,
        ready: asyncio.Future[_RoundState | None],
        join_only: bool = False,
    ) -> MemberResult | None:
        layout = layout_of(contribution.payloads)
        group = await self._matchmake(round, layout, join_only=join_only)
        if group is None:
            return None
        self._stage("grouped", round)
        keys = list(contribution.payloads)
        owner_index = assign_parts([len(contribution.payloads[k]) for k in keys], len(group.members))
        owners = {k: group.members[i] for k, i in zip(keys, owner_index, strict=True)}
        state = _RoundState(group, await self._open_session(group, contribution, metadata, owners, codec))
        ready.set_result(state)
        self._log(
            round,
            "group of %d, owning %d of %d parts",
            len(group.members),
            len(state.session.keys) if state.session else 0,
            len(keys),
        )
        try:
            answers = await self._collect(state, contribution, metadata, owners)
        finally:
            if state.session is not None:
                state.session.answered()
        return await self._assemble(state, keys, owners, answers)

    async def _matchmake(self, round: int, layout: bytes, *, join_only: bool = False) -> Group | None:
        key = f"{self.prefix}.round{round}"
        if join_only:
            await self._await_opened(key)
        registered = get_dht_time()
        try:
            stored = await self.dht.store(
                key,
                (registered, self._peer_id),
                expiration_time=registered + self.record_ttl_s,
                subkey=self._peer_id,
                return_future=True,
            )
        except Exception as e:  # the DHT process failed the call; this round cannot be joined
            raise _RoundFailed(f"storing the readiness record failed: {e!r}") from e
        if not stored:
            # hivemind returns the answer of the last replica to reply, and a replica refuses a record
            # it already holds with the same expiration; we saw False in ~1 of 20 test rounds with the
            # record stored. So False does not mean "not stored": the reads below decide, and a record
            # that nobody sees only makes the group ids differ (a safe failure).
            self._log(round, "the DHT reported the readiness record as not stored", level=logging.DEBUG)
        self._stage("registered", round)
        records = await self._registrations(key, registered)
        close, _ = close_and_members(records, self.window_s)
        if registered > close:
            self._log(round, "late: the round closed %.2f s before this peer registered", registered - close)
            return None
        await asyncio.sleep(max(0.0, close + self.grace_s - get_dht_time()))
        _, members = close_and_members(await self._registrations(key, registered), self.window_s)
        if self._peer_id not in members:
            self._log(round, "late: an earlier registration closed the round before this peer's")
            return None
        return Group(round, members, group_id_of(self.prefix, round, members, layout))

    async def _await_opened(self, key: str) -> None:
        """Poll until another peer has registered for the round (bounded by the caller's timeout)."""
        while True:
            try:
                found = await self.dht.get(key, latest=True, return_future=True)
            except Exception as e:
                raise _RoundFailed(f"reading the registrations failed: {e!r}") from e
            records = _parse_records(None if found is None else found.value)
            records.pop(self._peer_id, None)
            if records:
                return
            # Poll fast: the joiner must register within the window that this registration opened.
            await asyncio.sleep(0.05)

    async def _registrations(self, key: str, registered: float) -> dict[str, float]:
        try:
            found = await self.dht.get(key, latest=True, return_future=True)
        except Exception as e:
            raise _RoundFailed(f"reading the registrations failed: {e!r}") from e
        records = _parse_records(None if found is None else found.value)
        # Our own record may not be visible yet; we know it exists.
        records.setdefault(self._peer_id, registered)
        return records

    async def _open_session(
        self,
        group: Group,
        contribution: Contribution,
        metadata: bytes,
        owners: Mapping[str, str],
        codec: Codec,
    ) -> _OwnerSession | None:
        keys = [k for k, owner in owners.items() if owner == self._peer_id]
        if not keys:
            return None
        own = {k: bytes(contribution.payloads[k]) for k in keys}
        loop = asyncio.get_running_loop()
        shapes = await loop.run_in_executor(
            self._executor, lambda: {k: tuple(decode(p).shape) for k, p in own.items()}
        )
        session = _OwnerSession(
            group=group,
            keys=keys,
            shapes=shapes,
            codec=codec,
            outlier_factor=self.outlier_factor,
            with_metadata=next(iter(owners.values())) == self._peer_id,
            deadline=loop.time() + self.part_timeout_s,
        )
        # Our own slot is released by _run_round once it has taken the result (not on the wire).
        session.admit(self._peer_id, _Incoming(contribution.weight, contribution.tokens, own, metadata))
        self._spawn(session.run(self._executor))
        return session

    async def _collect(
        self, state: _RoundState, contribution: Contribution, metadata: bytes, owners: Mapping[str, str]
    ) -> dict[str, _Reduced]:
        """Every owner's answer for its parts (our own session's included); _RoundFailed otherwise."""
        by_owner: dict[str, list[str]] = {}
        for key, owner in owners.items():
            by_owner.setdefault(owner, []).append(key)
        metadata_owner = next(iter(owners.values()))
        fetches = {
            owner: self._spawn(
                self._fetch(state, owner, keys, contribution, metadata if owner == metadata_owner else None)
            )
            for owner, keys in by_owner.items()
            if owner != self._peer_id
        }
        waits: list[asyncio.Future[Any]] = list(fetches.values())
        if state.session is not None:
            waits.append(self._spawn(state.session.done.wait()))
        budget = self.part_timeout_s + self.reduce_timeout_s
        done, pending = await asyncio.wait(waits, timeout=budget, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        failed = [t for t in done if t.exception() is not None]
        if failed:
            raise _RoundFailed(str(failed[0].exception()))
        if pending:
            raise _RoundFailed(f"no answer from {len(pending)} owner(s) within {budget:.1f} s")
        answers = {owner: task.result() for owner, task in fetches.items()}
        if state.session is not None:
            if state.session.result is None:
                raise _RoundFailed("our own reduction failed")
            answers[self._peer_id] = state.session.result
        return answers

    async def _fetch(
        self,
        state: _RoundState,
        owner: str,
        keys: list[str],
        contribution: Contribution,
        metadata: bytes | None,
    ) -> _Reduced:
        header = {
            "v": PROTOCOL_VERSION,
            "r": state.group.round,
            "g": state.group.group_id,
            "p": self._peer_id,
            "w": float(contribution.weight),
            "t": float(contribution.tokens),
            "k": keys,
            "m": metadata,
        }
        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(
                PeerID.from_base58(owner), self._handler_name
            )
        except Exception as e:
            raise _RoundFailed(f"cannot reach owner {owner[-8:]}: {e}") from e
        try:
            await write_frame(writer, header, [contribution.payloads[k] for k in keys], state.meter)
            response, body = await read_frame(reader, state.meter)
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as e:
            raise _RoundFailed(f"exchange with owner {owner[-8:]} broke: {e!r}") from e
        finally:
            writer.close()
        if not response.get("ok"):
            raise _RoundFailed(f"owner {owner[-8:]} refused: {response.get('e')}")
        gathered = response.get("gm")
        if (
            _str_list(response.get("k")) != keys
            or len(body) != len(keys)
            or (metadata is not None and not _is_bytes_list(gathered))
        ):
            raise _RoundFailed(f"owner {owner[-8:]} answered with the wrong parts")
        contributors = tuple(_str_list(response.get("c")))
        rejected = _parse_rejected(response.get("x"), contributors, len(keys))
        if rejected is None:
            raise _RoundFailed(f"owner {owner[-8:]} answered with a malformed list of rejected parts")
        gathered_metadata = tuple(gathered) if metadata is not None and gathered is not None else None
        return _Reduced(contributors, dict(zip(keys, body, strict=True)), gathered_metadata, rejected)

    async def _assemble(
        self, state: _RoundState, keys: list[str], owners: Mapping[str, str], answers: Mapping[str, _Reduced]
    ) -> MemberResult:
        contributor_sets = {answer.contributors for answer in answers.values()}
        if len(contributor_sets) != 1:
            raise _RoundFailed(f"owners included different contributors: {sorted(contributor_sets)}")
        (contributors,) = contributor_sets
        if self._peer_id not in contributors:
            raise _RoundFailed("our contribution was not included")
        if not set(contributors) <= set(state.group.members):
            raise _RoundFailed("an owner included peers outside the group")
        metadata = answers[owners[keys[0]]].metadata
        if metadata is None or len(metadata) != len(contributors):
            raise _RoundFailed("metadata missing or incomplete")
        try:
            gathered = tuple(MSGPackSerializer.loads(m) for m in metadata)
        except Exception as e:  # malformed bytes from a remote peer
            raise _RoundFailed(f"unreadable metadata: {e!r}") from e
        if state.session is not None:
            # Wait until our answers to the other members are written, so the byte counts are final.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.session.idle.wait(), timeout=self.reduce_timeout_s)
        traffic = state.meter.traffic()
        rejected: dict[str, int] = {}
        for answer in answers.values():
            for peer, count in answer.rejected.items():
                rejected[peer] = rejected.get(peer, 0) + count
        self._log(
            state.group.round,
            "averaged with %d members, %d wire bytes out, %d in, %d parts rejected",
            len(contributors),
            traffic.wire_sent,
            traffic.wire_received,
            sum(rejected.values()),
        )
        return MemberResult(
            averaged={k: answers[owners[k]].payloads[k] for k in keys},
            gathered=gathered,
            members=contributors,
            owners=dict(owners),
            sent_bytes={self._peer_id: traffic.wire_sent},
            received_bytes={self._peer_id: traffic.wire_received},
            rejected=dict(sorted(rejected.items())),
            peer_id=self._peer_id,
            traffic=traffic,
        )

    # ---- one round, owner side -------------------------------------------------------------------

    async def _serve(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Stream handler: take one member's parts, answer with the averaged parts (or a refusal)."""
        meter = Meter()
        state: _RoundState | None = None
        admitted: _OwnerSession | None = None
        try:
            header, body = await asyncio.wait_for(read_frame(reader, meter), timeout=self.part_timeout_s)
            request = _Request.parse(header, body)
            ready = self._round_future(request.round)
            wait_s = self.window_s + self.grace_s + self.part_timeout_s
            state = await asyncio.wait_for(asyncio.shield(ready), timeout=wait_s)
            refusal = await self._refusal(state, request)
            if refusal is None and state is not None and state.session is not None:
                incoming = _Incoming(request.weight, request.tokens, request.payloads, request.metadata)
                if state.session.admit(request.peer, incoming):
                    admitted = state.session
                else:
                    refusal = "the owner has already reduced (too late) or got this member twice"
            if admitted is None:
                self._log(request.round, "refused %s: %s", request.peer[-8:], refusal, level=logging.DEBUG)
                await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": False, "e": refusal}, [], meter)
                return
            await admitted.done.wait()
            await self._answer(writer, admitted, meter)
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
            logger.debug("averaging stream dropped: %r", e)
        finally:
            writer.close()
            if state is not None:
                state.meter.add(meter)
            if admitted is not None:
                admitted.answered()

    async def _refusal(self, state: _RoundState | None, request: _Request) -> str | None:
        """Why this request cannot join our reduction (None if it can)."""
        if state is None:
            return "the owner is not in a group for this round"
        session = state.session
        if request.group_id != state.group.group_id:
            return "group mismatch (different view of the members, or a different tensor layout)"
        if request.peer not in state.group.members or request.peer == self._peer_id:
            return "not a member of the group"
        if session is None or list(request.payloads) != session.keys:
            return "these are not the parts this peer owns"
        if session.with_metadata and request.metadata is None:
            return "metadata missing"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _shape_error, request.payloads, session.shapes)

    async def _answer(self, writer: asyncio.StreamWriter, session: _OwnerSession, meter: Meter) -> None:
        result = session.result
        if result is None:
            header: dict[str, Any] = {"v": PROTOCOL_VERSION, "ok": False, "e": "the owner's reduction failed"}
            await write_frame(writer, header, [], meter)
            return
        header = {
            "v": PROTOCOL_VERSION,
            "ok": True,
            "c": list(result.contributors),
            "k": session.keys,
            "gm": list(result.metadata) if session.with_metadata and result.metadata else None,
            "x": result.rejected,
        }
        await write_frame(writer, header, [result.payloads[k] for k in session.keys], meter)
