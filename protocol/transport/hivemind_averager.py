"""Pseudo-gradient averaging over hivemind's P2P: our all-reduce, hivemind's DHT for matchmaking.

`HivemindAverager` implements `averager.Averager` between peers of a hivemind DHT. Everything is
namespaced by `prefix` (run id + model/run fingerprint): the DHT key and the stream handler name, so
peers of another run or model never mix, even on one DHT. A round is three stages, each its own
module: matchmaking.py forms the group through DHT records (no leader, bounded by the window);
member.py sends each owner this member's payloads of its parts and assembles the answers;
owner.py collects the members' payloads of the parts this peer owns, reduces them once with
`parts.reduce_parts` and answers everyone with the same bytes.

This module holds the protocol's description below, the averager's lifecycle (its loop thread, its
P2P replica and stream handlers, a shutdown that delivers the answers it owes) and a call from its
registration to its result, with what it tells the round's other members when the round fails: over
500 lines because the description is the protocol's one account. One member's round from its
group on runs in round_exchange.py, whom it leaves out in conduct.py, the run's evidence board in
evidence.py.

**Deadlines from bytes.** A round's phases take as long as their bytes need: every peer derives,
from the group and the payload sizes (which the group id covers), the most bytes one peer moves in
the round (`parts.most_bytes_moved`), and gives each phase `wire.bytes_timeout` of them, with the
phase's floor (`part_timeout_s`, `reduce_timeout_s`). An owner holds its parts open until
`grouped + part deadline` at the rate it measured in earlier rounds when that is faster than the
configured `bandwidth_bps` (a measurement only tightens, as in the state download); a member waits
for the answers at the configured rate, so it never gives up on an owner sooner than the owner
gives up on members configured alike.

**Failure rule.** Invariant: every member that returns a result returns bit-identical `averaged`
bytes, identical `members` and `reports`. Consequences, all accepted for now:
- a member that dies or stalls before sending is dropped after `part_timeout_s` and the others
  complete without it;
- an owner no stream reaches (dead before the exchange, or a registration nobody serves) is stood
  in for: each member asks the members after it in the group's order for its parts, and the first
  that takes them reduces them in its own session (`RoundExchange._stand_in`). A member accepts a stand-in's
  parts only when every answer names the same contributors and the replaced owner is not one of
  them, and accepts an owner's own parts only when that owner contributed to some other owner:
  so no member can hold a stand-in's bytes for parts another member got from their owner;
- an owner that dies mid-exchange takes its parts with it: everyone returns None for that round
  (consistent); each says so in the DHT (`Matchmaker.mark_failed`) so the next try opens at once;
  that holds when it dies after some members have read its answer and others not: a member whose
  exchange broke withdraws from the round at once (`verify_streams.WITHDRAW`, naming the owner), a
  member holding every answer finds the dead owner unreachable when it sends its reveal
  (`Mailbox.lost`), and neither waits out the budget for a reveal that cannot come, nor for the
  dead peer's failure record (`failed_everywhere`); a peer's first departure within `BAN_S` does
  not leave it out, so a node that restarts under its key is grouped again at once;
- a member that reaches some owners in time and others not makes the contributor sets differ:
  everyone returns None;
- a member can return None while the others apply a round that includes its Δ (e.g. its own
  `timeout` fired, or one owner's answer got lost on its way to it); None is therefore "not applied
  here", never "not applied anywhere", and the caller must re-check θ against the group's;
- two disjoint groups can both complete if the DHT views partition (each is internally
  consistent); the θ hash every peer publishes for r+1 reveals it.

**Checks.** No member returns a result it has not checked (`verification.verify_round`, after
`member.assemble`): every request carries the member's signed commitment, every answer the owner's
signed statement; the members exchange the statements they got and a secret, then projections of
their payloads on a direction drawn from the seeders' secrets (`trust.seeders`: the owners), and
check every part they did not reduce. A failed check raises `Caught`, naming the peers at fault:
this peer leaves them out of its next rounds, and its readiness records say so (`excluded`;
`matchmaking.outvoted`). So:
- an owner that answers a lie, or different bytes to different members, fails the round for every
  honest member and is in no later group (docs/decisions/044-verified-reducers.md);
- a seeder of the round that does not reveal its secret in the others' time is named and left out
  a while, and the round goes on with the seed drawn from the secrets of the rest, more than half
  of the seeders' (record 077); while fewer than that are in, it fails the round at the end of the
  budget; another member that does not reveal costs the others a grace, once
  (`trust.GRACE_S`), and a key this peer holds no record of not even that: it is not waited for
  at all (a key is 0.1 s to make: one per round would cost every round a grace), and its work counts
  once its reveal comes within the round's budget (`newcomers`, `_credit_late`: record 079);
- an owner that takes the parts and does not answer fails the try once most owners have answered
  and it is late by their times (`wire.late_answer_s`), not after the exchange budget. An owner
  this peer lists is not left out (an honest owner may be slow once) but demoted: it owns nothing
  until it has earned again, and every record needs more work before it is listed
  (`trust.WorkLedger.demote`); one it does not list (every member of a fresh swarm owns) is left
  out a while, as one silent for the whole budget is.

`MemberResult.traffic` counts payload bytes and every byte written to / read from the streams
(framing: wire.py); libp2p's own framing and encryption below the stream are not counted.

Threads: all asyncio work runs on one event loop thread owned by the averager (hivemind's P2P is
asyncio); reductions run on a one-thread executor; `average` blocks the calling thread. The
averager attaches its own P2P replica to the DHT's p2pd and never owns a p2pd process: shutting
the DHT down stops p2pd.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import secrets
import threading
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hivemind.p2p import P2P, PeerID

from ..algorithms.allreduce import Contribution
from ..algorithms.claims import UNBOUNDED, ClaimBounds
from ..algorithms.codecs import Codec
from ..algorithms.parts import (
    DEFAULT_OUTLIER_FACTOR,
    MEAN,
    Aggregate,
    check_outlier_factor,
)
from ..algorithms.scoring import Scorer
from ..algorithms.trust import WorkLedger, accepted_work, earners
from .admission import Admission
from .averager import MemberResult, Misconduct
from .conduct import EXCLUDE_PROVEN_S, Verdict, Verdicts
from .dht import DHT_RPC_TIMEOUT_S, DHT_STALL_S
from .evidence import DROPPED, EvidenceBoard
from .identity import NodeDHT
from .matchmaking import Caught, Group, Matchmaker, RoundFailed, layout_of, matchmaking_bound_s
from .owner import OwnerSession, RoundState
from .owner_streams import OwnerHandler
from .round_exchange import RoundExchange, own_facts
from .statements import Commitment, Signed, Signer
from .verification import check_late_reveal
from .verify_streams import ACCUSE, WITHDRAW, WITHDRAW_CHARS, VerifyHandler, send_statement
from .verify_streams import handler_name as verification_handler
from .wire import (
    DEFAULT_CHUNK_BYTES,
    EXCHANGE_SLACK,
    MAX_CHUNK_BYTES,
    PROTOCOL_VERSION,
    bytes_timeout,
    daemon_listen_maddr,
    exchange_budget_s,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


# Reading a try's failures (`Matchmaker.all_failed`) or registrations: one DHT read, which waits up
# to `DHT_STALL_S` on an unresponsive replica (a killed container's address answers nothing), and a
# round trip more. At 5 s, every read that met the dead peer was cut short and the survivor of a
# killed owner waited out the whole averaging timeout (110 s) for its failed try, while the other
# survivor, told sooner, averaged alone: a fork (issue 26, containers).
MARK_TIMEOUT_S = DHT_STALL_S + DHT_RPC_TIMEOUT_S
# The most a completed round waits to read who came after its close (`_chasers`): a read takes tens
# of milliseconds; one that meets an unresponsive replica is not waited for.
CHASER_READ_S = 0.5
PARTNER_ROUNDS = 64  # the completed rounds a peer remembers whom it averaged with (`_chasers`)
# The rounds a former partner that came after a round's close (catching up) must have completed with
# this peer to be waited for in the next (`_expected_again`): a key that averaged one round, then
# registered late for the next, would otherwise hold the one after open for the patience.
WAITED_AFTER_ROUNDS = 2
# Rounds other peers' streams may make this peer hold before a call here names them: an honest
# member is at most a round or two ahead of us (`_round_future`).
MAX_ASKED_ROUNDS = 4
HANG_UP_S = 1.0  # the most a failed try waits for its daemon to close a connection (`_hang_up`)


class HivemindAverager:
    """An `Averager` between peers of a hivemind DHT; see the module docstring for the protocol.

    Knobs:
    - `window_s`: how long a round stays open after its first registration. Raise it when peers that
      finish their local phase together keep missing each other's groups; lower it to cut idle time.
    - `grace_s`: wait after the close before reading the group, so late-propagating registrations
      are seen. Must exceed DHT store latency plus clock skew; symptom of too small: rounds where
      members return None with "group mismatch".
    - `part_timeout_s`: the floor of the part deadline: an owner waits at least this long for
      members' parts after forming the group before it reduces without the missing ones (and a
      request header must arrive within it). The deadline grows with the bytes (module docstring).
    - `reduce_timeout_s`: the floor of the answer phase: how much longer a member waits for the
      owners' answers (the reduction itself and the download of the averaged parts), and how long
      an owner may take to write one answer. Raise it if large reductions on a slow CPU make
      members give up ("no answer from 1 owner(s)").
    - `bandwidth_bps`: the bytes/s a peer is expected to move at least, each way; the deadlines give
      the round's bytes `slack` times what they need at this rate. Lower it if honest members on a
      slow link are dropped ("owner reduces without ... (part deadline)"); too low only makes
      failures slow to detect.
    - `chunk_bytes`: payloads go on the wire in frames of at most this many bytes (receivers take up
      to `wire.MAX_CHUNK_BYTES`): what a stream's reader holds at once. Smaller costs a frame
      header (~10 bytes) per chunk.
    - `record_ttl_s`: lifetime of readiness records; a call for a round older than this opens a
      new group instead of being late.
    - `outlier_factor`: this peer, as an owner, rejects a member's part whose L2 norm per claimed
      token exceeds this many times the part's median (3+ finite payloads, each claim credited with
      at most the round's reference work; `parts.DEFAULT_OUTLIER_FACTOR`, `--outlier-factor`); 0 or
      None turns the test off, non-finite parts are rejected regardless. Symptom of too low: honest
      peers named in "rejected part" warnings every round; of too high: loss spikes after rounds.
    - `on_stage`: fault-injection hook, called on the event-loop thread as on_stage(stage, round) at
      "registered" (record stored), "grouped" (group read), "sending" (a member's first chunk frame
      to an owner written, once per owner), "reducing" (an owner's members are in, before it
      reduces) and "answered" (a member has read its whole answer from this owner, once per
      member); tests block or kill the peer there.
    - `answer_delay`: fault injection, round -> seconds: in a round where it gives more than 0, this
      member reads each owner's answer that much later (its parts have gone out; its own owner side
      is not held), as a member on a stalled machine would. Tests race a leaving owner with it.
      None (the default) costs nothing.
    - `register_delay`: fault injection, round -> seconds: this peer registers for the round that
      much after the call (its local round ended later: a slower machine, or a checkpoint written
      between rounds). None (the default) costs nothing.
    - `scorer`: contribution scoring (`TrainConfig.score`, `scoring.Scorer`): this peer, as an owner,
      judges each member's Δ over its parts by the loss change on a batch of its own data, and
      rejects every part of a member it excludes (the "rejected part" warnings say why). None (the
      default) turns it off. It runs on the reduction's thread within `reduce_timeout_s`: raise that
      if scoring owners make members give up.
    - `evidence_every_s`: how often this peer reads the run's evidence board (`_watch_board`): a
      liar caught elsewhere is left out here within this much (and a DHT read's time) of it.
    - `shelve`: takes the payloads this peer holds only in case another member's check asks to see
      them (each contributor's inputs to its reductions, held for the checks' length: at the
      configured rate that spans rounds, ~1 B/param each at int8) and returns a mapping that reads
      them back, called off the loop once its own exchange is over; None (the default) keeps them
      in memory. A node passes one that writes them to an unnamed file (record 067).
    """

    def __init__(
        self,
        dht: NodeDHT,
        *,
        prefix: str,
        window_s: float = 3.0,
        grace_s: float = 0.5,
        part_timeout_s: float = 10.0,
        reduce_timeout_s: float = 5.0,
        bandwidth_bps: float = 10e6 / 8,
        slack: float = EXCHANGE_SLACK,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        record_ttl_s: float = 120.0,
        outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
        aggregate: Aggregate = MEAN,
        on_stage: Callable[[str, int], None] | None = None,
        answer_delay: Callable[[int], float] | None = None,
        register_delay: Callable[[int], float] | None = None,
        admission: Admission | None = None,
        scorer: Scorer | None = None,
        evidence_every_s: float = 5.0,
        shelve: Callable[[Mapping[str, bytes]], Mapping[str, bytes]] | None = None,
    ) -> None:
        _check_knobs(prefix, window_s, grace_s, part_timeout_s, reduce_timeout_s, record_ttl_s)
        if not bandwidth_bps > 0 or not slack >= 1 or not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"bandwidth_bps must be > 0, slack >= 1, chunk_bytes in (0, {MAX_CHUNK_BYTES}]")
        self.dht = dht
        self.prefix = prefix
        self.window_s = window_s
        self.grace_s = grace_s
        self.part_timeout_s = part_timeout_s
        self.reduce_timeout_s = reduce_timeout_s
        self.bandwidth_bps = bandwidth_bps
        self.slack = slack
        self.chunk_bytes = chunk_bytes
        self.record_ttl_s = record_ttl_s
        self.measured_bps: float | None = None  # this peer's rate over its earlier exchanges
        self.outlier_factor = check_outlier_factor(outlier_factor)
        self.aggregate = aggregate
        self.scorer = scorer
        self.evidence_every_s = evidence_every_s
        self.shelve = shelve
        self.admission = admission or Admission()
        self._on_stage = on_stage
        self._answer_delay = answer_delay
        self._register_delay = register_delay
        digest = hashlib.sha256(prefix.encode()).hexdigest()[:24]
        self._handler_name = f"adloco.allreduce.v{PROTOCOL_VERSION}.{digest}"
        self._rounds: dict[int, tuple[float, asyncio.Future[RoundState | None]]] = {}
        # Rounds held only because another peer's stream named them, before any call here did: the
        # peer whose stream opened each.
        self._asked: dict[int, str] = {}
        self._joined: set[int] = set()
        # Rounds whose call here ended in no group with others (alone, late, or before any group):
        # a later call may take them up afresh (`average`).
        self._alone: set[int] = set()
        self._lost_owners: dict[int, set[str]] = {}  # round -> owners whose exchange broke here
        self._worked = WorkLedger()  # whose work this peer took lately (`trust`)
        self._partners: dict[str, int] = {}  # peer -> this peer's completed round they last shared
        self._completed = 0  # rounds this peer completed
        self._last_group: Group | None = None  # the group of the last round this peer completed
        self._shared: dict[str, int] = {}  # partner -> rounds it completed with this peer
        self._laggards: set[str] = set()  # non-seeders whose reveal missed its grace (`verify_round`)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._calls: set[asyncio.Task[Any]] = set()  # our `average` calls running on the loop
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adloco-reduce")
        # A member's own work on the checks (digests, norms, projections): off the reductions' thread.
        self._verify_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="adloco-verify")
        self._signer = Signer(dht.identity)
        self._verify_name = verification_handler(prefix)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="adloco-averager", daemon=True)
        self._thread.start()
        try:
            self._attach()
        except BaseException:
            self._stop_loop()
            raise

    def _attach(self) -> None:
        """Our own P2P replica on the DHT's p2pd, and the owner's stream handler on it."""
        maddr = self.dht.run_coroutine(daemon_listen_maddr)
        self._p2p: P2P = self._call(P2P.replicate(maddr), timeout=30)
        self._peer_id: str = str(self._p2p.peer_id.to_base58())
        self._conduct = Verdicts(self._peer_id)  # whom this peer leaves out, why, how long
        self._matchmaker = Matchmaker(
            self.dht,
            peer_id=self._peer_id,
            prefix=self.prefix,
            window_s=self.window_s,
            grace_s=self.grace_s,
            record_ttl_s=self.record_ttl_s,
            on_stage=self._on_stage,
            log=self._log,
            admission=self.admission,
            excluded=self.excluded,
            workers=self.workers,
        )
        self._handler = handler = OwnerHandler(
            peer_id=self._peer_id,
            round_state=lambda r, peer: asyncio.shield(self._round_future(r, asked_by=peer)),
            header_timeout_s=self.part_timeout_s,
            wait_s=matchmaking_bound_s(self.window_s, self.grace_s) + self.part_timeout_s,
            chunk_bytes=self.chunk_bytes,
            admission=self.admission,
            signer=self._signer,
        )
        self._call(self._p2p.add_binary_stream_handler(self._handler_name, handler.serve), timeout=30)
        checks = VerifyHandler(
            round_state=lambda r, peer: asyncio.shield(self._round_future(r, asked_by=peer)),
            wait_s=matchmaking_bound_s(self.window_s, self.grace_s) + self._exchange_budget_s(0),
            chunk_bytes=self.chunk_bytes,
            executor=self._verify_executor,
            admission=self.admission,
            on_evidence=lambda peer, why: self._convict(Caught(why, {peer: why}, proven=True)),
            on_dropped=self._level_by_proof,
        )
        self._call(self._p2p.add_binary_stream_handler(self._verify_name, checks.serve), timeout=30)
        self._board = EvidenceBoard(self.dht, prefix=self.prefix, ttl_s=EXCLUDE_PROVEN_S)
        self._call(self._start(self._watch_board()), timeout=30)

    @property
    def peer_id(self) -> str:
        """This peer's libp2p id (base58), the id contributions must carry."""
        return self._peer_id

    async def _start(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._spawn(coro)

    async def _watch_board(self) -> None:
        """Every `evidence_every_s`, convict the peers that evidence new on the run's board proves
        to have lied (`evidence.EvidenceBoard`): a liar one node caught is left out by all."""
        while True:
            await asyncio.sleep(self.evidence_every_s)
            try:
                found = await asyncio.wait_for(self._board.read(), MARK_TIMEOUT_S)
            except Exception as e:  # a read that failed or timed out: the next one may not
                logger.debug("reading the evidence board: %r", e)
                continue
            for convicted in found:
                why = f"{convicted.why} (evidence published by {convicted.published_by[-8:]})"
                if convicted.peer != self._peer_id:
                    logger.warning("[%s] leaving %s out: %s", self._peer_id[-8:], convicted.peer[-8:], why)
                self._convict(Caught(why, {convicted.peer: why}, proven=True))

    def _convict(self, caught: Caught) -> None:
        """Leave the peers `caught` names out of this peer's next rounds (`excluded`), and publish
        the evidence it holds to the run (`evidence.EvidenceBoard`)."""
        if caught.evidence:
            self._spawn(self._board.publish(caught.evidence))
        if caught.unanswered and not caught.proven:
            # A late owner with a record loses it (it owns again once it has earned, with more work
            # each time). An owner without one that gave no answer (late, or for the whole budget:
            # which depends on whether the other owners' answers came first) is left out a while,
            # unless it completed a round with this peer before: a node that died while it reduced
            # looks the same, and its restart under its key must find itself grouped again (issue
            # 26), so it counts as a departure (not left out the first time within `BAN_S`; again,
            # as a silence). A key that stalls its first round as an owner is left out as before.
            listed = set(self._worked.listed())
            if caught.late:
                for peer in caught.culprits:
                    if peer in listed:
                        self._worked.demote(peer)
                        # Nor does the next try wait for it: expected, it held the retry open for
                        # the patience (6 s) while the others had all registered (record 062). A
                        # partner taken for a departure stays expected (record 060).
                        self._matchmaker.departed([peer])
            culprits = {p: why for p, why in caught.culprits.items() if not caught.late or p not in listed}
            # A refusal proves nothing either way (an honest owner's race: our parts too late, its
            # other view of the group): in a pair, where leaving it out splits the two, it is taken
            # for a departure, as a partner's missing answer is.
            partners = {
                p: why
                for p, why in culprits.items()
                if (p in self._partners or caught.refused) and p not in listed
            }
            if partners:
                self._convict(Caught(str(caught), partners, proven=False, gone=True))
            rest = {p: why for p, why in culprits.items() if p not in partners}
            if not rest:
                return
            caught = Caught(str(caught), rest, proven=False)
        for peer in self._conduct.convict(caught, self._loop.time()):
            self._worked.forget(peer)  # its trust is earned again, by work after its exclusion

    def _expected_again(
        self, group: Group, completed: Collection[str], chasers: Collection[str]
    ) -> tuple[str, ...]:
        """Whom this peer's next registrations expect after it completed a round with `group`
        (`Matchmaker.expected`: the round stays open for them up to the patience, at least
        `DHT_STALL_S`): itself, the group's owners (the members that worked together, `trust.core`
        of their work lists; every member while none did: a fresh swarm's founders, whom the
        patience keeps from each averaging alone, records 056 and 066) that completed the round with
        it (`completed`: the result's members, the same for every member that completed it), and the
        former partners that came after the round's close (`chasers`: a peer one round behind,
        catching up, record 059) that completed `WAITED_AFTER_ROUNDS` rounds with this one (record
        071).

        An owner that some owner did not admit failed the round (`member.assemble`): it is a round
        behind and catching up, and waiting for it could hold the next round open for the patience
        (the member a lying owner dropped, record 072). It is expected again as a chaser once it
        comes after a close. One that an owner left out by proof took the round (record 076): the
        caller counts it among `completed`.

        A key without a record that averaged a round and left (a key is 0.1 s to make) held every
        next round open for the patience; it owns nothing, so it is not waited for. Every member
        reads the owners from the group itself, so the members' registrations expect one group and
        the round closes once it is in: a rule read from each peer's own ledger made members expect
        different groups whenever their ledgers differed, and each such round waited the patience."""
        owners = set(group.owners) & set(completed)
        return tuple(sorted({self._peer_id, *owners, *chasers}))

    def _level_by_proof(self, state: RoundState, member: str) -> None:
        """An accusation showed that an owner left `member` out of `state`'s round after signing its
        receipt: the member took the round all the same (`member.assemble`), so where that round is
        the last this peer completed, its next registrations expect it as they do the owners that
        completed it (`_expected_again`). Came after our round ended, the accusation adds it now;
        the registration follows a local round later."""
        expected = self._matchmaker.expected
        group = state.group
        if group is not self._last_group or expected is None:
            return
        if member in expected or member not in group.owners:
            return
        self._matchmaker.expected = tuple(sorted({*expected, member}))

    def newcomers(self, members: Sequence[str], seeders: Collection[str]) -> set[str]:
        """Of a round's `members`, the keys this peer holds no record of (`trust.WorkLedger`) that
        are not seeders: `verification.verify_round` waits for neither their reveals nor their
        projections (a key is 0.1 s to make: a grace for each would cost every round one). Their
        work counts all the same once their reveals come, within the round's budget
        (`_credit_late`, record 079)."""
        listed = set(self._worked.listed())
        return {m for m in members if m != self._peer_id and m not in listed and m not in seeders}

    def _late_reveals(self, state: RoundState, peers: Collection[str]) -> tuple[set[str], set[str]]:
        """Of `peers` (members the round did not wait for), those whose reveals are in and check out
        (`verification.check_late_reveal`), taken off the laggards, and those whose reveals show a
        lie, convicted."""
        good, bad = set(), set()
        for peer in peers:
            try:
                if check_late_reveal(state, peer):
                    good.add(peer)
                    self._laggards.discard(peer)
            except Caught as e:
                self._convict(e)
                bad.add(peer)
        return good, bad

    async def _credit_late(self, state: RoundState, at: int, peers: set[str], until: float) -> None:
        """The work of `peers` in round `at` (`trust.WorkLedger.count`'s number), held back as their
        reveals had not come when the round ended, counts once they come and check out, up to the
        loop time `until` (record 079). One caught since begins its record after its exclusion."""
        mail = state.mail
        left = set(peers)

        def come() -> bool:
            return any(p in mail.reveals or p in mail.gone for p in left)

        while left and await mail.wait(come, until):
            good, bad = self._late_reveals(state, left)
            for peer in good - set(self.excluded()):
                self._worked.credit(peer, at)
            left.difference_update(good | bad | set(mail.gone))

    def workers(self) -> list[str]:
        """The peers whose work this peer took lately (`trust.WorkLedger.listed`), less those it
        leaves out now: its readiness and state records list them (`trust.eligible_owners`)."""
        return self._worked.listed(without=set(self.excluded()))

    def excluded(self) -> list[str]:
        """The peers this peer asks the others to leave out of its rounds' groups (its readiness
        records carry them; `matchmaking.outvoted`): those whose lies or silences it caught as a
        member (`verification`), and the members its owners banned for breaking the protocol."""
        now = self._loop.time()
        caught = list(self._conduct.current(now))
        banned = [p for p, until in list(self._handler.banned.items()) if until > now]
        return sorted(set(caught) | set(banned))

    def verdicts(self) -> dict[str, Verdict]:
        """The peers this peer caught as a member and still leaves out, with why."""
        return self._conduct.current(self._loop.time())

    def misconduct(self) -> Misconduct:
        """What this peer's owners caught (`owner_streams.OwnerHandler`): rule breaks, bans now."""
        handler = self._handler
        return Misconduct(violations=handler.violations, banned=handler.active_bans(self._loop.time()))

    @property
    def matchmaking_s(self) -> float:
        """Window plus grace: no call returns a result sooner."""
        return self.window_s + self.grace_s

    def phase_s(self, nbytes: int, *, floor_s: float, measured: bool = False) -> float:
        """How long a phase moving `nbytes` per peer may take: `wire.bytes_timeout` at the configured
        rate, or (`measured`) at the faster of it and the rate this peer measured."""
        rate = self._best_bps() if measured else self.bandwidth_bps
        return bytes_timeout(nbytes, rate, slack=self.slack, floor_s=floor_s)

    def call_timeout_s(self, payload_bytes: int) -> float:
        """A caller's `timeout` for contributions of `payload_bytes` in all: matchmaking, then both
        phases sized for 2 × `payload_bytes` per peer (what a member of a balanced group moves at
        most: its parts up, the averages of its own parts to everyone), and the wait for our own
        answers to go out."""
        exchange = 2 * payload_bytes
        answers = self.phase_s(exchange, floor_s=self.reduce_timeout_s)
        matchmaking = matchmaking_bound_s(self.window_s, self.grace_s)
        return matchmaking + self.phase_s(exchange, floor_s=self.part_timeout_s) + 2 * answers

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
        """Register for `round`, form the group, exchange parts; see the module docstring.

        Raises ValueError for a contribution of another peer or with no tensors, and for a second
        call with the same round, unless the first ended in no group with others (it averaged alone,
        came late, or failed before a group formed): that round may be taken up again. RuntimeError
        after shutdown; `NotOpened` when a join-only call found no round opened within `join_wait_s`.
        """
        if self._closed:
            raise RuntimeError("average() after shutdown()")
        if threading.current_thread() is self._thread:
            raise RuntimeError("average() blocks: call it from another thread than the averager's loop")
        if contribution.peer_id != self._peer_id:
            raise ValueError(f"contribution of {contribution.peer_id!r} given to averager {self._peer_id!r}")
        if not contribution.payloads:
            raise ValueError("a contribution needs at least one tensor")
        coro = self._average(
            contribution, round, codec, timeout, join_only, join_wait_s, bounds or UNBOUNDED, patience_s
        )
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # The coroutine bounds itself by `timeout`; the margin only guards against a stuck loop.
            return future.result(timeout=timeout + 5.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return None
        except concurrent.futures.CancelledError:  # shutdown() cancelled the round
            return None

    def round_view(self, round: int) -> tuple[frozenset[str], tuple[str, ...]] | None:
        """`Matchmaker.round_view` (None when the DHT could not be read, or after shutdown)."""
        if self._closed:
            return None
        try:
            return self._call(self._matchmaker.round_view(round), timeout=MARK_TIMEOUT_S)
        except Exception as e:
            self._log(round, "could not read the registrations: %r", e, level=logging.DEBUG)
            return None

    def failed_everywhere(self, round: int) -> bool:
        """Whether every member of the group this peer formed for `round` has left that try
        (`Matchmaker.all_left`: said its try failed there, or went on to the next try, or another
        member saw it leave), owners whose exchange with this peer broke aside: then no call of that
        try is left running anywhere that could complete it. Where this peer came late to
        the try, whether the group that formed without it is over (`_late_try_over`). False when
        it registered for no try there, or the DHT could not be read."""
        if self._closed:
            return False
        try:
            return self._call(self._failed_everywhere(round), timeout=MARK_TIMEOUT_S)
        except Exception as e:
            self._log(round, "could not read the failures: %r", e, level=logging.DEBUG)
            return False

    async def _failed_everywhere(self, round: int) -> bool:
        entry = self._rounds.get(round)
        state = None if entry is None else _formed(entry[1])
        if state is None:
            return round in self._joined and await self._late_try_over(round)
        # An owner whose exchange broke here has mostly died and gives its parts to nobody; one that
        # dropped only us and completed without us alone is at worst a fork the majority heals. So
        # too a member that left the checks (no stream reached it, or it withdrew): a dead peer never
        # says its try failed, and waiting for it held the next try for the whole averaging timeout.
        waited = (
            set(state.group.members)
            - self._lost_owners.get(round, set())
            - set(state.mail.gone)
            - set(self.excluded())
        )
        return await self._matchmaker.all_left(round, sorted(waited))

    async def _chasers(self, round: int, members: tuple[str, ...]) -> set[str]:
        """`Matchmaker.chasers` of `round` that completed `WAITED_AFTER_ROUNDS` rounds with this peer,
        the last within its last `PARTNER_ROUNDS` (a node restarted from its checkpoint comes back
        after more rounds than the work ledger keeps), less those it leaves out; none when the DHT
        does not answer within `CHASER_READ_S`. The log names only these: it named every partner
        that came late, the ones not waited for too (the victim of owner-omit, stop 55)."""
        try:
            late = await asyncio.wait_for(self._matchmaker.chasers(round, members), CHASER_READ_S)
        except (asyncio.TimeoutError, RoundFailed):
            return set()
        out = set(self.excluded())
        chasers = {
            p
            for p in late
            if p in self._partners and p not in out and self._shared.get(p, 0) >= WAITED_AFTER_ROUNDS
        }
        if chasers:
            self._log(round, "expecting %s, who came after the close", sorted(p[-8:] for p in chasers))
        return chasers

    async def _late_try_over(self, round: int) -> bool:
        """Whether the group that formed for `round` without this peer (it registered after the
        close) can no longer complete a round together: at most one of its members is still in it,
        the others having said their try failed there or gone on to the next try. One member left
        can complete it only alone, at worst a fork the majority heals. Without this, a peer one
        DHT timeout late for a try that then failed waited out the whole bound, while the others
        retried without it and each averaged alone."""
        members, left = await self._matchmaker.left_try(round)
        if not members or self._peer_id in members:
            return False
        return len(set(members) - left) <= 1

    def shutdown(self) -> None:
        """End the calls still running, deliver the answers this peer owes, remove the stream
        handler, drop this averager's P2P replica and stop its loop thread.

        A leaving owner owes the answers of every reduction it made: the members that sent it their
        parts are reading them, and a stream cut now fails their round ("exchange with owner ...
        broke") though the others complete it. So it waits until each has read its answer, at most
        as long as they wait for it (`OwnerSession.owed_until`). The parts of a round it abandoned
        before reducing are not owed. The DHT (and its p2pd) stays up: whoever created it shuts it
        down.
        """
        if self._closed:
            return
        self._closed = True
        try:
            owed_s = self._call(self._end_calls(), timeout=10)
            self._call(self._close(), timeout=10 + owed_s)
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
        self._verify_executor.shutdown(wait=False, cancel_futures=True)

    async def _end_calls(self) -> float:
        """Stop taking streams and end our own calls still running (their rounds are abandoned: their
        own slots in our sessions are released); returns how long answers may still be owed."""
        try:
            await asyncio.wait_for(self._p2p.remove_binary_stream_handler(self._handler_name), timeout=5)
            await asyncio.wait_for(self._p2p.remove_binary_stream_handler(self._verify_name), timeout=5)
        except Exception as e:  # p2pd already gone with its DHT: there is no handler left to remove
            logger.debug("removing the averaging handler: %r", e)
        for call in self._calls:
            call.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._calls, return_exceptions=True), timeout=5)
        now = asyncio.get_running_loop().time()
        return max([until - now for _, until in self._owed()], default=0.0)

    def _owed(self) -> list[tuple[OwnerSession, float]]:
        """Our reductions whose answers members may still be reading, and until when."""
        owed = []
        for _, future in self._rounds.values():
            state = _formed(future)
            until = None if state is None or state.session is None else state.session.owed_until()
            if state is not None and state.session is not None and until is not None:
                owed.append((state.session, until))
        return owed

    async def _close(self) -> None:
        owed = self._owed()
        if owed:
            now = asyncio.get_running_loop().time()
            rounds = sorted({session.group.round for session, _ in owed})
            self._log(rounds[-1], "leaving: delivering the answers owed for rounds %s", rounds)
            waits = [asyncio.wait_for(s.idle.wait(), timeout=max(0.0, until - now)) for s, until in owed]
            for outcome in await asyncio.gather(*waits, return_exceptions=True):
                if isinstance(outcome, asyncio.TimeoutError):
                    self._log(rounds[-1], "leaving: an answer was not read in time", level=logging.WARNING)
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
        task.add_done_callback(_settled)
        return task

    def _stage(self, stage: str, round: int) -> None:
        if self._on_stage is not None:
            self._on_stage(stage, round)

    def _log(self, round: int, message: str, *args: object, level: int = logging.INFO) -> None:
        logger.log(level, f"[{self._peer_id[-8:]} round={round}] {message}", *args)

    def _round_future(self, round: int, *, asked_by: str | None = None) -> asyncio.Future[RoundState | None]:
        """The future that resolves to this peer's state for `round` once its group is known.

        `asked_by`: the peer whose stream (an owner's or a verifier's) names the round. A member
        faster than us may name our round before our call for it does, so a stream may open a
        round's entry; but each peer at most `MAX_ASKED_ROUNDS` of them at once (issue 25 §1.7: any
        peer could name a round a stream, each held for `record_ttl_s`). Beyond, that peer's stream's
        round is one we are in no group for (resolved None: "the owner is not in a group for this
        round"). The bound is each partner's own (`_asks_too_many`): under one bound for all, one
        key naming a few rounds ahead made this peer refuse the others' streams that came before its
        own call, and they take a refusal for an owner that gave no answer (record 069) and leave it
        out (record 071)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for old in [r for r, (t, _) in self._rounds.items() if now - t > self.record_ttl_s]:
            _, stale = self._rounds.pop(old)
            self._asked.pop(old, None)
            self._lost_owners.pop(old, None)
            # Its records have expired too: what a call there would meet is a round nobody holds.
            self._joined.discard(old)
            self._alone.discard(old)
            if not stale.done():
                stale.set_result(None)
        if round not in self._rounds:
            if asked_by is not None and self._asks_too_many(asked_by):
                none: asyncio.Future[RoundState | None] = loop.create_future()
                none.set_result(None)
                return none
            self._rounds[round] = (now, loop.create_future())
            if asked_by is not None:
                self._asked[round] = asked_by
        elif asked_by is None:
            self._asked.pop(round, None)  # our own call took it up
        return self._rounds[round][1]

    def _asks_too_many(self, peer: str) -> bool:
        """Whether `peer`'s stream may open no further round that no call here named: each former
        partner (`_partners`) may hold `MAX_ASKED_ROUNDS` of them, and the peers this one never
        averaged with as many in all, so that keys made by the thousand hold no more than one
        partner does."""
        if peer in self._partners:
            return sum(p == peer for p in self._asked.values()) >= MAX_ASKED_ROUNDS
        return sum(p not in self._partners for p in self._asked.values()) >= MAX_ASKED_ROUNDS

    # ---- one round, member side ------------------------------------------------------------------

    async def _average(
        self,
        contribution: Contribution,
        round: int,
        codec: Codec,
        timeout: float,
        join_only: bool,
        join_wait_s: float | None,
        bounds: ClaimBounds,
        patience_s: float,
    ) -> MemberResult | None:
        if round in self._joined:
            if round not in self._alone:
                raise ValueError(f"round {round} was already averaged by this peer; rounds are single-use")
            # Averaged alone here before, or in no group (a node that went on alone, then took the
            # swarm's state and meets the others at this round): nobody else holds this peer's try.
            self._alone.discard(round)
            self._rounds.pop(round, None)
            self._asked.pop(round, None)
            self._lost_owners.pop(round, None)
        self._joined.add(round)
        ready = self._round_future(round)
        call = asyncio.current_task()
        assert call is not None
        self._calls.add(call)
        broke: set[str] = set()  # peers whose connections this try's failure closes (`_hang_up`)
        try:
            return await asyncio.wait_for(
                self._run_round(
                    contribution, round, codec, ready, join_only, join_wait_s, bounds, patience_s
                ),
                timeout,
            )
        except asyncio.TimeoutError:
            self._log(round, "gave up after the caller's timeout of %.1f s", timeout, level=logging.WARNING)
        except Caught as e:
            self._convict(e)
            how = "shown by their signed statements" if e.proven else "seen by this peer"
            self._log(round, "no result: %s (%s)", e, how, level=logging.WARNING)
            self._pass_on(_formed(ready), e)
            self._withdraw(ready, e)
        except RoundFailed as e:
            self._log(round, "no result: %s", e, level=logging.WARNING)
            self._matchmaker.departed(e.blamed)  # owners whose stream broke, or never opened
            broke.update(e.blamed)
            self._withdraw(ready, e)
        finally:
            self._calls.discard(call)
            if not ready.done():
                ready.set_result(None)
            state = ready.result()
            if state is not None:  # the members no stream reached: our next rounds do not wait for them
                self._matchmaker.departed(state.mail.unreachable)
            if state is None or state.group.members == (self._peer_id,):
                self._alone.add(round)
        if state is not None:  # a group formed: its other members may wait on this try
            self._matchmaker.mark_failed(round, self._lost_owners.get(round, set()) | set(state.mail.gone))
            broke |= self._lost_owners.get(round, set()) | set(state.mail.unreachable)
        # Before the call returns, so before this peer's next try opens a stream to any of them.
        await self._hang_up(round, broke)
        return None

    async def _hang_up(self, round: int, peers: Collection[str]) -> None:
        """Close this peer's libp2p connections to `peers`, owners and members that broke off or went
        silent in a try: a killed peer's connection is never reset (its container's address answers
        nothing), and libp2p opened the first streams to its restart under the same key over that
        dead connection, where they hung for seconds (a survivor's parts reached its other owner
        too late, and that owner caught it). The next stream to a live one dials it again."""
        peers = sorted(set(peers) - {self._peer_id})
        if not peers:
            return
        client = self._p2p._client

        async def hang_up(peer: str) -> None:
            try:
                await asyncio.wait_for(client.disconnect(PeerID.from_base58(peer)), HANG_UP_S)
            except Exception as e:  # an id that does not parse, a daemon that is slow: nothing to undo
                self._log(round, "could not hang up on %s: %r", peer[-8:], e, level=logging.DEBUG)

        await asyncio.gather(*(hang_up(p) for p in peers))

    async def _run_round(
        self,
        contribution: Contribution,
        round: int,
        codec: Codec,
        ready: asyncio.Future[RoundState | None],
        join_only: bool,
        join_wait_s: float | None,
        bounds: ClaimBounds,
        patience_s: float,
    ) -> MemberResult | None:
        loop = asyncio.get_running_loop()
        # What we commit to (our payloads' digests and norms), worked out while the group forms.
        facts = loop.run_in_executor(self._verify_executor, own_facts, contribution.payloads)
        if self._register_delay is not None:
            await asyncio.sleep(self._register_delay(round))
        group = await self._matchmaker.matchmake(
            round,
            layout_of(contribution.payloads),
            join_only=join_only,
            join_wait_s=join_wait_s,
            patience_s=patience_s,
        )
        if group is None:
            return None
        if self._matchmaker.expected is None and len(group.members) > 1 and patience_s > 0:
            # This peer's first group, where its caller asks for patience (a node): should the try
            # fail, the retry expects it (less those the failure leaves out or finds gone), so it
            # closes once they are in, not after a first registration's patience (record 066: 6 s).
            # A completed round sets it anew below. Without patience a retry keeps the window.
            self._matchmaker.expected = group.members
        self._stage("grouped", round)
        grouped_at = loop.time()
        digests, norms = await facts
        secret = secrets.token_bytes(32)
        commitment = Commitment.make(
            self._signer,
            round=group.round,
            group_id=group.group_id,
            weight=float(contribution.weight),
            tokens=float(contribution.tokens),
            digests=digests,
            norms=norms,
            report=bytes(contribution.metadata),
            secret=secret,
        )
        exchange = RoundExchange(
            self,
            group=group,
            contribution=contribution,
            codec=codec,
            bounds=bounds,
            commitment=commitment,
            secret=secret,
            grouped_at=grouped_at,
        )
        state = exchange.state
        ready.set_result(state)
        owned = len(state.session.keys) if state.session else 0
        self._log(round, "group of %d, owning %d of %d parts", len(group.members), owned, len(exchange.keys))
        result = await exchange.run()
        # What the checks moved counts too (their frames carry no payload).
        traffic = state.meter.traffic(result.traffic.exchange_s)
        weights = {m: state.commitments[m].weight for m in result.members if m in state.commitments}
        work = accepted_work(weights, result.rejected, len(exchange.keys))
        # A member that withheld its reveal from us earns nothing in our ledger (whose lists are our
        # own word): a key that takes the answers and never reveals never comes to seed a round. One
        # the round did not wait for earns once its reveal comes (record 079).
        unwaited = exchange.unwaited & self._laggards
        come, lied = self._late_reveals(state, unwaited)  # by now: counted with the round
        withheld = self._laggards | set(state.unrevealed)
        at = self._worked.count({m: 0.0 if m in withheld else w for m, w in work.items()}, me=self._peer_id)
        pending = (unwaited - come - lied) & set(earners(work))
        if pending and exchange.reveal_by is not None:
            self._spawn(self._credit_late(state, at, pending, exchange.reveal_by))
        if set(group.owners) == set(group.members):  # nobody listed anyone: a fresh swarm's first round
            self._worked.found()
        result = dataclasses.replace(
            result,
            work=work,
            traffic=traffic,
            sent_bytes={self._peer_id: traffic.wire_sent},
            received_bytes={self._peer_id: traffic.wire_received},
        )
        self._measure(result)
        # The next round's registration expects this group again, and the former partners that came
        # after its close, catching up: it closes once they are all in (a join-only registration
        # counts), where it closed before a chaser could come (record 059). Of the group, its owners
        # only (`_expected_again`).
        self._completed += 1
        self._partners.update(dict.fromkeys(group.members, self._completed))
        for peer in group.members:
            self._shared[peer] = self._shared.get(peer, 0) + 1
        for peer in [p for p, n in self._partners.items() if self._completed - n >= PARTNER_ROUNDS]:
            del self._partners[peer]
            self._shared.pop(peer, None)
        # A laggard none of those rounds shared is forgotten: a key made for each round would grow
        # the set for the process's life (a returning one is a laggard again after one grace).
        self._laggards.intersection_update(self._partners)
        chasers = await self._chasers(round, group.members)
        # A member an owner left out by proof took the round too (`member.assemble`): it is level
        # (an accusation that comes later adds it: `_level_by_proof`).
        # A seeder whose secret the seed was drawn without did not complete it: it is left out a while.
        completed = {*result.members, *(state.mail.dropped & set(group.members))} - set(state.unrevealed)
        self._matchmaker.expected = self._expected_again(group, completed, chasers)
        self._last_group = group
        self._log(
            round,
            "averaged with %d members, %d wire bytes out, %d in, %d parts rejected",
            len(result.members),
            result.traffic.wire_sent,
            result.traffic.wire_received,
            sum(result.rejected.values()),
        )
        return result

    def _pass_on(self, state: RoundState | None, caught: Caught) -> None:
        """Send the evidence of a drop `caught` holds to every other member of the round's group at
        once: they convict the culprit on its own signatures, without having seen what we saw (and
        every node of the run does, from the board: `_watch_board`)."""
        if state is None or not caught.evidence:
            return
        for evidence in caught.evidence:
            if evidence.kind != DROPPED:  # an accusation carries a drop; the board carries all of it
                continue
            body = [evidence.first.to_wire(), evidence.second.to_wire()]
            for peer in state.group.members:
                if peer != self._peer_id and peer not in caught.culprits:
                    self._send_statement(state, peer, ACCUSE, body, self.reduce_timeout_s)

    def _send_statement(
        self, state: RoundState, peer: str, kind: str, signed: Signed | list[Any], timeout_s: float
    ) -> None:
        """Start sending one verification statement (or an accusation's two) to `peer` (not waited
        for). A peer no stream reaches has left the round (`Mailbox.lost`): nobody waits for it."""
        self._spawn(
            send_statement(
                self._p2p,
                self._verify_name,
                peer,
                round=state.group.round,
                kind=kind,
                signed=signed,
                timeout_s=timeout_s,
                meter=state.meter,
                on_unreachable=lambda: state.mail.lost(peer),
            )
        )

    def _withdraw(self, ready: asyncio.Future[RoundState | None], failure: RoundFailed) -> None:
        """Tell the round's other members that this peer leaves it (`verify_streams.WITHDRAW`), and
        whom it blames, so none waits out its budget for our reveal or projections."""
        state = _formed(ready)
        if state is None:
            return
        members = state.group.members
        named = failure.culprits if isinstance(failure, Caught) else failure.blamed
        blamed = [p for p in named if p in members]
        body = [str(failure)[:WITHDRAW_CHARS], blamed, state.revealed]
        for peer in members:
            if peer != self._peer_id:
                self._send_statement(state, peer, WITHDRAW, body, self.reduce_timeout_s)

    def _exchange_budget_s(self, moved: int) -> float:
        """How long a member waits for every answer after forming the group, at the configured rate."""
        return exchange_budget_s(
            moved,
            self.bandwidth_bps,
            slack=self.slack,
            part_floor_s=self.part_timeout_s,
            reduce_floor_s=self.reduce_timeout_s,
        )

    def _measure(self, result: MemberResult) -> None:
        """Fold this round's rate into `measured_bps`: the bytes this peer moved each way over the
        whole exchange (waits and reductions included, so it errs on the slow side)."""
        t = result.traffic
        moved = max(t.wire_sent, t.wire_received)
        if moved and t.exchange_s > 0:
            rate = moved / t.exchange_s
            self.measured_bps = rate if self.measured_bps is None else (self.measured_bps + rate) / 2

    def _best_bps(self) -> float:
        """The configured rate, or the one this peer measured if faster (`phase_s`, send turns)."""
        return max(self.bandwidth_bps, self.measured_bps or 0.0)


def _settled(task: asyncio.Task[Any]) -> None:
    """A spawned task is over. Its failure was the round's (whoever awaited it has it), or comes from a
    fetch the round had stopped waiting for (its first failure ended it): taken here, so that asyncio
    does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _formed(future: asyncio.Future[RoundState | None]) -> RoundState | None:
    """This peer's state for a round once its group formed there; None before, or with no group."""
    return future.result() if future.done() and not future.cancelled() else None


def _check_knobs(
    prefix: str,
    window_s: float,
    grace_s: float,
    part_timeout_s: float,
    reduce_timeout_s: float,
    record_ttl_s: float,
) -> None:
    if not prefix:
        raise ValueError("prefix must name the run and model (e.g. run id + fingerprint)")
    if min(window_s, grace_s, part_timeout_s, reduce_timeout_s) < 0:
        raise ValueError("window_s, grace_s, part_timeout_s and reduce_timeout_s must be >= 0")
    if record_ttl_s <= matchmaking_bound_s(window_s, grace_s) + part_timeout_s + reduce_timeout_s:
        raise ValueError("record_ttl_s must outlast a whole round (window + grace + timeouts)")
