"""A node's instances across devices, on the CPU (issue 27 §2): `--device cpu,cpu`.

With a device list, instance k trains on device k mod D; the first device's instances in the node's
process, each further device's in a worker process of its own (`training.remote`). This machine
has no second device, so the tests list the CPU twice: the second "device" is a real worker
process, started and fed as a GPU's would be, and what crosses between the two (θ, Δ, an
instance's state for a checkpoint or an MIT merge) crosses exactly as it would there.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pytest
import torch

from adloco.errors import UserError
from adloco.node.data.corpus import Corpus
from adloco.node.model import bmax
from adloco.node.model.devices import resolve_devices
from adloco.node.training import parallel, sharding
from adloco.node.training.build import training_model
from adloco.node.training.config import TrainConfig
from adloco.node.training.instances import Instance
from adloco.node.training.peer import Peer
from adloco.node.training.remote import RemoteInstance
from adloco.node.training.rounds import LocalRound
from adloco.node.training.runtime import load_data
from adloco.protocol.algorithms.allreduce import GroupResult, reduce_group

CFG = TrainConfig(seq_len=32, batch_size=4, instances=2, inner_steps=2, b_max=4, max_corpus_mb=1)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_data(CFG)[0]


def _peer(corpus: Corpus, cfg: TrainConfig) -> Peer:
    return Peer(peer_id="a", index=0, num_peers=1, cfg=cfg, corpus=corpus, vocab_size=256)


def _round(peer: Peer) -> LocalRound:
    local = peer.train_round()
    contribution = peer.contribute(local)[0]
    assert contribution is not None
    peer.apply_round(reduce_group([contribution], codec=peer.downlink_codec(peer.state.schedule.codec)))
    return local


def test_a_device_list_is_read_in_order_and_a_gpu_named_twice_is_refused() -> None:
    cpu = torch.device("cpu")
    assert resolve_devices("cpu") == [cpu]
    assert resolve_devices("cpu, cpu") == [cpu, cpu]
    assert resolve_devices("cuda:1,cuda:0") == [torch.device("cuda", 1), torch.device("cuda", 0)]
    if not torch.cuda.is_available():
        assert resolve_devices("auto") == [cpu]
    with pytest.raises(ValueError, match="names a device twice"):
        resolve_devices("cuda:0,cuda")
    with pytest.raises(ValueError, match="'gpu' is not a torch device"):
        resolve_devices("cpu,gpu")


# A GPT-2 of 0.1M parameters: dropout 0.1, so each instance's masks must come from its own stream.
TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "n_positions": 64,
    "vocab_size": 256,
}


@pytest.mark.parametrize(
    ("model", "overlap"), [("tiny-llama", "off"), ("tiny-llama", "mix"), ("gpt2", "off")]
)
def test_instances_on_two_devices_train_the_theta_of_one_device_through_a_merge(
    corpus: Corpus, tmp_path: Path, model: str, overlap: Literal["off", "mix"]
) -> None:
    """Two instances, one in the node and one in a worker process, give bit for bit the θ, the
    losses and the instances' states of the same two trained in turn on one device, also across
    the MIT merge after round 1 (merge_every 2: it takes the node's own instance into the worker's),
    and with dropout (GPT-2)."""
    if model == "gpt2":
        (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
        model = str(tmp_path / "config.json")
    cfg = replace(CFG, overlap=overlap, model=model)
    one = _peer(corpus, cfg)
    # (after the merge the worker's device would otherwise train the survivor data parallel)
    two = _peer(corpus, replace(cfg, device="cpu,cpu", data_parallel=False))
    try:
        assert [type(inst) for inst in two.instances] != [type(inst) for inst in one.instances]
        worker = next(inst for inst in two.instances if isinstance(inst, RemoteInstance)).worker
        assert worker.process.pid != os.getpid() and worker.process.is_alive()
        for r in range(3):
            ours, theirs = _round(one), _round(two)
            assert ours.mean_loss == theirs.mean_loss
            assert one.state.theta_hash() == two.state.theta_hash()
            if r == 0:  # each device's share, as the node's metrics export it; the round's is the larger
                assert set(theirs.by_device) == {"cpu", "cpu#1"}
                assert [tokens for tokens, _ in theirs.by_device.values()] == [ours.tokens // 2] * 2
                assert theirs.compute_s == max(seconds for _, seconds in theirs.by_device.values())
        assert len(two.instances) == len(one.instances) == 1  # merged, into the worker's instance
        assert isinstance(two.instances[0], RemoteInstance)
        assert one.validation_loss() == two.validation_loss()
        for ours, theirs in zip(one.state_dict()["instances"], two.state_dict()["instances"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"], strict=True))
            assert torch.equal(ours["sampler"]["rng"], theirs["sampler"]["rng"])
    finally:
        two.close()
    assert not worker.process.is_alive()


def _replicas_match_their_primaries(peer: Peer) -> int:
    """Assert every replica holds its primary's weights and AdamW state bit for bit; how many."""
    checked = 0
    for group in peer.data_parallel.groups:
        ours = group.primary.state_dict()
        for replica in group.replicas:
            theirs = replica.state_dict()
            assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"], strict=True))
            assert ours["optimizer"].keys() == theirs["optimizer"].keys()
            for idx, fields in ours["optimizer"].items():
                for name, value in fields.items():
                    assert torch.equal(
                        torch.as_tensor(value), torch.as_tensor(theirs["optimizer"][idx][name])
                    )
            checked += 1
    return checked


