"""A member's check of a round's answers before it applies them (protocol/algorithms/verify.py).

Once every owner has answered (`member.assemble`), `verify_round`:

1. checks each owner's signed statement against the commitments it names: the same commitment of
   each contributor in every answer (else that contributor equivocated), the rules the round runs
   under, the screening recomputed from the committed norms, a rejection of this member's own
   payload as not matching its commitment (it does), exclusions by a scorer only where the run
   scores and alike in every part, the relayed reports against their commitments;
2. sends its reveal (every answer statement it holds, its secret) to every other member of the
   round and waits for theirs: an owner that sent another member a different answer is caught by
   its two signed statements, and a secret must match its commitment. The seed is drawn from the
   secrets of the round's *seeders* (`trust.seeders`: its owners, or every member where fewer than
   two own parts). A seeder that reveals nothing is late by the others' times once more than half
   of the seeders' reveals are in, ours counted (the rest get `wire.late_reveal_s` of the slowest,
   from the group's forming: record 057), not at the end of the exchange budget, which is set for
   the slowest link the run admits: the seed is then drawn from the secrets in hand (more than half
   of the seeders'), the late seeders are named (`RoundState.unrevealed`) and the round goes on
   without waiting for their projections (record 077; before, it failed for everyone, and the retry
   cost the round's exchange again), unless a member that withdrew named one of them: this member,
   which hears from every other seeder before it applies such a round, fails it too (a member that
   failed the try while the others applied it split θ, record 078); a seeder
   silent while too few are in for that still fails the round, at the end of the budget; any other
   member's reveal is waited for a grace only (`trust.GRACE_S`), not at all for one that missed it
   last time nor for a key this member holds no record of (its work counts once its reveal comes:
   `check_late_reveal`, record 079), so a key that withholds its reveal costs the round nothing;
3. derives the round's seed, projects its own payloads on it and sends the projections to every
   other member, with the inner products of its payloads with the CenteredClip answers they went
   into; checks every part it did not reduce itself: exactly where the answer needs no projection,
   against the norm its contributions allow, and by projection for the mean and for CenteredClip
   as the weighted mean its clip factors make it (`verify.check_mean`, a missing projection
   widening the check by what it could have been: the seeders' projections are waited for within
   the budget, the others' for a grace), whose factors it checks against the distances the inner
   products give (`verify.check_clip`).

A member that leaves the round before it has checked it (its exchange with an owner broke, or an
owner answered nothing) says so to the others (`WITHDRAW`, with whom it blames and whether it had
revealed), and a member to which no stream opens when this member sends it a statement has left
too (`Mailbox.lost`: dead, or gone from the network): nobody waits for their reveals or
projections. A seeder gone before its secret reached this member is waited for in the others'
projections (it may have revealed to them before it died: its secret then comes relayed) until
every other member has projected or left, a grace at most; then it is done without, as a late one
is, while more than half of the seeders' secrets are in hand (record 078: a node killed after one
member read its answer was late to that member and gone to the other, which failed the try the
first applied). With fewer, it fails the round (`Caught.gone`), naming it where this member could
not reach it, and a withdrawn one (with whom it blamed) unless
this member found some peer of the round unreachable itself, which bears the withdrawal out
(issue 26: an owner that died with some members holding its answer and others not cost the
survivors the whole reveal budget, ~45 s). One that withdrew before revealing fails it at once,
without waiting for the other seeders' reveals: nobody can relay a reveal never sent (record 059:
the dead owner, whose container's address answered nothing, held the member holding its answer
to the reveal deadline).

Any failure raises `Caught` naming the peers at fault: with `proven` when this member holds their
signed statements that show it (an equivocation, a screening its own commitments contradict), else
on its own observation (a silence, a mean that failed its projection: a contributor colluding with
the owner could have sent a false projection to frame it, which its committed norm bounds). The
statements of both later phases travel on their own stream handler (`VerifyHandler`): one frame,
acknowledged.

Three modules: this one runs the steps in order (`verify_round`: sending, waiting, the graces);
checks.py holds the checks themselves (from the statements and this member's payloads alone: no
stream, no wait); verify_streams.py the stream handler and the senders its statements travel on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor

from ..algorithms import verify
from ..algorithms.trust import grace_s
from ..algorithms.trust import seeders as seeders_of
from .checks import (
    Checked,
    Part,
    Settings,
    Shown,
    agree_all,
    blame,
    check_part,
    check_statements,
    clipped_answers,
    finish_check,
    own_dots,
    own_projections,
    parts_to_check,
    statements_of,
)
from .evidence import Evidence
from .matchmaking import Caught
from .owner import Answer, RoundState
from .statements import (
    ANSWER,
    PROJECT,
    REVEAL,
    AnswerStatement,
    BadStatement,
    Commitment,
    Mailbox,
    Projections,
    Reveal,
    Signed,
    Signer,
    digest,
)
from .wire import late_reveal_s

logger = logging.getLogger(__name__)


async def verify_round(
    *,
    state: RoundState,
    answers: Mapping[str, Answer],
    members: Sequence[str],
    peer_id: str,
    own: Commitment,
    secret: bytes,
    payloads: Mapping[str, bytes],
    settings: Settings,
    signer: Signer,
    send: Callable[[str, str, Signed], None],
    defend: Callable[[str, str, list[Signed]], Awaitable[dict[str, bytes]]],
    executor: Executor,
    budget_s: float,
    reveal_by: float,
    grouped_at: float,
    laggards: set[str] | None = None,
    unwaited: Collection[str] = (),
    audience: Sequence[str] = (),
) -> dict[str, str]:
    """The module doc's three steps for one round; returns when every answer checked out, with the
    contributors an owner showed to have sent false projections (the round still checks out with
    their true ones), and why. `reveal_by`: the loop time by which every member that is still
    within its exchange budget has sent its reveal (the group's formation plus that budget, plus
    `budget_s`); the wait for the reveals ends there, for secrets relayed by others `budget_s` later.
    `grouped_at`: the loop time the group formed, from which a seeder's reveal is late.

    `answers`: each answer keyed by the owner whose parts it holds (reduced by it, by a stand-in,
    or by this peer);
    `members`: the round's members (those every owner admitted), who reveal and project;
    `audience`: the other group members our reveal and projections go to as well (a member some
    owner left out by proof takes the round, and checks it on them: `member.assemble`);
    `payloads`: this member's own; `send(peer, kind, signed)` starts delivering a statement;
    `defend(owner, key, projections)` asks an owner whose part failed its check which of those
    projections were false (`ask_defense`);
    `laggards`: the members other than seeders whose reveal missed its grace in an earlier round
    (this peer's own memory, updated here to those that missed it in this one): they are not
    waited for; nor are `unwaited` members that are not seeders (keys without a record:
    `HivemindAverager.newcomers`). A reveal of either that is in when the seeders' are is checked
    and counts; one that comes later, `check_late_reveal`.
    """
    loop = asyncio.get_running_loop()
    layout = state.layout
    group = state.group
    commitments = check_statements(answers, layout=layout, own=own, settings=settings)
    state.commitments = commitments  # the weights the members' work is counted by (`trust`)
    statements = _statements(answers)
    reducers = sorted(statements)  # the owners' slots, in the order every member sees them
    reveal = Reveal.make(
        signer,
        round=group.round,
        group_id=group.group_id,
        answers=[statements[r].signed for r in reducers],
        secret=secret,
    )
    others = [m for m in members if m != peer_id]
    told = [*others, *(m for m in audience if m != peer_id and m not in members)]
    state.revealed = True
    for peer in told:
        send(peer, REVEAL, reveal.signed)
    mail = state.mail
    seeders = seeders_of(members, group.owners)
    laggards = set() if laggards is None else laggards
    skipped = laggards | set(unwaited)
    waited = [m for m in others if m in seeders or m not in skipped]
    secrets, late = await _gather_secrets(
        mail,
        commitments,
        statements,
        state,
        waited,
        peer_id,
        secret,
        reveal_by,
        budget_s,
        seeders,
        grouped_at,
    )
    state.unrevealed = tuple(late)
    skipped |= set(late)  # nor are their projections waited for
    for peer in others:  # a seeder revealed (to someone), or is named late
        (laggards.discard if peer in mail.reveals or peer in seeders else laggards.add)(peer)
    drawn = [m for m in seeders if m in secrets]
    seed = verify.round_seed(
        group.group_id,
        [secrets[m] for m in drawn],
        [statements[r].signed.digest for r in reducers],
    )
    state.seed = seed  # for the owners' defense of their parts (`VerifyHandler._defend`)
    # Our projections and the checks of the answers run side by side (the executor has two threads).
    ours = loop.run_in_executor(executor, own_projections, payloads, list(layout), seed)
    clipped = clipped_answers(answers, peer_id)
    dots = loop.run_in_executor(executor, own_dots, payloads, list(layout), clipped) if clipped else None
    parts = parts_to_check(answers, layout=layout, settings=settings, skip={peer_id})
    checks = [loop.run_in_executor(executor, check_part, part, seed, settings) for part in parts]
    mine = await ours
    projected = Projections.make(
        signer,
        round=group.round,
        group_id=group.group_id,
        seed=seed,
        values=mine,
        secrets=[[m, secrets[m]] for m in drawn],
        dots=[None] * len(mine) if dots is None else await dots,
    )
    for peer in told:
        send(peer, PROJECT, projected.signed)
    checked = []
    for outcome in await asyncio.gather(*checks, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome
        checked.append(outcome)
    wanted = {
        c.part.contributors[i] for c in checked if c.tolerance is not None for i, _ in c.part.factors or []
    } - {peer_id}
    # Every other seeder's word before we apply without a secret (`_named_left`); else those the
    # checks use.
    needed = ((set(others) if late else wanted) & set(seeders)) - set(late)
    await _wait_graced(
        mail,
        lambda: needed <= set(mail.projections) | set(mail.gone),
        lambda: wanted - laggards - skipped <= set(mail.projections) | set(mail.gone),
        max(loop.time(), reveal_by) + budget_s,
    )
    _check_equivocations(mail)
    _named_left(mail, late)
    held = {p: s for p, s in mail.projections.items() if s.seed == seed}
    held[peer_id] = projected
    failed: list[Checked] = []
    for c in checked:
        try:
            finish_check(c, held, layout)
        except Caught as e:
            if e.proven:
                raise
            failed.append(c)
    liars: dict[str, str] = {}
    for c in failed:
        # A contributor may have sent a false projection to frame the owner: the owner holds the
        # payloads, and shows the false ones (`VerifyHandler._defend`); failing that, it is blamed.
        part = c.part
        accepted = [part.contributors[i] for i, _ in part.factors or []]
        listed = [held[p].signed for p in accepted if p in held]
        shown = await defend(part.owner, part.key, listed)
        true = await loop.run_in_executor(executor, _shown, shown, part, held, seed, layout)
        for peer, (value, claimed) in true.items():
            liars[peer] = f"{part.key!r}: said {claimed}, its payload gives {value}"
        finish_check(c, held, layout, {p: v for p, (v, _) in true.items()})
    return liars


def _shown(
    shown: Mapping[str, bytes],
    part: Part,
    held: Mapping[str, Projections],
    seed: bytes,
    layout: Mapping[str, int],
) -> dict[str, tuple[Shown, Shown]]:
    """The payloads an owner showed that prove their contributors' projections or inner products
    with the answer false: (true, claimed) by contributor. One that is not the committed payload, or
    that gives what its contributor said, proves nothing and is ignored."""
    at = layout[part.key]
    offered = {}
    for peer, payload in shown.items():
        if peer not in part.contributors or peer not in held:
            continue
        if verify.payload_digest(payload) == part.claims[part.contributors.index(peer)].digest:
            offered[peer] = payload
    proven = {}
    for peer, value in statements_of(offered, part.payload, seed, part.key).items():
        claimed = (held[peer].values[at], held[peer].dots[at])
        if not agree_all(value, claimed):
            proven[peer] = (value, claimed)
    return proven


async def _wait_graced(
    mail: Mailbox, needed: Callable[[], bool], wanted: Callable[[], bool], deadline: float
) -> None:
    """Wait for `needed()` until `deadline`, then for `wanted()` a grace longer
    (`trust.grace_s` of what `needed` took), within `deadline`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    await mail.wait(needed, deadline)
    took = loop.time() - start
    await mail.wait(wanted, min(deadline, loop.time() + grace_s(took)))


async def _gather_secrets(
    mail: Mailbox,
    commitments: Mapping[str, Commitment],
    statements: Mapping[str, AnswerStatement],
    state: RoundState,
    others: Sequence[str],
    peer_id: str,
    secret: bytes,
    reveal_by: float,
    budget_s: float,
    seeders: Sequence[str],
    grouped_at: float,
) -> tuple[dict[str, bytes], list[str]]:
    """The seeders' secrets, each matching its commitment: from its reveal (whose answers must be
    ours), or relayed in another member's projections (a member may reveal to some members only:
    what one honest member holds, all then hold), and the seeders whose secrets are missing a grace
    after they were late (`_late_reveal_at`): the seed is drawn without them (record 077). Caught
    when one is missing `budget_s` after `reveal_by` without having been late (too few of the
    others revealed to tell), or one left the round before revealing. The reveals of `others` that
    are not seeders are waited for a grace and checked like any."""

    def known() -> dict[str, bytes]:
        found = {peer_id: secret}
        for peer, revealed in mail.reveals.items():
            commitment = commitments.get(peer)
            if commitment is not None and digest(revealed.secret) == commitment.secret:
                found[peer] = revealed.secret
        for relayed in mail.projections.values():
            for peer, value in relayed.secrets:
                commitment = commitments.get(peer)
                if peer not in found and commitment is not None and digest(value) == commitment.secret:
                    found[peer] = value
        return found

    loop = asyncio.get_running_loop()
    required = [p for p in seeders if p != peer_id]
    start = loop.time()
    late = await _wait_seeders(mail, required, seeders, peer_id, grouped_at, start, reveal_by)
    # A seeder that withdrew before revealing sent its secret to nobody, so nobody can relay it: the
    # round fails now, not at `reveal_by` (where a dead owner's address answered nothing, the member
    # that had read its answer waited there 45 s, and the other survivor as long for its mark).
    unrevealed = [p for p in required if p in mail.unrevealed and p not in known()]
    if unrevealed:
        raise _left(mail, unrevealed)
    if not late:  # the other members' reveals, a grace as long again (`trust.grace_s`)
        grace = grace_s(loop.time() - start)
        await mail.wait(
            lambda: all(p in mail.reveals or p in mail.gone for p in others),
            min(reveal_by, loop.time() + grace),
        )
    if not all(p in known() for p in required):
        relay_by = reveal_by + budget_s
        if late or any(p in mail.gone for p in required if p not in known()):
            # Relayed in a projection: a member that holds the secret projects as soon as it has it,
            # so a grace of this member's own exchange (`trust.grace_s`), not the budget, nor of the
            # time since the group formed, which holds the late wait itself (record 057).
            relay_by = min(relay_by, loop.time() + grace_s(start - grouped_at))

        def relayed() -> bool:  # every other member that might hold a gone seeder's secret projected
            return all(m in mail.projections or m in mail.gone for m in others)

        # A seeder gone (no stream reaches it) may have revealed to the others before it died: its
        # secret then comes in their projections, where the seed is drawn with it (a seed drawn
        # without it would differ from theirs, and widen every check, as for a late seeder).
        await mail.wait(
            lambda: all(p in known() or (p in mail.gone and relayed()) for p in required), relay_by
        )
    _check_equivocations(mail)
    for revealed in mail.reveals.values():
        _check_reveal(revealed, commitments, statements, state)
    secrets = known()
    silent = [p for p in required if p not in secrets]
    gone = [p for p in silent if p in mail.gone]
    # A seeder gone before its secret reached this member is done without, as a late one is, while
    # more than half of the seeders' secrets are in hand (record 078): a node killed after one
    # member read its answer is late to that member and gone to the other, and both complete the
    # round. Before, the second failed the try while the first applied it, and averaged the round
    # again with the dead node's restart: two lineages (the container kill/restart test, CI of stop
    # 58). With too few secrets in hand, the round fails (`_left`).
    if gone and 2 * (len(seeders) - len(silent)) <= len(seeders):
        raise _left(mail, gone)
    waiting = [p for p in silent if p not in mail.gone]
    if waiting and not late:
        raise Caught(
            f"no reveal from {[p[-8:] for p in waiting]}",
            dict.fromkeys(waiting, "withheld its reveal"),
            proven=False,
        )
    return secrets, silent


async def _wait_seeders(
    mail: Mailbox,
    required: Sequence[str],
    seeders: Sequence[str],
    peer_id: str,
    grouped_at: float,
    started: float,
    reveal_by: float,
) -> bool:
    """Wait until every one of `required` (the other seeders) has revealed or left the round, at
    most until `reveal_by`, and no longer once those still missing are late (`_late_reveal_at`) or
    one withdrew without revealing (`Mailbox.unrevealed`: the round cannot complete); True when
    they were late."""
    loop = asyncio.get_running_loop()

    def moved() -> int:
        return len(mail.reveals) + len(mail.gone)

    while any(p not in mail.reveals and p not in mail.gone for p in required):
        if any(p in mail.unrevealed and p not in mail.reveals for p in required):
            return False
        late_at = _late_reveal_at(mail, required, seeders, peer_id, grouped_at, started)
        deadline = reveal_by if late_at is None else min(reveal_by, late_at)
        if loop.time() >= deadline:
            return late_at is not None and late_at < reveal_by
        await mail.wait(_changed(moved, moved()), deadline)
    return False


def _changed(count: Callable[[], int], seen: int) -> Callable[[], bool]:
    """Whether `count()` has moved from `seen` (a mailbox wait that ends at any arrival)."""
    return lambda: count() != seen


def _late_reveal_at(
    mail: Mailbox,
    required: Sequence[str],
    seeders: Sequence[str],
    peer_id: str,
    grouped_at: float,
    started: float,
) -> float | None:
    """The loop time past which the seeders yet to reveal are late: once more than half of the
    round's seeders have revealed (this member counted when it is one, from `started`), as long
    after the group formed as `wire.late_reveal_s` of the slowest of them. An honest seeder reveals
    once its own exchange is over, and the others' show how long that takes on this run's links;
    one that waits past it is treated as a late owner is (`Caught.late`: demoted where it had a
    record, left out a while where not). None while too few are in."""
    took = {p: mail.arrived[p] - grouped_at for p in required if p in mail.arrived}
    if peer_id in seeders:
        took[peer_id] = started - grouped_at
    if 2 * len(took) <= len(seeders):
        return None
    return grouped_at + late_reveal_s(max(0.0, *took.values()))


def _left(mail: Mailbox, seeders: Sequence[str]) -> Caught:
    """The round fails: `seeders` left it before their secrets reached this member. One this member
    could not reach is named; one that withdrew is named too, unless this member itself found some
    member of the round unreachable (then the withdrawal is borne out: an owner died mid-answer,
    and the member it left without an answer is not at fault), else it names whom it blamed as
    well, accuser and accused alike (a dispute no signature settles)."""
    culprits: dict[str, str] = {}
    for peer in seeders:
        if peer in mail.unreachable:
            culprits[peer] = "left the round (unreachable)"
        elif not mail.unreachable:
            culprits[peer] = f"left the round ({mail.gone[peer]})"
            for blamed in mail.withdrawals.get(peer, []):
                culprits.setdefault(blamed, f"could not be reached by {peer[-8:]}")
    names = sorted(p[-8:] for p in seeders)
    return Caught(f"{names} left the round before revealing", culprits, proven=False, gone=True)


def _named_left(mail: Mailbox, late: Sequence[str]) -> None:
    """The round fails when a member withdrew naming a seeder whose secret the seed was drawn
    without (`late`, gone or late to this member): that member failed the try over it (it could not
    reach it, with too few secrets in hand to do without it: `_left`), and were this member to apply
    the round, the two would go on from different θ (a member that failed a try the others applied
    averaged the round again with a dead node's restart: two lineages until the fork healing,
    record 078). A withdrawal naming a seeder whose secret is in the seed changes nothing: the
    withdrawn member only left the round."""
    named = {p: sorted(m[-8:] for m, blamed in mail.withdrawals.items() if p in blamed) for p in late}
    left = {p: by for p, by in named.items() if by}
    if left:
        raise Caught(
            f"{sorted(p[-8:] for p in left)} left the round before revealing"
            f" (named by a member that withdrew from it)",
            {p: f"left the round (named by {', '.join(by)}, which withdrew)" for p, by in left.items()},
            proven=False,
            gone=True,
        )


def _check_equivocations(mail: Mailbox) -> None:
    for peer, (kind, first, second) in mail.equivocations.items():
        raise blame(
            peer,
            "sent this peer two different statements of one round",
            proven=True,
            evidence=Evidence.equivocated(kind, first, second),
        )


def check_late_reveal(state: RoundState, peer: str) -> bool:
    """Whether `peer` revealed (to this member) in the round `state` holds, checked as a reveal in
    time is: True once it holds a secret that matches the peer's commitment and every answer this
    member holds; Caught (proven) where it shows a lie, the revealer's or an owner's. A member that
    `verify_round` did not wait for (`unwaited`) may reveal after the round: its work then counts
    (`HivemindAverager._credit_late`, record 079)."""
    revealed = state.mail.reveals.get(peer)
    if revealed is None:
        return False
    statements = _statements(state.answers)
    _check_reveal(revealed, state.commitments, statements, state)
    return True


def _statements(answers: Mapping[str, Answer]) -> dict[str, AnswerStatement]:
    """The owners' signed statements among `answers`, by slot (none for an answer made in process)."""
    return {slot: a.statement for slot, a in answers.items() if a.statement is not None}


def _check_reveal(
    revealed: Reveal,
    commitments: Mapping[str, Commitment],
    statements: Mapping[str, AnswerStatement],
    state: RoundState,
) -> None:
    """Caught (proven) unless `revealed` holds the secret its peer committed to and every answer
    this member holds (`_compare_answers`)."""
    commitment = commitments.get(revealed.peer)
    if commitment is None or digest(revealed.secret) != commitment.secret:
        raise blame(revealed.peer, "revealed a secret it had not committed to", proven=True)
    _compare_answers(revealed, statements, state)


def _compare_answers(reveal: Reveal, statements: Mapping[str, AnswerStatement], state: RoundState) -> None:
    """Caught unless `reveal` holds every answer statement this member holds: a different one,
    signed by its owner, proves that owner equivocated; one not signed by it, that the revealer lied."""
    group = state.group
    theirs: dict[tuple[str, tuple[str, ...]], Signed] = {}
    for signed in reveal.answers:
        try:
            fields = state.ring.open(signed, ANSWER)
        except BadStatement as e:
            raise blame(reveal.peer, f"revealed a forged answer: {e}", proven=True) from e
        if fields[1] != group.round or fields[2] != group.group_id or not isinstance(fields[4], list):
            raise blame(reveal.peer, "revealed an answer of another round", proven=True)
        theirs[(fields[3], tuple(map(str, fields[4])))] = signed
    for statement in statements.values():
        reducer = statement.owner
        other = theirs.get((reducer, tuple(statement.keys)))
        if other is None:
            raise blame(reveal.peer, f"revealed no answer of {reducer[-8:]}", proven=True)
        if other.body != statement.signed.body:
            raise blame(
                reducer,
                f"answered {reveal.peer[-8:]} otherwise than this peer",
                proven=True,
                evidence=Evidence.equivocated(ANSWER, statement.signed, other),
            )
