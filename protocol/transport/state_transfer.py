"""Serving and fetching the run's state over hivemind's P2P: full state for joiners, recent updates
for peers a few rounds behind.

A peer serves two requests on a stream handler namespaced by the run prefix:
- "state": θ and the outer momentum (safetensors, never pickle), the round, the schedule, θ's hash;
- "updates" from round r: the averaged updates it keeps (round, encoded averaged bytes, the
  schedule after it, the MIT merge), which a lagging peer replays to reach the same θ bit for bit.
The receiver checks a downloaded state against the θ hash the swarm published for that round
(`node/swarm.py`), and a replayed θ against the hash published after the last update.

Wire frames are `wire.py`'s, request and response one frame each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import hivemind
import torch
from hivemind.p2p import P2P, PeerID
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .wire import PROTOCOL_VERSION, Meter, daemon_listen_maddr, read_frame, write_frame

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class StateSnapshot:
    """What a peer sends a joiner: θ and m by tensor name, the round, schedule and θ hash."""

    round: int
    schedule: dict[str, Any]
    theta: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    theta_hash: str


@dataclass(frozen=True)
class UpdateRecord:
    """One applied round as a lagging peer replays it."""

    round: int
    averaged: dict[str, bytes]
    schedule: dict[str, Any]
    merge: tuple[int, int] | None


class StateServer:
    """Serves this peer's state and kept updates, and fetches them from other peers.

    `snapshot` and `updates` are called on the server's loop thread; they must return copies that
    the trainer thread will not mutate afterwards.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        prefix: str,
        snapshot: Callable[[], StateSnapshot],
        updates: Callable[[int], list[UpdateRecord]],
    ) -> None:
        self._snapshot = snapshot
        self._updates = updates
        digest = hashlib.sha256(prefix.encode()).hexdigest()[:24]
        self._handler_name = f"adloco.state.v{PROTOCOL_VERSION}.{digest}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="adloco-state", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            maddr = dht.run_coroutine(daemon_listen_maddr)
            self._p2p: P2P = self._call(P2P.replicate(maddr), timeout=30)
            self._call(self._p2p.add_binary_stream_handler(self._handler_name, self._serve), timeout=30)
        except BaseException:
            self._stop_loop()
            raise

    # ---- client ------------------------------------------------------------------------------

    def fetch_state(self, peer_id: str, *, timeout: float = 60.0) -> StateSnapshot:
        """Download the full state from `peer_id`; raises on any failure (caller tries another)."""
        header, body = self._call(self._request(peer_id, {"op": "state"}), timeout=timeout)
        tensors = load_safetensors(body[0])
        theta = {k.removeprefix("theta."): v for k, v in tensors.items() if k.startswith("theta.")}
        momentum = {k.removeprefix("momentum."): v for k, v in tensors.items() if k.startswith("momentum.")}
        return StateSnapshot(
            round=int(header["round"]),
            schedule=dict(header["schedule"]),
            theta=theta,
            momentum=momentum,
            theta_hash=str(header["theta_hash"]),
        )

    def fetch_updates(self, peer_id: str, *, from_round: int, timeout: float = 60.0) -> list[UpdateRecord]:
        """The updates `peer_id` keeps from `from_round` on, in order (possibly empty)."""
        header, body = self._call(
            self._request(peer_id, {"op": "updates", "from": from_round}), timeout=timeout
        )
        records: list[UpdateRecord] = []
        chunks = iter(body)
        for item in header["updates"]:
            averaged = {str(key): next(chunks) for key in item["keys"]}
            merge = (int(item["merge"][0]), int(item["merge"][1])) if item["merge"] is not None else None
            records.append(UpdateRecord(int(item["round"]), averaged, dict(item["schedule"]), merge))
        return records

    async def _request(self, peer_id: str, header: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        meter = Meter()
        _, reader, writer = await self._p2p.call_binary_stream_handler(
            PeerID.from_base58(peer_id), self._handler_name
        )
        try:
            await write_frame(writer, {"v": PROTOCOL_VERSION, **header}, [], meter)
            response, body = await read_frame(reader, meter)
        finally:
            writer.close()
        if not response.get("ok"):
            raise ValueError(f"peer {peer_id} refused {header['op']}: {response.get('e')}")
        return response, body

    # ---- server ------------------------------------------------------------------------------

    async def _serve(
        self, _stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        meter = Meter()
        try:
            request, _ = await read_frame(reader, meter)
            header, body = await asyncio.get_running_loop().run_in_executor(None, self._answer, request)
            await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": True, **header}, body, meter)
        except Exception as e:
            logger.debug("state request failed: %r", e)
            with contextlib.suppress(Exception):  # the requester may already be gone
                await write_frame(writer, {"v": PROTOCOL_VERSION, "ok": False, "e": str(e)[:200]}, [], meter)
        finally:
            writer.close()

    def _answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        if request.get("op") == "state":
            snap = self._snapshot()
            tensors = {f"theta.{k}": v.contiguous().cpu() for k, v in snap.theta.items()}
            tensors.update({f"momentum.{k}": v.contiguous().cpu() for k, v in snap.momentum.items()})
            header = {"round": snap.round, "schedule": snap.schedule, "theta_hash": snap.theta_hash}
            return header, [save_safetensors(tensors)]
        if request.get("op") == "updates":
            records = self._updates(int(request["from"]))
            items: list[dict[str, Any]] = []
            body: list[bytes] = []
            for rec in records:
                keys = list(rec.averaged)
                items.append({"round": rec.round, "keys": keys, "schedule": rec.schedule, "merge": rec.merge})
                body.extend(rec.averaged[k] for k in keys)
            return {"updates": items}, body
        raise ValueError(f"unknown request {request.get('op')!r}")

    # ---- plumbing ----------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T], *, timeout: float) -> _T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout}s") from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._close(), timeout=10)
        except Exception as e:  # the DHT may already be gone
            logger.debug("state server shutdown: %r", e)
        finally:
            self._stop_loop()

    async def _close(self) -> None:
        try:
            await self._p2p.remove_binary_stream_handler(self._handler_name)
            await self._p2p.shutdown()  # a replica owns no p2pd: this closes its connections only
        finally:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
