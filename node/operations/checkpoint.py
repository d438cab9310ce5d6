"""Local rolling checkpoints: everything a node needs to resume where it stopped, crash-safe.

A checkpoint holds the replicated state (θ, outer momentum m, round r, schedule S_r, the kept
averaged updates), the node's own state (each MIT instance's weights, round start, AdamW state and
data-sampler RNG; the error-feedback residual; the low-rank codecs' warm starts; the overlap base
round; DyLU's speed ratio; b_max) and a small JSON `extra` dict of the caller's (counters, the data
shard). Tensors go to safetensors and everything else to JSON, so loading never unpickles.

A save writes a temporary directory next to the target, fsyncs every file and the directory, renames
it to `round-<NNNNNNNN>` (`.1`, `.2`, ... when that round was saved before) and then atomically
repoints `latest`; older checkpoints beyond `keep` are deleted only after that. Every file's sha256
is in the manifest: loading verifies it and falls back to the previous checkpoint when the newest is
truncated or corrupt (research/reliability_ops.md A12, BI-13, F-11). One node per directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ...errors import UserError
from ...protocol.algorithms.schedule import Schedule
from ..training.instances import Instance
from ..training.model import model_fingerprint
from ..training.peer import Peer, PeerState, Update
from ..training.sampling import TokenSampler

logger = logging.getLogger(__name__)

FORMAT = 1
LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"
TENSORS = "tensors.safetensors"
_TMP = ".tmp-"
_NAME = re.compile(r"^round-(\d{8,})(?:\.(\d+))?$")
# Tokens of each instance's data stream kept in the checkpoint, at evenly spaced positions: enough to
# tell which shards an MIT-merged stream was built from (see `_stream_plan`) at a few KB.
_PROBES = 512
_CHUNK = 1 << 20

_SAVE_LOCK = threading.Lock()
_DIGESTS: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}


@dataclass(frozen=True)
class CheckpointInfo:
    """What `peek_checkpoint` reads without a Peer: enough to build the node the checkpoint needs."""

    path: Path
    round: int
    model_fingerprint: str
    extra: dict[str, Any]


class _Unusable(Exception):
    """A checkpoint that cannot be loaded (truncated, bad hash, malformed): try the previous one."""


# ---- public API ------------------------------------------------------------------------------------


def check_checkpoint_dir(path: Path) -> None:
    """Create `path` if needed and prove it writable; raise UserError naming --checkpoint-dir if not.

    Call it at startup before any networking, so a bad path fails in a second, not after joining.
    Writes and removes a probe file (permission bits alone lie when running as root).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"--checkpoint-dir: {path} exists and is not a directory") from None
    except OSError as e:
        raise UserError(f"--checkpoint-dir: cannot create {path}: {e.strerror or e}") from None
    probe = path / f"{_TMP}probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with probe.open("wb") as f:
            f.write(b"adloco")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise UserError(f"--checkpoint-dir: {path} is not writable: {e.strerror or e}") from None


