"""An instance's decoder layers sharded over its data-parallel group (FSDP2, `training.sharding`):
two real processes over gloo on this CPU, against record 064's replicated step and one device alone
(a node's instance sharded over its devices: tests/test_multidevice.py)."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing
from torch._C._distributed_c10d import TCPStore

from adloco.node.data.sampling import TokenSampler
from adloco.node.model import bmax
from adloco.node.model.devices import is_sharded
from adloco.node.model.model import build_model
from adloco.node.training import parallel, sharding
from adloco.node.training.instances import InnerConfig, Instance
from adloco.protocol.algorithms.switch import BatchPlan

SEQ = 32
# A GPT-2 of the node's kind (the tied head, `TiedEmbedding`) small enough for three steps a second.
GPT2 = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "vocab_size": 256,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}


def _instance(spec: str, *, grad_clip: float) -> Instance:
    model = build_model(spec, vocab_size=256, seed=0, max_seq_len=64)
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(5))
    return Instance(
        slot=0,
        model=model,
        sampler=TokenSampler([tokens], seq_len=SEQ, seed=3),
        inner=InnerConfig(lr=1e-2, grad_clip=grad_clip),
        batch_stats="sums",
    )


def _steps(
    member: parallel.Member, group: parallel.Group, plans: list[BatchPlan], sampler: TokenSampler
) -> list[Any]:
    """The plans' steps as member `group.rank` (rank 0 draws the rows); each step's loss and stats."""
    out = []
    for plan in plans:
        loss, stats = parallel._step(
            member,
            group,
            micro=plan.micro,
            accum=plan.accum,
            cols=SEQ,
            stats="sums",
            draw=sampler.next_batch if group.rank == 0 else None,
        )
        out.append(
            (float(loss), None if stats is None else (stats.sq_dev_sum, stats.mean_sq_norm, stats.num_grads))
        )
    return out


def _member(rank: int, port: int, spec: str, plans: list[BatchPlan], grad_clip: float, out: str) -> None:
    """One member: the plans' steps replicated (record 064), then sharded (the primary through its
    trainer, a sharded copy; the replica sharded in place), then θ through the shards."""
    try:
        torch.set_num_threads(1)
        result: dict[str, Any] = {}
        replicated = _instance(spec, grad_clip=grad_clip)
        replicated.join(parallel.GroupSpec(port, "replicated/", rank, 2))
        assert replicated.group is not None
        result["replicated"] = _steps(replicated, replicated.group, plans, replicated.sampler)
        result["replicated_params"] = [p.detach().clone() for p in replicated.params]
        replicated.leave()

        inst = _instance(spec, grad_clip=grad_clip)
        inst.join(parallel.GroupSpec(port, "sharded/", rank, 2, sharded=True))
        assert inst.group is not None
        group = inst.group
        member: parallel.Member = inst
        if rank == 0:  # (the primary trains a sharded copy: its own weights stay whole)
            assert inst.trainer is not None
            member = inst.trainer
        assert member.sharded_layers is not None
        result["sharded_count"] = sum(1 for p in member.params if is_sharded(p))
        result["local_values"] = sum(sharding.local(p).numel() for p in member.params)
        result["sharded"] = _steps(member, group, plans, inst.sampler)
        # what it holds after the steps: its weights, gradients and AdamW moments (a shard's or whole)
        held = [p for p in member.params] + [p.grad for p in member.params if p.grad is not None]
        held += [t for state in member.optimizer.state.values() for t in state.values() if t.dim()]
        result["held_bytes"] = sum(sharding.local(t).numel() * t.element_size() for t in held)
        shares = sharding.shares(inst.model, 2)
        result["member_bytes"] = bmax.member_bytes(sum(p.numel() for p in inst.params), shares)
        result["sharded_params"] = [t.clone() for t in sharding.gather(member.params)]
        # θ into the shards and back: rank 0's tensors, whole on every member again.
        theta = [
            torch.randn(p.shape, generator=torch.Generator().manual_seed(j))
            for j, p in enumerate(member.params)
        ]
        sharding.scatter(
            member.params, theta if rank == 0 else None, rank=rank, size=2, broadcast=group.broadcast
        )
        result["round_trip"] = all(
            torch.equal(t, whole) for t, whole in zip(theta, sharding.gather(member.params), strict=True)
        )
        inst.leave()
        torch.save(result, f"{out}.{rank}")
    except BaseException:
        Path(f"{out}.{rank}.err").write_text(traceback.format_exc())
        raise


def _run(tmp_path: Path, spec: str, plans: list[BatchPlan], *, grad_clip: float) -> list[dict[str, Any]]:
    return _spawn(tmp_path, _member, spec, plans, grad_clip)


def _spawn(tmp_path: Path, target: Callable[..., None], *args: Any) -> list[dict[str, Any]]:
    """Two members, `target(rank, port, *args, out)` each in a process of its own; what they saved."""
    store = TCPStore("127.0.0.1", 0, None, True, timeout=parallel.TIMEOUT, wait_for_workers=False)
    out = str(tmp_path / "member")
    ctx = torch.multiprocessing.get_context("spawn")
    members = [ctx.Process(target=target, args=(rank, store.port, *args, out)) for rank in range(2)]
    try:
        for m in members:
            m.start()
        for m in members:
            m.join(timeout=240)
    finally:
        for m in members:
            if m.is_alive():
                m.kill()
                m.join()
    errors = [p.read_text() for p in sorted(tmp_path.glob("member.*.err"))]
    assert not errors, errors[0]
    assert [m.exitcode for m in members] == [0, 0]
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.fixture(params=["tiny-llama", "gpt2"])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "gpt2":
        path = tmp_path / "gpt2.json"
        path.write_text(json.dumps(GPT2))
        return str(path)
    return str(request.param)


def test_sharded_layers_train_the_replicated_step_s_weights_bit_for_bit(tmp_path: Path, spec: str) -> None:
    """One pass per member (2 rows each), no clip: the layers' gradients reduce-scattered by FSDP2
    are the replicated path's all-reduced sums, so every weight after three steps is the same bits;
    each member holds about half of the layers' values, and θ scattered into the shards gathers back."""
    plans = [BatchPlan(micro=2, accum=2)] * 3
    members = _run(tmp_path, spec, plans, grad_clip=0.0)
    first = members[0]
    assert first["sharded_count"] > 0
    whole = sum(p.numel() for p in first["replicated_params"])
    assert all(m["local_values"] < 0.8 * whole for m in members)
    assert all(
        torch.equal(a, b) for a, b in zip(first["sharded_params"], first["replicated_params"], strict=True)
    )
    # every member gathered the same weights
    assert all(
        torch.equal(a, b) for a, b in zip(members[1]["sharded_params"], first["sharded_params"], strict=True)
    )
    for (loss_s, stats_s), (loss_r, stats_r) in zip(first["sharded"], first["replicated"], strict=True):
        assert loss_s == loss_r
        # the same two samples (a member's one pass is its share), norms summed in another order
        assert stats_s[2] == stats_r[2] == 2
        assert stats_s[0] == pytest.approx(stats_r[0], rel=1e-6)
        assert stats_s[1] == pytest.approx(stats_r[1], rel=1e-9)
    assert all(m["round_trip"] for m in members)
    # b_max's estimate counts what each member holds (`bmax.member_bytes`: the largest share, so
    # rank 0's, which takes the odd row of each layer's tensors)
    assert members[0]["held_bytes"] == pytest.approx(members[0]["member_bytes"], rel=0.01)
    assert members[1]["held_bytes"] <= members[0]["held_bytes"]


