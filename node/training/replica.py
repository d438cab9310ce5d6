"""What every peer of a run holds identically after each round, and how it travels in a state dict.

θ (the global parameters), the outer momentum m, the round r, the schedule S_r, and the last few
averaged updates, kept so that a peer a few rounds behind can replay them (catch-up). Peers agree on
all of it bit for bit; θ's hash is what they publish and check each other against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...protocol.algorithms.pseudograd import tensors_hash
from ...protocol.algorithms.schedule import Schedule
from ..data.spill import SpillFile
from ..data.state import integer, mapping, tensors_like
from .config import TrainConfig

logger = logging.getLogger(__name__)

HISTORY_ROUNDS = 8  # averaged updates each peer keeps for laggards to replay

Copy = Callable[[torch.Tensor], torch.Tensor]  # one tensor's copy, placed where the state lives


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()


class SpilledPayloads(Mapping[str, bytes]):
    """An update's payloads in an unnamed temporary file, each read back when asked for.

    A kept update waits for a laggard that may never ask: on disk (`SpillFile`) it costs no memory
    meanwhile (~1 B/param per int8 update).
    """

    def __init__(self, payloads: Mapping[str, bytes], directory: str | None = None) -> None:
        self._file = SpillFile(directory)
        self._spans = {name: (self._file.append(payload), len(payload)) for name, payload in payloads.items()}

    @property
    def num_bytes(self) -> int:
        return self._file.size  # the payloads, one after the other

    def size(self, name: str) -> int:
        """One payload's size, not read."""
        return self._spans[name][1]

    def __getitem__(self, name: str) -> bytes:
        return self._file.read(*self._spans[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


class DiskShelf:
    """Payloads that wait for a reader who may never come (a laggard's catch-up, another member's
    check), moved to unnamed files in `directory` (`SpilledPayloads`; the system's temporary folder
    when None). A folder that cannot hold them (gone, full) is never worth failing a round for: they
    stay in memory from then on, with one warning naming `what` they are."""

    def __init__(self, directory: str | None, what: str) -> None:
        self.directory, self.what = directory, what
        self.working = True

    def __call__(self, payloads: Mapping[str, bytes]) -> Mapping[str, bytes]:
        if not self.working or isinstance(payloads, SpilledPayloads):
            return payloads
        try:
            return SpilledPayloads(payloads, self.directory)
        except OSError as e:
            self.working = False
            where = self.directory or "the temporary folder"
            logger.warning("%s stay in memory from now on: %s cannot hold them: %s", self.what, where, e)
            return payloads


@dataclass(frozen=True)
class Update:
    """An applied round, kept so a peer that missed it can replay it (catch-up)."""

    round: int
    averaged: Mapping[str, bytes]
    schedule: Schedule
    merge: tuple[int, int] | None

    @property
    def num_bytes(self) -> int:
        """The encoded bytes it holds (what keeping it costs)."""
        if isinstance(self.averaged, SpilledPayloads):
            return self.averaged.num_bytes
        return sum(len(payload) for payload in self.averaged.values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "averaged": dict(self.averaged),
            "schedule": self.schedule.to_dict(),
            "merge": None if self.merge is None else list(self.merge),
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Update:
        """Inverse of `state_dict`; ValueError (or KeyError/TypeError) on a malformed one."""
        averaged = mapping(state["averaged"], "update payloads")
        if not all(isinstance(payload, bytes) for payload in averaged.values()):
            raise ValueError("update payloads: expected bytes")
        merge = state["merge"]
        return cls(
            round=integer(state["round"], "update round"),
            averaged=dict(averaged),
            schedule=Schedule.from_dict(mapping(state["schedule"], "update schedule")),
            merge=None if merge is None else (integer(merge[0], "merge"), integer(merge[1], "merge")),
        )


@dataclass
class PeerState:
    """θ, m, r, S_r and the kept updates: what all peers of a run hold identically after every round."""

    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    round: int
    schedule: Schedule
    history: list[Update] = field(default_factory=list)

    def theta_hash(self) -> str:
        return tensors_hash(self.theta)

    def state_dict(self, *, theta_hash: str | None = None) -> dict[str, Any]:
        """The live tensors (not copies), θ's hash (`theta_hash` where the caller has it), round,
        schedule and the kept updates."""
        return {
            "round": self.round,
            "theta": list(self.theta),
            "momentum": list(self.momentum),
            "theta_hash": theta_hash or self.theta_hash(),
            "schedule": self.schedule.to_dict(),
            "history": [u.state_dict() for u in self.history],
        }

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Any], *, like: PeerState, copy: Copy, copy_theta: Copy | None = None
    ) -> PeerState:
        """A state dict's replicated state, copied tensor by tensor with `copy` (θ with `copy_theta`,
        default `copy`) and checked: tensors shaped like `like`'s, θ matching the hash it was saved
        with (ValueError otherwise)."""
        theta = tensors_like(state["theta"], like.theta, "theta")
        momentum = tensors_like(state["momentum"], like.momentum, "momentum")
        replicated = cls(
            theta=[(copy_theta or copy)(t) for t in theta],
            momentum=[copy(t) for t in momentum],
            round=integer(state["round"], "round"),
            schedule=Schedule.from_dict(mapping(state["schedule"], "schedule")),
            history=[Update.from_state_dict(mapping(u, "update")) for u in state["history"]],
        )
        if replicated.theta_hash() != state["theta_hash"]:
            raise ValueError("θ does not match the θ hash it was saved with")
        return replicated


def initial_state(model: torch.nn.Module, cfg: TrainConfig, *, copy: Copy | None = None) -> PeerState:
    """θ_0 (the seeded model's weights, identical on every peer), m = 0, r = 0, S_0 from the config.

    θ is copied from the model tensor by tensor with `copy` (default: a clone on the model's device);
    m is zeros where θ is.
    """
    theta = [(copy or _clone)(p) for p in model.parameters() if p.requires_grad]
    return PeerState(
        theta=theta,
        momentum=[torch.zeros_like(t) for t in theta],
        round=0,
        schedule=Schedule(
            round=0,
            batch=(cfg.batch_size,) * cfg.instances,
            inner_steps=cfg.inner_steps,
            codec=cfg.codec_candidates[1] if cfg.codec == "adaptive" else cfg.codec,
        ),
    )
