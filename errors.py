"""Errors the node and the bootstrap report to the user instead of a traceback.

A `UserError` means the input was wrong (a flag, a path, a dataset name), not the code. The CLI catches
it, prints `error: <message>` on one line and exits with status 2, so the message must stand alone:
name the option it concerns, say what was wrong and, where there is one, how to fix it.
"""

from __future__ import annotations


class NetworkLost(Exception):
    """The node's networking (its DHT process or p2pd) died under it: it saved a checkpoint and
    leaves; the CLI says why on one line and exits with status 3, for a supervisor to restart it."""


class UserError(Exception):
    """Bad user input; the message names the option, e.g. ``--model: no such file or model type 'lama'``."""