def save_checkpoint(
    directory: Path, peer: Peer, *, extra: Mapping[str, Any] | None = None, keep: int = 2
) -> Path:
    """Write the peer's state as a new checkpoint in `directory`; return its path.

    Reads the peer and never mutates it, so another thread may read `peer.state` meanwhile (not
    mutate it: call between rounds, from the thread that trains). `extra` must be JSON-able and is
    returned by `load_checkpoint`. After the new checkpoint is in place, the newest `keep` are kept;
    a checkpoint of a higher round than this one is stale (the node did not resume from it) and is
    removed too. Raises OSError (disk full, read-only) with the previous checkpoints untouched.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if peer.in_round:
        raise RuntimeError("cannot checkpoint during a local round; save between rounds")
    try:
        extra_json = json.loads(json.dumps(dict(extra or {}), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint extra must be JSON-able: {e}") from None
    t0 = time.perf_counter()
    with _SAVE_LOCK:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(directory)
        meta, tensors = _snapshot(peer, extra_json)
        name = _next_name(directory, meta["round"])
        tmp = directory / f"{_TMP}{name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            size = _write_checkpoint(tmp, meta, tensors)
            # The rename is atomic (POSIX), and the new name never exists, so no reader ever sees a
            # half-written round-* directory.
            os.rename(tmp, directory / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(directory)
        _write_pointer(directory, name)
        _prune(directory, keep=keep, current=name)
    logger.info(
        "checkpoint round=%d saved: %s (%.1f MB, %.2fs)",
        meta["round"],
        directory / name,
        size / 1e6,
        time.perf_counter() - t0,
    )
    return directory / name


def load_checkpoint(directory: Path, peer: Peer) -> dict[str, Any] | None:
    """Restore the newest usable checkpoint into `peer`; return its `extra`, or None if none is usable.

    `peer` must be freshly built from the same TrainConfig. A checkpoint that fails verification is
    skipped with a warning (the previous one is tried). Raises UserError naming --checkpoint-dir for
    a checkpoint of another model, format or instance count: that directory belongs to another run.
    """
    candidates = list_checkpoints(directory)
    for path in candidates:
        try:
            restored = _read(path, peer)
        except _Unusable as e:
            logger.warning("checkpoint %s is unusable (%s); trying the previous one", path, e)
            continue
        restored.apply(peer)
        logger.info("resumed from checkpoint %s at round %d", path, peer.state.round)
        return restored.extra
    if candidates:
        logger.error(
            "no usable checkpoint in %s (%d corrupt); starting from scratch", directory, len(candidates)
        )
    return None


def peek_checkpoint(directory: Path) -> CheckpointInfo | None:
    """The newest checkpoint's round, model fingerprint and `extra`, read without building a Peer.

    Use it to build the Peer a checkpoint needs (e.g. the data shard the caller kept in `extra`).
    Verifies only the small metadata file, so `load_checkpoint` may still fall back to an older
    checkpoint if the newest one's tensors turn out corrupt. Raises UserError for an unknown format.
    """
    for path in list_checkpoints(directory):
        try:
            meta = _read_meta(path, _read_manifest(path))
        except _Unusable:
            continue
        return CheckpointInfo(path, int(meta["round"]), str(meta["model_fingerprint"]), dict(meta["extra"]))
    return None


def list_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints (those with a manifest) in `directory`, newest first."""
    return [p for p in _round_dirs(directory) if (p / MANIFEST).is_file()]


# ---- save ------------------------------------------------------------------------------------------


