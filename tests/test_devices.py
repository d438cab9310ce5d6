"""The GPU path on a CPU: state placement, bf16 autocast and activation checkpointing.

No GPU runs here. What can run without one does: the cross-device code path (`Placement` with
`staged=True`, train and state devices both the CPU) against the plain one, bf16 autocast on the
CPU, activation checkpointing on a tiny model, and the precision decision for devices this machine
does not have (from what they can do, no CUDA call).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adloco.errors import UserError
from adloco.node.data.corpus import Corpus
from adloco.node.model.bmax import STATS_TENSORS, b_max_of, fitting_rows, saved_activation_bytes, static_bytes
from adloco.node.model.devices import Placement, precision_dtype
from adloco.node.model.model import build_model, enable_activation_checkpointing
from adloco.node.training.config import TrainConfig
from adloco.node.training.peer import Peer
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.allreduce import reduce_group

CPU = torch.device("cpu")
CFG = TrainConfig(seq_len=32, batch_size=4, instances=2, inner_steps=2, b_max=4, max_corpus_mb=1)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_data(CFG)[0]


def _peer(corpus: Corpus, cfg: TrainConfig = CFG, placement: Placement | None = None) -> Peer:
    return Peer(
        peer_id="a", index=0, num_peers=1, cfg=cfg, corpus=corpus, vocab_size=256, placement=placement
    )


def _round(peer: Peer) -> float:
    local = peer.train_round()
    contribution = peer.contribute(local)[0]
    assert contribution is not None
    peer.apply_round(reduce_group([contribution], codec=peer.downlink_codec(peer.state.schedule.codec)))
    return local.mean_loss


# ---- placement -----------------------------------------------------------------------------------


def test_a_gpu_peer_keeps_its_state_on_the_host() -> None:
    on_cpu = Placement.for_training(CPU)
    assert (on_cpu.state, on_cpu.staged, on_cpu.pin) == (CPU, False, False)
    on_gpu = Placement.for_training(torch.device("cuda:1"))
    assert (on_gpu.state, on_gpu.staged, on_gpu.pin) == (CPU, True, True)


class _Copies(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves the mode untyped
    """Records the size of every tensor a copy op writes (the real ops, as torch dispatches them)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten._to_copy):
            self.sizes.append(out.numel())
        return out


@contextmanager
def _copies() -> Iterator[_Copies]:
    with _Copies() as mode:
        yield mode


def test_staged_moves_go_tensor_by_tensor() -> None:
    torch.manual_seed(0)
    shapes = [(64, 8), (8,), (3, 5), (100,)]
    params = [torch.randn(s) for s in shapes]
    theta = [torch.randn(s) for s in shapes]
    staged = Placement(train=CPU, state=CPU, staged=True)
    largest = max(p.numel() for p in params)

    with _copies() as moves:
        delta = staged.delta(theta, params)
    # Each parameter leaves through the one staging buffer: one copy of it, never a flat model.
    assert moves.sizes == [p.numel() for p in params]
    assert staged._staging is not None and staged._staging.numel() == largest
    plain = Placement(train=CPU, state=CPU).delta(theta, params)
    for d, e in zip(delta, plain, strict=True):
        assert torch.equal(d, e)

    weights = [p.clone() for p in params]
    with _copies() as moves:
        held = staged.swap(params, theta)
    assert max(moves.sizes) <= largest and len(moves.sizes) == 2 * len(params)
    assert all(torch.equal(p, t) for p, t in zip(params, theta, strict=True))
    with _copies() as moves:
        staged.load(params, held)
    assert moves.sizes == [p.numel() for p in params]
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))


@pytest.mark.parametrize("overlap", ["off", "mix"])
def test_a_staged_peer_trains_bit_identically_and_keeps_theta_apart(corpus: Corpus, overlap: Any) -> None:
    cfg = replace(CFG, overlap=overlap)
    plain = _peer(corpus, cfg)
    staged = _peer(corpus, cfg, Placement(train=CPU, state=CPU, staged=True))
    _assert_state_apart(staged)
    for _ in range(2):
        assert _round(plain) == _round(staged)
    assert plain.state.theta_hash() == staged.state.theta_hash()
    weights = [p.detach().clone() for p in staged.local_instances[0].params]
    assert plain.validation_loss() == staged.validation_loss()
    # Evaluating θ through the instance gave the instance its own weights back, bit for bit.
    assert all(torch.equal(p, w) for p, w in zip(staged.local_instances[0].params, weights, strict=True))
    _assert_state_apart(staged)


