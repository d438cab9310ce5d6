"""State dicts: how a peer's stateful objects hand their state to a checkpoint and take it back.

Modelled on torch's `Stateful` protocol (torchtitan's checkpointer, torchft's registered state
functions): `state_dict()` returns a tree of dicts (string keys) and lists whose leaves are tensors,
bytes, or JSON scalars and strings, and `load_state_dict(state)` restores it, checking all of it
before it changes anything. A state that cannot have come from such an object (malformed, corrupt)
raises ValueError; a well-formed one of another run (another model, more MIT instances) raises
`IncompatibleState`, a UserError whose message the caller prefixes with where the state came from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ...errors import UserError


class IncompatibleState(UserError):
    """A state saved by a peer of another run: not corrupt, but not this peer's to load."""


@contextmanager
def malformed(what: str) -> Iterator[None]:
    """Turn what reading a malformed state raises (a missing key, a wrong type) into a ValueError."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed {what}: {type(e).__name__}: {e}") from e


def tensors_like(value: Any, like: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """`value` as a list of tensors with the shapes and dtypes of `like`; ValueError otherwise."""
    if not isinstance(value, Sequence) or len(value) != len(like):
        raise ValueError(f"{what}: expected {len(like)} tensors")
    for i, (t, ref) in enumerate(zip(value, like, strict=True)):
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}[{i}]: expected {tuple(ref.shape)} {ref.dtype}, got {got}")
    return list(value)


def integer(value: Any, what: str, *, minimum: int = 0) -> int:
    """`value` if it is an int (not a bool) of at least `minimum`; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    return value


def number(value: Any, what: str, *, minimum: float = 0.0) -> float:
    """`value` as a float if it is a finite number of at least `minimum`; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what}: expected a finite number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what}: expected a number >= {minimum}, got {value!r}")
    return float(value)


def mapping(value: Any, what: str) -> Mapping[str, Any]:
    """`value` if it is a dict with string keys; ValueError otherwise."""
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{what}: expected a dict with string keys, got {type(value).__name__}")
    return value
