"""MIT instances on a node's further devices, each device's in a worker process (issue 27 §2).

A node given several devices (`--device cuda:0,cuda:1`, or `auto` on a machine with several GPUs)
places its MIT instances across them: slot k trains on device k mod D. The first device's
instances train in the node's own process, as on a one-device node. Each further device gets a
worker process of its own (started with `spawn`: the node already runs threads, and CUDA cannot be
forked), which builds the same seeded model and holds the real `Instance`s of its slots. In the
node a `RemoteInstance` stands for each of them with the methods `Peer` calls, so θ, the outer
state, the network and the checkpoints stay one per node, and the batch test and MIT merges see
every instance as on one device.

What crosses the pipe to a worker: commands and small results, pickled; tensors (θ at a round's
start or a shift, Δ at a round's end, an instance's state for a checkpoint or a merge) as shared
host memory through torch.multiprocessing's reductions, not copied through the pipe. A worker's
round runs while the node's own instances train (`RemoteInstance.start_round`, then
`finish_rounds`); the worker reports each inner step, so the node's per-step hook (overlap's
landing of an update) runs for those steps too, and a shift sent mid-round is applied between two
of the worker's steps, as a local instance's is.

A worker that dies (its device failed, the process was killed) is noticed at the next message:
`DeviceLost`, a UserError naming the device. The node stops without writing a checkpoint (the lost
instance's state is gone), so its last checkpoint stays intact for a restart.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.multiprocessing

from ...errors import UserError
from ...protocol.algorithms.pseudograd import PseudoGradient
from ...protocol.algorithms.switch import BatchPlan
from ..data.sampling import TokenSampler
from ..model.devices import Placement, resolve_precision
from ..model.model import resolve_compile
from .build import new_instance, training_model
from .config import TrainConfig
from .instances import Instance, InstanceRound
from .parallel import GroupSpec

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

# How long a worker may take to build its model and answer (spawn imports torch and transformers).
_READY_TIMEOUT_S = 600.0


class DeviceLost(UserError):
    """A device's worker process is gone: its instances' state with it."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a device's worker builds its instances with: the node's settings and thread count."""

    device: str
    cfg: TrainConfig
    vocab_size: int
    threads: int
    log_level: int


