"""Send turns (`transport.turns`): each sender takes its receivers one at a time, each sender
starting with another, and a turn never waits on the one before it longer than that one's budget."""

from __future__ import annotations

import asyncio

import pytest

from adloco.protocol.transport.turns import TURN_FLOOR_S, chain, send_order, turn_budget_s


def test_every_sender_starts_with_another_receiver_and_each_receives_from_one_at_a_time() -> None:
    members = ["a", "b", "c", "d"]
    orders = {m: send_order(members, m) for m in members}
    assert orders["a"] == ["b", "c", "d"] and orders["c"] == ["d", "a", "b"]
    for step in range(len(members) - 1):
        receivers = [orders[m][step] for m in members]
        assert sorted(receivers) == members  # a permutation: nobody receives two streams at once


def test_the_budget_grows_with_the_bytes_from_a_floor() -> None:
    assert turn_budget_s(0, 1e6) == TURN_FLOOR_S
    assert turn_budget_s(10_000_000, 1e6) == pytest.approx(20.0)


def test_turns_run_one_after_another_and_a_stuck_turn_holds_the_next_for_its_budget_only() -> None:
    async def scenario() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        log: list[tuple[str, float]] = []
        turns = chain(["x", "y", "z"], {"x": 0.2, "y": 0.3, "z": 0.3})

        async def send(peer: str, seconds: float | None) -> None:
            await turns[peer].begin()
            log.append((f"{peer} begins", loop.time() - t0))
            if seconds is None:
                return  # stuck: never ends its turn (a receiver that stopped reading)
            await asyncio.sleep(seconds)
            turns[peer].end()

        # z asks first, y next, x last: the order is the chain's, not the callers'.
        await asyncio.gather(send("z", 0.0), send("y", None), send("x", 0.05))
        return log

    log = asyncio.run(scenario())
    assert [name for name, _ in log] == ["x begins", "y begins", "z begins"]
    times = dict(log)
    assert times["y begins"] == pytest.approx(0.05, abs=0.04)  # right after x ended
    assert times["z begins"] == pytest.approx(0.05 + 0.3, abs=0.06)  # y stuck: its budget, no more


def test_a_turn_whose_stream_failed_before_it_began_lets_the_next_go_at_once() -> None:
    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        turns = chain(["x", "y"], {"x": 5.0, "y": 5.0})
        t0 = loop.time()
        turns["x"].end()  # refused, or unreachable: nothing will be sent
        await turns["y"].begin()
        return loop.time() - t0

    assert asyncio.run(scenario()) < 0.1