def test_sharded_layers_take_a_sample_per_pass_as_one_device_takes_one_per_micro_batch(
    tmp_path: Path, spec: str
) -> None:
    """Two and three passes per member (one of them empty on the member with fewer rows), the clip
    on: weights, losses and the norm test's statistics those of one device accumulating the same
    micro-batches (`Instance._step_with_sums`), to rounding."""
    plans = [BatchPlan(micro=1, accum=4), BatchPlan(micro=1, accum=3), BatchPlan(micro=1, accum=4)]
    members = _run(tmp_path, spec, plans, grad_clip=0.05)
    alone = _instance(spec, grad_clip=0.05)
    start = [p.detach().clone() for p in alone.params]
    for plan, (loss_s, stats_s) in zip(plans, members[0]["sharded"], strict=True):
        loss, stats = alone.inner_step(plan, collect_stats=True)
        assert stats is not None
        assert loss_s == pytest.approx(float(loss), rel=1e-5)
        assert stats_s[2] == stats.num_grads == plan.accum
        assert stats_s[1] == pytest.approx(stats.mean_sq_norm, rel=1e-4)
        assert stats_s[0] == pytest.approx(stats.sq_dev_sum, rel=1e-4)
    # Each tensor's three steps alike to rounding (AdamW magnifies it where a moment is near 0, so
    # the whole step's difference is measured against the step, not each value's).
    for a, b, s in zip(members[0]["sharded_params"], alone.params, start, strict=True):
        assert float((a - b.detach()).norm()) <= 1e-4 * float((b.detach() - s).norm())