class DeviceWorker:
    """The worker process of one device and the pipe to it, shared by the `RemoteInstance`s on it."""

    def __init__(self, device: torch.device, spec: WorkerSpec, *, label: str) -> None:
        self.device = device
        self.label = label  # how metrics name the device
        ctx = torch.multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(theirs, spec), name=f"adloco-{device}", daemon=True)
        self.process.start()
        theirs.close()
        self.conn: Connection = ours
        self._keys = itertools.count()
        # Reports read while waiting for something else: inner steps (key, step) and ended rounds.
        self._steps: list[tuple[int, int]] = []
        self.rounds: dict[int, tuple[str, Any]] = {}
        self.on_step: dict[int, Callable[[int], None] | None] = {}
        if not self.conn.poll(_READY_TIMEOUT_S):
            self.process.kill()
            raise DeviceLost(f"device {device}: its worker process did not start in {_READY_TIMEOUT_S:.0f} s")
        self._reply(self._recv())
        logger.info("device %s: worker process %d holds its instances", device, self.process.pid)

    def new_key(self) -> int:
        return next(self._keys)

    def call(self, op: str, *args: Any) -> Any:
        """Run `op` in the worker and return its result (its error raised here)."""
        self.send(op, *args)
        return self.answer()

    def answer(self) -> Any:
        """The result of the command sent last (`send`), once the worker gives it."""
        while True:
            message = self._recv()
            if message[0] in ("ok", "err"):
                return self._reply(message)
            self._keep(message)

    def send(self, op: str, *args: Any) -> None:
        try:
            self.conn.send((op, args))
        except (OSError, EOFError) as e:
            raise self._lost(e) from None
        except RuntimeError as e:  # θ moved into shared memory to be sent, and it did not fit
            raise _error(self.device, type(e).__name__, str(e)) from None

    def read(self) -> None:
        """Take one report the worker sent (a step or an ended round), for `finish_rounds`."""
        message = self._recv()
        if message[0] in ("ok", "err"):
            raise RuntimeError(f"device {self.device}: an answer {message[0]!r} nobody asked for")
        self._keep(message)

    def deliver_steps(self) -> None:
        """Run the step hooks of the steps reported so far, in order."""
        steps, self._steps = self._steps, []
        for key, step in steps:
            hook = self.on_step.get(key)
            if hook is not None:
                hook(step)

    def close(self) -> None:
        """Stop the worker (it also stops by itself when the node's end of the pipe closes)."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop", ()))
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.conn.close()

    def _keep(self, message: tuple[Any, ...]) -> None:
        if message[0] == "step":
            self._steps.append((message[1], message[2]))
        elif message[0] == "round":
            self.rounds[message[1]] = message[2]
        else:
            raise RuntimeError(f"device {self.device}: unknown report {message[0]!r}")

    def _recv(self) -> tuple[Any, ...]:
        try:
            message = self.conn.recv()
        except (OSError, EOFError) as e:
            raise self._lost(e) from None
        if not isinstance(message, tuple) or not message:
            raise RuntimeError(f"device {self.device}: a malformed report from its worker")
        return message

    def _reply(self, message: tuple[Any, ...]) -> Any:
        if message[0] == "ok":
            return message[1]
        raise _error(self.device, message[1], message[2])

    def _lost(self, cause: BaseException) -> DeviceLost:
        self.process.join(timeout=5)
        code = self.process.exitcode
        how = "is still running" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by signal {-code}"
        return DeviceLost(
            f"device {self.device} was lost: its worker process (pid {self.process.pid}) {how}"
            f" ({type(cause).__name__}). This node stops without a new checkpoint, so its last one is"
            " intact: restart it to resume from there, with --device naming the devices that work"
        )


# What torch says when /dev/shm cannot hold a tensor it shares (a container's is 64 MB by default).
_SHM_FULL = ("No space left on device", "unable to write to file", "unable to mmap")


def _error(device: torch.device, kind: str, text: str) -> Exception:
    """The worker's exception as the node raises it: ValueError and UserError keep their type (a
    state that does not fit, bad input), shared memory too small is a UserError that says what to
    do, anything else names the device."""
    if any(marker in text for marker in _SHM_FULL):
        return UserError(
            f"device {device}: shared memory (/dev/shm) is too small for the tensors the devices"
            f" share ({text.strip().splitlines()[0]}); it needs 4 bytes per parameter for θ plus 4 per"
            " instance on a further device: in a container give it more (docker run --shm-size 8g,"
            " or --ipc=host)"
        )
    if kind == "ValueError":
        return ValueError(text)
    if kind in ("UserError", "IncompatibleState"):
        return UserError(text)
    return RuntimeError(f"device {device}: {kind}: {text}")


class RemoteInstance:
    """An MIT instance in a device's worker process: the `Instance` methods `Peer` calls.

    Δ comes back whole at the round's end (in shared memory), so nothing is settled later
    (`settle_delta` has nothing to do). `slot` is the node's numbering, kept here.
    """

    def __init__(self, worker: DeviceWorker, *, slot: int, sampler: TokenSampler, random_seed: int) -> None:
        self.worker = worker
        self.slot = slot
        self.key = worker.new_key()
        worker.call("create", self.key, sampler, random_seed)
        self._closed = False

    @property
    def device(self) -> torch.device:
        return self.worker.device

    def settle_delta(self) -> None:
        """Nothing to settle: a remote round's Δ is sent whole when the round ends."""

    def load(self, theta: Sequence[torch.Tensor]) -> None:
        self.worker.call("load", self.key, list(theta))

    def begin(self, theta: Sequence[torch.Tensor] | None, *, share: bool = False) -> None:
        self.worker.call("begin", self.key, None if theta is None else list(theta), share)

    def shift(self, theta: Sequence[torch.Tensor], *, mode: str, mix: float = 0.5) -> None:
        """As `Instance.shift`; mid-round the worker applies it after its current inner step."""
        self.worker.call("shift", self.key, list(theta), mode, mix)

    def start_round(
        self,
        theta: Sequence[torch.Tensor] | None,
        *,
        plan: BatchPlan,
        steps: int,
        on_step: Callable[[int], None] | None = None,
        share_theta: bool = False,
        collect_stats: bool = True,
    ) -> None:
        """Start `Instance.run_round` in the worker; `finish_rounds` waits for it."""
        self.worker.on_step[self.key] = on_step
        self.worker.rounds.pop(self.key, None)
        self.worker.send(
            "round", self.key, None if theta is None else list(theta), plan, steps, share_theta, collect_stats
        )

    def start_serving(self) -> None:
        """As a replica, follow the primary's round in the worker; `finish_rounds` waits for it."""
        self.worker.on_step[self.key] = None
        self.worker.rounds.pop(self.key, None)
        self.worker.send("serve_round", self.key)

    def join(self, spec: GroupSpec) -> None:
        """Start joining a data-parallel group (`Instance.join`); `worker.answer()` says it is done."""
        self.worker.send("join", self.key, spec)

    def leave(self) -> None:
        self.worker.call("leave", self.key)

    def run_round(self, theta: Sequence[torch.Tensor] | None, **kwargs: Any) -> InstanceRound:
        self.start_round(theta, **kwargs)
        return finish_rounds([self])[0]

    def surrender(self) -> tuple[dict[str, torch.Tensor], TokenSampler]:
        """The weights and data stream an MIT merge takes; the worker's instance is dropped."""
        others, sampler = self.worker.call("surrender", self.key)
        self._closed = True
        return others, sampler

    def absorb(
        self, others: Mapping[str, torch.Tensor], sampler: TokenSampler, *, weight: float, other_weight: float
    ) -> None:
        self.worker.call("absorb", self.key, dict(others), sampler, weight, other_weight)

    @property
    def sampler(self) -> TokenSampler:
        sampler: TokenSampler = self.worker.call("get_sampler", self.key)
        return sampler

    @sampler.setter
    def sampler(self, sampler: TokenSampler) -> None:
        self.worker.call("set_sampler", self.key, sampler)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.worker.call("state_dict", self.key)
        return state

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        self.worker.call("check_state_dict", self.key, dict(state))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.worker.call("load_state_dict", self.key, dict(state))

    def close(self) -> None:
        """Drop the worker's instance (a merge that took it already did)."""
        if not self._closed:
            self._closed = True
            self.worker.call("drop", self.key)