def _overlapped(peer: Peer, rounds: int) -> list[LocalRound]:
    """`rounds` overlapped rounds as the swarm runs them: each round's update lands after the first
    step of the next (so every instance shifts mid-round); the last one is not applied."""
    locals_: list[LocalRound] = []
    pending: list[GroupResult] = []

    def land(_done: int) -> None:
        while pending:
            peer.apply_round(pending.pop())

    for _ in range(rounds):
        local = peer.train_round(on_step=land)
        land(0)
        contribution = peer.contribute(local)[0]
        assert contribution is not None
        pending.append(reduce_group([contribution], codec=peer.downlink_codec(peer.state.schedule.codec)))
        locals_.append(local)
    return locals_


@pytest.mark.parametrize("overlap", ["off", "mix"])
@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
def test_an_instance_trains_data_parallel_over_the_device_no_instance_holds(
    corpus: Corpus, tmp_path: Path, overlap: Literal["off", "mix"], shard: bool
) -> None:
    """One instance on two devices: the worker's device holds a replica, each trains half of every
    batch's rows, and the gradients are summed before the step. θ is one device's up to float
    rounding (the rows of one matrix product are split in two); the replica stays the primary's
    copy bit for bit, also when overlap shifts the instance mid-round; the batch test takes the two
    halves as its two samples, as one device takes its two chunks (the same statistics).
    `--data-parallel shard` (record 084): the replica's layers, like the primary's trainer's, are
    half of the model's; the primary's whole weights are gathered at each round's end (and before
    a mid-round shift, then scattered again), and its AdamW moments, gathered into files mapped
    beside the state the node keeps on disk, are one device's to rounding."""
    cfg = replace(CFG, instances=1, overlap=overlap, model="tiny-llama")
    one = _peer(corpus, cfg)
    two = _peer(corpus, replace(cfg, device="cpu,cpu", shard_layers=shard))
    if shard:
        two.keep_state_on_disk(str(tmp_path))
    try:
        assert [group.devices for group in two.data_parallel.groups] == [(1,)]
        if overlap == "off":
            ours, theirs = [_round(one) for _ in range(3)], [_round(two) for _ in range(3)]
        else:
            ours, theirs = _overlapped(one, 3), _overlapped(two, 3)
        for a, b in zip(ours, theirs, strict=True):
            assert b.mean_loss == pytest.approx(a.mean_loss, rel=1e-5)
            (sa,), (sb,) = a.report.slot_stats, b.report.slot_stats
            assert sa is not None and sb is not None
            assert (sb.num_grads, sb.samples_per_grad) == (sa.num_grads, sa.samples_per_grad)
            assert sb.num_grads == 2
            assert sb.sq_dev_sum == pytest.approx(sa.sq_dev_sum, rel=1e-4)
            assert sb.mean_sq_norm == pytest.approx(sa.mean_sq_norm, rel=1e-4)
            # Both devices train: each half of the tokens, each for the whole compute time.
            assert [tokens for tokens, _ in b.by_device.values()] == [a.tokens // 2] * 2
        for x, y in zip(one.state.theta, two.state.theta, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
        assert one.state.theta_hash() != two.state.theta_hash()  # (two matrix products, not one)
        if not shard:
            assert _replicas_match_their_primaries(two) == 1
            return
        (primary,) = two.local_instances
        assert primary.trainer is not None and primary._moment_files is not None
        mapped = {t.data_ptr() for t in primary._moment_files[0][0]}
        assert all(primary.optimizer.state[p]["exp_avg"].data_ptr() in mapped for p in primary.params)
        held = sum(sharding.local(p).numel() for p in primary.trainer.params)
        assert held < 0.8 * sum(p.numel() for p in primary.params)
        (ours_,), (theirs_,) = one.state_dict()["instances"], two.state_dict()["instances"]
        assert ours_["optimizer"].keys() == theirs_["optimizer"].keys()
        for idx, fields in ours_["optimizer"].items():
            assert float(theirs_["optimizer"][idx]["step"]) == float(fields["step"])
            for name in ("exp_avg", "exp_avg_sq"):  # (whole tensors: a moment near 0 is all rounding)
                error = theirs_["optimizer"][idx][name] - fields[name]
                assert float(error.norm()) <= 1e-4 * float(fields[name].norm())
    finally:
        two.close()


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
def test_a_round_that_fails_mid_way_leaves_no_replica_waiting_and_the_next_trains(
    corpus: Corpus, shard: bool
) -> None:
    """The primary's second round stops after its first step (its step hook raises): the replica,
    waiting for the second, ends its round when the primary leaves the group, the error is the
    hook's, and the next round forms the group anew, syncs the replica and trains on both devices
    (sharded: a new replica, sharded again, the primary's whole weights and moments scattered in)."""
    two = _peer(corpus, replace(CFG, instances=1, model="tiny-llama", device="cpu,cpu", shard_layers=shard))
    try:
        _round(two)

        def fail(_done: int) -> None:
            raise RuntimeError("the hook failed")

        with pytest.raises(RuntimeError, match="the hook failed"):
            two.train_round(on_step=fail)
        local = _round(two)
        assert set(local.by_device) == {"cpu", "cpu#1"}
        assert math.isfinite(local.mean_loss) and math.isfinite(two.validation_loss())
        if not shard:
            assert _replicas_match_their_primaries(two) == 1
    finally:
        two.close()


def _sockets(pid: int) -> int:
    """How many sockets process `pid` has open."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # (one closed while listed: the listing's own)
            count += os.readlink(fd).startswith("socket:")
    return count


def test_a_sharded_primary_failing_inside_its_step_frees_the_replica_at_once_and_leaves_nothing_open(
    corpus: Corpus,
) -> None:
    """Three times, a round's first step raises inside the primary's forward pass (its trainer's last
    layer), in the middle of FSDP2's collectives, and the next round trains on both devices. The
    primary drops its trainer and the layers' group with it, so the replica, waiting in one of the
    collectives, fails at once (not after `layers_timed`'s floor, 30 s: the bound for a member that
    lives on holding it), the error keeping the lines of the frames it passed through; and each
    group formed anew leaves nothing of its predecessor open: the node's and the worker's sockets
    are as many after every re-formation."""
    two = _peer(corpus, replace(CFG, instances=1, model="tiny-llama", device="cpu,cpu", shard_layers=True))
    try:
        _round(two)
        worker = two._workers[1].process.pid
        assert worker is not None
        sockets = []
        for _ in range(3):
            inst = two.instances[0]
            assert isinstance(inst, Instance) and inst.trainer is not None

            def fail(*_: object) -> None:
                raise RuntimeError("injected: out of memory")

            sharding.decoder_layers(inst.trainer.model)[-1].register_forward_hook(fail)
            del inst
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="injected") as raised:
                two.train_round()  # (it ends when the replica's round has)
            assert time.monotonic() - start < 20
            # the frames it passed through are gone, their lines kept (Python 3.11 on: as a note)
            assert sys.version_info < (3, 11) or "in fail" in "".join(getattr(raised.value, "__notes__", []))
            local = _round(two)
            assert set(local.by_device) == {"cpu", "cpu#1"}
            assert math.isfinite(local.mean_loss)
            sockets.append((_sockets(os.getpid()), _sockets(worker)))
        assert sockets[0] == sockets[1] == sockets[2], sockets
        assert math.isfinite(two.validation_loss())
    finally:
        two.close()


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
def test_a_replica_failing_inside_its_step_frees_the_primary_at_once_and_the_next_round_trains(
    corpus: Corpus, shard: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three times, the replica (in the worker) raises inside its step's forward pass: the rows the
    primary sends it hold a token past the vocabulary (the primary keeps its own rows as they are).
    Its worker leaves the group (a sharded replica is dropped, its modules releasing the layers'
    group), so the primary, waiting in the step's collectives, fails at once, not after
    `layers_timed`'s floor (30 s); the next round forms the group anew and trains on both devices,
    and nothing of a group formed before stays open (the sockets are as many each time)."""
    two = _peer(corpus, replace(CFG, instances=1, model="tiny-llama", device="cpu,cpu", shard_layers=shard))
    try:
        _round(two)
        worker = two._workers[1].process.pid
        assert worker is not None
        sockets = []
        broadcast = parallel.Group.broadcast

        def poisoning(group: parallel.Group, tensors: Sequence[torch.Tensor]) -> None:
            # (a step's rows: the last goes to the replica, which receives a copy with a bad token)
            if (
                group.rank == 0
                and len(tensors) == 1
                and tensors[0].dim() == 2
                and not tensors[0].is_floating_point()
            ):
                sent = tensors[0].clone()
                sent[-1, 0] = 10**6
                broadcast(group, [sent])
                return
            broadcast(group, tensors)

        for _ in range(3):
            monkeypatch.setattr(parallel.Group, "broadcast", poisoning)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"closed by peer|reset by peer"):
                two.train_round()
            assert time.monotonic() - start < 20
            monkeypatch.undo()
            local = _round(two)
            assert set(local.by_device) == {"cpu", "cpu#1"}
            assert math.isfinite(local.mean_loss)
            sockets.append((_sockets(os.getpid()), _sockets(worker)))
        assert sockets[0] == sockets[1] == sockets[2], sockets
        if not shard:
            assert _replicas_match_their_primaries(two) == 1
    finally:
        two.close()


def test_after_the_merge_the_survivor_trains_on_both_devices_as_on_one(corpus: Corpus) -> None:
    """Two instances on two devices merge after round 1 (into the worker's instance): the survivor
    moves into the node's process and trains data parallel with a replica in the worker. Its batch
    of 8 runs as two micro-batches of 4 alone (b_max 4), and the two devices take one each: the
    same sums in the same order, so θ is one device's bit for bit."""
    cfg = replace(CFG, model="tiny-llama")
    one = _peer(corpus, cfg)
    two = _peer(corpus, replace(cfg, device="cpu,cpu"))
    try:
        for _ in range(3):
            ours, theirs = _round(one), _round(two)
            assert ours.mean_loss == theirs.mean_loss
            assert one.state.theta_hash() == two.state.theta_hash()
        assert len(two.instances) == 1 and isinstance(two.instances[0], Instance)
        assert two.home_model is two.instances[0].model
        assert [group.devices for group in two.data_parallel.groups] == [(1,)]
        assert ours.accum_steps == 2 and set(theirs.by_device) == {"cpu", "cpu#1"}
        assert _replicas_match_their_primaries(two) == 1
        for x, y in zip(one.state_dict()["instances"], two.state_dict()["instances"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(x["params"], y["params"], strict=True))
            assert torch.equal(x["sampler"]["rng"], y["sampler"]["rng"])
        assert one.validation_loss() == two.validation_loss()
    finally:
        two.close()


def test_instances_in_workers_train_data_parallel_with_replicas_in_other_workers(
    corpus: Corpus, tmp_path: Path
) -> None:
    """Two instances on four devices: the node's instance with a replica on the third device, the
    second instance in the second device's worker with a replica on the fourth (its group joins two
    workers, not the node). θ is one device's up to rounding; every replica is its primary's copy,
    and a GPT-2 with dropout draws each replica's masks from a stream of its own."""
    (config := tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    cfg = replace(CFG, model="tiny-llama")
    cfg = replace(cfg, schedule=replace(cfg.schedule, merge=replace(cfg.schedule.merge, min_instances=2)))
    one = _peer(corpus, cfg)
    four = _peer(corpus, replace(cfg, device="cpu,cpu,cpu,cpu"))
    try:
        assert [group.devices for group in four.data_parallel.groups] == [(2,), (3,)]
        assert isinstance(four.instances[1], RemoteInstance)
        for _ in range(2):
            ours, theirs = _round(one), _round(four)
            assert theirs.mean_loss == pytest.approx(ours.mean_loss, rel=1e-5)
            assert set(theirs.by_device) == {"cpu", "cpu#1", "cpu#2", "cpu#3"}
        for x, y in zip(one.state.theta, four.state.theta, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
        assert _replicas_match_their_primaries(four) == 2
    finally:
        four.close()
    gpt2 = _peer(corpus, replace(cfg, model=str(config), device="cpu,cpu,cpu"))
    try:
        _round(gpt2)
        _round(gpt2)
        assert _replicas_match_their_primaries(gpt2) == 1
    finally:
        gpt2.close()


def test_merging_away_the_instance_that_trained_the_home_model_frees_its_weights(corpus: Corpus) -> None:
    """θ is evaluated through the first device's model; when the MIT merge takes the instance that
    trained it, a survivor's model takes its place and the victim's weights are freed, not kept as
    a model's worth of memory for the rest of the run."""
    peer = _peer(corpus, CFG)
    victim = weakref.ref(peer.local_instances[0].model)
    assert peer.home_model is victim()
    peer.merge_instances(0, 1)
    gc.collect()
    assert victim() is None
    assert peer.home_model is peer.local_instances[0].model
    assert math.isfinite(peer.validation_loss())


def _node_command(args: list[str], ck: Path, *, instances: int = 2) -> list[str]:
    """An offline node of `instances` instances kept apart (no merge), checkpointing every round."""
    node = [sys.executable, "-m", "adloco.node.cli.node", "--offline", "--instances", str(instances)]
    node += ["--min-instances", str(instances)]
    small = ["--inner-steps", "2", "--seq-len", "32", "--batch-size", "4", "--max-corpus-mb", "1"]
    return [*node, *small, "--checkpoint-dir", str(ck), "--checkpoint-every", "1", *args]


def _node(args: list[str], ck: Path, *, instances: int = 2) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _node_command(args, ck, instances=instances),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _workers_of(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize(
    ("instances", "data_parallel"),
    [(2, "on"), (1, "on"), (1, "shard")],
    ids=["an-instance-on-it", "a-replica-on-it", "a-sharded-replica-on-it"],
)
def test_a_device_lost_mid_run_stops_the_node_with_one_line_and_its_checkpoint_resumes(
    tmp_path: Path, instances: int, data_parallel: str
) -> None:
    """The worker process of the second device is killed while the node trains (it holds the second
    instance, or, with one instance, its data-parallel replica, whole or holding half of the layers):
    the node exits with one line naming the device (no traceback), writes no checkpoint after the
    loss, and a restart on the device that remains resumes from the last one."""
    ck = tmp_path / "ck"
    args = ["--device", "cpu,cpu", "--data-parallel", data_parallel, "--rounds", "0"]
    node = _node(args, ck, instances=instances)
    try:
        deadline = time.monotonic() + 240
        while not (ck / "round-00000002").exists():
            assert node.poll() is None, node.communicate()
            assert time.monotonic() < deadline, "no second checkpoint in 240 s"
            time.sleep(0.2)
        workers = _workers_of(node.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        _, err = node.communicate(timeout=120)
    finally:
        if node.poll() is None:
            node.kill()
            node.communicate()
    assert node.returncode == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("adloco-node: error: device cpu was lost: its worker process"), last
    assert "killed by signal 9" in last
    saved = sorted(p.name for p in ck.iterdir() if p.name.startswith("round-"))
    resumed_from = int(saved[-1].removeprefix("round-"))
    again = _node(["--device", "cpu", "--rounds", str(resumed_from + 1)], ck, instances=instances)
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0, err
    assert f"resumed from the checkpoint of round {resumed_from}" in err
    assert f"[local round={resumed_from + 1}]" in out


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounts a small /dev/shm in a mount namespace of its own: needs root and unshare (CI has both)",
)
def test_shared_memory_too_small_for_the_devices_is_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    """In a container /dev/shm is 64 MB unless raised, and the devices share θ and Δ through it. With
    512 KiB (θ of this model is 2.4 MB) the node stops at its first round with one line naming
    /dev/shm and --shm-size, not a worker's traceback."""
    command = shlex.join(_node_command(["--device", "cpu,cpu", "--rounds", "1"], tmp_path / "ck"))
    script = f"mount -t tmpfs -o size=512k tmpfs /dev/shm && exec {command}"
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("adloco-node: error: device cpu: shared memory (/dev/shm) is too small"), last
    assert "--shm-size" in last


# ---- the layers sharded over the devices (`--data-parallel shard`, record 084) -------------------------


def test_after_the_merge_the_survivor_trains_sharded_over_both_devices(corpus: Corpus) -> None:
    """Two instances on two devices merge after round 1 into the worker's: the survivor moves into
    the node's process and trains with its layers sharded over both devices (the worker's old model
    serves as the replica). θ is one device's to rounding through the merge."""
    cfg = replace(CFG, model="tiny-llama")
    one = _peer(corpus, cfg)
    two = _peer(corpus, replace(cfg, device="cpu,cpu", shard_layers=True))
    try:
        for _ in range(3):
            ours, theirs = _round(one), _round(two)
            assert theirs.mean_loss == pytest.approx(ours.mean_loss, rel=1e-5)
        assert len(two.instances) == 1 and isinstance(two.instances[0], Instance)
        assert two.instances[0].trainer is not None
        assert [group.devices for group in two.data_parallel.groups] == [(1,)]
        assert set(theirs.by_device) == {"cpu", "cpu#1"}
        for x, y in zip(one.state.theta, two.state.theta, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
        assert two.validation_loss() == pytest.approx(one.validation_loss(), rel=1e-5)
    finally:
        two.close()


def test_sharded_layers_refuse_the_augmented_test_with_a_message_that_says_what_to_use() -> None:
    with pytest.raises(ValueError, match="--batch-test norm, or --data-parallel on"):
        replace(CFG, shard_layers=True, schedule=replace(CFG.schedule, test="augmented"))


# ---- when the layers are sharded (`Peer._probe`, `bmax.Sharded`) ----------------------------------------


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A narrow GPT-2 of eight layers: a member's share of them saves more than FSDP2's gathered
    blocks cost (with the tiny Llama's two, the four blocks gathered are all its layers)."""
    path = tmp_path_factory.mktemp("deep") / "gpt2.json"
    path.write_text(
        json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 8, "n_head": 4, "vocab_size": 256})
    )
    return str(path)


def _budgets_gb(cfg: TrainConfig) -> tuple[float, float]:
    """The memory one whole model's training on each of two CPU devices needs (both on the host, both
    training at once) and what a sharded group's two members need, as b_max's estimate counts them,
    in GiB of budget (its safety factor taken off): one sequence per step each."""
    model, _ = training_model(cfg, 256)
    shares = sharding.shares(model, 2)
    fixed, per_sample = bmax.activation_bytes(model, seq_len=cfg.seq_len, vocab_size=256)
    need = [
        bmax.static_bytes(model, instances=2, state_on_device=True, sharded=s) + 2 * (fixed + per_sample)
        for s in (None, shares)
    ]
    return need[0] / bmax.SAFETY / 2**30, need[1] / bmax.SAFETY / 2**30


def test_data_parallel_on_shards_the_layers_where_whole_models_do_not_fit_and_only_there(
    corpus: Corpus, deep: str
) -> None:
    """`--data-parallel on` (the default) with one instance on two devices: where two whole models'
    training does not fit the memory (here the host's, `--memory-budget-gb`) and two sharded
    members' does, the node shards the layers by itself and trains on both devices; where the whole
    models fit, it replicates them. The probe counts what each layout holds: at one budget, the
    sharded group's b_max is above the replicated group's, and a replicated group's (two models on
    the host) below one device's."""
    cfg = replace(CFG, instances=1, model=deep, device="cpu,cpu", b_max=None)
    whole_gb, sharded_gb = _budgets_gb(cfg)
    assert sharded_gb < whole_gb
    tight = replace(cfg, memory_budget_gb=(whole_gb + sharded_gb) / 2)
    two = _peer(corpus, tight)
    try:
        assert two.data_parallel.sharded
        (inst,) = two.local_instances
        assert inst.trainer is not None
        local = _round(two)
        assert set(local.by_device) == {"cpu", "cpu#1"}
        assert math.isfinite(local.mean_loss)
    finally:
        two.close()
    roomy = replace(cfg, memory_budget_gb=1.5 * whole_gb)
    b_max = {}
    for name, c in {
        "replicated": roomy,
        "sharded": replace(roomy, shard_layers=True),
        "alone": replace(roomy, device="cpu"),
    }.items():
        peer = _peer(corpus, c)
        try:
            assert peer.data_parallel.sharded == (name == "sharded")
            b_max[name] = peer.b_max
        finally:
            peer.close()
    assert b_max["replicated"] < b_max["sharded"]
    assert b_max["replicated"] < b_max["alone"]


def test_layers_that_must_be_sharded_refuse_the_augmented_test_with_a_message_that_says_what_to_use(
    corpus: Corpus, deep: str
) -> None:
    cfg = replace(CFG, instances=1, model=deep, device="cpu,cpu", b_max=None)
    whole_gb, sharded_gb = _budgets_gb(cfg)
    tight = replace(
        cfg, memory_budget_gb=(whole_gb + sharded_gb) / 2, schedule=replace(CFG.schedule, test="augmented")
    )
    with pytest.raises(UserError, match=r"does not fit one device.*use --batch-test norm"):
        _peer(corpus, tight)
