"""Local rolling checkpoints: any state dict written crash-safe, and verified when read back.

`save_checkpoint` stores a state dict (a tree of dicts and lists whose leaves are tensors, bytes, or
JSON scalars and strings, as the training objects' `state_dict()` return) and a small JSON `extra`
of the caller's: the tensors go to safetensors (bytes as uint8 tensors) and the rest of the tree to
JSON, so loading never unpickles. A save writes a temporary directory next to the target, fsyncs
every file and the directory, renames it to `round-<NNNNNNNN>` (`.1`, `.2`, ... when that round was
saved before) and then atomically repoints `latest`; older checkpoints beyond `keep` are deleted only
after that. Every file's sha256 is in the manifest: `load_checkpoint` verifies it and falls back to
the previous checkpoint when the newest is truncated or corrupt, or its state is refused as malformed
(research/reliability_ops.md A12, BI-13, F-11). One node per directory.

Over 500 lines, one idea: the checkpoint's format on disk and its atomic write, listing, reading and
verification; the helpers below (escaping, hashing, fsync, pruning, the manifest) serve only it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import struct
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ...errors import UserError

logger = logging.getLogger(__name__)

# 2: the state is a generic tree (meta.json's `state`, tensors keyed by JSON pointer); 1 was Peer-shaped.
FORMAT = 2
LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"
TENSORS = "tensors.safetensors"
_TMP = ".tmp-"
_NAME = re.compile(r"^round-(\d{8,})(?:\.(\d+))?$")
_CHUNK = 1 << 20
# How a tensor or bytes leaf appears in the JSON skeleton; dict keys of a state may not start with "$".
_TENSOR, _BYTES = "$tensor", "$bytes"
_SCALARS = (str, int, float, bool, type(None))

_SAVE_LOCK = threading.Lock()


@dataclass(frozen=True)
class CheckpointInfo:
    """What `peek_checkpoint` reads without loading the state: enough to build what will load it."""

    path: Path
    round: int
    model_fingerprint: str | None
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
    directory: Path,
    state: Mapping[str, Any],
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int = 2,
    written: Callable[[], None] | None = None,
) -> Path:
    """Write `state` as a new checkpoint in `directory`; return its path.

    The state's top-level `round` (an int) names the checkpoint, and its top-level
    `model_fingerprint`, when a string, is what `peek_checkpoint` reports. The tree is read, never
    changed: its owner must not change it meanwhile (call between rounds, from the thread that
    trains). `extra` must be JSON-able and is returned by `load_checkpoint`. After the new checkpoint
    is in place, the newest `keep` are kept; a checkpoint of a higher round than this one is stale
    (the node did not resume from it) and is removed too. Raises ValueError, writing nothing, for a
    tree that is not a state dict; OSError (disk full, read-only) with the previous checkpoints
    untouched. `written()` runs after each tensor is written (a peer whose θ and m are mapped from
    files gives their pages back: `Peer.release_state`).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    t0 = time.perf_counter()
    meta, tensors = _describe(state, extra or {})
    round_ = meta["round"]
    with _SAVE_LOCK:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(directory)
        name = _next_name(directory, round_)
        tmp = directory / f"{_TMP}{name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            size = _write_checkpoint(tmp, meta, tensors, written)
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
        round_,
        directory / name,
        size / 1e6,
        time.perf_counter() - t0,
    )
    return directory / name