def finish_rounds(instances: Sequence[RemoteInstance]) -> list[InstanceRound]:
    """Wait for the rounds `start_round` began, running their step hooks as the steps are reported;
    their results in the order given. DeviceLost if a worker dies meanwhile."""
    workers = {id(inst.worker): inst.worker for inst in instances}
    for worker in workers.values():
        worker.deliver_steps()

    def pending() -> list[DeviceWorker]:
        return [w for w in workers.values() if any(i.key not in w.rounds for i in instances if i.worker is w)]

    while waiting := pending():
        ready = wait([w.conn for w in waiting])
        for worker in waiting:
            if worker.conn in ready:
                worker.read()
                worker.deliver_steps()
    results = []
    for inst in instances:
        kind, value = inst.worker.rounds.pop(inst.key)
        inst.worker.on_step.pop(inst.key, None)
        if kind != "ok":
            raise _error(inst.device, value[0], value[1])
        results.append(value)
    return results


# ---- the worker process ----------------------------------------------------------------------------


def serve(conn: Connection, spec: WorkerSpec) -> None:
    """A device worker's main: build the model, then carry out the node's commands until told to
    stop or the node's end of the pipe closes (the node exited or died)."""
    logging.basicConfig(level=spec.log_level, format=f"%(levelname)s %(name)s [{spec.device}]: %(message)s")
    torch.set_num_threads(spec.threads)
    try:
        server = _Server(conn, spec)
    except Exception as e:
        conn.send(("err", type(e).__name__, str(e)))
        return
    conn.send(("ok", None))
    server.run()


