"""Where a peer's tensors live and in which precision its instances compute (issue 9 §1, GPU part).

On a GPU only what trains lives on the device: the instances' weights, gradients, AdamW state and
activations. What a peer keeps between rounds (θ, the outer momentum, the round start, Δ, the
error-feedback residual, the kept updates) lives in host memory, which a volunteer has more of, and
crosses to the device one tensor at a time: θ into an instance at a round start, a parameter out of
it when Δ is taken. `Placement` names the two devices and does those moves; on a CPU both are the
CPU and every move is the identity, so a CPU peer computes exactly what it did before.

The host side of the moves is page-locked ("pinned") where it pays, for CUDA training: θ, copied
into every instance each round, and one staging buffer, the size of the largest parameter, that
each parameter passes through on its way out. Pinned memory lets the DMA engine copy without the
driver's own bounce buffer; pinning all of Δ or the momentum, which never cross, would only take
page-locked memory from the rest of the machine.

Precision: `resolve_precision` turns `--precision` into the dtype the instances' forward passes
autocast to (bf16 by default on GPUs with native bf16); the master weights, gradients and AdamW
state stay fp32, as θ does. `autocast` is the context every training forward runs in, and `adamw`
the optimizer every instance (and the b_max probe) steps with, fused wherever the device has one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import UserError
from ...protocol.algorithms.pseudograd import pseudo_gradient

HOST = torch.device("cpu")


def resolve_device(spec: str) -> torch.device:
    """The first device of `resolve_devices(spec)`: the one a node's own process trains on."""
    return resolve_devices(spec)[0]


def resolve_devices(spec: str) -> list[torch.device]:
    """`--device` as the devices a node's MIT instances train on, in order (issue 27 §2).

    'auto': every visible CUDA device (one: `cuda`, several: `cuda:0`, `cuda:1`, ...), else the
    CPU. Otherwise a comma-separated list of torch devices ("cuda:0,cuda:1"); the CPU may be listed
    more than once ("cpu,cpu": two processes training on the CPU, how the multi-device path runs
    where no second device exists). ValueError for an entry that is no torch device or a GPU named
    twice. Whether the devices exist here is the CLI's check (`options.check_device`).
    """
    if spec == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return [HOST]
        return [torch.device("cuda")] if count == 1 else [torch.device("cuda", i) for i in range(count)]
    devices = []
    for entry in spec.split(","):
        try:
            devices.append(torch.device(entry.strip()))
        except RuntimeError:
            raise ValueError(
                f"{entry.strip()!r} is not a torch device; use auto, cpu, cuda or cuda:N"
            ) from None
    gpus = [d for d in devices if d.type != "cpu"]
    named = {(d.type, d.index or 0) for d in gpus}
    if len(named) != len(gpus):
        raise ValueError(f"{spec!r} names a device twice; list each GPU once")
    return devices


