"""The simulator on the embedded corpus: loss falls, the batch adapts, switch mode and MIT merges
engage, and in async mode a slow peer's late contributions are corrected.

Each scenario runs once (module fixtures) and several tests read its records. Its simulation runs in
a subprocess (this file as a script) that conftest.py starts with the session, in the background at
the lowest priority (tests/background.py); the fixture collects the records it saved.
"""

from __future__ import annotations

import json
import math
import pickle
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import torch

from adloco.errors import UserError
from adloco.node.cli.sim import run
from adloco.node.sim.compute import StepCurve
from adloco.node.sim.engine import SimConfig, Simulator
from adloco.node.training.config import TrainConfig
from adloco.node.training.rounds import RoundRecord
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.heloco import HelocoConfig
from adloco.protocol.algorithms.merge import MergePolicy
from adloco.protocol.algorithms.schedule import ScheduleConfig

from background import collect, sim_scenario

SMALL = TrainConfig(
    seq_len=64,
    batch_size=4,
    instances=3,
    inner_steps=6,
    b_max=8,
    # η 0.5 (AdAdaGrad uses 0.1-0.5): the batch grows within the few rounds a test can afford.
    schedule=ScheduleConfig(eta=0.5, batch_cap=32, merge=MergePolicy(merge_every=2, min_instances=1)),
    max_corpus_mb=4,
)


def _collect(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str) -> Any:
    """What scenario `name` returned, run in the background (`SCENARIOS`; its files in `out`)."""
    started = collect(request, name, lambda: tmp_path_factory.mktemp(name), sim_scenario(name))
    returncode, _, stderr = started.result(timeout=280)
    assert returncode == 0, stderr[-3000:]
    return pickle.loads((started.folder / "records.pkl").read_bytes())


def _sim_time(record: RoundRecord) -> float:
    """The simulator's clock at `record` (the simulator always sets it)."""
    return cast(float, record.sim_time_s)


def _sync_run(out: Path) -> tuple[Path, list[RoundRecord]]:
    return out, run(SimConfig(peers=4, rounds=10, train=SMALL), out, quiet=True)


@pytest.fixture(scope="module")
def sync_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[RoundRecord]]:
    collected: tuple[Path, list[RoundRecord]] = _collect(request, tmp_path_factory, "sync_run")
    return collected