def _snapshot(peer: Peer, extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The checkpoint's JSON part and its tensors (CPU, contiguous), keyed by position, not by name."""
    state = peer.state
    tensors: dict[str, torch.Tensor] = {}
    _put_all(tensors, "theta", state.theta)
    _put_all(tensors, "momentum", state.momentum)
    residuals = peer.error_feedback.state_dict()
    _put_all(tensors, "ef", residuals.values())
    meta = {
        "format": FORMAT,
        "model_fingerprint": model_fingerprint(peer.eval_model),
        "names": list(peer.names),
        "round": state.round,
        "theta_hash": state.theta_hash(),
        "schedule": state.schedule.to_dict(),
        "history": [_put_update(tensors, f"history/{j}", u) for j, u in enumerate(state.history)],
        "instances": [_put_instance(tensors, f"inst/{k}", inst) for k, inst in enumerate(peer.instances)],
        "error_feedback": list(residuals),
        "codecs": _put_codecs(tensors, peer),
        "phase_round": peer.phase_round,
        "dylu_speed_ratio": peer.dylu_speed_ratio,
        "b_max": peer.b_max,
        "extra": extra,
        "saved_at": time.time(),
    }
    return meta, tensors


def _put_all(tensors: dict[str, torch.Tensor], prefix: str, values: Iterable[torch.Tensor]) -> None:
    for i, t in enumerate(values):
        tensors[f"{prefix}/{i}"] = t.detach().to("cpu").contiguous()


def _put_update(tensors: dict[str, torch.Tensor], prefix: str, update: Update) -> dict[str, Any]:
    keys = list(update.averaged)
    _put_all(tensors, prefix, (_bytes_tensor(update.averaged[key]) for key in keys))
    return {
        "round": update.round,
        "schedule": update.schedule.to_dict(),
        "merge": None if update.merge is None else list(update.merge),
        "keys": keys,
    }


def _put_instance(tensors: dict[str, torch.Tensor], prefix: str, inst: Instance) -> dict[str, Any]:
    _put_all(tensors, f"{prefix}/param", inst.params)
    _put_all(tensors, f"{prefix}/start", inst.start)
    optimizer: dict[str, dict[str, Any]] = {}
    for idx, fields in inst.optimizer_state()["state"].items():
        entry: dict[str, Any] = {"tensors": [], "values": {}}
        for field, value in fields.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}/adam/{idx}/{field}"] = value.detach().to("cpu").contiguous()
                entry["tensors"].append(field)
            else:
                entry["values"][field] = value
        optimizer[str(idx)] = entry
    stream = inst.sampler.stream
    tensors[f"{prefix}/rng"] = inst.sampler.get_state()
    tensors[f"{prefix}/probe"] = stream[_probe_positions(stream.numel())].long()
    digest = _stream_digest(stream)
    return {
        "optimizer": optimizer,
        "stream": {"tokens": stream.numel(), "dtype": str(stream.dtype), "sha256": digest},
    }


def _put_codecs(tensors: dict[str, torch.Tensor], peer: Peer) -> list[list[Any]]:
    """Each codec's key in the peer's table and the names of its warm-start state (low-rank Q)."""
    codecs = []
    for c, (key, codec) in enumerate(peer.codecs.items()):
        state = codec.state_dict() if hasattr(codec, "state_dict") else {}
        _put_all(tensors, f"codec/{c}", state.values())
        codecs.append([key, list(state)])
    return codecs


def _write_checkpoint(tmp: Path, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> int:
    """Write and fsync the files, then the manifest (last, so its presence means complete)."""
    save_file(dict(tensors), str(tmp / TENSORS))
    _write_json(tmp / META, meta)
    files: dict[str, dict[str, Any]] = {}
    total = 0
    for name in (TENSORS, META):
        digest, size = _hash_file(tmp / name, sync=True)
        files[name] = {"sha256": digest, "bytes": size}
        total += size
    _write_json(tmp / MANIFEST, {"format": FORMAT, "round": meta["round"], "files": files})
    _fsync_dir(tmp)
    return total


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())


def _write_pointer(directory: Path, name: str) -> None:
    """Atomically repoint `latest` (for operators and tools; loading orders checkpoints by name)."""
    tmp = directory / f"{LATEST}{_TMP}{os.getpid()}"
    with tmp.open("w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    _fsync_dir(directory)


def _hash_file(path: Path, *, sync: bool = False) -> tuple[str, int]:
    """sha256 and size of a file; `sync` also fsyncs it (the bytes are on disk before the rename)."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest(), size


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _next_name(directory: Path, round_: int) -> str:
    """`round-<NNNNNNNN>`, or with the next free `.k` suffix when that round was saved before."""
    base = f"round-{round_:08d}"
    taken = [seq for r, seq in (_order(p.name) for p in directory.iterdir()) if r == round_]
    return base if not taken else f"{base}.{max(taken) + 1}"


def _remove_leftovers(directory: Path) -> None:
    """Temporary files of saves that crashed (one node per directory, so none is in progress)."""
    for p in directory.iterdir():
        if p.name.startswith(_TMP) or p.name.startswith(f"{LATEST}{_TMP}"):
            logger.info("removing %s left by an interrupted checkpoint", p)
            _remove(p)


def _prune(directory: Path, *, keep: int, current: str) -> None:
    """Keep `current` and the newest complete checkpoints before it, `keep` in all; delete the rest."""
    dirs = _round_dirs(directory)
    newer = dirs[: [p.name for p in dirs].index(current)]
    for p in newer:
        logger.warning("removing stale checkpoint %s: newer than the round just saved", p)
        _remove(p)
    kept = 0
    for p in dirs[len(newer) :]:
        if kept < keep and (p / MANIFEST).is_file():
            kept += 1
        else:
            _remove(p)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _round_dirs(directory: Path) -> list[Path]:
    """Every `round-*` directory, newest first (by round, then by same-round save)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: _order(p.name), reverse=True)