def _failing_member(rank: int, port: int, fails: int, out: str) -> None:
    """Three sharded steps, then a fourth in which member `fails` raises inside its last layer's
    forward pass and lives on, still holding its sharded model (`member`), so that the layers' group
    stays open (a node drops its trainer, `sharding.release`: tests/test_multidevice.py), while the
    other waits in FSDP2's collectives: the other records how long it waited and what ended it."""
    try:
        torch.set_num_threads(1)
        parallel.FLOOR_S = 3.0  # (a tiny model's steps take tens of ms here: the floor sets the bound)
        inst = _instance("tiny-llama", grad_clip=0.0)
        inst.join(parallel.GroupSpec(port, "failing/", rank, 2, sharded=True))
        assert inst.group is not None
        member: parallel.Member = inst.trainer if rank == 0 and inst.trainer is not None else inst
        plan = [BatchPlan(micro=2, accum=2)]
        for _ in range(3):
            _steps(member, inst.group, plan, inst.sampler)
        if rank == fails:

            def fail(*_: Any) -> None:
                raise RuntimeError("injected: out of memory")

            sharding.decoder_layers(member.model)[-1].register_forward_hook(fail)
        start = time.perf_counter()
        try:
            _steps(member, inst.group, plan, inst.sampler)
            result: dict[str, Any] = {"error": None}
        except RuntimeError as e:
            result = {"error": str(e)}
        result["waited_s"] = time.perf_counter() - start
        if rank == fails:
            inst.leave()  # (what a failed round does; `member` keeps the layers' group open)
            other = Path(f"{out}.{1 - rank}")
            deadline = time.monotonic() + 200
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        torch.save(result, f"{out}.{rank}.part")
        Path(f"{out}.{rank}.part").rename(f"{out}.{rank}")
    except BaseException:
        Path(f"{out}.{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("fails", [0, 1], ids=["the-primary-fails", "the-replica-fails"])
def test_a_member_failing_inside_a_sharded_step_lets_the_other_go_in_its_measured_time(
    tmp_path: Path, fails: int
) -> None:
    """A member raising in the middle of a step's forward pass and living on with its sharded model:
    the other, waiting in one of FSDP2's collectives, is let go by the timeout measured on the earlier
    steps (10 × the step, at least the floor: 3 s here), not the group's 30 minutes; its step raises."""
    members = _spawn(tmp_path, _failing_member, fails)
    failed, other = members[fails], members[1 - fails]
    assert failed["error"] == "injected: out of memory"
    assert other["error"] is not None and "timed out" in other["error"].lower()
    assert 3.0 <= other["waited_s"] < 60.0