def load_checkpoint(directory: Path, load: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
    """Hand the newest usable checkpoint's state to `load`; return its `extra`, or None if none is usable.

    A checkpoint that fails verification, or whose state `load` refuses with ValueError (malformed
    or corrupt; `load` must then have changed nothing), is skipped with a warning and the previous
    one tried. A UserError from `load` (a state of another run) is raised again naming
    --checkpoint-dir and the checkpoint, as is a checkpoint of another format: that directory
    belongs to another run or version.
    """
    candidates = list_checkpoints(directory)
    for path in candidates:
        try:
            meta, state = _read(path)
            _hand_over(path, state, load)
        except _Unusable as e:
            logger.warning("checkpoint %s is unusable (%s); trying the previous one", path, e)
            continue
        logger.info("resumed from checkpoint %s at round %d", path, meta["round"])
        return dict(meta["extra"])
    if candidates:
        logger.error(
            "no usable checkpoint in %s (%d corrupt); starting from scratch", directory, len(candidates)
        )
    return None


def peek_checkpoint(directory: Path) -> CheckpointInfo | None:
    """The newest checkpoint's round, model fingerprint and `extra`, read without loading its state.

    Use it to build what will load the state (e.g. with the data shard the caller kept in `extra`).
    Verifies only the small metadata file, so `load_checkpoint` may still fall back to an older
    checkpoint if the newest one's tensors turn out corrupt. Raises UserError for an unknown format.
    """
    for path in list_checkpoints(directory):
        try:
            meta = _read_meta(path, _read_manifest(path))
        except _Unusable:
            continue
        fingerprint = meta.get("model_fingerprint")
        return CheckpointInfo(
            path, meta["round"], fingerprint if isinstance(fingerprint, str) else None, dict(meta["extra"])
        )
    return None


def list_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints (those with a manifest) in `directory`, newest first."""
    return [p for p in _round_dirs(directory) if (p / MANIFEST).is_file()]


def flatten_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split a state dict into a JSON-able skeleton and its tensors, which `unflatten_state` joins.

    Each tensor leaf becomes `{"$tensor": key}` in the skeleton and each bytes leaf `{"$bytes": key}`
    (stored as a uint8 tensor), the key being the leaf's JSON pointer (RFC 6901), so keys are unique
    and say where a tensor belongs. Tensors are detached, on the CPU and contiguous; tuples become
    lists. Raises ValueError for another leaf type, a non-finite float, or a dict key that is not a
    string or starts with "$".
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"a state dict is a dict, got {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = _stored(value, storages)
            return {_TENSOR: path}
        if isinstance(value, bytes):
            tensors[path] = _bytes_tensor(value)
            return {_BYTES: path}
        if isinstance(value, Mapping):
            for key in value:
                if not isinstance(key, str) or key.startswith("$"):
                    raise ValueError(f"state {path or '/'}: key {key!r} is not a string without a leading $")
            return {key: walk(v, f"{path}/{_escape(key)}") for key, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"state {path}: {value} is not finite")
        if isinstance(value, _SCALARS):
            return value
        raise ValueError(f"state {path}: a {type(value).__name__} is not a state leaf")

    return walk(state, ""), tensors


def unflatten_state(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict `flatten_state` split into `skeleton` and `tensors`; ValueError if they do not fit."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if any(key.startswith("$") for key in node):
                return _leaf(node, tensors)
            return {key: walk(v) for key, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, _SCALARS):
            return node
        raise ValueError(f"a {type(node).__name__} in a state skeleton")

    state = walk(skeleton)
    if not isinstance(state, dict):
        raise ValueError(f"a state dict is a dict, got {type(state).__name__}")
    return state


# ---- save ------------------------------------------------------------------------------------------


def _describe(
    state: Mapping[str, Any], extra: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The checkpoint's JSON part (round, fingerprint, `extra`, the state's skeleton) and its tensors."""
    round_ = state.get("round") if isinstance(state, Mapping) else None
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        raise ValueError(f"a checkpointed state needs an integer round >= 0, got {round_!r}")
    try:
        extra_json = json.loads(json.dumps(dict(extra), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint extra must be JSON-able: {e}") from None
    skeleton, tensors = flatten_state(state)
    fingerprint = state.get("model_fingerprint")
    meta = {
        "format": FORMAT,
        "round": round_,
        "model_fingerprint": fingerprint if isinstance(fingerprint, str) else None,
        "extra": extra_json,
        "saved_at": time.time(),
        "state": skeleton,
    }
    return meta, tensors


def _stored(tensor: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """`tensor` as saved: detached, CPU, contiguous, and copied when it shares memory with one saved
    before (safetensors refuses to write shared tensors)."""
    stored = tensor.detach().to("cpu").contiguous()
    ptr = stored.untyped_storage().data_ptr()
    if ptr in storages:
        stored = stored.clone()
        ptr = stored.untyped_storage().data_ptr()
    if ptr:
        storages.add(ptr)
    return stored


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """The bytes as a uint8 tensor over their own buffer (read-only, and only read: no copy)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _write_checkpoint(
    tmp: Path,
    meta: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    written: Callable[[], None] | None = None,
) -> int:
    """Write and fsync the files, then the manifest (last, so its presence means complete)."""
    _write_safetensors(tmp / TENSORS, tensors, written)
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


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], written: Callable[[], None] | None = None
) -> None:
    """Write a safetensors file tensor by tensor from the tensors' own memory, calling `written()`
    after each.

    The library's `save_file` first turns every tensor into a bytes copy, doubling the memory of the
    whole state for the length of the save; here the header is computed from shapes and dtypes and
    each tensor's buffer is written as it is (little-endian hosts, as everything we run on).
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"checkpoint tensor {name}: dtype {tensor.dtype} cannot be stored")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors.values():
            if tensor.numel():
                f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
            if written is not None:
                written()


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


def _read(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint's metadata and state, verified; raises _Unusable, or UserError for another format."""
    manifest = _read_manifest(path)
    meta = _read_meta(path, manifest)
    try:
        _verify(path / TENSORS, manifest["files"][TENSORS])
        return meta, unflatten_state(meta["state"], load_file(str(path / TENSORS)))
    except _Unusable:
        raise
    except Exception as e:  # whatever a malformed file raises: fall back, never crash the node
        raise _Unusable(f"{type(e).__name__}: {e}") from e


def _hand_over(path: Path, state: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
    try:
        load(state)
    except UserError as e:
        raise UserError(f"--checkpoint-dir: {path}: {e}, or use another directory") from e
    except ValueError as e:
        raise _Unusable(f"state refused: {e}") from e


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
    if not (
        isinstance(meta, dict)
        and isinstance(meta.get("extra"), dict)
        and isinstance(meta.get("state"), dict)
        and isinstance(meta.get("round"), int)
    ):
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


def _leaf(node: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | bytes:
    """The tensor or bytes a `{"$tensor": key}` or `{"$bytes": key}` skeleton node stands for."""
    if len(node) == 1:
        ((kind, key),) = node.items()
        tensor = tensors.get(key) if isinstance(key, str) else None
        if kind == _TENSOR and tensor is not None:
            return tensor
        if kind == _BYTES and tensor is not None and tensor.dtype == torch.uint8 and tensor.ndim == 1:
            return tensor.numpy().tobytes()
    raise ValueError(f"bad leaf {node!r} in a state skeleton")