@dataclass
class Placement:
    """The training device (`train`) and the device the replicated state lives on (`state`).

    `staged`: the two are treated as distinct memories, so θ is never handed to an instance as its
    own tensors (evaluation swaps it in and out, `evaluate_with`) and a parameter leaves the device
    through the staging buffer. True whenever the devices differ; a test may set it on CPU/CPU to run
    the cross-device code where no second device exists. `pin`: host tensors that cross are pinned.
    """

    train: torch.device
    state: torch.device = HOST
    staged: bool = False
    pin: bool = False
    _staging: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def for_training(cls, train: torch.device) -> Placement:
        """A peer training on `train`: state on the host; staged and pinned when `train` is a GPU."""
        on_host = train.type == "cpu"
        return cls(train=train, state=HOST, staged=not on_host, pin=train.type == "cuda")

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of one tensor on the state device (pinned when `pin`), for θ."""
        if not self.pin:
            return tensor.detach().to(self.state, copy=True)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.state, pin_memory=True)
        return out.copy_(tensor.detach())

    def state_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of one tensor on the state device, not pinned: what never crosses (m, a start)."""
        return tensor.detach().to(self.state, copy=True)

    @torch.no_grad()
    def load(self, params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
        """Copy `tensors` (any device) into the training device's `params`, one tensor at a time."""
        for p, t in zip(params, tensors, strict=True):
            p.copy_(t, non_blocking=self.pin)
        # A copy from pinned memory is asynchronous, and the host changes θ in place later (the
        # outer step, a shift): wait until the device has read it all.
        self.synchronize()

    @torch.no_grad()
    def delta(self, start: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Δ = start − params per tensor, on the start's device (the host, staged).

        Staged, each parameter comes out through the one staging buffer, so the host never holds
        more than one parameter in transit; unstaged this is `start − params` as it always was.
        """
        if not self.staged:
            return pseudo_gradient(start, params)
        if len(start) != len(params):
            raise ValueError(f"start has {len(start)} tensors, the instance {len(params)}")
        out = []
        for s, p in zip(start, params, strict=True):
            if s.shape != p.shape:
                raise ValueError(f"start/params: shape {tuple(s.shape)} vs {tuple(p.shape)}")
            out.append(s.detach() - self.to_host(p))
        return out

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """One tensor of the training device as a view of the staging buffer (valid until the next
        call). Its dtype must be fp32, the dtype of every parameter (build_model makes them so)."""
        numel = tensor.numel()
        if self._staging is None or self._staging.numel() < numel or self._staging.dtype != tensor.dtype:
            self._staging = torch.empty(numel, dtype=tensor.dtype, device=self.state, pin_memory=self.pin)
        view = self._staging[:numel].view(tensor.shape)
        view.copy_(tensor.detach(), non_blocking=self.pin)
        self.synchronize()
        return view

    @torch.no_grad()
    def swap(self, params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Put `tensors` into `params` one at a time; return what they held, on the state device.

        Evaluating θ through an instance without a copy of the model on the device: swap θ in,
        evaluate, swap the returned weights back (`load`). The host holds the instance's weights
        meanwhile, the device nothing more than the instance.
        """
        held = []
        for p, t in zip(params, tensors, strict=True):
            held.append(self.state_copy(p))
            p.copy_(t, non_blocking=self.pin)
        self.synchronize()
        return held

    def synchronize(self) -> None:
        """Wait for the training device's queued copies (CUDA); nothing elsewhere."""
        if self.pin and self.train.type == "cuda":
            torch.cuda.synchronize(self.train)


# ---- precision -----------------------------------------------------------------------------------

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(spec: str, device: torch.device) -> torch.dtype | None:
    """The dtype the instances' forward passes autocast to on `device`; None: fp32, no autocast.

    auto: bf16 on a CUDA device with native bf16 (Ampere and later), fp32 elsewhere. bf16: asked
    for explicitly, also on a CPU (slower than fp32 on most CPUs, but it runs). UserError for bf16
    where it cannot run.
    """
    if device.type != "cuda":
        return precision_dtype(spec, device_type=device.type, bf16_native=device.type == "cpu")
    with torch.cuda.device(device):  # the check is of the current device: make it this one
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    return precision_dtype(
        spec, device_type="cuda", bf16_native=native, device_name=torch.cuda.get_device_name(device)
    )


def precision_dtype(
    spec: str, *, device_type: str, bf16_native: bool, device_name: str | None = None
) -> torch.dtype | None:
    """`resolve_precision`'s decision, from what the device can do (`bf16_native`)."""
    if spec not in PRECISIONS:
        raise UserError(f"--precision: expected one of {', '.join(PRECISIONS)}, got {spec!r}")
    if spec == "fp32" or (spec == "auto" and not (device_type == "cuda" and bf16_native)):
        return None
    if device_type not in ("cpu", "cuda"):
        raise UserError(f"--precision bf16: bf16 autocast runs on cpu and cuda, not {device_type}; use fp32")
    if not bf16_native:
        raise UserError(
            f"--precision bf16: {device_name or device_type} has no native bfloat16 (it needs an Ampere"
            " or later GPU); use --precision fp32 or auto"
        )
    return torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[object]:
    """The context a training forward pass runs in: autocast to `dtype`, or nothing for fp32."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def is_sharded(tensor: torch.Tensor) -> bool:
    """A tensor sharded over a group (a layer's parameter or its gradient, `training.sharding`), not
    held whole; asked without importing DTensor's module (a third of a second) where nothing has:
    then there is none."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def adamw(params: Sequence[torch.Tensor], **options: Any) -> torch.optim.AdamW:
    """AdamW with PyTorch's fused kernel wherever the device has one (CPUs and GPUs alike).

    On a CPU the default (one parameter at a time, no fused kernel) forms the update's temporaries
    tensor by tensor: at GPT-2 124M a step took 202 ms and 294 MB above the state, the fused one
    34 ms and nothing (bench/results/adamw.json). The inner optimizer's state never needs to be
    bit-identical between peers: only θ does.
    """
    fused = {p.device.type for p in params} in ({"cpu"}, {"cuda"})
    sharded = [p for p in params if is_sharded(p)]
    if not sharded or len(sharded) == len(params):
        return torch.optim.AdamW(params, fused=fused or None, **options)
    # The fused kernel takes a group's tensors in one call, which must all be sharded or none: the
    # layers sharded over a group (`training.sharding`) in one, the others in another.
    groups = [{"params": sharded}, {"params": [p for p in params if not is_sharded(p)]}]
    return torch.optim.AdamW(groups, fused=fused or None, **options)
