"""Staying in step with the swarm: publish where this node is, find where the swarm is, catch up.

After every applied round a node offers its state (`offers.py`: a manifest of per-chunk hashes) and
publishes a signed state record (round, θ hash, schedule, the manifest's hash and size) and a beacon
(progress, for the bootstrap's metrics). Before contributing it reads everyone's records. A node
that has averaged lately believes only the peers whose work it took (`vouch`: they averaged with it
and their contribution counted, `trust.earners`; the last `VOUCH_ROUNDS` rounds): the head is the
latest round whose θ hash more than half of them hold (of those at this node's round or later), and
before acting on it that many of its donors must serve its manifest themselves. A node that has
averaged with nobody (a fresh joiner), or whose vouched peers have all gone, weighs only the peers
that are live: it asks each record's writer (at most `PROBE_PEERS`, its anchors first and the others
drawn at random), over the writer's own libp2p identity, whether it stands by the state its record
names (one of its last few published rounds; nothing is frozen or read for that). Of those that do,
the voters are the node's anchors (`--trust-peers`, by default the ids in its `--peers`) and the
peers their records list as workers when an anchor is live, else the writers that worked together
(`trust.core` of the work lists the records carry), else all of them: the head is the highest round
more than half of the voters have reached, at the θ hash most of the voters at that round hold
(`live_head`). Records are bound to their writer's key (`transport.identity`), so a record speaks
for one peer, a made-up peer that answers nothing does not vote, and keys nobody that worked lists
count for nothing: taking over a joiner with no live anchor needs more live keys that list one
another than the peers that worked together (a private run admits only credentialed peers). The
donors are the holders of the head's hash who published the most common manifest. A node behind the
head catches up with the simulator's own code (`training.catchup`: replay the averaged updates a
holder keeps, else download the state), checked against that published hash; the download takes
chunks from several donors at once, each checked against the manifest, and an unfinished download is
resumed rather than restarted. A node at the head with another θ than a strict majority of the
others (it averaged a round apart from them) downloads the majority's state: the fork heals toward
it.

A node that has averaged only alone since it last had company (its link was down, say) weighs the
live peers as a joiner does, even with vouched peers left, and dials its initial peers again every
few seconds (`NodeDHT.rejoin`: a DHT cut off long enough has forgotten every other peer, and hivemind
does not retry by itself). Ahead of the live peers' head, it takes their state when its own θ at the
head's round was another (its rounds alone are another lineage, which a swarm of more peers
outweighs); a peer merely behind it on its own lineage catches up to it instead.

Over 500 lines, one idea: where the swarm is (its head, from vouched and live records) and how a
node gets there (catch-up, downloads, fork healing), which `SwarmSync` decides from that head alone.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from ...protocol.algorithms.codecs import make_codec
from ...protocol.algorithms.schedule import Schedule
from ...protocol.algorithms.trust import MAX_WORKERS, core, earners
from ...protocol.transport.manifest import ChunkedState
from ...protocol.transport.records import BeaconRecord, RunRecords, StateRecord, dht_time
from ...protocol.transport.state_transfer import (
    DownloadReport,
    IncompleteDownload,
    StateServer,
    UpdateRecord,
)
from ..operations.metrics import NodeMetrics
from ..training.catchup import catch_up
from ..training.config import TrainConfig
from ..training.peer import Peer
from ..training.replica import HISTORY_ROUNDS, PeerState, Update
from ..training.runtime import give_back_free_memory
from .offers import StateOffers, state_layout
from .ops import NodeOps

logger = logging.getLogger(__name__)

VOUCH_ROUNDS = 8  # rounds a peer this node averaged with keeps vouching for the swarm's head
REJOIN_EVERY_S = 5.0  # how often a node averaging alone dials its initial peers again
OWN_HASHES_KEPT = 64  # rounds whose θ hash a node remembers (to tell a laggard from another lineage)
PROBE_PEERS = 32  # the most record writers a fresh joiner asks whether they stand by their record
SYNC_PASSES = 3  # a download that lands behind the head is followed by a replay in the same sync
SHUN_S = 600.0  # how long a holder whose kept updates missed the head's θ is asked last for them
UPDATE_SLACK_BYTES = 4 << 10  # per tensor: a codec header is tens of bytes; an fp32 payload 4/param


def schedule_refusal(schedule: Schedule, cfg: TrainConfig) -> str | None:
    """Why a schedule another peer hands over (with its state, or with a kept update) is not one this
    run's configuration can reach; None when it can. The batch test only grows b up to the cap, MIT
    only merges slots away, H only shrinks ("constant_tokens"; DyLU is each peer's own) or stays within
    its bounds ("hide_comm"), and the codec
    must be one this node can decode: so a peer cannot make this node train a batch it never could,
    for ever, with a codec it does not know."""
    cap = max(cfg.schedule.batch_cap, cfg.batch_size)
    most_steps = max(cfg.inner_steps, cfg.schedule.min_inner_steps)
    if cfg.schedule.inner_steps_policy == "hide_comm":
        most_steps = max(most_steps, cfg.schedule.max_inner_steps)
    if schedule.instances > cfg.instances:
        return f"{schedule.instances} instance slots, this run starts with {cfg.instances}"
    if max(schedule.batch) > cap:
        return f"batch {max(schedule.batch)} above the cap {cap}"
    if schedule.inner_steps > most_steps:
        return f"{schedule.inner_steps} inner steps, this run's H is at most {most_steps}"
    if schedule.base_samples > most_steps * cfg.instances * cap:
        return f"base samples {schedule.base_samples} beyond H x instances x cap"
    try:
        make_codec(schedule.codec)
    except ValueError as e:
        return f"codec {schedule.codec[:40]!r}: {e}"
    return None


@dataclass(frozen=True)
class DownloadTarget:
    """A published state to download: its manifest (sha256 and size), round, θ hash, and donors."""

    digest: str
    size: int
    round: int
    theta_hash: str
    donors: tuple[str, ...]


@dataclass(frozen=True)
class SwarmHead:
    """The latest round any peer published, the other peers' majority θ hash at it, the others that
    hold that hash, how many others hold each hash there, and the state to download from them."""

    round: int
    theta_hash: str
    holders: list[str]
    hashes: Counter[str]
    target: DownloadTarget | None = None
    # Vouched heads: how many of its donors must serve its manifest themselves before it is acted on.
    quorum: int = 0


class Downloads:
    """This node's state downloads: manifests checked against its own model before any chunk is
    read, and the unfinished download kept, so the next try resumes it."""

    def __init__(self, server: StateServer, peer: Peer) -> None:
        self.server, self.names, self.cfg = server, list(peer.names), peer.cfg
        self.layout = state_layout(peer)
        numel = sum(t.numel() for t in peer.state.theta)
        # The most kept updates a holder may send: HISTORY_ROUNDS rounds, none larger than fp32.
        self.max_update_bytes = HISTORY_ROUNDS * (4 * numel + UPDATE_SLACK_BYTES * len(self.names))
        self.partial: ChunkedState | None = None
        self.partial_target: DownloadTarget | None = None
        self.last: DownloadReport | None = None

    def fetch(self, target: DownloadTarget) -> PeerState:
        """The state `target` names, from its donors in parallel; IncompleteDownload (progress kept)
        or ValueError (a manifest that is not the published one, or not for this model)."""
        state = self._state_for(target)
        try:
            self.last = self.server.download(state, target.donors)
        except IncompleteDownload as e:
            self.last = e.report
            if not e.report.kept:
                self.forget()  # no donor serves it any more: nothing to resume
            raise
        self.forget()
        manifest = state.manifest
        return PeerState(
            theta=[state.tensors[f"theta.{n}"] for n in self.names],
            momentum=[state.tensors[f"momentum.{n}"] for n in self.names],
            round=manifest.round,
            schedule=Schedule.from_dict(manifest.schedule),
        )

    def unfinished(self) -> DownloadTarget | None:
        return self.partial_target

    def forget(self) -> None:
        self.partial = self.partial_target = None

    def _state_for(self, target: DownloadTarget) -> ChunkedState:
        if self.partial is not None and self.partial.digest == target.digest:
            return self.partial
        manifest = self.server.fetch_manifest(target.donors, digest=target.digest, size=target.size)
        manifest.expect_layout(self.layout)
        if (manifest.round, manifest.theta_hash) != (target.round, target.theta_hash):
            raise ValueError("the manifest is of another round or θ than its records say")
        why = schedule_refusal(Schedule.from_dict(manifest.schedule), self.cfg)
        if why is not None:
            raise ValueError(f"the state's schedule is not one this run can reach: {why}")
        self.partial, self.partial_target = ChunkedState(manifest, target.digest), target
        return self.partial


@dataclass
class RemoteSource:
    """Peers holding the swarm's state, as a catch-up source over the network: the kept updates of
    the first holder that answers (`answered`), asked in an order drawn afresh each time (by id, a
    key ground to sort first would be every laggard's first source: one serving poisoned updates
    would send each to a full download), the state in chunks from every donor of `target`.
    `doubted`: holders whose updates missed the head's θ lately, asked only after all the others."""

    server: StateServer
    holders: Sequence[str]
    downloads: Downloads
    target: DownloadTarget | None
    answered: str = ""
    doubted: Collection[str] = ()

    def updates(self, from_round: int) -> Sequence[Update]:
        fresh = [h for h in self.holders if h not in self.doubted]
        doubted = [h for h in self.holders if h in self.doubted]
        for holder in [*random.sample(fresh, len(fresh)), *random.sample(doubted, len(doubted))]:
            try:
                records = self.server.fetch_updates(
                    holder, from_round=from_round, max_bytes=self.downloads.max_update_bytes
                )
            except Exception as e:  # a holder that left or answered badly: ask the next one
                logger.info("kept updates from %s: %s", holder[-6:], e)
                continue
            try:
                updates = [
                    Update(r.round, r.averaged, Schedule.from_dict(r.schedule), r.merge) for r in records
                ]
                why = next(
                    filter(None, (schedule_refusal(u.schedule, self.downloads.cfg) for u in updates)), None
                )
            except ValueError as e:
                why = str(e)
            if why is not None:
                logger.info("kept updates from %s: a schedule this run cannot reach: %s", holder[-6:], why)
                continue
            self.answered = holder
            return updates
        return []

    def state(self) -> PeerState:
        if self.target is None:
            raise ValueError("no published manifest to download")
        return self.downloads.fetch(self.target)


def updates_of(peer: Peer, lock: threading.Lock, from_round: int) -> list[UpdateRecord]:
    """The averaged updates this node keeps from `from_round` on (for a laggard to replay)."""
    with lock:
        return [
            UpdateRecord(u.round, u.averaged, u.schedule.to_dict(), u.merge)
            for u in peer.state.history
            if u.round >= from_round
        ]


def swarm_head(
    records: Sequence[StateRecord], me: str, *, vouched: Collection[str] = (), my_round: int = 0
) -> SwarmHead | None:
    """Where the swarm is, from the state records (None: no records yet); see the module docstring.

    With `vouched` (the peers this node has averaged with lately) only their records count, and
    the head is the latest round whose majority θ hash more than half of them hold, among those
    that published a round >= `my_round` (a peer behind this node does not vote on what lies ahead):
    one peer's record, or a few made-up ones, cannot move this node. None when no round has such a
    majority. Without `vouched`: the latest round any record claims up to one past the round most
    other peers reached, a hint for waiting only.
    """
    known = [r for r in records if r.peer_id in vouched and r.peer_id != me]
    if known:
        voters = {r.peer_id for r in known if r.round >= my_round}
        for top in sorted({r.round for r in known if r.round >= my_round}, reverse=True):
            best, support = _holders(known, top).most_common(1)[0]
            if 2 * support > len(voters):
                return _head_at(known, me, top, best, quorum=len(voters) // 2 + 1)
        return None
    if not records:
        return None
    # The hint: the latest round claimed, but no further than one past the round more than half of
    # the other peers have reached, so one far-ahead record does not end a wait (a forged round
    # 10^6 would have ended every failed try's wait at once, and the next try opened alone: a fork).
    latest = {r.peer_id: r.round for r in records if r.peer_id != me}
    reached = sorted(latest.values(), reverse=True)[len(latest) // 2] if latest else None
    top = max(r.round for r in records if reached is None or r.round <= reached + 1)
    hashes = _holders([r for r in records if r.peer_id != me], top)
    if not hashes:
        return SwarmHead(top, "", [], hashes)
    return _head_at(records, me, top, hashes.most_common(1)[0][0])


def live_head(live: Sequence[StateRecord], me: str, *, anchors: Collection[str] = ()) -> SwarmHead | None:
    """A fresh joiner's head from the records of the peers that stand by what they published (`live`):
    the highest round more than half of the voters have reached, and the θ hash held by more of the
    voters at exactly that round than any other hash (None on a tie, or with no live voter). A claim
    far ahead counts only as having reached the rounds below it: one peer, or a minority, cannot
    move the joiner past where the majority is, nor tie with it and win.

    The voters (`voters`): with `anchors` live (the peers the operator trusts, `--trust-peers`), the
    anchors and the peers their records list as workers; otherwise the writers that worked together
    (`trust.core` of the records' work lists), or all of them while none did."""
    latest = {r.peer_id: r for r in live if r.peer_id != me}
    if not latest:
        return None
    others = [latest[p] for p in sorted(voters(latest, anchors))]
    top = sorted((r.round for r in others), reverse=True)[len(others) // 2]
    ranked = _holders(others, top).most_common(2)
    if len(ranked) == 2 and ranked[0][1] == ranked[1][1]:
        return None
    return _head_at(others, me, top, ranked[0][0])


def voters(latest: Mapping[str, StateRecord], anchors: Collection[str] = ()) -> set[str]:
    """Whose record a fresh joiner counts, among the live writers `latest` (see `live_head`): keys
    that did no work the others took count for nothing once some writers worked together, and an
    anchor's word decides whom else to count. Keys that list one another and outnumber the peers
    that worked together are counted (the limit `trust` states): an anchor is what beats them."""
    trusted = [a for a in anchors if a in latest]
    if trusted:
        named = {w for a in trusted for w in latest[a].workers}
        return set(trusted) | (named & set(latest))
    return core(latest, {p: r.workers for p, r in latest.items()}) or set(latest)


def _holders(records: Sequence[StateRecord], top: int) -> Counter[str]:
    """How many distinct peers published each θ hash at round `top` (a peer named by several
    records counts once per hash)."""
    return Counter(h for _, h in {(r.peer_id, r.theta_hash) for r in records if r.round == top})


def _head_at(records: Sequence[StateRecord], me: str, top: int, best: str, *, quorum: int = 0) -> SwarmHead:
    """The head at round `top` with θ hash `best`: its holders and the state to download from them."""
    hashes = _holders([r for r in records if r.peer_id != me], top)
    agreeing = [r for r in records if r.round == top and r.theta_hash == best and r.peer_id != me]
    holders = sorted({r.peer_id for r in agreeing})
    manifests = Counter((r.manifest_hash, r.manifest_bytes) for r in agreeing)
    (digest, size), _ = manifests.most_common(1)[0]
    donors = tuple(
        sorted({r.peer_id for r in agreeing if (r.manifest_hash, r.manifest_bytes) == (digest, size)})
    )
    target = DownloadTarget(digest, size, top, best, donors)
    return SwarmHead(top, best, holders, hashes, target, quorum)


class SwarmSync:
    """One node's publishing, reading and catching up (see the module docstring)."""

    def __init__(
        self,
        *,
        peer: Peer,
        lock: threading.Lock,
        records: RunRecords,
        server: StateServer,
        offers: StateOffers,
        ops: NodeOps,
        metrics: NodeMetrics,
        rejoin: Callable[[], int] | None = None,
        workers: Callable[[], Sequence[str]] = tuple,
        excluded: Callable[[], Collection[str]] = tuple,
        anchors: Collection[str] = (),
    ) -> None:
        self.peer, self.lock, self.records, self.server = peer, lock, records, server
        # The peers whose work this node took lately (its state records list them), and the peers
        # whose records a fresh joiner believes first (`live_head`).
        self._workers, self.anchors = workers, frozenset(anchors)
        # The peers this node leaves out of its rounds (caught lying or silent, or banned): their
        # state records count for nothing here either (`_states`).
        self._excluded = excluded
        self._rejoin, self._rejoined_at = rejoin, -math.inf
        # Rounds applied alone since this node last averaged with company, and the last round it
        # did; its θ hash per round.
        self.solo_rounds = 0
        self._company_round = -1
        self._own_hashes: dict[int, str] = {}
        self.offers, self.ops, self.metrics = offers, ops, metrics
        self.downloads = Downloads(server, peer)
        # The peers this node averaged with, and the last round it did: what it trusts on where the
        # swarm is (`swarm_head`), for VOUCH_ROUNDS rounds.
        self.vouched: dict[str, int] = {}
        # Holders whose kept updates did not lead to the head's θ, and until when (monotonic time)
        # they are not asked for updates again (`_shun`).
        self._shunned: dict[str, float] = {}
        # The last sync left this node behind the head it read (its catch-up failed: the donors had
        # moved on, say): its contribution is late whatever its own staleness, and joins only.
        self.behind = False
        self._head: SwarmHead | None = None  # the last head `sync` read

    def vouch(self, members: Sequence[str], work: Mapping[str, float]) -> None:
        """The members of the group whose round this node just applied (authenticated: each sent or
        answered parts over its own libp2p identity) whose work counted (`trust.earners`: a key that
        averaged at weight 0, or all of whose parts were left out, earns nothing) vouch for the
        swarm's head from now on. `work` empty (a transport that does not know it): every member."""
        current = self.peer.state.round
        company = [m for m in members if m != self.peer.peer_id]
        self.solo_rounds = 0 if company else self.solo_rounds + 1
        if company:
            self._company_round = current
        counted = set(earners(work)) if work else set(company)
        for member in company:
            if member in counted:
                self.vouched[member] = current
        for member, last in list(self.vouched.items()):
            if current - last > VOUCH_ROUNDS:
                del self.vouched[member]

    def publish(self, *, wait: bool = True) -> None:
        """Offer this round's state and announce it (round, θ hash, schedule, manifest), signed, so
        joiners and laggards know where the swarm is and what to download. `wait=False`: do not
        block on the DHT's answer (between rounds, `RunRecords.publish_state`)."""
        state = self.peer.state
        served = self.offers.publish()
        record = StateRecord(
            peer_id=self.peer.peer_id,
            round=state.round,
            theta_hash=served.manifest.theta_hash,
            schedule=json.dumps(state.schedule.to_dict(), sort_keys=True),
            manifest_hash=served.digest,
            manifest_bytes=len(served.encoded),
            workers=list(self._workers())[:MAX_WORKERS],
        )
        self.records.publish_state(record, wait=wait)
        self._own_hashes[state.round] = record.theta_hash
        self._own_hashes.pop(state.round - OWN_HASHES_KEPT, None)
        counters = self.ops.counters
        beacon = BeaconRecord(
            round=state.round,
            tokens=counters.tokens_total,
            tokens_per_s=float(counters.tokens_per_s),
            updated=dht_time(),
        )
        self.records.publish_beacon(beacon)

    def head(self, *, trusted: bool = True) -> SwarmHead | None:
        """Where the swarm is, from the state records (None: no records yet, or no majority of the
        vouched peers anywhere). `trusted=False`: the latest round any record claims (up to one past
        the round most peers reached), whoever wrote it, a hint for waiting only
        (`RoundLoop._settle`), never for adopting a state."""
        read = self.records.states()
        self.ops.peers_visible = len({r.peer_id for r in read})
        self.metrics.peers.set(self.ops.peers_visible)
        records = self._states(read)
        me, my_round = self.peer.peer_id, self.peer.state.round
        if not trusted:
            return swarm_head(records, me, my_round=my_round)
        if not self.solo_rounds and any(r.peer_id in self.vouched for r in records if r.peer_id != me):
            return swarm_head(records, me, vouched=self.vouched, my_round=my_round)
        # No company lately, or only rounds alone since: weigh the peers that are live now.
        return live_head(self._live(records), me, anchors=self.anchors)

    def _states(self, read: Sequence[StateRecord] | None = None) -> list[StateRecord]:
        """The state records (`read`, or read now), less those of the peers this node leaves out:
        a peer every honest node convicted (evidence travels with the ban) was the only live writer
        left to a node whose partners had ended their run, and the node took its state (stop 53)."""
        out = set(self._excluded())
        return [r for r in (self.records.states() if read is None else read) if r.peer_id not in out]

    def _live(self, records: Sequence[StateRecord]) -> list[StateRecord]:
        """The records (one per peer, at most PROBE_PEERS drawn at random) whose peer answers, now,
        that it published that state (one of its last rounds: its next record may be on its way)."""
        others = [r for r in records if r.peer_id != self.peer.peer_id]
        if len(others) > PROBE_PEERS:  # the anchors' records always, the others drawn at random
            anchored = [r for r in others if r.peer_id in self.anchors][:PROBE_PEERS]
            rest = [r for r in others if r.peer_id not in self.anchors]
            others = anchored + random.sample(rest, PROBE_PEERS - len(anchored))
        serving = self.server.standing([(r.peer_id, r.manifest_hash) for r in others])
        if len(serving) < len(others):
            logger.info(
                "[%s round=%d] %d of %d peers stand by the state they published",
                *self._tag(),
                len(serving),
                len(others),
            )
        return [r for r in others if r.peer_id in serving]

    def level_peers(self, theta_hash: str) -> list[str]:
        """The peers whose latest state record is this node's round at `theta_hash` (its θ) and
        that stand by it now: they are averaging the next round, or about to."""
        round = self.peer.state.round
        level = [r for r in self._states() if r.round == round and r.theta_hash == theta_hash]
        return [r.peer_id for r in self._live(level)]

    def sync(self) -> int:
        """Reach the swarm's published round (or heal a fork at it); returns the rounds advanced."""
        start = self.peer.state.round
        if (
            self.solo_rounds
            and self._rejoin is not None
            and time.monotonic() - self._rejoined_at > REJOIN_EVERY_S
        ):
            # Alone: maybe its link was down and its DHT forgot every other peer; tell it of them.
            self._rejoined_at = time.monotonic()
            self._rejoin()
        self._head = None
        try:
            for _ in range(SYNC_PASSES):
                if not self._sync_once():
                    break
        finally:
            if self.peer.state.round != start:  # a download or a replay freed what it held
                give_back_free_memory()
        head = self._head
        self.behind = head is not None and head.round > self.peer.state.round and self.holders_stand(head)
        return self.peer.state.round - start

    def holders_stand(self, head: SwarmHead) -> bool:
        """Whether a holder of the head this node is behind still stands by its state (asked over
        the network: only when a catch-up left this node behind). Then a round this node opened
        would be one the others finished: it joins only. When the holders have all gone (their run
        ended, or they left), their records outlive them, and waiting for them would be forever: it
        goes on."""
        ahead = [r for r in self._states() if r.peer_id in head.holders]
        if not ahead or self._live(ahead):
            return bool(ahead)
        logger.warning(
            "[%s round=%d] the %d peers at round %d no longer answer: going on without them",
            *self._tag(),
            len(ahead),
            head.round,
        )
        return False

    def _sync_once(self) -> bool:
        """One step toward the head; True if this node moved and may still be behind."""
        head = self.head()
        if head is None or not head.holders:
            return False
        self._head = head
        behind = head.round - self.peer.state.round
        if behind < 0 and self._apart_from(head):
            logger.warning(
                "[%s round=%d] averaged alone for %d rounds, on another θ than %d live peers at round %d:"
                " taking theirs",
                *self._tag(),
                self.solo_rounds,
                len(head.holders),
                head.round,
            )
            self._catch_up(head, replay=False, event="fork_healed")
            return False
        if behind <= 0:
            mine = self.peer.theta_hash()
            if behind < 0 or head.theta_hash == mine or head.hashes[head.theta_hash] <= head.hashes[mine] + 1:
                return False
            logger.warning(
                "[%s round=%d] θ differs from %d peers' at the same round: taking theirs",
                *self._tag(),
                len(head.holders),
            )
            self._catch_up(head, replay=False, event="fork_healed")
            return False
        self._resume_unfinished(head)
        return self._catch_up(head, replay=True, event="catch_up") and self.peer.state.round < head.round

    def _apart_from(self, head: SwarmHead) -> bool:
        """Whether this node, ahead of `head`, got there alone on another lineage: it has averaged
        only alone since it last had company, the head is no older than that company's round, and
        its own θ at the head's round was not the head's (a peer merely behind it on the same
        lineage catches up to it instead). A head older than the last round with company is no
        lineage this node left: its partners held its θ then. (A node whose partners ended their run
        took the θ of the one live peer left, 19 rounds back, stop 53.)"""
        return (
            bool(self.solo_rounds)
            and head.round >= self._company_round
            and self._own_hashes.get(head.round) != head.theta_hash
        )

    def _resume_unfinished(self, head: SwarmHead) -> None:
        """Finish a download of an earlier round that the head has since passed, if it can still be
        replayed forward from: its verified chunks are not fetched again."""
        target = self.downloads.unfinished()
        if target is None or head.target is None or target.digest == head.target.digest:
            return
        if not self.peer.state.round < target.round < head.round < target.round + HISTORY_ROUNDS:
            self.downloads.forget()
            return
        source = RemoteSource(self.server, [], self.downloads, target)
        self._run_catch_up(head, source, target.theta_hash, replay=False, event="catch_up")

    def _catch_up(self, head: SwarmHead, *, replay: bool, event: str) -> bool:
        """Catch up from the holders of the head's hash: replay their kept updates, else download the
        published state from its donors; False if that failed (the next sync tries again)."""
        if head.quorum and not self._confirmed(head):
            return False
        now = time.monotonic()
        self._shunned = {h: until for h, until in self._shunned.items() if until > now}
        doubted = set(self._shunned)  # the expired ones forgotten just above
        source = RemoteSource(self.server, head.holders, self.downloads, head.target, doubted=doubted)
        return self._run_catch_up(
            head, source, head.theta_hash, replay=replay, event=event, to_round=head.round
        )

    def _shun(self, holder: str) -> None:
        """`holder`'s kept updates did not lead to the head's θ from this node's (poisoned, or this
        node on another lineage): the state was downloaded instead, and for `SHUN_S` the holder is
        asked for updates only after every other (a replay-poison holder sent one joiner to a
        download at three catch-ups in a row, stop 50). Not left out: where this node's own θ was
        the cause, an honest holder may still be the only one."""
        if not holder:
            return
        self._shunned[holder] = time.monotonic() + SHUN_S
        logger.warning(
            "[%s round=%d] the kept updates of %s do not lead to the head's θ: asked last for %.0f s",
            *self._tag(),
            holder[-6:],
            SHUN_S,
        )

    def _confirmed(self, head: SwarmHead) -> bool:
        """Whether a quorum of the head's donors serve its manifest themselves: a record names its
        peer but is signed by any key, so records naming honest peers prove nothing until those
        peers, reached by their own libp2p identity, serve what the records say."""
        target = head.target
        if target is None:
            return False
        serving: list[str] = []
        for donor in target.donors:
            if len(serving) >= head.quorum:
                break
            try:
                self.server.fetch_manifest([donor], digest=target.digest, size=target.size)
                serving.append(donor)
            except Exception as e:
                logger.info("[%s round=%d] %s does not serve the head: %s", *self._tag(), donor[-6:], e)
        if len(serving) >= head.quorum:
            return True
        logger.warning(
            "[%s round=%d] head round %d not confirmed: %d of its donors serve it, %d needed",
            *self._tag(),
            head.round,
            len(serving),
            head.quorum,
        )
        self.ops.counters.unconfirmed_heads += 1
        return False

    def _run_catch_up(
        self,
        head: SwarmHead,
        source: RemoteSource,
        expected_hash: str,
        *,
        replay: bool,
        event: str,
        to_round: int | None = None,
    ) -> bool:
        start = self.peer.state.round
        try:
            done = catch_up(
                self.peer,
                source,
                expected_hash=expected_hash,
                replay=replay,
                lock=self.lock,
                to_round=to_round,
                on_refused=lambda: self._shun(source.answered),
            )
        except Exception as e:  # donors that left or answered badly: the next sync tries again
            logger.warning("[%s round=%d] catch-up failed: %s", *self._tag(), e)
            return False
        (self.metrics.replays if done.how == "replay" else self.metrics.downloads).inc()
        source_name = source.answered
        if done.how == "download":
            report = self.downloads.last or DownloadReport()
            source_name = "+".join(sorted(d[-6:] for d in report.kept))
            self.ops.status.write(
                "state_download",
                round=self.peer.state.round,
                source=source_name,
                chunks={d[-6:]: n for d, n in report.kept.items()},
                dropped={d[-6:]: why for d, why in sorted(report.dropped.items())},
                failed={d[-6:]: n for d, n in sorted(report.failed.items())},
                seconds=round(report.seconds, 3),
            )
        self.ops.status.write(
            event, round=self.peer.state.round, behind=head.round - start, source=source_name, how=done.how
        )
        return True

    def _tag(self) -> tuple[str, int]:
        return self.peer.peer_id[-6:], self.peer.state.round
