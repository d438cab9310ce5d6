"""One MIT instance (AdLoCo stage 1): a model copy with its own persistent AdamW state and data stream.

Each round an instance starts from the global θ, runs H optimizer steps of micro-batch × accumulation
(AdLoCo switch mode, see `adloco.protocol.switch.plan_batch`), and returns its pseudo-gradient
Δ = θ_start − θ_end together with the gradient statistics the adaptive-batch test needs.

Under one-step-delay overlap (DiLoCoX) a round starts from the instance's own weights instead, and
when the averaged update of the previous round lands mid-round, `shift` moves the weights and the
recorded start onto the new θ (rebase, overwrite or mix), so Δ is always measured from a global θ.

The statistics come from the micro-batch gradients of the *first* optimizer step of the round, which
every instance (and, in a synchronous round, every peer) computes at the same synchronized θ. This is
the "gradients at the synchronized θ" option of research/algorithms.md §2.10 item 4, at no extra
backward pass: the first step's batch is split into `stats_chunks` equal micro-batches when it is
not already accumulated, and the chunk gradients are the samples g_m of the norm test.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...protocol.algorithms.batchtest import GradStats, grad_stats
from ...protocol.algorithms.merge import merge_weighted
from ...protocol.algorithms.pseudograd import pseudo_gradient
from ...protocol.algorithms.switch import BatchPlan
from .sampling import TokenSampler
from .state import malformed, mapping, tensors_like


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer of every instance (DiLoCo: AdamW lr 4e-4, wd 0.1, betas 0.9/0.95).

    `grad_clip` bounds the global gradient norm of each inner step (0 turns it off); lower it if the
    inner loss spikes right after the batch size grows. `stats_chunks` is how many equal micro-batches
    the first step of a round is split into for the variance test when it is not already accumulated.
    """

    lr: float = 4e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    stats_chunks: int = 4

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"inner lr must be > 0, got {self.lr}")
        if self.stats_chunks < 1:
            raise ValueError(f"stats_chunks must be >= 1, got {self.stats_chunks}")


@dataclass
class InstanceRound:
    """What one instance produced in one round."""

    delta: list[torch.Tensor]
    tokens: int
    samples: int
    steps: int
    mean_loss: float
    stats: GradStats | None
    compute_s: float