def _order(name: str) -> tuple[int, int]:
    match = _NAME.match(name)
    if match is None:
        return -1, -1
    return int(match.group(1)), int(match.group(2) or 0)


# ---- load ------------------------------------------------------------------------------------------


@dataclass
class _Restored:
    """A checkpoint read, verified and matched to a peer, ready to apply without failing midway."""

    state: PeerState
    instances: list[dict[str, Any]]
    samplers: list[TokenSampler]
    residuals: dict[str, torch.Tensor]
    codecs: list[tuple[str, dict[str, torch.Tensor]]]
    phase_round: int
    dylu_speed_ratio: float | None
    b_max: int
    extra: dict[str, Any]

    def apply(self, peer: Peer) -> None:
        peer.state = self.state
        kept = peer.instances[: len(self.instances)]
        for slot, (inst, saved, sampler) in enumerate(zip(kept, self.instances, self.samplers, strict=True)):
            inst.slot = slot
            inst.sampler = sampler
            with torch.no_grad():
                for p, s, saved_p, saved_s in zip(
                    inst.params, inst.start, saved["params"], saved["start"], strict=True
                ):
                    p.copy_(saved_p)
                    s.copy_(saved_s)
            # The config's hyper-parameters (lr, betas, ...) stay; only the moments and steps load.
            optimizer = inst.optimizer_state()
            optimizer["state"] = saved["optimizer"]
            inst.load_optimizer_state(optimizer)
        peer.instances = kept
        peer.error_feedback.load_state_dict(self.residuals)
        for key, codec_state in self.codecs:
            spec = key.removesuffix("/avg")
            codec = peer.downlink_codec(spec) if key.endswith("/avg") else peer.codec(spec)
            if codec_state and hasattr(codec, "load_state_dict"):
                codec.load_state_dict(codec_state)
        peer.phase_round = self.phase_round
        peer.dylu_speed_ratio = self.dylu_speed_ratio
        # An explicit --b-max wins over the saved probe (the hardware may have changed).
        peer.b_max = peer.cfg.b_max or self.b_max


def _read(path: Path, peer: Peer) -> _Restored:
    """Verify and parse a checkpoint for `peer`; raises _Unusable, or UserError when incompatible."""
    manifest = _read_manifest(path)
    meta = _read_meta(path, manifest)
    _check_compatible(path, meta, peer)
    try:
        _verify(path / TENSORS, manifest["files"][TENSORS])
        tensors = load_file(str(path / TENSORS))
        return _restored(meta, tensors, peer)
    except _Unusable:
        raise
    except Exception as e:  # whatever a malformed file raises: fall back, never crash the node
        raise _Unusable(f"{type(e).__name__}: {e}") from e


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if not all(isinstance(files[name]["sha256"], str) for name in (TENSORS, META)):
            raise TypeError("sha256 is not a string")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Unusable(f"bad manifest: {type(e).__name__}: {e}") from e
    if manifest.get("format") != FORMAT:
        raise UserError(
            f"--checkpoint-dir: {path} has checkpoint format {manifest.get('format')!r}; this version"
            f" reads format {FORMAT}: use another directory or the adloco-node version that wrote it"
        )
    return dict(manifest)


