"""How an owner's average of a part travels back to the members: the downlink of a round.

Every member's contribution to a part is encoded by the round's codec; the average of several is
not: four top-k supports give up to four times the nonzeros (SparseLoCo, arXiv 2508.15706, gathers
the compressed contributions for that reason). Three ways, `Downlink`:

- "encode": the owner encodes the average with the round's codec, as the members did theirs. For
  the dense quantizers (int8, int4) that is a second rounding of about the first one's size; a
  sparse codec re-sparsifies, and what it drops is lost.
- "feedback": owner-side error feedback (`OwnerFeedback`): the owner sends C(avg + e_part) and
  keeps e_part ← avg + e_part − decode(sent) for the next round, so what it drops is sent later.
  Same bytes as "encode".
- "gather": the accepted contributions themselves travel, whole, as one `codecs.sum_payload`
  decoding to their weighted mean (`Gather`): nothing is lost, and the downlink carries every
  contributor's bytes of the part (a group of n receives about n times what "encode" sends).

An owner's residual belongs to the part and to the lineage of rounds it was formed in, and in a
swarm the owner of a part changes when the group does. `OwnerFeedback` keeps a residual only from
one round to the next: what it forms in round r is committed when round r is applied (`commit`)
and used by an encode in round r + 1 alone. A round that failed (retried, or healed by replaying
another member's update) commits nothing, and the residual of round r − 1 is still the one a retry
adds; a part whose owner changed starts from zero at the new owner and the old one drops its
residual at its next commit. What is dropped is lost as under "encode", never sent twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch

from .codecs import Codec, decode, sum_payload, sum_payload_bytes, to_cpu_float

Downlink = Literal["encode", "feedback", "gather"]
DOWNLINKS: tuple[Downlink, ...] = ("encode", "feedback", "gather")
SPARSE_DEFAULT: Downlink = "feedback"
"""What "auto" means for a sparse codec (docs/decisions/ 032, the downlink of a sparse round: measured
against "gather" and "encode" in bench/comm.py). Every other codec re-encodes ("encode")."""
_ROUND_KEY = "round"
_RESIDUAL_PREFIX = "residual/"
_INNER_PREFIX = "codec/"


class OwnerFeedback(Codec):
    """The round's codec with owner-side error feedback: encodes avg + e, keeps what was lost.

    `start_round(r)` before a round's encodes; `commit(r)` once round r is applied. The residual is
    kept in fp32 (only for the parts this peer owns: about 4/n bytes per parameter in a group of n).
    """

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = inner.name
        self.round = 0
        # Residuals usable in round `round of the entry` + 1, and those formed in the current round.
        self._committed: dict[str, tuple[int, torch.Tensor]] = {}
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}

    def start_round(self, round: int) -> None:
        """The round whose average the next encodes carry."""
        self.round = round

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """C(avg + e) with e the residual committed in the previous round (zero if none)."""
        values = to_cpu_float(tensor)
        kept = self._committed.get(key)
        if kept is not None and kept[0] == self.round - 1 and kept[1].shape == values.shape:
            values = values + kept[1]
        payload = self.inner.encode(key, values)
        error = values - decode(payload)
        # A non-finite average is rejected by its receivers; its NaN must not poison later rounds.
        error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self._pending[key] = (self.round, error)
        return payload

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """The inner codec's: the residual changes what is sent, not its size."""
        return self.inner.wire_bytes(shape)

    def commit(self, round: int) -> None:
        """Round `round` was applied: its residuals become the next round's, every other one is
        dropped (parts this peer no longer owns, tries that failed)."""
        self._committed = {k: v for k, v in self._pending.items() if v[0] == round}
        self._pending.clear()

    def residual_norm(self) -> float:
        """L2 norm of the committed residuals."""
        return math.sqrt(sum(float(e.double().square().sum()) for _, e in self._committed.values()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The committed residuals with their round, and the inner codec's state (low-rank warm
        starts), each under a prefix of its own."""
        state = {_INNER_PREFIX + k: v for k, v in self.inner.state_dict().items()}
        if self._committed:
            state[_ROUND_KEY] = torch.tensor(next(iter(self._committed.values()))[0], dtype=torch.int64)
            state.update({_RESIDUAL_PREFIX + k: e.clone() for k, (_, e) in self._committed.items()})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore a `state_dict`; ValueError, nothing changed, for one it did not write."""
        inner = {k.removeprefix(_INNER_PREFIX): v for k, v in state.items() if k.startswith(_INNER_PREFIX)}
        residuals = {
            k.removeprefix(_RESIDUAL_PREFIX): v for k, v in state.items() if k.startswith(_RESIDUAL_PREFIX)
        }
        round = state.get(_ROUND_KEY)
        if len(inner) + len(residuals) + (round is not None) != len(state):
            raise ValueError(f"owner feedback state: unexpected keys {sorted(state)[:3]}")
        if residuals and (round is None or round.numel() != 1 or round.is_floating_point()):
            raise ValueError("owner feedback state: residuals without an integer round")
        if any(not (isinstance(e, torch.Tensor) and e.is_floating_point()) for e in residuals.values()):
            raise ValueError("owner feedback state: a residual is not a float tensor")
        self.inner.load_state_dict(inner)
        at = int(round) if round is not None else 0
        self._committed = {
            k: (at, e.detach().to("cpu", torch.float32, copy=True)) for k, e in residuals.items()
        }
        self._pending.clear()


class Gather(Codec):
    """The accepted contributions travel whole (`codecs.sum_payload`) instead of their encoded mean.

    `encode` is the round's codec (for a part whose average is zeros: nothing was accepted); an owner
    reducing with the mean calls `gather` (`parts.reduce_part`).
    """

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = inner.name

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        return self.inner.encode(key, tensor)

    def encode_spans(self, key: str, shape: tuple[int, ...], spans: Iterable[torch.Tensor]) -> bytes:
        return self.inner.encode_spans(key, shape, spans)

    def wire_bytes(self, shape: tuple[int, ...]) -> int:
        """A single encode's (a gathered part is the sum of its contributions' sizes and a header)."""
        return self.inner.wire_bytes(shape)

    def answer_bytes(self, shape: tuple[int, ...], contribution_bytes: int, members: int) -> int:
        """Every member's contribution in one sum payload."""
        return max(
            self.inner.answer_bytes(shape, contribution_bytes, members),
            sum_payload_bytes(shape, members, contribution_bytes),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.inner.load_state_dict(state)

    def gather(self, payloads: Sequence[bytes], factors: Sequence[float]) -> bytes:
        """The bytes every member receives for a part: the payloads with their mean's factors."""
        return sum_payload(payloads, factors)


def downlink_for(setting: str, spec: str, *, checked: bool = False, mean: bool = True) -> Downlink:
    """The downlink a setting ("auto" or one of `DOWNLINKS`) means for the round's codec `spec`.

    `checked`: the members check every owner's answer (`verify`, as every swarm node does), which
    an answer carrying the owner's private residual ("feedback") would fail: auto then gathers a
    sparse codec's contributions under the mean (checked exactly) and re-encodes them under a robust
    rule, and "feedback" is refused. `mean`: the round's aggregate is the mean.
    """
    if setting == "auto":
        if not spec.startswith("sparse"):
            return "encode"
        if not checked:
            return SPARSE_DEFAULT
        return "gather" if mean else "encode"
    if setting == "feedback" and checked:
        raise ValueError(
            "downlink feedback: an owner's answer would carry a residual only it holds, which the"
            " members that check its answers (every swarm node does) cannot tell from a lie;"
            " use gather or encode"
        )
    for downlink in DOWNLINKS:
        if setting == downlink:
            return downlink
    raise ValueError(f"downlink must be auto or one of {', '.join(DOWNLINKS)}, got {setting!r}")


def make_downlink(inner: Codec, downlink: Downlink) -> Codec:
    """The codec an owner encodes its parts' averages with, for `downlink` (see the module);
    ValueError for an unknown one."""
    if downlink == "encode":
        return inner
    if downlink == "feedback":
        return OwnerFeedback(inner)
    if downlink == "gather":
        return Gather(inner)
    raise ValueError(f"downlink must be one of {', '.join(DOWNLINKS)}, got {downlink!r}")
