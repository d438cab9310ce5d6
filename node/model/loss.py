"""The training loss without the whole logits tensor.

`model(input_ids=x, labels=x).loss` forms the logits of every token at once, (B, T, V) in fp32,
keeps their log-softmax for the backward pass and then their gradient: three tensors of B·T·V·4
bytes (77 MB each at GPT-2's 50257 words and 3 × 128 tokens; 1.6 GB each at 8 × 1024). Past the
transformer body the loss is a linear map and a cross-entropy, so `causal_lm_loss` runs the body,
then forms the logits a chunk of tokens at a time and, in the same pass, the loss's gradient with
respect to the hidden states and to the output embedding (softmax − one-hot, over the token count),
as Liger's fused linear cross-entropy does. One chunk's logits exist at a time, none is kept, and
backward only scales the two kept gradients by the incoming one: no logits are ever formed again.

What is kept instead: the hidden states' gradient (B·T·D, the size of one layer's activations) and
the output embedding's gradient (V·D), which the backward pass hands to autograd as that weight's
gradient, so it is the gradient the step needs anyway, formed earlier (at the end of the forward
pass rather than at the start of the backward one).

Used where the architecture's causal-LM head is exactly `lm_head(base_model(x).last_hidden_state)`
with a bias-free linear head (`FUSED_TYPES`); any other model gets transformers' own loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Model types whose logits are the bias-free output embedding applied to the base model's last
# hidden state (final norm included), with no scaling or capping of the logits.
FUSED_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen2", "bloom", "gpt_neox"})
# The logits of one chunk, fp32: tokens per chunk = this / (4 · vocabulary). On a CPU a chunk that
# stays in cache; on a GPU one large enough that the head's matrix products fill the device (at 16 MB
# a chunk was 83 tokens of GPT-2: its weight-gradient product was a sliver of work per launch).
CHUNK_BYTES = 16 << 20
GPU_CHUNK_BYTES = 512 << 20
# Set on a model by `model.compile_layers`: its loss head's softmax terms run compiled too.
COMPILED_MARK = "adloco_compiled"
# The output embedding's rows are padded to a multiple of this on a GPU (`_FusedLinearCrossEntropy`).
VOCAB_PAD = 64


def _is_gpu(device: torch.device) -> bool:
    """Whether `device` runs matrix products fast enough that the GPU chunking applies."""
    return device.type == "cuda"


def _chunk_rows(device: torch.device, vocab: int) -> int:
    """Tokens per chunk of logits on `device`."""
    return max(1, (GPU_CHUNK_BYTES if _is_gpu(device) else CHUNK_BYTES) // (4 * vocab))


def _add_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h32: torch.Tensor, compute: torch.dtype) -> None:
    """grad_w += gᵀ · h. In fp32 and in place (no V x D temporary) where the compute is fp32 or the
    device a CPU; under a low-precision autocast on a GPU in the compute dtype, as autocast computes
    any linear layer's weight gradient (fp32 accumulation inside the product, one V x D temporary)."""
    if compute == torch.float32 or not _is_gpu(g.device):
        grad_w.addmm_(g.T, h32)
    else:
        grad_w.add_(g.to(compute).T @ h32.to(compute))


