"""One member's round of a `HivemindAverager`, from its group to its checked result.

Once matchmaking has formed the group and this member has signed its commitment, `RoundExchange`
holds what the round's steps share (the group, the contribution and its layout, the parts each
owner reduces, the bytes the round moves, when it was grouped) and runs them in order (the
averager's module docstring says why each is so):

1. deal the parts and open this member's own reductions (`owner.OwnerSession`), and, on demand, a
   stand-in's for an owner no stream reaches (`_take_over`);
2. send each owner this member's parts in send turns and gather every answer (`_collect`), asking
   the next owners in the group's order for an unreachable owner's parts (`_stand_in`), while
   `_watch_members` stops waiting for members to which no stream opens;
3. assemble the answers (`member.assemble`) and check them (`verification.verify_round`);
4. leave out the members that sent no owner their parts.

It is part of its averager, split off for size: it uses the averager's loop, streams, signer,
executors and verdicts as the averager's own methods do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from hivemind.p2p import P2P, PeerID

from ..algorithms.allreduce import Contribution
from ..algorithms.claims import ClaimBounds
from ..algorithms.codecs import Codec, payload_codec, payload_shape
from ..algorithms.parts import deal_parts, most_bytes_moved, payload_norm
from ..algorithms.trust import seeders as seeders_of
from ..algorithms.verify import payload_digest
from .averager import MemberResult
from .checks import Settings
from .matchmaking import Caught, Group, RoundFailed
from .member import OwnerUnreachable, assemble, fetch, omission
from .owner import Answer, Incoming, OwnerSession, RoundState
from .statements import Commitment, Signed
from .turns import SendTurn, chain, send_order, turn_budget_s
from .verification import verify_round
from .verify_streams import ask_defense
from .wire import late_answer_s

if TYPE_CHECKING:
    from .hivemind_averager import HivemindAverager

PROBE_EVERY_S = 1.0  # how often an owner asks whether the members it still waits for are there
PROBE_TIMEOUT_S = 2.0  # a member whose stream does not open within this may be busy: waited for


class RoundExchange:
    """One member's round from its group on (module doc)."""

    def __init__(
        self,
        averager: HivemindAverager,
        *,
        group: Group,
        contribution: Contribution,
        codec: Codec,
        bounds: ClaimBounds,
        commitment: Commitment,
        secret: bytes,
        grouped_at: float,
    ) -> None:
        self.averager = averager
        self.group = group
        self.contribution = contribution
        self.codec = codec
        self.bounds = bounds
        self.secret = secret
        self.grouped_at = grouped_at
        me = averager.peer_id
        self.keys = keys = list(contribution.payloads)
        self.layout = {k: i for i, k in enumerate(keys)}
        sizes = [len(contribution.payloads[k]) for k in keys]
        # What a reduction of any part needs of our payloads (from their headers), so that a stand-in
        # opened late needs no payload: they are released with the round (`_release`).
        self.sizes = dict(zip(keys, sizes, strict=True))
        self.shapes = {k: payload_shape(contribution.payloads[k]) for k in keys}
        self.families = {k: payload_codec(contribution.payloads[k]) for k in keys}
        # Parts go to the members the others' work lists make eligible (`trust`), in the group's order.
        owner_index = deal_parts(sizes, group.members, group.owners)
        self.owners = {k: group.members[i] for k, i in zip(keys, owner_index, strict=True)}
        members = len(group.members)
        answer_sizes = [
            codec.for_part(k).answer_bytes(payload_shape(contribution.payloads[k]), size, members)
            for k, size in zip(keys, sizes, strict=True)
        ]
        self.moved = most_bytes_moved(sizes, owner_index, members, answer_sizes)
        self.by_owner = parts_by_owner(self.owners)
        self.metadata_owner = next(iter(self.owners.values()))
        session = None
        if me in self.by_owner:
            session = self._new_session(me)
            # Our own slot is released below once we have taken the result (not on the wire).
            session.admit(me, _incoming(contribution, self.by_owner[me], commitment))
        self._stand_in_for: dict[str, OwnerSession] = {}
        # Set by the checks: the members they did not wait for (`HivemindAverager.newcomers`), and
        # the loop time by which every member within its exchange budget has revealed.
        self.unwaited: set[str] = set()
        self.reveal_by: float | None = None
        self.state = RoundState(group, session, take_over=self._take_over, layout=self.layout, own=commitment)
        self.state.reductions = [session] if session is not None else []

    def _new_session(self, owner: str) -> OwnerSession:
        """A reduction of `owner`'s parts (ours, or an unreachable owner's), running from now."""
        a, keys = self.averager, self.by_owner[owner]
        # From the headers: our own payloads are decoded once, with the others', when we reduce.
        shapes = {k: self.shapes[k] for k in keys}
        session = OwnerSession(
            group=self.group,
            keys=keys,
            shapes=shapes,
            sizes=[self.sizes[k] for k in keys],
            codec=self.codec,
            outlier_factor=a.outlier_factor,
            aggregate=a.aggregate,
            scorer=a.scorer,
            bounds=self.bounds,
            with_metadata=owner == self.metadata_owner,
            deadline=self.grouped_at + a.phase_s(self.moved, floor_s=a.part_timeout_s, measured=True),
            # Only frees the stream of a member that stopped reading: never sooner than the member
            # itself gives up (its whole budget), so load on this peer cannot cut an answer short.
            answer_timeout_s=a._exchange_budget_s(self.moved),
            on_stage=a._on_stage,
            owner=owner,
            turn_budget_s=turn_budget_s(sum(self.sizes[k] for k in keys), a._best_bps()),
            signer=a._signer,
            layout=self.layout,
            codecs={k: self.families[k] for k in keys},
        )
        a._spawn(session.run(a._executor))
        return session

    def _take_over(self, keys: list[str]) -> OwnerSession | None:
        """This member's reduction of an unreachable owner's parts `keys` (opened at the first ask)."""
        owner = self.owners.get(keys[0]) if keys else None
        if owner is None or owner == self.averager.peer_id or self.by_owner[owner] != keys:
            return None
        if owner not in self._stand_in_for:
            self._stand_in_for[owner] = self._new_session(owner)
            self._stand_in_for[owner].drop(owner)  # an owner never sends its own parts
            self.state.reductions.append(self._stand_in_for[owner])
        return self._stand_in_for[owner]

    async def run(self) -> MemberResult:
        """Steps 2-4 of the module doc: the assembled, checked result (RoundFailed otherwise)."""
        a, state, group = self.averager, self.state, self.group
        loop = asyncio.get_running_loop()
        watch = a._spawn(self._watch_members())
        try:
            result = await self._exchange()
            dropped = omission(state, a.peer_id, state.answers)
            if dropped is not None:  # proven (`assemble` raised otherwise): the round is ours all the same
                a._convict(dropped)
                a._pass_on(state, dropped)
                a._log(
                    group.round,
                    "%s left our contribution out after signing its receipt: taking the round all the same",
                    sorted(p[-8:] for p in dropped.culprits),
                    level=logging.WARNING,
                )
            # A member within its exchange budget may reveal as late as that budget allows.
            reveal_by = (
                self.grouped_at
                + a._exchange_budget_s(self.moved)
                + a.phase_s(self.moved, floor_s=a.reduce_timeout_s)
            )
            await self._check(result, reveal_by)
            # A member in no answer joined the group and sent no owner its parts (or died): it held
            # every owner to the part deadline. Every member sees the same answers.
            sent = set().union(*(answer.contributors for answer in state.answers.values()))
            absent = [m for m in group.members if m not in sent and m != a.peer_id]
            dead = [m for m in absent if m in state.mail.unreachable]
            if dead:  # no stream reached them: they died (a restart under the key is welcome)
                a._convict(Caught("left", dict.fromkeys(dead, "unreachable"), proven=False, gone=True))
                a._log(group.round, "%s left the round: no stream reaches them", sorted(p[-8:] for p in dead))
            absent = [m for m in absent if m not in dead]
            if absent:
                a._convict(
                    Caught(
                        "sent nothing",
                        dict.fromkeys(absent, "sent no owner its parts"),
                        proven=False,
                        silent=True,
                    )
                )
                a._log(
                    group.round,
                    "leaving out %s a while: they sent no owner their parts",
                    sorted(p[-8:] for p in absent),
                )
        finally:
            watch.cancel()
            self._release_unasked()
            # Members slower with their checks may still ask us to show the payloads we reduced; in
            # a group of one there is nobody to ask.
            alone = group.members == (a.peer_id,)
            if not alone:
                self._shelve_inputs()
            checks_s = 0.0 if alone else a.phase_s(self.moved, floor_s=a.reduce_timeout_s)
            loop.call_later(checks_s, self._release)
        return result

    def _release_unasked(self) -> None:
        """Once our exchange and checks are over, free what no member's check can ask for: our own
        payloads (the owners hold our parts; a stand-in opened later needs none) and the answers of
        the parts we did not reduce (the caller's result holds them). Only our reductions' inputs
        and our answers of them wait for the others' checks (`_release`): held for the checks'
        length, which at the configured rate spans rounds, three payloads a round made a founder's
        level grow ~0.3 GiB a round at GPT-2 124M (issue 28 §2)."""
        state = self.state
        defended = {key for session in state.reductions for key in session.keys}
        state.answers = {
            owner: dataclasses.replace(
                answer, payloads={k: p for k, p in answer.payloads.items() if k in defended}
            )
            for owner, answer in state.answers.items()
        }
        self.contribution = dataclasses.replace(self.contribution, payloads={})

    def _shelve_inputs(self) -> None:
        """Hand our reductions' inputs and our answers of them to the averager's `shelve` (on an
        executor thread: it writes them out), and hold what it returns instead, unless the checks
        ended meanwhile. The answers too: the checks outlast rounds at the configured rate, and an
        answer held in memory until then made a founder's level grow by its part (~0.5 B/param per
        round in a group of two at int8) where the inputs alone were shelved (issue 28 §2)."""
        shelve, state = self.averager.shelve, self.state
        sessions = [s for s in state.reductions if s.kept]
        answers = {owner: a.payloads for owner, a in state.answers.items() if a.payloads}
        if shelve is None or not (sessions or answers):
            return
        held = [s.kept for s in sessions]
        Moved = tuple[list[dict[str, Mapping[str, bytes]]], dict[str, Mapping[str, bytes]]]

        def move() -> Moved:
            inputs = [{peer: shelve(payloads) for peer, payloads in kept.items()} for kept in held]
            return inputs, {owner: shelve(payloads) for owner, payloads in answers.items()}

        def swap(future: asyncio.Future[Moved]) -> None:
            if future.cancelled():
                return
            if (error := future.exception()) is not None:
                self.averager._log(
                    self.group.round,
                    "its reductions' inputs and answers stay in memory: %r",
                    error,
                    level=logging.WARNING,
                )
                return
            inputs, shelved = future.result()
            for session, before, after in zip(sessions, held, inputs, strict=True):
                if session.kept is before:  # not released meanwhile
                    session.kept = after
            for owner, on_disk in shelved.items():
                answer = state.answers.get(owner)
                if answer is not None and answer.payloads is answers[owner]:  # not released meanwhile
                    state.answers[owner] = dataclasses.replace(answer, payloads=on_disk)

        asyncio.get_running_loop().run_in_executor(None, move).add_done_callback(swap)

    def _release(self) -> None:
        """The round's checks are over: free what our reductions kept, the answers' payloads and our
        own (the caller's result holds the averaged ones). The round's state outlives the round by
        the averager's `record_ttl_s` and reaches this exchange (`RoundState.take_over`), so until
        now it held every recent round's payloads, ~2 bytes per parameter each at int8."""
        self.state.release()
        self.contribution = dataclasses.replace(self.contribution, payloads={})

    async def _exchange(self) -> MemberResult:
        """Send our parts, gather every owner's answer and assemble them (`member.assemble`)."""
        a, state = self.averager, self.state
        stand_ins: dict[str, str] = {}
        try:
            answers = await self._collect(stand_ins)
        finally:
            if state.session is not None:
                state.session.answered()
        if stand_ins:
            a._log(
                state.group.round,
                "stood in for unreachable owners: %s",
                {o[-8:]: f[-8:] for o, f in stand_ins.items()},
            )
        state.answers = answers
        return await assemble(
            state,
            peer_id=a.peer_id,
            keys=self.keys,
            owners=self.owners,
            answers=answers,
            idle_timeout_s=a.phase_s(self.moved, floor_s=a.reduce_timeout_s),
            exchange_s=asyncio.get_running_loop().time() - self.grouped_at,
            stand_ins=stand_ins,
        )

    async def _collect(self, stand_ins: dict[str, str]) -> dict[str, Answer]:
        """Every owner's answer for its parts (our own session's included); RoundFailed otherwise.

        The parts of an owner no stream can be opened to are asked of the members after it in the
        group's order (`_stand_in`); `stand_ins` records who answered for whom.
        """
        a, state, contribution, codec = self.averager, self.state, self.contribution, self.codec
        # An owner's average of part k is a payload of k's shape from the round's codec, or a
        # contributor's payload forwarded as is, or (downlink gather) all of them in one sum payload.
        members = len(state.group.members)
        bounds = {
            k: codec.for_part(k).answer_bytes(payload_shape(p), len(p), members)
            for k, p in contribution.payloads.items()
        }
        lost: set[str] = set()
        p2p = a._p2p
        delay_s = 0.0 if a._answer_delay is None else a._answer_delay(state.group.round)
        if delay_s > 0:
            p2p = cast(P2P, _LateAnswers(p2p, delay_s))

        # Our payloads go to the owners one at a time, each member starting with another (`turns`).
        order = [o for o in send_order(state.group.members, a.peer_id) if o in self.by_owner]
        rate = a._best_bps()
        sent = {o: sum(len(contribution.payloads[k]) for k in self.by_owner[o]) for o in order}
        turns = chain(order, {o: turn_budget_s(sent[o], rate) for o in order})

        async def answer_of(owner: str, keys: list[str]) -> Answer:
            def ask(member: str, turn: SendTurn | None = None) -> Awaitable[Answer]:
                return fetch(
                    p2p,
                    a._handler_name,
                    state,
                    peer_id=a.peer_id,
                    owner=member,
                    keys=keys,
                    contribution=contribution,
                    with_metadata=owner == self.metadata_owner,
                    chunk_bytes=a.chunk_bytes,
                    answer_bounds={k: bounds[k] for k in keys},
                    on_stage=a._on_stage,
                    turn=turn,
                )

            try:
                return await ask(owner, turns.get(owner))
            except RoundFailed as e:
                lost.add(owner)
                if not isinstance(e, OwnerUnreachable):
                    raise
                # Why no stream opened (p2pd's words) is what tells a dead owner from a transient
                # failure: a test that lost a round this way once did not say which (stop 53).
                a._log(state.group.round, "%s: asking the next owners", e, level=logging.WARNING)
                return await self._stand_in(owner, keys, ask, stand_ins, e)

        fetches = {
            owner: a._spawn(answer_of(owner, keys))
            for owner, keys in self.by_owner.items()
            if owner != a.peer_id
        }
        waits: list[asyncio.Future[Any]] = list(fetches.values())
        if state.session is not None:
            waits.append(a._spawn(state.session.done.wait()))
        budget = a._exchange_budget_s(self.moved)
        loop = asyncio.get_running_loop()
        end = loop.time() + budget
        took: dict[str, float] = {}  # owner -> seconds from the group's forming to its answer
        late_at: float | None = None
        pending = set(waits)
        try:
            while pending and loop.time() < min(end, late_at or end):
                done, pending = await asyncio.wait(
                    pending,
                    timeout=min(end, late_at or end) - loop.time(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                failed = [t for t in done if t.exception() is not None]
                if failed:
                    a._lost_owners[state.group.round] = lost
                    error = failed[0].exception()
                    raise error if isinstance(error, RoundFailed) else RoundFailed(str(error))
                for owner, task in fetches.items():
                    if task in done:
                        took[owner] = loop.time() - self.grouped_at
                late_at = self._late_at(took, sent, [o for o, t in fetches.items() if t in pending])
        finally:
            for waiting in pending:
                waiting.cancel()
        silent = {owner for owner, task in fetches.items() if task in pending}
        if silent:
            # An owner silent for the whole budget is lost as one whose stream broke (cut off, or
            # dead): the others need not wait for it to say that its try failed.
            a._lost_owners[state.group.round] = lost | silent
            # Most owners answered: it is late, not proven silent, whether its late bound or the
            # budget came first (a slow machine's answers can push the bound past the budget; a
            # founder that died while it reduced was then left out by one member and demoted by the
            # other, and its restart was not grouped again by the first: CI, stop 59).
            if loop.time() < end or self._late_at(took, sent, sorted(silent)) is not None:
                waited = loop.time() - self.grouped_at
                raise Caught(
                    f"no answer from {len(silent)} owner(s) within {waited:.1f} s;"
                    f" the other {len(took)} answered within {max(took.values()):.1f} s",
                    dict.fromkeys(silent, f"took our parts and gave no answer within {waited:.1f} s"),
                    proven=False,
                    late=True,
                    unanswered=True,
                )
            raise Caught(
                f"no answer from {len(silent)} owner(s) within {budget:.1f} s",
                dict.fromkeys(silent, f"took our parts and gave no answer within {budget:.1f} s"),
                proven=False,
                unanswered=True,
            )
        if lost:
            # Owners no stream reached, whose parts others stood in for: should the try still fail
            # (its checks), the next waits for them to say so no more than for a broken stream (a
            # dead owner never says; the survivors of one held the next try for the whole averaging
            # timeout, while a member whose own exchange broke averaged alone: a fork).
            a._lost_owners[state.group.round] = set(lost)
        if pending:  # our own reduction did not end within the budget
            raise RoundFailed(f"our own reduction did not end within {budget:.1f} s")
        answers: dict[str, Answer] = {owner: task.result() for owner, task in fetches.items()}
        if state.session is not None:
            if state.session.result is None:
                raise RoundFailed("our own reduction failed")
            answers[a.peer_id] = state.session.result
        return answers

    def _late_at(
        self, took: Mapping[str, float], sent: Mapping[str, int], waiting: Sequence[str]
    ) -> float | None:
        """The loop time past which the owners in `waiting` are late (`wire.late_answer_s`): once
        more than half of the round's owners are in (`took`: the others that answered; our own
        reduction when it is done), each waiting one gets as long as the slowest of the others took,
        by its share of our bytes (`sent`: what we sent each owner)."""
        session = self.state.session
        ours = 0 if session is None else 1
        done = len(took) + (1 if session is not None and session.done.is_set() else 0)
        if not waiting or not took or 2 * done <= len(took) + len(waiting) + ours:
            return None
        slowest = max(took.values())
        largest = max(sent[o] for o in took) or 1
        return self.grouped_at + max(late_answer_s(slowest, sent[o] / largest) for o in waiting)

    async def _stand_in(
        self,
        owner: str,
        keys: list[str],
        ask: Callable[[str], Awaitable[Answer]],
        stand_ins: dict[str, str],
        unreachable: OwnerUnreachable,
    ) -> Answer:
        """The parts of `owner`, whom no stream reached, from the first member after it in the
        group's order that takes them (this peer, in its own session for them, when it comes
        first). Every member walks the same order, so all that reach nobody before agree on who
        stands in; `member.assemble` takes the answer only if it cannot differ from what any other
        member holds for those parts."""
        state, me = self.state, self.averager.peer_id
        owners = state.group.owners
        at = owners.index(owner)
        for member in (*owners[at + 1 :], *owners[:at]):
            if member == me:
                session = state.take_over(keys)
                assert session is not None  # they are `owner`'s parts, and we are not `owner`
                if not session.admit(me, _incoming(self.contribution, keys, state.own)):
                    raise RoundFailed(f"standing in for {owner[-8:]}: the reduction had already closed")
                try:
                    await session.done.wait()
                    answer = session.result
                finally:
                    session.answered()
                if answer is None:
                    raise RoundFailed(f"standing in for {owner[-8:]}: the reduction failed")
            else:
                try:
                    answer = await ask(member)
                except OwnerUnreachable:
                    continue
            stand_ins[owner] = member
            return answer
        raise unreachable

    async def _check(self, result: MemberResult, reveal_by: float) -> None:
        """`verification.verify_round` of the answers (Caught when they do not check out); an owner
        that shows some contributor's projections false convicts it."""
        a, state, contribution = self.averager, self.state, self.contribution
        assert state.own is not None
        budget = a.phase_s(self.moved, floor_s=a.reduce_timeout_s)

        def defend(owner: str, key: str, listed: list[Signed]) -> Awaitable[dict[str, bytes]]:
            return ask_defense(
                a._p2p,
                a._verify_name,
                owner,
                round=state.group.round,
                key=key,
                projections=listed,
                size=len(contribution.payloads[key]),
                timeout_s=budget,
                meter=state.meter,
            )

        self.unwaited = unwaited = a.newcomers(result.members, seeders_of(result.members, state.group.owners))
        self.reveal_by = reveal_by
        # Our statements go to every member an owner admitted: one that another owner left out
        # takes the round too (`member.assemble`), and checks it on them.
        admitted = set().union(*(answer.contributors for answer in state.answers.values()))
        liars = await verify_round(
            state=state,
            answers=state.answers,
            members=result.members,
            audience=[m for m in state.group.members if m in admitted],
            peer_id=a.peer_id,
            own=state.own,
            secret=self.secret,
            payloads=contribution.payloads,
            settings=Settings(
                a.aggregate, a.outlier_factor, self.bounds.reference_tokens, a.scorer is not None
            ),
            signer=a._signer,
            send=lambda peer, kind, signed: a._send_statement(state, peer, kind, signed, budget),
            defend=defend,
            executor=a._verify_executor,
            budget_s=budget,
            reveal_by=reveal_by,
            grouped_at=self.grouped_at,
            laggards=a._laggards,
            unwaited=unwaited,
        )
        # The seed was drawn without their secrets: late by the others' times, or gone (a departure:
        # a node that died as it revealed, whose restart is grouped again, record 078).
        gone = [p for p in state.unrevealed if p in state.mail.gone]
        late = [p for p in state.unrevealed if p not in state.mail.gone]
        if late:
            a._convict(
                Caught(
                    f"no reveal from {[p[-8:] for p in late]} (late by the others' times)",
                    dict.fromkeys(late, "withheld its reveal"),
                    proven=False,
                    late=True,
                )
            )
            a._log(
                state.group.round,
                "%s withheld their reveals past the others' times: checked without their secrets",
                sorted(p[-8:] for p in late),
                level=logging.WARNING,
            )
        if gone:
            why = {p: f"left the round before revealing ({state.mail.gone[p]})" for p in gone}
            a._convict(
                Caught(f"{sorted(p[-8:] for p in gone)} left before revealing", why, proven=False, gone=True)
            )
            a._log(
                state.group.round,
                "%s left the round before their reveals reached this peer: checked without their secrets",
                sorted(p[-8:] for p in gone),
                level=logging.WARNING,
            )
        if liars:
            a._convict(Caught("false projections", liars, proven=True))
            a._log(state.group.round, "owners showed false projections of %s", sorted(p[-8:] for p in liars))

    async def _watch_members(self) -> None:
        """While our reductions wait for members' parts, ask every `PROBE_EVERY_S` whether each
        member that has sent them nothing yet is still there: one to which no stream opens at all
        has died (or left the network) and is not waited for until the part deadline (it cost every
        owner that deadline, 15 s at its floor). One that does not answer in time may be busy: it
        is waited for as before."""
        a, state = self.averager, self.state

        async def reachable(peer: str) -> bool:
            try:
                _, _, writer = await asyncio.wait_for(
                    a._p2p.call_binary_stream_handler(PeerID.from_base58(peer), a._verify_name),
                    PROBE_TIMEOUT_S,
                )
            except asyncio.TimeoutError:
                return True
            except Exception:
                return False
            writer.close()
            return True

        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            waiting = {p for s in state.reductions for p in s.waiting() if p != a.peer_id}
            if not any(not s.closed for s in state.reductions):
                return
            for peer, alive in zip(waiting, await asyncio.gather(*map(reachable, waiting)), strict=True):
                if not alive:
                    a._log(state.group.round, "no stream reaches %s: not waiting for its parts", peer[-8:])
                    state.mail.lost(peer)
                    for session in state.reductions:
                        session.drop(peer)


def parts_by_owner(owners: Mapping[str, str]) -> dict[str, list[str]]:
    """Each owner's parts, in the order of the tensors."""
    by_owner: dict[str, list[str]] = {}
    for key, owner in owners.items():
        by_owner.setdefault(owner, []).append(key)
    return by_owner


def _incoming(contribution: Contribution, keys: list[str], commitment: Commitment | None) -> Incoming:
    """Our own contribution to the parts `keys`, as a session takes it (never on the wire)."""
    own = {k: bytes(contribution.payloads[k]) for k in keys}
    return Incoming(
        float(contribution.weight), float(contribution.tokens), own, bytes(contribution.metadata), commitment
    )


def own_facts(payloads: Mapping[str, bytes]) -> tuple[list[bytes], list[float]]:
    """What a member commits to of its payloads: their digests and the norms of their decoded values
    (`statements.Commitment`), in the layout's order."""
    digests = [payload_digest(p) for p in payloads.values()]
    norms = [payload_norm(p) for p in payloads.values()]
    return digests, norms


class _LateAnswers:
    """Fault injection (`answer_delay`): a P2P whose streams hold back the reading of the answer.

    A member's stream reads the owner's go frame (two reads: its length, its header), then the
    answer; the third read waits `delay_s` first.
    """

    def __init__(self, p2p: P2P, delay_s: float) -> None:
        self._p2p, self._delay_s = p2p, delay_s

    async def call_binary_stream_handler(
        self, peer_id: PeerID, handler: str
    ) -> tuple[Any, _LateReader, asyncio.StreamWriter]:
        info, reader, writer = await self._p2p.call_binary_stream_handler(peer_id, handler)
        return info, _LateReader(reader, self._delay_s), writer


class _LateReader:
    def __init__(self, reader: asyncio.StreamReader, delay_s: float) -> None:
        self._reader, self._delay_s, self._reads = reader, delay_s, 0

    async def readexactly(self, n: int) -> bytes:
        self._reads += 1
        if self._reads == 3:
            await asyncio.sleep(self._delay_s)
        return await self._reader.readexactly(n)