def _read_meta(path: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    _verify(path / META, manifest["files"][META])
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _Unusable(f"bad {META}: {e}") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("extra"), dict):
        raise _Unusable(f"bad {META}: not a checkpoint description")
    return meta


def _verify(path: Path, expected: Mapping[str, Any]) -> None:
    try:
        digest, size = _hash_file(path)
    except OSError as e:
        raise _Unusable(f"{path.name}: {e.strerror or e}") from e
    if size != expected.get("bytes") or digest != expected["sha256"]:
        raise _Unusable(
            f"{path.name}: {size} bytes, sha256 does not match the manifest (truncated or corrupt)"
        )


def _check_compatible(path: Path, meta: Mapping[str, Any], peer: Peer) -> None:
    ours, theirs = model_fingerprint(peer.eval_model), str(meta.get("model_fingerprint"))
    if theirs != ours or meta.get("names") != peer.names:
        raise UserError(
            f"--checkpoint-dir: {path} holds a checkpoint of another model (fingerprint {theirs[:12]},"
            f" this node's {ours[:12]}); use another directory or the --model it was trained with"
        )
    saved, have = len(meta.get("instances", ())), len(peer.instances)
    if saved > have:
        raise UserError(
            f"--checkpoint-dir: {path} was saved with {saved} MIT instances, this node starts"
            f" {have}; use --instances {saved} or another directory"
        )


def _restored(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], peer: Peer) -> _Restored:
    device = peer.device
    n = len(peer.names)
    state = PeerState(
        theta=[tensors[f"theta/{i}"].to(device) for i in range(n)],
        momentum=[tensors[f"momentum/{i}"].to(device) for i in range(n)],
        round=int(meta["round"]),
        schedule=Schedule.from_dict(meta["schedule"]),
        history=[
            Update(
                round=int(h["round"]),
                averaged={
                    key: tensors[f"history/{j}/{i}"].numpy().tobytes() for i, key in enumerate(h["keys"])
                },
                schedule=Schedule.from_dict(h["schedule"]),
                merge=None if h["merge"] is None else (int(h["merge"][0]), int(h["merge"][1])),
            )
            for j, h in enumerate(meta["history"])
        ],
    )
    if state.theta_hash() != meta["theta_hash"]:
        raise _Unusable("θ does not match the θ hash it was saved with")
    instances = []
    for k, saved in enumerate(meta["instances"]):
        instances.append(
            {
                "params": [tensors[f"inst/{k}/param/{i}"] for i in range(n)],
                "start": [tensors[f"inst/{k}/start/{i}"] for i in range(n)],
                "optimizer": {
                    int(idx): {
                        **entry["values"],
                        **{field: tensors[f"inst/{k}/adam/{idx}/{field}"] for field in entry["tensors"]},
                    }
                    for idx, entry in saved["optimizer"].items()
                },
            }
        )
    samplers = _samplers(meta["instances"], tensors, peer)
    return _Restored(
        state=state,
        instances=instances,
        samplers=samplers,
        residuals={key: tensors[f"ef/{i}"] for i, key in enumerate(meta["error_feedback"])},
        codecs=[
            (str(key), {name: tensors[f"codec/{c}/{i}"] for i, name in enumerate(names)})
            for c, (key, names) in enumerate(meta["codecs"])
        ],
        phase_round=int(meta["phase_round"]),
        dylu_speed_ratio=None if meta["dylu_speed_ratio"] is None else float(meta["dylu_speed_ratio"]),
        b_max=int(meta["b_max"]),
        extra=dict(meta["extra"]),
    )


# ---- data streams ----------------------------------------------------------------------------------


