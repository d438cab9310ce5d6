"""Sending to several peers one at a time, each sender starting with another: send turns.

In both phases of a round every peer sends to every other: a member its parts to their owners, an
owner its averages to the members. Sent all at once, a peer's streams share its uplink and each
receiver's downlink with the others', TCP shares the links unevenly, and the phase lasts until the
stream that came off worst is done. Behind 100 Mbit/s links (bench/allreduce.py, 3 peers, 33.6 MB
of fp16) one owner held its parts 1.8 s after the others in a 2 s phase, every round. Taken in
turns, in the order after the sender's own place in the group (`send_order`), at any moment each
peer sends one stream and receives one: a rotation, as in a ring's all-to-all schedule.

A turn waits for the one before it to be done, but no longer than that turn's budget (a few times
its bytes at the rate the peer expects or measured): a receiver that reads slowly, or never,
holds back the sender's other streams by that much at most, and a turn whose stream failed or was
never opened ends at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

TURN_SLACK = 2.0  # a turn's budget: this many times its bytes at the rate, and at least TURN_FLOOR_S
TURN_FLOOR_S = 0.5


def turn_budget_s(nbytes: int, rate_bps: float) -> float:
    """How long a turn of `nbytes` may hold back the next one, at `rate_bps` bytes/s."""
    return max(TURN_FLOOR_S, TURN_SLACK * nbytes / rate_bps)


def send_order(members: Sequence[str], me: str) -> list[str]:
    """The peers `me` sends to, in turn: those after it in the group, then those before it."""
    i = members.index(me)
    return [*members[i + 1 :], *members[:i]]


class SendTurn:
    """One receiver's place in a sender's order: its bytes go out once the previous receiver's have
    (or never will), or once the previous turn has had its `budget_s`, whichever comes first."""

    def __init__(self, previous: SendTurn | None, budget_s: float) -> None:
        self._previous, self.budget_s = previous, budget_s
        self._began_at: float | None = None
        self._began, self._done = asyncio.Event(), asyncio.Event()

    async def begin(self) -> None:
        """Wait for this turn (see the class docstring)."""
        previous = self._previous
        if previous is not None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(previous._began.wait(), previous.budget_s)
            began = previous._began_at
            # Not begun within its budget (its stream never got that far): no wait for its end.
            left = 0.0 if began is None else began + previous.budget_s - loop.time()
            if left > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(previous._done.wait(), left)
        self._start()

    def end(self) -> None:
        """This turn's payloads are out, or will never be: the next may go."""
        self._start()
        self._done.set()

    def _start(self) -> None:
        if self._began_at is None:
            self._began_at = asyncio.get_running_loop().time()
            self._began.set()


def chain(peers: Sequence[str], budget_s: dict[str, float]) -> dict[str, SendTurn]:
    """A turn per peer, each after the one before it in `peers`."""
    turns: dict[str, SendTurn] = {}
    previous: SendTurn | None = None
    for peer in peers:
        previous = turns[peer] = SendTurn(previous, budget_s[peer])
    return turns