class _Server:
    def __init__(self, conn: Connection, spec: WorkerSpec) -> None:
        self.conn = conn
        self.cfg = spec.cfg
        self.vocab_size = spec.vocab_size
        self.device = torch.device(spec.device)
        self.placement = Placement.for_training(self.device)
        self.autocast_dtype = resolve_precision(self.cfg.precision, self.device)
        self.compiled = resolve_compile(self.cfg.compile, self.device)
        # The first instance trains the model built here; later ones train copies.
        self.spare: torch.nn.Module | None = self._built()
        self.instances: dict[int, Instance] = {}
        # Commands read mid-round that are no shift (the next instance's round): carried out after it.
        self.deferred: list[tuple[str, tuple[Any, ...]]] = []

    def _built(self) -> torch.nn.Module:
        model = cast(torch.nn.Module, training_model(self.cfg, self.vocab_size)[0])
        return model.to(self.device)

    def run(self) -> None:
        while True:
            if self.deferred:
                op, args = self.deferred.pop(0)
            else:
                try:
                    op, args = self.conn.recv()
                except (EOFError, OSError):
                    return  # the node is gone
            if op == "stop":
                return
            if op == "round":
                self._round(*args)
                continue
            if op == "serve_round":
                self._serve_round(*args)
                continue
            try:
                result = getattr(self, f"op_{op}")(*args)
            except Exception as e:
                self.conn.send(("err", type(e).__name__, str(e)))
            else:
                self.conn.send(("ok", result))

    def _round(
        self,
        key: int,
        theta: list[torch.Tensor] | None,
        plan: BatchPlan,
        steps: int,
        share: bool,
        collect_stats: bool,
    ) -> None:
        inst = self.instances[key]

        def step_done(step: int) -> None:
            self.conn.send(("step", key, step))
            while self.conn.poll():  # a shift the node sent mid-round: between two steps, as locally
                op, args = self.conn.recv()
                if op != "shift":
                    self.deferred.append((op, args))
                    continue
                try:
                    self.op_shift(*args)
                except Exception as e:
                    self.conn.send(("err", type(e).__name__, str(e)))
                else:
                    self.conn.send(("ok", None))

        try:
            result = inst.run_round(
                theta,
                plan=plan,
                steps=steps,
                on_step=step_done,
                share_theta=share,
                collect_stats=collect_stats,
            )
            delta = [t.to("cpu") for t in result.delta]  # Δ whole, in host memory, for the node
            if isinstance(result.delta, PseudoGradient):
                result.delta.release()
        except Exception as e:
            self.conn.send(("round", key, ("err", (type(e).__name__, str(e)))))
            return
        self.conn.send(("round", key, ("ok", replace(result, delta=delta))))

    def _serve_round(self, key: int) -> None:
        try:
            self.instances[key].serve_round()
        except Exception as e:
            error = (type(e).__name__, str(e))
        else:
            self.conn.send(("round", key, ("ok", None)))
            return
        # (out of the except clause: the error's frames, which hold the model, are gone)
        if self.instances[key].sharded_layers is not None:
            # A sharded replica never joins again (the node makes a new one): dropped now, its
            # modules release the layers' group, whose connections close, and a primary waiting in
            # one of its collectives fails at once (`sharding.release`).
            self.op_drop(key)
        else:
            self.instances[key].leave()
        self.conn.send(("round", key, ("err", error)))

    def op_join(self, key: int, spec: GroupSpec) -> None:
        self.instances[key].join(spec)

    def op_leave(self, key: int) -> None:
        self.instances[key].leave()

    def op_create(self, key: int, sampler: TokenSampler, random_seed: int) -> None:
        # (a replica whose layers are sharded holds a part of its model: never copied nor kept)
        whole = [inst.model for inst in self.instances.values() if inst.sharded_layers is None]
        if self.spare is not None:
            model, self.spare = self.spare, None
        elif whole:
            model = copy.deepcopy(whole[0])
        else:
            model = self._built()
        self.instances[key] = new_instance(
            self.cfg,
            slot=key,
            model=model,
            sampler=sampler,
            placement=self.placement,
            autocast_dtype=self.autocast_dtype,
            compiled=self.compiled,
            random_seed=random_seed,
        )

    def op_load(self, key: int, theta: list[torch.Tensor]) -> None:
        self.instances[key].load(theta)

    def op_begin(self, key: int, theta: list[torch.Tensor] | None, share: bool) -> None:
        self.instances[key].begin(theta, share=share)

    def op_shift(self, key: int, theta: list[torch.Tensor], mode: str, mix: float) -> None:
        self.instances[key].shift(theta, mode=mode, mix=mix)

    def op_surrender(self, key: int) -> tuple[dict[str, torch.Tensor], TokenSampler]:
        others, sampler = self.instances.pop(key).surrender()
        return {name: t.to("cpu") for name, t in others.items()}, sampler

    def op_absorb(
        self,
        key: int,
        others: dict[str, torch.Tensor],
        sampler: TokenSampler,
        weight: float,
        other_weight: float,
    ) -> None:
        self.instances[key].absorb(others, sampler, weight=weight, other_weight=other_weight)

    def op_get_sampler(self, key: int) -> TokenSampler:
        return self.instances[key].sampler

    def op_set_sampler(self, key: int, sampler: TokenSampler) -> None:
        self.instances[key].sampler = sampler

    def op_state_dict(self, key: int) -> dict[str, Any]:
        state: dict[str, Any] = _on_host(self.instances[key].state_dict())
        return state

    def op_check_state_dict(self, key: int, state: dict[str, Any]) -> None:
        self.instances[key].check_state_dict(state)

    def op_load_state_dict(self, key: int, state: dict[str, Any]) -> None:
        self.instances[key].load_state_dict(state)

    def op_drop(self, key: int) -> None:
        inst = self.instances.pop(key, None)
        if inst is None:  # (a sharded replica whose round failed is dropped already)
            return
        inst.leave()
        if inst.sharded_layers is not None:
            from . import sharding  # (FSDP2's modules: imported where a group shards)

            del inst
            sharding.release()  # (its modules held the layers' group open)
        elif self.spare is None and not self.compiled:
            self.spare = inst.model  # what the next instance here trains (a replica, often)


def _on_host(tree: Any) -> Any:
    """`tree` with its tensors in host memory (a GPU's are copied; the node never maps a device)."""
    if isinstance(tree, torch.Tensor):
        return tree.to("cpu")
    if isinstance(tree, dict):
        return {k: _on_host(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_on_host(v) for v in tree]
    return tree