def _assert_state_apart(peer: Peer) -> None:
    """θ, m and the round starts (θ itself without overlap) are the state's own memory, never the
    instances' parameters."""
    params = {p.untyped_storage().data_ptr() for inst in peer.local_instances for p in inst.params}
    starts = [t for inst in peer.local_instances for t in inst.start]
    for t in (*peer.state.theta, *peer.state.momentum, *starts):
        assert t.untyped_storage().data_ptr() not in params


# ---- precision -----------------------------------------------------------------------------------


def test_precision_follows_what_the_device_can_do() -> None:
    assert precision_dtype("auto", device_type="cpu", bf16_native=True) is None
    assert precision_dtype("auto", device_type="cuda", bf16_native=True) is torch.bfloat16
    assert precision_dtype("auto", device_type="cuda", bf16_native=False) is None
    assert precision_dtype("fp32", device_type="cuda", bf16_native=True) is None
    assert precision_dtype("bf16", device_type="cpu", bf16_native=True) is torch.bfloat16
    for device_type, native in (("cuda", False), ("mps", False)):
        with pytest.raises(UserError) as e:
            precision_dtype("bf16", device_type=device_type, bf16_native=native, device_name="Tesla T4")
        assert str(e.value).startswith("--precision bf16:") and "\n" not in str(e.value)


def test_bf16_autocast_trains_and_theta_stays_fp32(corpus: Corpus) -> None:
    peer = _peer(corpus, replace(CFG, precision="bf16"))
    assert peer.autocast_dtype is torch.bfloat16
    seen: list[torch.dtype] = []
    # A linear layer of the transformer body (the output embedding runs in the fused loss, no module).
    body = cast(Any, peer.local_instances[0].model).base_model
    linear = next(m for m in body.modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    try:
        loss = _round(peer)
    finally:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the training forwards ran under autocast
    assert torch.isfinite(torch.tensor(loss))
    assert all(t.dtype == torch.float32 for t in (*peer.state.theta, *peer.state.momentum))
    for inst in peer.local_instances:
        assert all(p.dtype == torch.float32 for p in inst.params)
        moments = [v for s in inst.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert moments and all(m.dtype == torch.float32 for m in moments)
    # bf16 rounding changes the training, not the state: θ moved, and differently from fp32's.
    fp32 = _peer(corpus)
    _round(fp32)
    assert fp32.state.theta_hash() != peer.state.theta_hash()


# ---- activation checkpointing ------------------------------------------------------------------


def test_activation_checkpointing_gives_the_same_loss_and_gradients() -> None:
    plain, checkpointed = build_model(None, seed=3), build_model(None, seed=3)
    enable_activation_checkpointing(checkpointed)
    x = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, checkpointed):
        model.train()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(float(loss.detach()))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)
    # And it did checkpoint: autograd keeps a fraction of the activations.
    kept = [saved_activation_bytes(m, batch=4, seq_len=48, vocab_size=256) for m in (plain, checkpointed)]
    assert kept[1] < 0.5 * kept[0]


def test_every_instance_checkpoints_and_checkpoints_record_the_model_as_built(corpus: Corpus) -> None:
    peer = _peer(corpus, replace(CFG, activation_checkpointing=True))
    for inst in peer.local_instances:  # the copies too
        assert any(getattr(m, "gradient_checkpointing", False) for m in inst.model.modules())
    assert '"use_cache": false' not in peer.state_dict()["model_config"]
    assert torch.isfinite(torch.tensor(_round(peer)))


# ---- b_max -----------------------------------------------------------------------------------------


def test_b_max_counts_instances_statistics_state_and_precision() -> None:
    model = build_model(None, seed=0)
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    assert static_bytes(model, instances=2, state_on_device=False) == 32 * n + STATS_TENSORS * 4 * largest
    assert static_bytes(model, instances=2, state_on_device=True) == 48 * n + STATS_TENSORS * 4 * largest
    budget = 48 << 20
    kwargs: dict[str, Any] = {"seq_len": 64, "vocab_size": 256, "budget_bytes": budget}
    host_state = b_max_of(fitting_rows(model, **kwargs))
    gpu_state = b_max_of(fitting_rows(model, **kwargs, state_on_device=False))
    bf16 = b_max_of(fitting_rows(model, **kwargs, autocast_dtype=torch.bfloat16))
    assert host_state < gpu_state  # θ, m, Δ and e on the probed device leave less room
    assert host_state < bf16  # bf16 activations take less room per sample
    enable_activation_checkpointing(model)
    assert host_state < b_max_of(fitting_rows(model, **kwargs))