def test_writes_results_and_plots(sync_run: tuple[Path, list[RoundRecord]]) -> None:
    out, records = sync_run
    results = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in results] == list(range(1, 11))
    for key in (
        "round",
        "sim_time_s",
        "tokens",
        "round_bytes",
        "bytes_sent",
        "val_loss",
        "batch_sizes",
        "accum_steps",
        "instances",
        "staleness_mean",
    ):
        assert key in results[0]
    for name in ("val_loss_vs_tokens.png", "val_loss_vs_time.png", "val_loss_vs_bytes.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((out / "run.json").read_text())
    assert meta["final_val_loss"] == records[-1].val_loss


def test_validation_loss_falls_well_below_initial(sync_run: tuple[Path, list[RoundRecord]]) -> None:
    out, records = sync_run
    initial = json.loads((out / "run.json").read_text())["initial_val_loss"]
    assert initial > 5.0  # a random byte-level model starts near ln(256) = 5.55
    assert records[-1].val_loss < initial - 1.5
    assert all(r.group_size == 4 and r.staleness == 0 for r in records)


def test_adaptive_batch_grows(sync_run: tuple[Path, list[RoundRecord]]) -> None:
    _, records = sync_run
    # Merges move batch between slots without changing the total; only the norm test adds to it.
    totals = [sum(r.batch_sizes) for r in records]
    assert totals[0] == 3 * SMALL.batch_size
    assert totals[-1] > totals[0]
    assert totals == sorted(totals)  # monotone


def test_switch_mode_engages_above_b_max(sync_run: tuple[Path, list[RoundRecord]]) -> None:
    _, records = sync_run
    b_max = cast(int, SMALL.b_max)  # SMALL sets it
    for r in records:
        expected = max(-(-b // b_max) for b in r.batch_sizes)
        assert r.accum_steps == expected
    assert any(max(r.batch_sizes) > b_max and r.accum_steps > 1 for r in records)


def test_mit_merges_down_to_the_minimum(sync_run: tuple[Path, list[RoundRecord]]) -> None:
    _, records = sync_run
    instances = [r.instances for r in records]
    # merge_every=2: the merges decided after rounds 2 and 4 take effect in rounds 3 and 5.
    assert instances[:2] == [3, 3]
    assert instances[2:4] == [2, 2]
    assert all(k == 1 for k in instances[4:])


@pytest.fixture(scope="module")
def async_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[RoundRecord]]:
    collected: dict[str, list[RoundRecord]] = _collect(request, tmp_path_factory, "async_runs")
    return collected


def _async_runs(out: Path) -> dict[str, list[RoundRecord]]:
    # c_ok 0.6: late pseudo-gradients of this tiny run keep cos(Δ, m) around 0.3-0.7, which the
    # default c_ok 0.2 keeps as they are; a higher threshold makes the rotation branch act.
    train = replace(
        SMALL,
        instances=1,
        batch_size=8,
        inner_steps=4,
        outer=replace(SMALL.outer, lr=0.35),
        heloco=HelocoConfig(c_ok=0.6),
        non_iid=True,
    )
    runs = {}
    for name, correct in (("corrected", True), ("raw", False)):
        cfg = SimConfig(
            peers=3,
            rounds=10,
            mode="async",
            slowdown=(1.0, 1.0, 4.0),
            train=replace(train, correct_late=correct),
        )
        runs[name] = run(cfg, out / name, quiet=True)
    return runs


def test_async_slow_peer_arrives_late_and_is_corrected(async_runs: dict[str, list[RoundRecord]]) -> None:
    records = async_runs["corrected"]
    late = [r for r in records if r.staleness > 0]
    assert late, "the 4x slower peer never contributed late"
    assert all(r.late_contributions >= 1 for r in late)
    assert sum(r.late_corrected for r in late) >= 1
    assert sum(r.corrected_tensors for r in late) > 0  # the correction changed some tensors
    # Replaying the missed updates was paid for in bytes.
    assert all(r.catch_up_bytes > 0 for r in late)
    # Correction changed the trajectory relative to applying the same late Δ uncorrected.
    assert records[-1].theta_hash != async_runs["raw"][-1].theta_hash
    # The fast peers never wait for the slow one: most rounds run without it.
    assert sum(1 for r in records if r.group_size < 3) >= len(records) // 2
    assert records[-1].val_loss < records[0].val_loss


def test_async_without_correction_applies_late_contributions_as_they_are(
    async_runs: dict[str, list[RoundRecord]],
) -> None:
    records = async_runs["raw"]
    assert any(r.late_contributions > 0 for r in records)
    assert all(r.late_corrected == 0 and r.corrected_tensors == 0 for r in records)


@pytest.fixture(scope="module")
def overlap_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[RoundRecord]]:
    collected: dict[str, list[RoundRecord]] = _collect(request, tmp_path_factory, "overlap_runs")
    return collected


def _overlap_runs(out: Path) -> dict[str, list[RoundRecord]]:
    train = replace(SMALL, instances=2, inner_steps=4)
    runs = {}
    Scenario = tuple[str, Literal["sync", "async"], Literal["off", "rebase"], tuple[float, ...]]
    scenarios: tuple[Scenario, ...] = (
        ("off", "sync", "off", (1.0,)),
        ("rebase", "sync", "rebase", (1.0,)),
        ("async", "async", "rebase", (1.0, 1.0, 4.0)),
    )
    for name, mode, overlap, slowdown in scenarios:
        cfg = SimConfig(
            peers=3, rounds=6, mode=mode, slowdown=slowdown, train=replace(train, overlap=overlap)
        )
        runs[name] = run(cfg, out / name, quiet=True)
    return runs


def test_overlap_hides_communication_behind_the_next_local_round(
    overlap_runs: dict[str, list[RoundRecord]],
) -> None:
    off, on = overlap_runs["off"], overlap_runs["rebase"]
    # Without overlap members idle through the whole transfer; with it, only where it outlasts a round.
    assert all(r.wait_s >= r.comm_s - 1e-9 and r.comm_s > 0 for r in off)
    assert all(r.wait_s < r.comm_s for r in on)
    assert _sim_time(on[-1]) < _sim_time(off[-1])
    assert on[-1].val_loss < on[0].val_loss
    # MIT merges decided while the instances trained on still happen (at the end of their round).
    assert on[-1].instances < on[0].instances


def test_overlap_with_late_peers_agrees_and_corrects(overlap_runs: dict[str, list[RoundRecord]]) -> None:
    records = overlap_runs["async"]  # the engine itself asserts that members hold identical θ
    assert any(r.staleness > 0 for r in records)
    assert records[-1].val_loss < records[0].val_loss


def test_dylu_shortens_the_slow_peers_rounds_from_the_reported_step_times() -> None:
    """DyLU in the simulator is the swarm's: each member takes its speed from the step times the
    group reported (modelled here), so the 4x slower peer runs a quarter of H after its first round."""
    schedule = replace(SMALL.schedule, test="none")
    train = replace(SMALL, instances=1, inner_steps=8, dylu=True, schedule=schedule)
    cfg = SimConfig(peers=3, rounds=3, mode="sync", slowdown=(1.0, 1.0, 4.0), train=train)
    corpus, tokenizer = load_data(train)
    steps: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def run(config: SimConfig) -> Simulator:
        sim = Simulator(config, corpus, vocab_size=tokenizer.vocab_size)
        for i, peer in enumerate(sim.peers):
            original = peer.train_round

            def counted(*args: Any, _i: int = i, _f: Any = original, **kwargs: Any) -> Any:
                local = _f(*args, **kwargs)
                steps[_i].append(local.inner_steps)
                return local

            peer.train_round = counted  # type: ignore[method-assign]
        sim.run()
        return sim

    sim = run(cfg)
    assert [p.dylu_speed_ratio for p in sim.peers] == pytest.approx([1.0, 1.0, 0.25])
    assert steps[0] == steps[1] == [8] * 4  # the first round of each, then one per applied round
    assert steps[2] == [8, 2, 2, 2]
    steps.update({0: [], 1: [], 2: []})
    without = run(replace(cfg, train=replace(train, dylu=False)))
    assert all(p.dylu_speed_ratio is None for p in without.peers)
    assert steps[2] == [8] * 4


def test_hostile_peers_send_their_attack_and_the_owners_screen_or_bound_it() -> None:
    """The last peer attacks: ×−1000 is rejected part by part by the owners' norm test every round
    (what the attack sends does reach them), and a fixed direction at normal norm, which passes that
    test, moves CenteredClip's θ less than the mean's from the clean run's."""
    train = replace(SMALL, instances=1, inner_steps=4, schedule=replace(SMALL.schedule, test="none"))
    corpus, tokenizer = load_data(train)

    def run_sim(config: SimConfig) -> tuple[Simulator, list[RoundRecord], torch.Tensor]:
        sim = Simulator(config, corpus, vocab_size=tokenizer.vocab_size)
        records = sim.run()
        return sim, records, torch.cat([t.reshape(-1) for t in sim.peers[0].state.theta])

    base = SimConfig(peers=4, rounds=2, train=train)
    sim, flipped, _ = run_sim(replace(base, hostile=1, attack="flip1000"))
    assert [r.rejected_parts for r in flipped] == [len(sim.peers[0].names)] * 2
    # --outlier-factor 0 turns the norm test off: the same attack reaches the average.
    _, unscreened, _ = run_sim(
        replace(base, hostile=1, attack="flip1000", train=replace(train, outlier_factor=0.0))
    )
    assert [r.rejected_parts for r in unscreened] == [0, 0]
    _, _, clean = run_sim(base)
    moved = {}
    for spec in ("mean", "clip:1"):
        _, _, attacked = run_sim(
            replace(base, hostile=1, attack="constant", train=replace(train, aggregate=spec))
        )
        moved[spec] = float((attacked - clean).norm())
    assert moved["clip:1"] < moved["mean"]


def test_a_staller_costs_a_short_try_once_it_owns_parts_then_owns_nothing_for_longer() -> None:
    """`--attack stall` (issue 25 §2): the last peer contributes honestly until the others list it
    (a founder: after the fresh swarm's first round, `trust.WorkLedger.found`), so that it owns
    parts, then takes them and never answers. That try
    fails once the other owners have answered and it is late by their time (`wire.late_answer_s`
    of the link's time for a Δ each way), not after the exchange budget (the floors, 25 s); the
    honest peers demote it (`trust.WorkLedger.demote`): it stays a member, owns nothing, and needs
    `BAR_GROWTH` times more rounds of work before it owns again. Every round's members agree on θ
    (the engine checks). A clean run loses nothing."""
    from adloco.protocol.algorithms.trust import BAR_GROWTH, WORK_MIN_ROUNDS
    from adloco.protocol.transport.wire import LATE_FLOOR_S, late_answer_s

    train = replace(SMALL, instances=1, inner_steps=4, schedule=replace(SMALL.schedule, test="none"))
    corpus, tokenizer = load_data(train)
    base = SimConfig(peers=4, rounds=6, train=train, sec_per_sample=0.05)
    clean = Simulator(base, corpus, vocab_size=tokenizer.vocab_size)
    clean_records = clean.run()
    stalled = Simulator(replace(base, hostile=1, attack="stall"), corpus, vocab_size=tokenizer.vocab_size)
    records = stalled.run()
    assert clean.tries_lost == 0 and [r.group_size for r in clean_records] == [4] * 6
    assert stalled.tries_lost == 1 and [r.group_size for r in records] == [4] * 6
    # The failed try delays the round after the staller's first (a founder, listed from its second)
    # by what its lateness cost.
    after = 1
    # The honest owners' answers take a Δ each way at the link's rate (a little less than the
    # round's whole exchange, which moves the codec's actual bytes).
    assert LATE_FLOOR_S < stalled.stalled_s <= late_answer_s(records[after].comm_s) < 5.0  # budget: 25 s
    clean_round = _sim_time(clean_records[after]) - _sim_time(clean_records[after - 1])
    stall_round = _sim_time(records[after]) - _sim_time(records[after - 1])
    assert stall_round - clean_round == pytest.approx(stalled.stalled_s, abs=0.05)
    staller = stalled.peers[3].peer_id
    assert stalled.ledger.bar == WORK_MIN_ROUNDS * BAR_GROWTH and staller not in stalled.ledger.listed()
    assert len(stalled.ledger.listed()) == 3
    with pytest.raises(ValueError, match="sync mode only"):
        replace(base, hostile=1, attack="stall", mode="async")


def test_scoring_excludes_the_weighted_sign_flip_every_round_and_no_honest_peer() -> None:
    """With --score loss the hub judges every Δ on a batch no peer chooses: the peer sending −Δ
    with the most weight the round allows (which the norm screening lets through) is left out of
    every round, and a clean run keeps all four."""
    train = replace(
        SMALL, instances=1, inner_steps=4, schedule=replace(SMALL.schedule, test="none"), score="loss"
    )
    corpus, tokenizer = load_data(train)
    base = SimConfig(peers=4, rounds=2, train=train)
    attacked = Simulator(replace(base, hostile=1, attack="flip"), corpus, vocab_size=tokenizer.vocab_size)
    assert [r.group_size for r in attacked.run()] == [3, 3]
    assert attacked.scorer is not None
    assert (attacked.scorer.stats.judged, attacked.scorer.stats.excluded) == (8, 2)
    hashes = {p.state.theta_hash() for p in attacked.peers}
    assert len(hashes) == 1  # the excluded peer took the update as a listener
    clean = Simulator(base, corpus, vocab_size=tokenizer.vocab_size)
    assert [r.group_size for r in clean.run()] == [4, 4]
    assert clean.scorer is not None and clean.scorer.stats.excluded == 0


SCENARIOS: dict[str, Callable[[Path], Any]] = {
    "sync_run": _sync_run,
    "async_runs": _async_runs,
    "overlap_runs": _overlap_runs,
}

if __name__ == "__main__":  # python tests/test_sim.py SCENARIO FOLDER (tests/background.py)
    name, folder = sys.argv[1], Path(sys.argv[2])
    result = SCENARIOS[name](folder / "out")
    (folder / "records.pkl").write_bytes(pickle.dumps(result))


def test_a_measured_step_curve_times_each_pass_at_its_micro_batch(tmp_path: Path) -> None:
    """With `--step-curve` a peer's round takes the curve's time for each forward and backward pass at
    its micro-batch size: the first step of a round cut in two for the batch test counts two passes
    of half the batch. Points in between are interpolated, past the last one proportional."""
    path = tmp_path / "curve.json"
    points = [{"batch": 1, "step_s": 0.030}, {"batch": 2, "step_s": 0.032}, {"batch": 8, "step_s": 0.05}]
    path.write_text(json.dumps({"model": "m", "device": "d", "seq_len": 64, "points": points}))
    curve = StepCurve.load(path)
    assert curve.step_s(1) == 0.030 and curve.step_s(4) == pytest.approx(0.038)  # 0.032 + 2/6 · 0.018
    assert curve.step_s(16) == pytest.approx(0.1) and curve.round_s({2: 3, 8: 1}) == pytest.approx(0.146)
    train = replace(SMALL, instances=2, inner_steps=3, b_max=4)
    cfg = SimConfig(peers=2, rounds=1, train=train, step_curve=curve, sec_per_sample=99.0)
    corpus, tokenizer = load_data(train)
    sim = Simulator(cfg, corpus, vocab_size=tokenizer.vocab_size)
    locals_: list[Any] = []
    original = sim.peers[0].train_round

    def recorded(*args: Any, **kwargs: Any) -> Any:
        local = original(*args, **kwargs)
        locals_.append(local)
        return local

    sim.peers[0].train_round = recorded  # type: ignore[method-assign]
    records = sim.run()
    # Two instances, three steps of 4 each; each one's first step is two passes of 2 for the test.
    assert dict(locals_[0].passes) == {2: 4, 4: 4}
    expected = 4 * curve.step_s(2) + 4 * curve.step_s(4)
    assert sim.compute_time(0, locals_[0]) == pytest.approx(expected)
    assert locals_[0].report.step_time_s == pytest.approx(expected / 3)  # what the group is told
    assert cast(float, records[0].sim_time_s) >= expected  # not 99 s per sample
    assert cast(float, records[0].sim_time_s) < 10.0


def test_a_step_curve_that_is_not_one_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read"):
        StepCurve.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": [{"batch": 2, "step_s": 0.1}, {"batch": 2, "step_s": 0.2}]}))
    with pytest.raises(UserError, match="increasing"):
        StepCurve.load(bad)
    bad.write_text("{}")
    with pytest.raises(UserError, match="not a step curve"):
        StepCurve.load(bad)


def test_hide_comm_sets_h_so_the_round_outlasts_the_exchange() -> None:
    """Under --inner-steps-policy hide_comm every peer takes the same H from the group's reports: the
    exchange of the round's payload over the reported link, in modelled step times, × the margin."""
    from adloco.protocol.algorithms.adaptive import predicted_wire_bytes
    from adloco.protocol.algorithms.report import HIDE_MARGIN

    schedule = replace(SMALL.schedule, test="none", inner_steps_policy="hide_comm", max_inner_steps=400)
    train = replace(SMALL, instances=1, inner_steps=3, batch_size=4, codec="int8", schedule=schedule)
    cfg = SimConfig(peers=2, rounds=2, train=train, bandwidth_mbps=20.0, sec_per_sample=0.004)
    corpus, tokenizer = load_data(train)
    sim = Simulator(cfg, corpus, vocab_size=tokenizer.vocab_size)
    peer = sim.peers[0]
    payload = predicted_wire_bytes("int8", dict(zip(peer.names, peer.state.theta, strict=True)))
    exchange_s = payload * 2 * (2 - 1) / 2 / (20e6 / 8)
    expected = math.ceil(exchange_s / (4 * 0.004) * HIDE_MARGIN)
    assert 3 < expected < 400
    sim.run()
    assert [p.state.schedule.inner_steps for p in sim.peers] == [expected, expected]
