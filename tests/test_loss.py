"""`causal_lm_loss`: transformers' loss and gradients, without the whole logits tensor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest
import torch

from adloco.node.model import loss as loss_module
from adloco.node.model.loss import TiedEmbedding, causal_lm_loss, fused_head
from adloco.node.model.model import build_model, compile_missing

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VOCAB = 300
TINY_GPT2 = (
    '{"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "vocab_size": 300}'
)


@pytest.fixture
def gpt2_config(tmp_path: Path) -> str:
    path = tmp_path / "gpt2.json"
    path.write_text(TINY_GPT2)
    return str(path)


_LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def _model(spec: str) -> PreTrainedModel:
    model = build_model(spec, vocab_size=VOCAB, max_seq_len=64)
    model.eval()  # no dropout: both losses see the same forward pass
    return model


def _lookup(model: PreTrainedModel) -> TiedEmbedding:
    """The input embedding of a model whose head is tied to it (build_model makes it a TiedEmbedding)."""
    return cast(TiedEmbedding, model.get_input_embeddings())


def _loss_and_grads(model: torch.nn.Module, fn: _LossFn, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = fn(model, x)
    torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
    return float(loss.detach()), [cast(torch.Tensor, p.grad).clone() for p in model.parameters()]


def _reference(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(input_ids=x, labels=x).loss
    return out


@pytest.mark.parametrize("spec", ["tiny-llama", "gpt2", "bloom"])
def test_loss_and_every_gradient_match_transformers_over_several_uneven_chunks(
    spec: str, gpt2_config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 7 tokens over 3 × 19 targets (the last chunk shorter); gpt2 and bloom tie the output
    embedding to the input one, so its gradient is the sum of both uses (the lookup's rows added to
    the head's gradient in place; transformers' loss through the same lookup gets its dense one)."""
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * VOCAB * 7)
    model = _model(gpt2_config if spec == "gpt2" else spec)
    assert fused_head(model) is not None
    embedding = model.get_input_embeddings()
    tied = embedding.weight is model.get_output_embeddings().weight
    assert isinstance(embedding, TiedEmbedding) == tied  # build_model ties the lookup's gradient
    x = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(model, _reference, x)
    loss, grads = _loss_and_grads(model, causal_lm_loss, x)
    assert all(g.layout == torch.strided for g in grads)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("spec", ["tiny-llama", "gpt2"])
