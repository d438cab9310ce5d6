"""Operating a swarm node: its counters, status events, checkpoints, and the control plane's requests.

The round loop owns every state change; this module holds what operators see of it and the few
things they may ask for. The control service's threads only read a status snapshot (`node_status`)
or queue a request (`request_checkpoint`, `request_drain`) that the loop answers at the next round
boundary (`between_rounds`): checkpoints are written between rounds only, never during one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import UserError
from ...protocol.algorithms.schedule import accumulation_for
from ..operations.checkpoint import load_checkpoint, save_checkpoint
from ..operations.control import AveragingInfo, NodeStatus, ScheduleInfo
from ..training.peer import Peer
from ..training.rounds import RoundRecord

logger = logging.getLogger(__name__)


class StatusLog:
    """One JSON object per line, appended and flushed: what `adloco-swarm` and operators read."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


@dataclass
class Counters:
    """What a node counts across rounds (its status line, `ctl status`, the checkpoint's extra).

    bytes_*: every byte on its averaging streams (framing included); payload_*: encoded tensors only.
    dropped: contributions that never made it into an applied round. rejected_parts: parts of group
    members the owners screened out. malformed_reports: members' reports every member dropped.
    unconfirmed_heads: heads the state records named that too few of their donors served themselves
    (`sync.SwarmSync._confirmed`: forged records, or donors that moved on).
    """

    applied: int = 0
    tokens_total: int = 0
    tokens_per_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    payload_sent: int = 0
    payload_received: int = 0
    checks_sent: int = 0
    checks_received: int = 0
    dropped: int = 0
    rejected_parts: int = 0
    malformed_reports: int = 0
    unconfirmed_heads: int = 0


class NodeOps:
    """Checkpoints, drain and status of one node (see the module docstring)."""

    def __init__(
        self,
        *,
        peer: Peer,
        lock: threading.Lock,
        status: StatusLog,
        run_id: str,
        checkpoint_dir: Path | None,
        checkpoint_every: int,
        data_shard: int,
    ) -> None:
        self.peer, self.lock, self.status = peer, lock, status
        self.run_id, self.checkpoint_dir, self.checkpoint_every = run_id, checkpoint_dir, checkpoint_every
        self.data_shard = data_shard
        self.counters = Counters()
        # Read by the control plane from its own threads.
        self.phase = "starting"
        self.draining = threading.Event()
        self.last_averaging: AveragingInfo | None = None
        self.last_checkpoint: tuple[int, str] | None = None
        self.last_record: RoundRecord | None = None
        self.peers_visible = 0
        self._started = time.monotonic()
        self._saved_at = -1
        self._requests_lock = threading.Lock()
        self._checkpoint_requests: list[Future[tuple[int, str]]] = []

    # ---- checkpoints -------------------------------------------------------------------------

    def resume(self) -> None:
        """Continue from the newest usable checkpoint in --checkpoint-dir, if there is one."""
        if self.checkpoint_dir is None:
            return
        with self.lock:
            extra = load_checkpoint(self.checkpoint_dir, self.peer.load_state_dict)
        if extra is None:
            return
        self.counters.tokens_total = int(extra.get("tokens_total", 0))
        self.last_checkpoint = (self.peer.state.round, str(self.checkpoint_dir))
        logger.warning(
            "[%s] resumed from the checkpoint of round %d", self.peer.peer_id[-6:], self.peer.state.round
        )
        self.status.write("resumed", round=self.peer.state.round, theta_hash=self.peer.theta_hash())

    def save(self, *, final: bool = False) -> tuple[int, str] | None:
        """Write a checkpoint now (call between rounds, on the training thread)."""
        if self.checkpoint_dir is None:
            return None
        with self.lock:
            path = save_checkpoint(
                self.checkpoint_dir,
                self.peer.state_dict(),
                extra={"tokens_total": self.counters.tokens_total, "data_shard": self.data_shard},
                written=self.peer.release_state,
            )
        self.last_checkpoint = (self.peer.state.round, str(path))
        self.status.write("checkpoint", round=self.peer.state.round, path=str(path), final=final)
        return self.last_checkpoint

    def save_final(self) -> None:
        """The checkpoint at exit; a failure is logged, not raised (the node is leaving anyway)."""
        try:
            self.save(final=True)
        except OSError as e:
            logger.warning("[%s round=%d] final checkpoint failed: %s", *self._tag(), e)

    def between_rounds(self) -> None:
        """The round boundary: periodic checkpoints and the ones operators asked for."""
        applied, every = self.counters.applied, self.checkpoint_every
        due = every > 0 and applied > 0 and applied % every == 0 and self._saved_at != applied
        with self._requests_lock:
            requests, self._checkpoint_requests = self._checkpoint_requests, []
        if not (due or requests):
            return
        try:
            written = self.save()
            self._saved_at = applied
        except OSError as e:  # disk full, volume gone: keep training, say so, retry next time
            logger.warning("[%s round=%d] checkpoint failed: %s", *self._tag(), e)
            self.status.write("checkpoint_failed", round=self.peer.state.round, error=str(e))
            for request in requests:
                request.set_exception(UserError(f"checkpoint failed: {e}"))
            return
        for request in requests:
            request.set_result(written or (self.peer.state.round, ""))

    def stopped(self) -> None:
        """The loop has ended: refuse what is still queued."""
        self.phase = "stopped"
        with self._requests_lock:
            requests, self._checkpoint_requests = self._checkpoint_requests, []
        for request in requests:
            request.set_exception(UserError("checkpoint: the node stopped"))

    # ---- the control plane (called on its threads) -----------------------------------------------

    def request_checkpoint(self, timeout: float | None = None) -> tuple[int, str]:
        """A checkpoint at the next round boundary; blocks until it is written."""
        if self.checkpoint_dir is None:
            raise UserError("checkpoint: --checkpoint-dir is not set")
        if self.phase == "stopped":
            raise UserError("checkpoint: the node has stopped")
        with self._requests_lock:
            if not self._checkpoint_requests:
                self._checkpoint_requests.append(Future())
            request = self._checkpoint_requests[0]
        return request.result(timeout)

    def request_drain(self) -> str:
        """Finish the round, checkpoint, leave."""
        if self.phase in ("draining", "stopped"):
            raise UserError(f"drain: the node is already {self.phase}")
        self.draining.set()
        return f"draining: finishing round {self.peer.state.round + 1}, then checkpoint and leave"

    def node_status(self) -> NodeStatus:
        """What the node is doing (cheap; read without the training thread's help)."""
        state = self.peer.state
        schedule = state.schedule
        last = self.last_record
        checkpoint_round, checkpoint_path = self.last_checkpoint or (None, "")
        return NodeStatus(
            peer_id=self.peer.peer_id,
            run_id=self.run_id,
            round=state.round,
            phase="draining" if self.draining.is_set() and self.phase != "stopped" else self.phase,
            peers_visible=self.peers_visible,
            last_averaging=self.last_averaging,
            schedule=ScheduleInfo(
                batch_sizes=schedule.batch,
                inner_steps=schedule.inner_steps,
                accumulation=tuple(p.accum for p in accumulation_for(schedule, self.peer.b_max)),
                codec=schedule.codec,
            ),
            val_loss=None if last is None else last.val_loss,
            inner_loss=None if last is None else last.inner_loss,
            tokens_per_s=0.0 if last is None else last.tokens_per_s,
            uptime_s=time.monotonic() - self._started,
            last_checkpoint_round=checkpoint_round,
            last_checkpoint_path=checkpoint_path,
        )

    def _tag(self) -> tuple[str, int]:
        return self.peer.peer_id[-6:], self.peer.state.round
