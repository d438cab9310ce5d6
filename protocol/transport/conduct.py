"""Whom this peer leaves out of its rounds, why, and for how long (`Verdicts`).

A round's failure names the peers at fault (`matchmaking.Caught`). This peer leaves them out of its
next rounds for a time that depends on how sure it is:
- `EXCLUDE_PROVEN_S` for a lie their own signatures prove (anyone can check it: `evidence`);
- `EXCLUDE_SEEN_S` for what only this peer saw (an answer that failed its projection);
- a silence (a member that sent no owner its parts) `EXCLUDE_SILENT_S` first, twice as long each
  time again within `BAN_S`, up to `EXCLUDE_SEEN_S`;
- a departure (a member no stream reaches any more, or one that withdrew) not at all the first time
  within `BAN_S`: a node that died and restarts under its key is grouped again at once; again, as a
  silence (a key that leaves rounds on purpose);
- a late owner (`Caught.late`) is not brought here when it had a record of work: the averager
  takes the record instead (`trust.WorkLedger.demote`), so it owns nothing until it has earned
  again, with more work each time; one without a record that completed a round with this peer
  before (a fresh swarm's partner: a node killed while it reduced looks the same) comes here as a
  departure, any other as seen.
Its readiness records then ask the others to leave them out too (`matchmaking.outvoted`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .matchmaking import Caught
from .owner import BAN_S

EXCLUDE_PROVEN_S = BAN_S
"""How long a peer caught by its own signed statements is left out of this peer's rounds (a lie
anyone can check), as long as an owner bans a member that broke the protocol."""
EXCLUDE_SEEN_S = BAN_S / 5
"""How long a peer caught only by this peer's observation (a silence, an answer that failed its
projection) is left out: a failure an honest peer can have (a dropped link) costs it less."""
EXCLUDE_SILENT_S = EXCLUDE_SEEN_S / 4
"""How long a member that sent no owner its parts (`Caught.silent`: it joined the group and then
sent nothing, or it died) is first left out; twice as long each time again within `BAN_S`, up to
`EXCLUDE_SEEN_S`. A node that died and restarts under its key loses no more than its restart; a
key that joins groups to hold them to the part deadline holds few."""


@dataclass(frozen=True)
class Verdict:
    """Why this peer leaves another out of its rounds, whether signed statements show it, and until
    when (the averager's loop time)."""

    why: str
    proven: bool
    until: float


class Verdicts:
    """The peers this peer leaves out now (module doc); times are the averager's loop time."""

    def __init__(self, peer_id: str) -> None:
        self._peer_id = peer_id
        self._held: dict[str, Verdict] = {}  # peers caught lying or silent, left out for a while
        self._silences: dict[str, tuple[int, float]] = {}  # peer -> (times seen silent, last time)
        self._departures: dict[str, tuple[int, float]] = {}  # peer -> (times it left a round, last time)

    def convict(self, caught: Caught, now: float) -> list[str]:
        """Leave the peers `caught` names out from `now`; returns those it left out (a departure
        the first time within `BAN_S`, and this peer itself, are not)."""
        until = now + (EXCLUDE_PROVEN_S if caught.proven else EXCLUDE_SEEN_S)
        left_out = []
        for peer, why in caught.culprits.items():
            if caught.gone and not caught.proven:
                times = _repeat(self._departures, peer, now)
                if times == 1:
                    continue
                until = now + min(EXCLUDE_SEEN_S, EXCLUDE_SILENT_S * 2 ** (times - 2))
            elif caught.silent and not caught.proven:
                times = _repeat(self._silences, peer, now)
                until = now + min(EXCLUDE_SEEN_S, EXCLUDE_SILENT_S * 2 ** (times - 1))
            if peer != self._peer_id:
                self._held[peer] = Verdict(why, caught.proven, until)
                left_out.append(peer)
        return left_out

    def current(self, now: float) -> dict[str, Verdict]:
        """The peers left out at `now`, with why."""
        return {p: v for p, v in list(self._held.items()) if v.until > now}


def _repeat(seen: dict[str, tuple[int, float]], peer: str, now: float) -> int:
    """Count `peer` once more in `seen` (peer -> (times, last time)), forgetting whatever is older
    than `BAN_S`; returns how many times it has been counted within `BAN_S` of each other."""
    for old in [p for p, (_, last) in seen.items() if now - last >= BAN_S]:
        del seen[old]
    times, _ = seen.get(peer, (0, now))
    seen[peer] = (times + 1, now)
    return times + 1
