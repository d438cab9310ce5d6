"""`UserError`, re-exported where the node's modules have always found it (it lives in adloco.errors,
which the bootstrap shares)."""

from __future__ import annotations

from adloco.errors import UserError

__all__ = ["UserError"]
