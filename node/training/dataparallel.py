"""Which devices replicate which instance, and the groups that join them (issue 27 §2, `parallel`).

A node with more devices than MIT instances gives the devices no instance holds to the instances,
in turn (the first free device to the first instance, the next to the second, ...): each instance
then trains data parallel over its own device and those. K is the run's (every peer follows the same
schedule) and MIT merges lower it, so the plan is made again whenever the instances change (a merge,
a state loaded or adopted): after the defaults' merge from 2 instances to 1, a node with two GPUs
trains its one instance on both.

A replica lives in the worker process of its device (`remote`), as a `RemoteInstance` that serves
the primary's rounds; the node's own process always holds a primary (the node moves an instance
onto its first device when merges took the one there, `Peer._replan`), so it never serves one.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch._C._distributed_c10d import TCPStore

from .instances import Instance
from .parallel import TIMEOUT, GroupSpec, share
from .remote import RemoteInstance

logger = logging.getLogger(__name__)


def replica_devices(held: Sequence[int], num_devices: int) -> list[tuple[int, ...]]:
    """For instances on the devices `held` (one each), the devices each one's replicas train on: the
    devices no instance holds, dealt out in turn in the instances' order."""
    free = [d for d in range(num_devices) if d not in set(held)]
    return [tuple(free[k :: len(held)]) for k in range(len(held))] if held else []


@dataclass(frozen=True)
class Sharing:
    """What shares the memory of a node's first device at the start (b_max's probe, `bmax`): how many
    models it holds (instances or replicas), how many of them train at once, and the size of the
    smallest data-parallel group (0 where some instance has none: it trains alone)."""

    models: int
    concurrent: int
    members: int


def sharing(instances: int, devices: int, *, data_parallel: bool, host: bool) -> Sharing:
    """`instances` MIT instances on `devices` devices (instance k on device k mod D): a GPU holds its
    own instances, the host's memory (CPU devices) every device's models, each device's process
    training one at a time."""
    groups = replica_devices(range(instances), devices) if data_parallel and instances < devices else []
    members = 1 + min(len(g) for g in groups) if groups and all(groups) else 0
    if not host:
        return Sharing(len(range(0, instances, devices)), 1, members)
    models = devices if groups else instances
    return Sharing(models, min(models, devices), members)


@dataclass
class Replicated:
    """An instance trained data parallel: its primary, and a replica on each further device."""

    primary: Instance | RemoteInstance
    devices: tuple[int, ...]
    replicas: list[RemoteInstance] = field(default_factory=list)
    broken: bool = False  # a round failed: its members may have left the group


MakeReplica = Callable[[Instance | RemoteInstance, int, int], RemoteInstance]


class DataParallel:
    """A node's data-parallel groups: formed over a store the node serves on the loopback, one group
    per replicated instance, formed anew when the plan changes or a round broke one."""

    def __init__(self, *, sharded: bool = False) -> None:
        self.sharded = sharded  # the members shard the instances' layers (`sharding`)
        self._store: TCPStore | None = None
        self._names = itertools.count()
        self.groups: list[Replicated] = []

    def arrange(
        self,
        instances: Sequence[Instance | RemoteInstance],
        wanted: Sequence[tuple[int, ...]],
        make_replica: MakeReplica,
    ) -> None:
        """Make the groups those of `wanted` (each instance's replica devices, in order): a group
        whose primary and devices are unchanged stays, the others are dissolved and formed anew.
        `make_replica(primary, device, rank)` creates a replica in that device's worker."""
        keep: list[Replicated] = []
        for group in self.groups:
            position = next((k for k, inst in enumerate(instances) if inst is group.primary), None)
            if position is not None and not group.broken and wanted[position] == group.devices:
                keep.append(group)
            else:
                _dissolve(group)
        self.groups = keep
        formed = {id(group.primary) for group in keep}
        new = [
            Replicated(inst, devices)
            for inst, devices in zip(instances, wanted, strict=True)
            if devices and id(inst) not in formed
        ]
        if new:
            self._form(new, make_replica)
            self.groups += new
            for group in new:
                logger.info(
                    "instance %d trains data parallel: replicas on devices %s",
                    group.primary.slot,
                    ", ".join(map(str, group.devices)),
                )

    def _form(self, groups: Sequence[Replicated], make_replica: MakeReplica) -> None:
        if self._store is None:
            # Port 0: the system picks a free one, so two nodes on one machine never collide.
            self._store = TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
        port = self._store.port
        asked: list[RemoteInstance] = []
        local: list[tuple[Instance, GroupSpec]] = []
        for group in groups:
            name, size = f"instance-group-{next(self._names)}/", 1 + len(group.devices)
            group.replicas = [make_replica(group.primary, d, rank) for rank, d in enumerate(group.devices, 1)]
            for rank, replica in enumerate(group.replicas, 1):
                replica.join(GroupSpec(port, name, rank, size, self.sharded))
                asked.append(replica)
            spec = GroupSpec(port, name, 0, size, self.sharded)
            if isinstance(group.primary, Instance):
                local.append((group.primary, spec))
            else:
                group.primary.join(spec)
                asked.append(group.primary)
        # Every member builds its end of the group at once; the workers' ends are being built.
        for inst, spec in local:
            inst.join(spec)
        for member in asked:
            member.worker.answer()

    def serve(self, told: list[RemoteInstance]) -> None:
        """Tell every replica to follow its primary's next round; each is added to `told` as it is
        (`finish_rounds` waits for them)."""
        for group in self.groups:
            for replica in group.replicas:
                replica.start_serving()
                told.append(replica)

    def release(self, *, led: Sequence[RemoteInstance]) -> None:
        """After a failed round: every primary in this process, and every other primary whose round
        did not start (not in `led`), leaves its group, so that its replicas stop waiting for it."""
        for group in self.groups:
            if isinstance(group.primary, Instance) or group.primary not in led:
                group.primary.leave()

    def broke(self) -> None:
        """A round failed: every group is formed anew before the next."""
        for group in self.groups:
            group.broken = True

    def dissolve(self) -> None:
        for group in self.groups:
            _dissolve(group)
        self.groups = []

    def by_device(self, primary: Instance | RemoteInstance, rows: int) -> list[tuple[int | None, float]]:
        """What share of a micro-batch of `rows` each member of `primary`'s group trains: (the
        device index of each replica, None for the primary's own device)."""
        group = next((g for g in self.groups if g.primary is primary), None)
        if group is None:
            return [(None, 1.0)]
        size = 1 + len(group.devices)
        members: list[int | None] = [None, *group.devices]
        return [
            (d, (hi - lo) / rows)
            for d, (lo, hi) in zip(members, (share(rows, r, size) for r in range(size)), strict=True)
        ]


def _dissolve(group: Replicated) -> None:
    group.primary.leave()
    for replica in group.replicas:
        replica.close()
    group.replicas = []