class Instance:
    """A model instance with persistent AdamW state, fed by its own token stream."""

    def __init__(
        self,
        *,
        slot: int,
        model: torch.nn.Module,
        sampler: TokenSampler,
        inner: InnerConfig,
    ) -> None:
        self.slot = slot
        self.model = model
        self.sampler = sampler
        self.inner = inner
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=inner.lr,
            weight_decay=inner.weight_decay,
            betas=(inner.beta1, inner.beta2),
        )
        # Where the current round started: Δ = start − weights at the end of the round.
        self.start = [p.detach().clone() for p in self.params]

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @torch.no_grad()
    def load(self, theta: Sequence[torch.Tensor]) -> None:
        """Set the instance's parameters to θ (copied, so the instance never aliases global state)."""
        for p, t in zip(self.params, theta, strict=True):
            p.copy_(t, non_blocking=True)

    @torch.no_grad()
    def begin(self, theta: Sequence[torch.Tensor] | None) -> None:
        """Start a round from θ, or (θ None: overlap) from the instance's own current weights."""
        if theta is not None:
            self.load(theta)
        for s, p in zip(self.start, self.params, strict=True):
            s.copy_(p)

    @torch.no_grad()
    def shift(self, theta: Sequence[torch.Tensor], *, mode: str, mix: float = 0.5) -> None:
        """The global θ changed while this instance trains on (overlap): carry its progress over.

        rebase: weights ← θ + (weights − start), the local progress of the round kept on top of θ.
        overwrite: weights ← θ, the progress since the round started is dropped.
        mix: weights ← mix·weights + (1 − mix)·θ (Streaming DiLoCo's α-mixing).
        In every mode the start becomes θ, so the round's Δ is measured from the global θ.
        """
        for p, s, t in zip(self.params, self.start, theta, strict=True):
            if mode == "rebase":
                p.add_(t - s)
            elif mode == "overwrite":
                p.copy_(t)
            elif mode == "mix":
                p.mul_(mix).add_(t, alpha=1 - mix)
            else:
                raise ValueError(f"unknown overlap mode {mode!r}")
            s.copy_(t)

    def run_round(
        self,
        theta: Sequence[torch.Tensor] | None,
        *,
        plan: BatchPlan,
        steps: int,
        on_step: Callable[[int, float], None] | None = None,
    ) -> InstanceRound:
        """Run `steps` optimizer steps of `plan`; return Δ and the round's statistics.

        With θ the round starts there. With None it continues a round `begin(None)` started, and Δ
        is measured from the start as `shift` may have moved it meanwhile.
        """
        if theta is not None:
            self.begin(theta)
        self.model.train()
        t0 = time.perf_counter()
        losses: list[float] = []
        stats: GradStats | None = None
        for step in range(steps):
            loss, step_stats = self.inner_step(plan, collect_stats=step == 0)
            losses.append(loss)
            if step == 0:
                stats = step_stats
            if on_step is not None:
                on_step(step, loss)
        compute_s = time.perf_counter() - t0
        with torch.no_grad():
            delta = pseudo_gradient(self.start, [p.detach() for p in self.params])
        samples = plan.effective * steps
        return InstanceRound(
            delta=delta,
            tokens=samples * self.sampler.seq_len,
            samples=samples,
            steps=steps,
            mean_loss=sum(losses) / max(len(losses), 1),
            stats=stats,
            compute_s=compute_s,
        )

    def inner_step(self, plan: BatchPlan, *, collect_stats: bool) -> tuple[float, GradStats | None]:
        """One AdamW step over plan.accum micro-batches; optionally the per-micro-batch gradient stats."""
        micro, accum = self._stats_split(plan) if collect_stats else (plan.micro, plan.accum)
        self.optimizer.zero_grad(set_to_none=True)
        chunk_grads: list[torch.Tensor] = []
        previous: torch.Tensor | None = None
        total_loss = 0.0
        for _ in range(accum):
            batch = self.sampler.next_batch(micro).to(self.device, non_blocking=True)
            loss = self.model(input_ids=batch, labels=batch).loss
            (loss / accum).backward()
            total_loss += float(loss.detach())
            if collect_stats and accum > 1:
                flat = self._flat_grad()
                # Gradients accumulate in .grad: the chunk's own gradient is the increment, rescaled
                # by accum because each chunk's loss was divided by accum.
                chunk = flat if previous is None else flat - previous
                chunk_grads.append(chunk * accum)
                previous = flat
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.inner.grad_clip)
        self.optimizer.step()
        stats = grad_stats(chunk_grads, samples_per_grad=micro) if len(chunk_grads) >= 2 else None
        return total_loss / accum, stats

    def _stats_split(self, plan: BatchPlan) -> tuple[int, int]:
        """The (micro, accum) of the statistics step: the plan itself, or the batch cut into chunks."""
        if plan.accum > 1 or self.inner.stats_chunks < 2:
            return plan.micro, plan.accum
        chunks = min(self.inner.stats_chunks, plan.micro)
        # Keep the step's effective batch at least the plan's (never below b).
        return math.ceil(plan.micro / chunks), chunks

    def _flat_grad(self) -> torch.Tensor:
        return torch.cat(
            [
                (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                for p in self.params
            ]
        )

    @torch.no_grad()
    def absorb(self, other: Instance, *, weight: float, other_weight: float) -> None:
        """AdLoCo MIT merge, this instance surviving: weights and round starts become their weighted
        mean (so the round's Δ stays linear), this instance keeps its AdamW state and takes over the
        other's data stream (its compute share)."""
        merged = merge_weighted(
            dict(self.model.named_parameters()),
            dict(other.model.named_parameters()),
            weight_a=weight,
            weight_b=other_weight,
        )
        starts = merge_weighted(
            {str(i): t for i, t in enumerate(self.start)},
            {str(i): t for i, t in enumerate(other.start)},
            weight_a=weight,
            weight_b=other_weight,
        )
        for name, p in self.model.named_parameters():
            p.copy_(merged[name])
        for i, s in enumerate(self.start):
            s.copy_(starts[str(i)])
        self.sampler = self.sampler.merged_with(other.sampler)

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    # ---- state dict ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Weights, round start, AdamW moments and steps (by parameter index) and the sampler's state.

        The tensors are the live ones: save or copy the tree before the instance trains on. The
        optimizer's hyper-parameters are configuration, not state, and are left out.
        """
        optimizer = self.optimizer.state_dict()["state"]
        return {
            "params": [p.detach() for p in self.params],
            "start": list(self.start),
            "optimizer": {str(idx): dict(fields) for idx, fields in optimizer.items()},
            "sampler": self.sampler.state_dict(),
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError if `load_state_dict(state)` would fail (another shape, a malformed tree)."""
        self._checked(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` (copied, so the instance never aliases it); the sampler continues
        the saved random sequence on its own stream. ValueError, nothing changed, if it does not fit."""
        params, start, moments = self._checked(state)
        with torch.no_grad():
            for p, s, saved_p, saved_s in zip(self.params, self.start, params, start, strict=True):
                p.copy_(saved_p)
                s.copy_(saved_s)
        # The config's hyper-parameters (lr, betas, ...) stay; only the moments and steps load, copied:
        # AdamW's load_state_dict keeps tensors that are already on the right device and dtype.
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {
            idx: {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in fields.items()}
            for idx, fields in moments.items()
        }
        self.optimizer.load_state_dict(optimizer)
        self.sampler.load_state_dict(state["sampler"])

    def _checked(
        self, state: Mapping[str, Any]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, dict[str, Any]]]:
        with malformed("instance state"):
            params = tensors_like(state["params"], self.params, "instance parameters")
            start = tensors_like(state["start"], self.start, "instance round start")
            moments: dict[int, dict[str, Any]] = {}
            for idx, fields in mapping(state["optimizer"], "instance optimizer").items():
                if not idx.isdigit() or int(idx) >= len(self.params):
                    raise ValueError(f"instance optimizer: no parameter {idx!r}")
                shape = self.params[int(idx)].shape
                for name, value in mapping(fields, f"instance optimizer {idx}").items():
                    # Every tensor of AdamW's state but the step count has the parameter's shape.
                    if isinstance(value, torch.Tensor) and name != "step" and value.shape != shape:
                        raise ValueError(f"instance optimizer {idx}.{name}: shape {tuple(value.shape)}")
                moments[int(idx)] = dict(fields)
            self.sampler.check_state_dict(state["sampler"])
        return params, start, moments