def test_the_gpu_form_of_the_head_matches_transformers_loss_under_bf16_autocast(
    spec: str, compiled: bool, gpt2_config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, chunks of GPU_CHUNK_BYTES, the output embedding padded to a multiple of VOCAB_PAD
    rows (300 → 320 here), the chunk's softmax terms in one function (compiled where the model's
    layers are), and the head's weight gradient in bf16 under a bf16 autocast (as autocast forms any
    linear layer's). Run here on the CPU by taking it for a GPU, with chunks of 7 tokens: the loss
    and every gradient within bf16 rounding of transformers' own loss under the same autocast."""
    if compiled and compile_missing(torch.device("cpu")) is not None:
        pytest.skip(f"{compile_missing(torch.device('cpu'))} (apt-get install g++)")
    monkeypatch.setattr(loss_module, "_is_gpu", lambda device: True)
    monkeypatch.setattr(loss_module, "GPU_CHUNK_BYTES", 4 * VOCAB * 7)
    model = _model(gpt2_config if spec == "gpt2" else spec)
    setattr(model, loss_module.COMPILED_MARK, compiled)
    x = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))

    LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]

    def under_bf16(fn: LossFn) -> LossFn:
        def run(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(m, ids)

        return run

    ref_loss, ref_grads = _loss_and_grads(model, under_bf16(_reference), x)
    loss, grads = _loss_and_grads(model, under_bf16(causal_lm_loss), x)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        assert float((g - r).norm()) <= 3e-2 * float(r.norm()) + 1e-6


def test_a_tied_weight_gets_the_head_gradient_itself_with_the_lookup_rows_added_in_place(
    gpt2_config: str,
) -> None:
    """The tied weight's gradient is the tensor the fused head formed in the forward pass (no second
    V x D tensor), it is the sum of both uses, and gradient accumulation still adds up."""
    model = _model(gpt2_config)
    weight = _lookup(model).weight
    formed: list[int] = []
    zeros_like = torch.zeros_like

    def spy(t: torch.Tensor, **kwargs: object) -> torch.Tensor:
        out = zeros_like(t, **kwargs)  # type: ignore[arg-type]
        if t is weight:
            formed.append(out.data_ptr())
        return out

    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    _, ref_grads = _loss_and_grads(model, _reference, x)
    model.zero_grad(set_to_none=True)
    torch.zeros_like = spy  # type: ignore[assignment]
    try:
        torch.autograd.backward(causal_lm_loss(model, x))
    finally:
        torch.zeros_like = zeros_like
    assert weight.grad is not None and formed == [weight.grad.data_ptr()]
    torch.testing.assert_close(weight.grad, ref_grads[0], rtol=1e-4, atol=1e-6)
    assert _lookup(model).pending is None
    torch.autograd.backward(causal_lm_loss(model, x))  # accumulates onto the first
    torch.testing.assert_close(weight.grad, 2 * ref_grads[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_padded_gpu_form_in_fp32_is_the_cpu_form_to_rounding(
    compiled: bool, gpt2_config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The padding rows of the GPU form (zero weights, logits masked out of the softmax) change
    nothing: in fp32 its loss and every gradient are the CPU form's to float rounding."""
    if compiled and compile_missing(torch.device("cpu")) is not None:
        pytest.skip(f"{compile_missing(torch.device('cpu'))} (apt-get install g++)")
    model = _model(gpt2_config)
    x = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))
    cpu_loss, cpu_grads = _loss_and_grads(model, causal_lm_loss, x)
    monkeypatch.setattr(loss_module, "_is_gpu", lambda device: True)
    monkeypatch.setattr(loss_module, "GPU_CHUNK_BYTES", 4 * VOCAB * 7)
    setattr(model, loss_module.COMPILED_MARK, compiled)
    loss, grads = _loss_and_grads(model, causal_lm_loss, x)
    assert loss == pytest.approx(cpu_loss, rel=1e-6)
    for g, r in zip(grads, cpu_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_accumulating_adds_the_head_gradient_into_the_held_one_with_no_vocab_sized_tensor(
    gpt2_config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A micro-batch after the first (the weight has a gradient) gets its head gradient formed at the
    end of the backward pass, straight into the held gradient: no V x D tensor, the sum as before,
    and the incoming gradient (loss / accum) scales it."""
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * VOCAB * 5)  # several chunks of logits again
    model = _model(gpt2_config)
    weight = _lookup(model).weight
    x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(7))
    _, ref_grads = _loss_and_grads(model, _reference, x)
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(causal_lm_loss(model, x[:2]) / 2)
    assert weight.grad is not None
    held = weight.grad.data_ptr()
    shapes: list[tuple[int, ...]] = []
    zeros, zeros_like = torch.zeros, torch.zeros_like

    def spy_zeros(*size: object, **kwargs: object) -> torch.Tensor:
        out: torch.Tensor = zeros(*size, **kwargs)  # type: ignore[call-overload]
        shapes.append(tuple(out.shape))
        return out

    def spy_zeros_like(t: torch.Tensor, **kwargs: object) -> torch.Tensor:
        out = zeros_like(t, **kwargs)  # type: ignore[arg-type]
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "zeros", spy_zeros)
    monkeypatch.setattr(torch, "zeros_like", spy_zeros_like)
    torch.autograd.backward(causal_lm_loss(model, x[2:]) / 2)
    monkeypatch.undo()
    assert tuple(weight.shape) not in shapes and weight.grad.data_ptr() == held
    assert _lookup(model).pending_head is None
    for p, r in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_deferred_head_gradient_is_the_one_formed_in_the_forward_pass(
    gpt2_config: str, autocast: bool
) -> None:
    """`defer_head` (the norm test's replay): the weight's gradient is formed after the body's
    backward pass and handed to autograd, so post-accumulate hooks see it; it equals the one the
    forward pass forms (bf16 autocast included, where both form the logits the same way)."""
    model = _model(gpt2_config)
    lookup = _lookup(model)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(8))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, direct = _loss_and_grads(model, causal_lm_loss, x)
        seen: list[torch.Tensor] = []
        # torch leaves the hook registration unannotated
        handle = lookup.weight.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda p: seen.append(p.grad.clone())
        )
        lookup.defer_head = True
        try:
            _, deferred = _loss_and_grads(model, causal_lm_loss, x)
        finally:
            lookup.defer_head = False
            handle.remove()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], direct[0], rtol=1e-5, atol=1e-7)
    for d, r in zip(deferred, direct, strict=True):
        torch.testing.assert_close(d, r, rtol=1e-5, atol=1e-7)


def test_the_incoming_gradient_scales_both_kept_gradients(gpt2_config: str) -> None:
    """Accumulation backpropagates loss / accum: every gradient is that fraction of the full one."""
    model = _model(gpt2_config)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    _, full = _loss_and_grads(model, causal_lm_loss, x)
    _, third = _loss_and_grads(model, lambda m, b: causal_lm_loss(m, b) / 3, x)
    for f, t in zip(full, third, strict=True):
        torch.testing.assert_close(t, f / 3, rtol=1e-5, atol=1e-8)


def test_bf16_autocast_stays_close_to_the_fp32_reference(gpt2_config: str) -> None:
    model = _model(gpt2_config)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads = _loss_and_grads(model, _reference, x)

    def bf16(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return causal_lm_loss(m, b)

    loss, grads = _loss_and_grads(model, bf16, x)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == torch.float32
        assert float((g - r).norm()) <= 0.05 * float(r.norm()) + 1e-6


def test_without_autograd_only_the_loss_is_computed(gpt2_config: str) -> None:
    model = _model(gpt2_config)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        loss = causal_lm_loss(model, x)
        assert float(loss) == pytest.approx(float(_reference(model, x)), rel=1e-6)
    assert not loss.requires_grad


def test_no_logits_sized_tensor_is_kept_for_the_backward_pass(gpt2_config: str) -> None:
    """What autograd keeps after the forward pass (its saved tensors, by storage) shrinks by at least
    the logits-sized log-softmax transformers' loss keeps (B·T·V·4 bytes)."""

    def saved_bytes(fn: _LossFn, x: torch.Tensor) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(model, x)
        del loss
        return sum(seen.values())

    model = _model(gpt2_config)
    x = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(5))
    logits_bytes = 4 * 64 * VOCAB * 4
    assert saved_bytes(causal_lm_loss, x) <= saved_bytes(_reference, x) - logits_bytes


def test_other_architectures_get_transformers_own_loss(tmp_path: Path) -> None:
    """OPT is not in FUSED_TYPES: its loss is transformers' own, to the bit."""
    path = tmp_path / "opt.json"
    path.write_text(
        '{"model_type": "opt", "hidden_size": 32, "num_hidden_layers": 2, "ffn_dim": 64,'
        ' "num_attention_heads": 2, "max_position_embeddings": 64, "word_embed_proj_dim": 32,'
        ' "vocab_size": 300}'
    )
    model = _model(str(path))
    assert fused_head(model) is None
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    assert torch.equal(causal_lm_loss(model, x), _reference(model, x))


def test_gpt2s_activation_runs_fused_with_the_same_values_and_keeps_less_for_backward(
    gpt2_config: str,
) -> None:
    """build_model swaps transformers' gelu_new (five saved intermediate tensors) for PyTorch's tanh
    GELU kernel: the same function to float rounding, and at least three B·T·4D tensors less kept
    per layer for the backward pass."""
    from transformers.activations import NewGELUActivation

    from adloco.node.model.model import TanhGELU

    model = _model(gpt2_config)
    swapped = [(m, n) for m in model.modules() for n, c in m.named_children() if isinstance(c, TanhGELU)]
    assert len(swapped) == 2 and not any(isinstance(m, NewGELUActivation) for m in model.modules())
    x = torch.randn(4, 8, 128, generator=torch.Generator().manual_seed(7)) * 4
    torch.testing.assert_close(TanhGELU()(x), NewGELUActivation()(x), rtol=0, atol=1e-6)

    def saved_bytes(ids: torch.Tensor) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            causal_lm_loss(model, ids)
        return sum(seen.values())

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(8))
    fused = saved_bytes(ids)
    for module, name in swapped:
        setattr(module, name, NewGELUActivation())
    hidden_4d = 2 * 16 * 4 * 32 * 4  # B·T·4D fp32
    assert saved_bytes(ids) - fused >= 3 * hidden_4d * len(swapped)