def fused_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(base model, output embedding) when `causal_lm_loss` can fuse the head; None otherwise."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FUSED_TYPES:
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    base = getattr(model, "base_model", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or base is None or base is model:
        return None
    return base, head


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `model` on `input_ids` (B, T), the loss of
    `model(input_ids=input_ids, labels=input_ids)`, with the logits formed a chunk at a time."""
    fused = fused_head(model)
    if fused is None:
        # (no key/value cache: a compiled layer would otherwise recompile for each layer's cache slot)
        loss: torch.Tensor = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        return loss
    base, head = fused
    hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state
    targets = input_ids[:, 1:].reshape(-1)
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    grads = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    get_lookup = getattr(base, "get_input_embeddings", None)
    lookup = get_lookup() if callable(get_lookup) else None
    tied = lookup if isinstance(lookup, TiedEmbedding) and lookup.weight is head.weight else None
    # With a gradient already held (accumulating, or the norm test's replay beside the step's mean),
    # the weight's gradient is formed at the end of the backward pass, once the activations are gone.
    defer = grads and tied is not None and (tied.weight.grad is not None or tied.defer_head)
    compiled = bool(getattr(model, COMPILED_MARK, False))
    out: torch.Tensor = _FusedLinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
        hidden, head.weight, targets, dtype, grads, tied, defer, compiled
    )
    return out


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """mean_i CE(h_i · Wᵀ, t_i), with d/dh and d/dW computed in the forward pass, chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        dtype: torch.dtype | None,
        grads: bool,
        tied: TiedEmbedding | None,
        defer: bool,
        compiled: bool,
    ) -> torch.Tensor:
        n, vocab = targets.numel(), weight.shape[0]
        if n == 0:
            raise ValueError("no next-token targets: sequences need at least 2 tokens")
        need_h, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        deferred = None
        if need_w and defer and tied is not None:
            deferred = _DeferredHead(hidden.detach(), targets, dtype)
        need_w = need_w and deferred is None
        rows = _chunk_rows(hidden.device, vocab)
        compute = dtype or weight.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros_like(weight) if need_w else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            if _is_gpu(hidden.device):
                chunk = _CHUNK_TERMS_COMPILED() if compiled else _chunk_terms
                # The output embedding's rows padded to a multiple of 64: GPT-2's 50257 words make
                # every row of logits misaligned, and the device's matrix products then fall back to
                # kernels three times slower (measured on an H200: 15 of a 38 ms step went there).
                padded = -(-vocab // VOCAB_PAD) * VOCAB_PAD
                w = torch.zeros(padded, weight.shape[1], dtype=compute, device=weight.device)
                w[:vocab].copy_(weight.detach())
                for start in range(0, n, rows):
                    h = hidden[start : start + rows].detach().to(compute)
                    t = targets[start : start + rows]
                    loss_sum, lse, g = chunk(h @ w.T, t, 1.0 / n, vocab)
                    total += loss_sum
                    if deferred is not None:
                        deferred.lse[start : start + rows] = lse
                    if grad_h is not None:
                        grad_h[start : start + rows] = g @ w
                    if grad_w is not None:
                        grad_w.add_((g.T @ h)[:vocab])
            else:
                w = weight.detach().to(compute)
                for start in range(0, n, rows):
                    h32 = hidden[start : start + rows].detach().float()
                    h = h32.to(compute)
                    t = targets[start : start + rows]
                    logits = (h @ w.T).float()  # (rows, V): the one chunk of logits that exists
                    lse = torch.logsumexp(logits, dim=1)
                    total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
                    if deferred is not None:
                        deferred.lse[start : start + rows] = lse
                    if grad_h is None and grad_w is None:
                        continue
                    g = _softmax_minus_one_hot_(logits, lse, t).div_(n)  # the mean divides by n
                    if grad_h is not None:
                        grad_h[start : start + rows] = g.to(compute) @ w
                    if grad_w is not None:
                        _add_weight_grad(grad_w, g, h32, compute)
        if grad_h is not None:
            ctx.save_for_backward(grad_h)  # grows with the batch: counted as an activation
        ctx.grad_w = grad_w  # the weight's own gradient: not an activation (bmax)
        ctx.has_grad_h = grad_h is not None
        ctx.tied = tied
        ctx.deferred = deferred
        return total / n

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h = ctx.saved_tensors[0] * grad_out if ctx.has_grad_h else None
        grad_w = ctx.grad_w
        ctx.grad_w = None
        # Scaled unless the incoming gradient is 1 (a plain loss.backward()): tested on a CPU only, where
        # reading it costs nothing; on a GPU the test would wait for the device, the multiply does not.
        if grad_w is not None and (_is_gpu(grad_out.device) or not bool(grad_out == 1)):
            grad_w.mul_(grad_out)
        if grad_w is not None and ctx.tied is not None:
            # The input lookup's backward, which runs later in this pass, adds its rows in place and
            # hands over the sum: the weight gets one gradient, not two for autograd to add.
            ctx.tied.pending = grad_w
            grad_w = None
        if ctx.deferred is not None and ctx.tied is not None:
            ctx.deferred.scale = grad_out / ctx.deferred.lse.numel()
            ctx.tied.pending_head = ctx.deferred
        ctx.tied = ctx.deferred = None
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_terms(
    logits: torch.Tensor, targets: torch.Tensor, scale: float, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's Σ CE, log-sum-exp and scale · (softmax − one-hot) in the logits' dtype, from
    logits whose columns past `vocab` are padding (their softmax, and so their gradient, is 0). One
    function, so that torch.compile fuses it into two passes over the chunk's logits."""
    cols = torch.arange(logits.shape[1], device=logits.device)[None, :]
    x = torch.where(cols < vocab, logits.float(), float("-inf"))
    lse = torch.logsumexp(x, dim=1)
    picked = x.gather(1, targets[:, None]).squeeze(1)
    p = torch.exp(x - lse[:, None])
    g = torch.where(cols == targets[:, None], p - 1.0, p) * scale
    return (lse - picked).sum(), lse, g.to(logits.dtype)


@functools.cache
def _CHUNK_TERMS_COMPILED() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`_chunk_terms` through torch.compile (once per process; any chunk and vocabulary size)."""
    return torch.compile(_chunk_terms, dynamic=True)


def _softmax_minus_one_hot_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """d(Σ CE)/d logits = softmax − one-hot, formed in `logits`' own buffer (fp32, one chunk)."""
    g = logits.sub_(lse[:, None]).exp_()
    g[torch.arange(len(targets), device=g.device), targets] -= 1.0
    return g


class _DeferredHead:
    """What the output embedding's gradient is formed from at the end of the backward pass: the
    hidden states, targets and log-sum-exp of each token (kept from the forward pass, B·T·(D + 2)
    values) and the incoming gradient over the token count. `add_to` forms the logits again, a chunk
    at a time: one more (B·T × D) @ (D × V) product, for a V x D tensor less beside the activations."""

    def __init__(self, hidden: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None) -> None:
        self.hidden, self.targets, self.dtype = hidden, targets, dtype
        self.lse = torch.empty(targets.numel(), dtype=torch.float32, device=hidden.device)
        self.scale: torch.Tensor | None = None

    @torch.no_grad()
    def add_to(self, grad_w: torch.Tensor, weight: torch.Tensor) -> None:
        """grad_w += d(loss)/d(weight) through the head (softmax − one-hot, times the scale)."""
        assert self.scale is not None
        n, vocab = self.targets.numel(), weight.shape[0]
        rows = _chunk_rows(self.hidden.device, vocab)
        with torch.autocast(self.hidden.device.type, enabled=False):
            w = weight.detach().to(self.dtype or weight.dtype)
            for start in range(0, n, rows):
                h32 = self.hidden[start : start + rows].float()
                t = self.targets[start : start + rows]
                logits = (h32.to(w.dtype) @ w.T).float()
                g = _softmax_minus_one_hot_(logits, self.lse[start : start + rows], t)
                _add_weight_grad(grad_w, g.mul_(self.scale), h32, w.dtype)


class TiedEmbedding(nn.Embedding):
    """An input embedding whose weight is also the output head (GPT-2, Bloom): the lookup's gradient
    rows are added in place to the head's gradient of that weight.

    The fused head forms its dense V x D gradient; the lookup's is a few rows. Handed to autograd as
    two gradients of one weight, they are summed out of place (PyTorch adds a sparse gradient to a
    dense one into a new tensor, and a dense pair needs the second dense tensor first): a third V x D
    tensor at the end of every backward pass (1.2 B/param at GPT-2 124M). Here the head parks its
    gradient in `pending` and the lookup's backward, later in the same pass, adds its rows there
    and returns the sum as the weight's only gradient. Without a pending gradient (transformers' own
    loss) the lookup's gradient is the dense one `nn.Embedding` gives. `build_model` installs it.
    """

    pending: torch.Tensor | None = None
    pending_head: _DeferredHead | None = None
    # Set while the norm test replays micro-batches beside the step's gradient: the head's gradient
    # is then formed after the activations are freed (`causal_lm_loss`).
    defer_head: bool = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(input)
        self.pending = self.pending_head = None  # a pass whose backward never ran leaves nothing
        out: torch.Tensor = _TiedLookup.apply(input, self.weight, self)  # type: ignore[no-untyped-call]
        return out

    @staticmethod
    def plain(module: nn.Module) -> bool:
        """Whether `module` is an embedding this lookup reproduces exactly (no padding row, norm
        limit, frequency scaling or sparse gradient)."""
        return (
            type(module) is nn.Embedding
            and module.padding_idx is None
            and module.max_norm is None
            and not module.scale_grad_by_freq
            and not module.sparse
        )


class _TiedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, owner: TiedEmbedding) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.owner, ctx.weight = owner, weight
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        owner: TiedEmbedding = ctx.owner
        weight: torch.Tensor = ctx.weight
        grad_w, owner.pending = owner.pending, None
        head, owner.pending_head = owner.pending_head, None
        # A deferred head adds straight into a gradient the weight already has (accumulating):
        # nothing is returned then, so no V x D tensor is formed at all.
        into_held = head is not None and grad_w is None and weight.grad is not None and not owner.defer_head
        if into_held:
            grad_w = weight.grad
        elif grad_w is None:
            grad_w = torch.zeros(ctx.weight_shape, dtype=ctx.weight_dtype, device=grad_out.device)
        assert grad_w is not None
        if head is not None:
            head.add_to(grad_w, weight)
        rows = grad_out.reshape(-1, grad_out.shape[-1]).to(grad_w.dtype)
        grad_w.index_add_(0, ids.reshape(-1), rows)
        return None, None if into_held else grad_w, None