def _samplers(
    saved: Sequence[Mapping[str, Any]], tensors: Mapping[str, torch.Tensor], peer: Peer
) -> list[TokenSampler]:
    """The saved instances' samplers, rebuilt from the fresh peer's shards, RNG state restored.

    After MIT merges an instance's stream is its shard followed by the shards it absorbed. We find
    which fresh shards, in which order, make up each saved stream (checked against the saved token
    probes and sha256), and concatenate them as the merges did. When they cannot be matched (the
    node now trains another data shard, or another corpus), the fresh streams are merged as a state
    download would (`Peer.adopt_state`: smallest first) and a warning says so: training goes on, on
    other data.
    """
    fresh = [inst.sampler for inst in peer.instances]
    plan = _stream_plan([s.stream for s in fresh], saved, tensors)
    if plan is None:
        logger.warning(
            "checkpoint data streams do not match this node's data shards (another --data-shard or"
            " dataset?); the instances resume on this node's shards"
        )
        plan = _fallback_plan([s.num_tokens for s in fresh], len(saved))
    samplers = []
    for k, group in enumerate(plan):
        sampler = fresh[group[0]]
        for i in group[1:]:
            sampler = sampler.merged_with(fresh[i])
        sampler.set_state(tensors[f"inst/{k}/rng"])
        samplers.append(sampler)
    return samplers


def _stream_plan(
    streams: Sequence[torch.Tensor], saved: Sequence[Mapping[str, Any]], tensors: Mapping[str, torch.Tensor]
) -> list[list[int]] | None:
    """For each saved instance, the fresh streams it is made of, in order; None if one has no match."""
    plan: list[list[int]] = []
    used: set[int] = set()
    for k, info in enumerate(saved):
        found = _decompose(streams, info["stream"], tensors[f"inst/{k}/probe"], used)
        if found is None:
            return None
        used.update(found)
        plan.append(found)
    return plan


def _decompose(
    streams: Sequence[torch.Tensor], info: Mapping[str, Any], probe: torch.Tensor, used: set[int]
) -> list[int] | None:
    """The unused fresh streams whose concatenation, in this order, is the saved stream; None if none."""
    length = int(info["tokens"])
    positions = _probe_positions(length)
    if probe.shape != positions.shape:
        return None

    def search(offset: int, chosen: list[int]) -> list[int] | None:
        if offset == length:
            parts = [streams[i] for i in chosen]
            ok = str(parts[0].dtype) == info["dtype"] and _digest(parts) == info["sha256"]
            return chosen if ok else None
        for i, stream in enumerate(streams):
            end = offset + stream.numel()
            if i in used or i in chosen or end > length:
                continue
            lo, hi = torch.searchsorted(positions, torch.tensor([offset, end])).tolist()
            if not torch.equal(stream[positions[lo:hi] - offset].long(), probe[lo:hi]):
                continue
            found = search(end, [*chosen, i])
            if found is not None:
                return found
        return None

    return search(0, [])


def _fallback_plan(tokens: Sequence[int], count: int) -> list[list[int]]:
    """Merge the two smallest streams (the smaller one absorbed) until `count` are left."""
    groups = [[k] for k in range(len(tokens))]
    while len(groups) > count:
        order = sorted(range(len(groups)), key=lambda g: (sum(tokens[k] for k in groups[g]), g))
        victim, survivor = order[0], order[1]
        groups[survivor] = groups[survivor] + groups[victim]
        del groups[victim]
    return groups


def _probe_positions(length: int) -> torch.Tensor:
    count = min(length, _PROBES)
    return torch.arange(count, dtype=torch.int64) * (length - 1) // max(count - 1, 1)


def _stream_digest(stream: torch.Tensor) -> str:
    # Streams never change once built and can be large: hash each one once per process.
    cached = _DIGESTS.get(id(stream))
    if cached is not None and cached[0]() is stream:
        return cached[1]
    digest = _digest([stream])
    for key in [key for key, (ref, _) in _DIGESTS.items() if ref() is None]:
        del _DIGESTS[key]
    _DIGESTS[id(stream)] = (weakref.ref(stream), digest)
    return digest


def _digest(parts: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.contiguous().numpy().data)
    return digest.hexdigest()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
