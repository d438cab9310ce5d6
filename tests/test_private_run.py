"""Private runs (issue 10 §4): only peers holding the run owner's credential, or listed by peer id,
average, download state, and write records that nodes act on. Credentials and the `credential`
command in-process; the enforcement with real DHT peers and p2pd: two insiders and an outsider of
the same run id, which is refused at each of the three doors while the insiders complete."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import torch

from adloco.errors import UserError
from adloco.node.cli.credential import credential_main
from adloco.node.cli.node import build_parser, swarm_from_args, swarm_train_config
from adloco.node.cli.options import train_config_from_args
from adloco.node.swarm.node import SwarmConfig
from adloco.node.training.config import TrainConfig
from adloco.protocol.algorithms.allreduce import Contribution, reduce_group
from adloco.protocol.algorithms.codecs import encode_tensors, make_codec
from adloco.protocol.transport.admission import (
    NOT_ADMITTED,
    Admission,
    check,
    issue,
    read_allowlist,
    read_credential,
)
from adloco.protocol.transport.averager import MemberResult
from adloco.protocol.transport.hivemind_averager import HivemindAverager
from adloco.protocol.transport.identity import Identity, NodeDHT, create_identity, load_identity
from adloco.protocol.transport.manifest import build_manifest
from adloco.protocol.transport.records import RunRecords, StateRecord
from adloco.protocol.transport.state_transfer import ServedState, StateServer, TransferSettings
from adloco.settings import parse_settings

pytestmark = pytest.mark.timeout(180)
RUN = "private-run"
KW = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "start": True}
DAY = 86400.0


NAMES = ("owner", "stranger", "a", "b", "x")


@pytest.fixture(scope="module")
def key_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("keys")
    return {name: folder / f"{name}.key" for name in NAMES if create_identity(str(folder / f"{name}.key"))}


@pytest.fixture(scope="module")
def keys(key_files: dict[str, Path]) -> dict[str, Identity]:
    return {name: load_identity(str(path)) for name, path in key_files.items()}


def test_a_credential_admits_its_peer_to_its_run_until_it_expires(keys: dict[str, Identity]) -> None:
    owner, peer = keys["owner"], keys["a"].peer_id
    token = issue(owner, run_id=RUN, peer_id=peer, expires=time.time() + DAY)
    credential = read_credential(token)
    assert (credential.run_id, credential.peer_id, credential.owner) == (RUN, peer, owner.peer_id)
    check(credential, run_id=RUN, owner=owner.peer_id)
    with pytest.raises(ValueError, match="not by the run owner"):
        check(read_credential(issue(keys["stranger"], run_id=RUN, peer_id=peer, expires=time.time() + DAY)),
              run_id=RUN, owner=owner.peer_id)  # fmt: skip
    with pytest.raises(ValueError, match="for run"):
        check(credential, run_id="another-run", owner=owner.peer_id)
    with pytest.raises(ValueError, match="expired"):
        check(read_credential(issue(owner, run_id=RUN, peer_id=peer, expires=time.time() - 1)),
              run_id=RUN, owner=owner.peer_id)  # fmt: skip
    # Another peer's id put into a signed payload: the signature no longer matches.
    prefix, payload, signature = token.split(".")
    forged = _swap_peer(payload, keys["x"].peer_id)
    with pytest.raises(ValueError, match="signature"):
        read_credential(f"{prefix}.{forged}.{signature}")
    for junk in ("", "adloco1.e30.AA", "x" * 5000, "adloco1.!!.??"):
        with pytest.raises(ValueError):
            read_credential(junk)

    admission = Admission(run_id=RUN, owner=owner.peer_id)
    assert not admission.admits(peer)
    admission.learn(token)
    assert admission.admits(peer) and not admission.admits(keys["x"].peer_id)
    assert admission.learn_all([token, "junk", 7, None]) == 1
    assert not admission.admits(peer, now=time.time() + 2 * DAY)  # expired meanwhile
    assert Admission().admits("anyone")  # a public run


def test_credentials_are_re_read_at_once_for_a_new_peer_and_rarely_for_a_refused_one() -> None:
    """A member that just joined is looked up the first time it shows up (or its group would differ
    between the members that knew it and those that did not: the round fails for all); an outsider
    that keeps asking costs a re-read at most every REFRESH_S."""
    admission = Admission(run_id=RUN, owner="QmOwner")
    assert admission.should_refresh(["outsider"])
    assert not admission.should_refresh(["outsider"])  # looked up in vain a moment ago
    assert admission.should_refresh(["outsider", "newcomer"])  # a new one: at once
    assert not admission.should_refresh(["outsider", "newcomer"])
    assert not Admission().should_refresh(["anyone"])  # a public run reads nothing


def _swap_peer(payload: str, other: str) -> str:
    import base64

    fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    fields["peer"] = other
    return base64.urlsafe_b64encode(json.dumps(fields, sort_keys=True).encode()).decode().rstrip("=")


def test_allowlist_file(tmp_path: Path, keys: dict[str, Identity]) -> None:
    path = tmp_path / "peers.txt"
    path.write_text(f"# the run's peers\n{keys['a'].peer_id}\n\n{keys['b'].peer_id}  # b\n")
    assert read_allowlist(str(path)) == {keys["a"].peer_id, keys["b"].peer_id}
    admission = Admission(allowed=read_allowlist(str(path)))
    assert admission.admits(keys["a"].peer_id) and not admission.admits(keys["x"].peer_id)
    path.write_text("not a peer id!\n")
    with pytest.raises(ValueError, match=r"peers\.txt:1"):
        read_allowlist(str(path))


def test_credential_command_and_node_flags(
    tmp_path: Path, keys: dict[str, Identity], capsys: pytest.CaptureFixture[str]
) -> None:
    """The owner makes its key and id, a volunteer its identity and id, the owner issues, anyone
    inspects; a node refuses to start on a credential that is not its own, for another run, or
    missing, with one line naming the flag."""
    owner_key, node_key, cred = tmp_path / "owner.key", tmp_path / "node.key", tmp_path / "node.cred"
    assert credential_main(["owner", "--key", str(owner_key)]) == 0
    owner = capsys.readouterr().out.strip()
    assert credential_main(["peer-id", "--identity-path", str(node_key)]) == 0
    peer = capsys.readouterr().out.strip()
    assert credential_main(["peer-id", "--identity-path", str(node_key)]) == 0  # the same file, the same id
    assert capsys.readouterr().out.strip() == peer
    assert credential_main(["issue", "--key", str(owner_key), "--run-id", RUN, "--peer-id", peer]) == 0
    cred.write_text(capsys.readouterr().out)
    assert credential_main(["inspect", str(cred), "--run-owner", owner, "--run-id", RUN]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["peer_id"], said["owner"], said["admitted"]) == (peer, owner, "yes")
    assert credential_main(["inspect", str(cred), "--run-owner", keys["stranger"].peer_id]) == 1
    assert "no: signed by" in capsys.readouterr().out
    assert credential_main(["issue", "--key", str(owner_key), "--run-id", RUN, "--peer-id", "x!"]) == 2
    assert "--peer-id" in capsys.readouterr().err

    def swarm(*flags: str) -> SwarmConfig:
        return swarm_from_args(parse_settings(build_parser(), ["--run-id", RUN, *flags]))

    good = swarm("--identity-path", str(node_key), "--run-owner", owner, "--credential", str(cred))
    assert good.run_owner == owner and good.credential == cred.read_text().strip()
    other_key = tmp_path / "other.key"
    create_identity(str(other_key))
    bad = {
        "this node (--identity-path) is": ["--identity-path", str(other_key), "--run-owner", owner,
                                           "--credential", str(cred)],
        "give --identity-path": ["--run-owner", owner, "--credential", str(cred)],
        "give --credential": ["--identity-path", str(node_key), "--run-owner", owner],
        "not by the run owner": ["--identity-path", str(node_key), "--run-owner", keys["stranger"].peer_id,
                                 "--credential", str(cred)],
        "only a private run": ["--credential", str(cred)],
    }  # fmt: skip
    for message, flags in bad.items():
        with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
            swarm(*flags)


def test_a_public_run_defaults_to_checked_centered_clip_and_a_private_run_to_the_mean(tmp_path: Path) -> None:
    """Without --aggregate, a swarm node of a public run reduces by CenteredClip (`PUBLIC_AGGREGATE`:
    its answers are checked by their fixed point), one of a private run (--allow-peers, --run-owner)
    by the mean; a rule given is kept, but the trimmed mean (checked by its norm only) only in a private
    run; the mean's own default (the simulator, --offline) stays."""
    allowlist = tmp_path / "peers.txt"
    allowlist.write_text("")

    def rule(*flags: str) -> str:
        args = parse_settings(build_parser(), ["--run-id", RUN, *flags])
        return swarm_train_config(train_config_from_args(args), args).aggregate

    assert rule() == "clip:0.5"
    assert rule("--allow-peers", str(allowlist)) == "mean"
    assert rule("--aggregate", "mean") == "mean"
    assert rule("--aggregate", "trimmed:0.2", "--allow-peers", str(allowlist)) == "trimmed:0.2"
    with pytest.raises(Exception, match=r"--aggregate trimmed:0\.2: members can check .* a norm bound"):
        rule("--aggregate", "trimmed:0.2")
    assert train_config_from_args(parse_settings(build_parser(), [])).aggregate == "mean"
    with pytest.raises(Exception, match=r"default --aggregate is clip:0\.5"):
        rule("--downlink", "gather")


def test_a_public_run_takes_only_codecs_whose_answers_are_checked_beyond_their_norm(tmp_path: Path) -> None:
    """A low-rank answer, or a sparse one re-encoded under a robust rule, bounds no error of its own:
    members could check it against a norm bound only, as the trimmed mean (issue 25 §1). A public run
    refuses such a codec given outright and chooses the adaptive codec among the others; a sparse
    codec under the mean is gathered (checked exactly), and a private run takes any."""
    allowlist = tmp_path / "peers.txt"
    allowlist.write_text("")

    def train(*flags: str) -> TrainConfig:
        args = parse_settings(build_parser(), ["--run-id", RUN, *flags])
        return swarm_train_config(train_config_from_args(args), args)

    assert train("--codec", "adaptive").codec_candidates == ("fp16", "int8", "int4")
    assert "lowrank:4" in train("--codec", "adaptive", "--allow-peers", str(allowlist)).codec_candidates
    assert train("--codec", "sparse", "--aggregate", "mean").codec == "sparse"
    assert train("--codec", "int4").codec == "int4"
    assert train("--codec", "lowrank:4", "--allow-peers", str(allowlist)).codec == "lowrank:4"
    for codec in ("lowrank:4", "sparse"):
        with pytest.raises(UserError, match=rf"--codec {codec}: members can check .* only against a norm"):
            train("--codec", codec)


# ---- enforcement with real DHT peers and p2pd ---------------------------------------------------


@pytest.fixture
def dhts(key_files: dict[str, Path]) -> Iterator[dict[str, NodeDHT]]:
    started: dict[str, NodeDHT] = {}
    try:
        for name in ("a", "b", "x"):
            peers = {"initial_peers": started["a"].get_visible_maddrs()} if started else {}
            path = str(key_files[name])
            started[name] = NodeDHT(identity_path=path, check_if_identity_free=False, **peers, **KW)
        yield started
    finally:
        for dht in started.values():
            dht.shutdown()


def _served() -> ServedState:
    tensor = torch.arange(4096, dtype=torch.float32)
    manifest = build_manifest(
        [("theta.w", tensor)], round=3, theta_hash="ab" * 32, schedule={}, chunk_bytes=4096
    )
    return ServedState(manifest=manifest, encoded=manifest.encode(), read_chunk=lambda i: b"")


def test_an_outsider_neither_averages_nor_downloads_nor_writes_records_insiders_act_on(
    dhts: dict[str, NodeDHT], keys: dict[str, Identity]
) -> None:
    owner = keys["owner"]
    prefix = f"adloco.{RUN}.test"
    admissions, records = {}, {}
    for name in ("a", "b"):
        admissions[name] = admission = Admission(run_id=RUN, owner=owner.peer_id)
        admission.attach(dhts[name], prefix)
        records[name] = RunRecords(dhts[name], prefix=prefix, run_id=RUN, ttl_s=60, admission=admission)
        token = issue(owner, run_id=RUN, peer_id=dhts[name].identity.peer_id, expires=time.time() + DAY)
        admission.learn(token)
        records[name].publish_credential(token)
    # The outsider believes everyone (a public node of the same run id) and even republishes an
    # insider's credential: a credential admits the peer it names, not whoever shows it.
    records["x"] = RunRecords(dhts["x"], prefix=prefix, run_id=RUN, ttl_s=60)
    records["x"].publish_credential(records["a"].credential or "")
    x_id = dhts["x"].identity.peer_id

    # 1. Records: the outsider's state record (far ahead) is not among what the insiders read.
    for name, rnd in (("a", 3), ("x", 10**6)):
        records[name].publish_state(StateRecord(
            peer_id=dhts[name].identity.peer_id, round=rnd, theta_hash="ab" * 32, schedule="{}",
            manifest_hash="cd" * 32, manifest_bytes=100,
        ))  # fmt: skip
    seen_by_b = records["b"].states()
    assert [r.round for r in seen_by_b] == [3]
    assert {r.round for r in records["x"].states()} == {3, 10**6}  # it was there to be read

    # 2. State: insider b downloads a's manifest; the outsider is refused before its request is read.
    served = _served()
    settings = TransferSettings(timeout_floor_s=3.0)
    servers = {
        name: StateServer(dhts[name], prefix=prefix, offered=lambda d: served if d == served.digest else None,
                          updates=lambda r: [], settings=settings, admission=admissions.get(name))
        for name in ("a", "b", "x")
    }  # fmt: skip
    try:
        a_id = dhts["a"].identity.peer_id
        got = servers["b"].fetch_manifest([a_id], digest=served.digest, size=len(served.encoded))
        assert got.round == 3
        with pytest.raises(ValueError, match=NOT_ADMITTED[:30]):
            servers["x"].fetch_manifest([a_id], digest=served.digest, size=len(served.encoded))
        assert admissions["a"].refused >= 1
    finally:
        for server in servers.values():
            server.shutdown()

    # 3. Averaging: all three register for the round; the insiders form their group of two and
    # complete it, exactly as two would alone; the outsider's parts are refused unread.
    averagers = {
        name: HivemindAverager(dhts[name], prefix=prefix, window_s=1.0, grace_s=0.5, part_timeout_s=5.0,
                               reduce_timeout_s=5.0, admission=admissions.get(name))
        for name in ("a", "b", "x")
    }  # fmt: skip
    try:
        g = torch.Generator().manual_seed(0)
        contributions = {
            name: Contribution(
                peer_id=averager.peer_id,
                payloads=encode_tensors(make_codec("none"), {"w": torch.randn(64, 64, generator=g)}),
                weight=100.0,
                tokens=100.0,
            )
            for name, averager in averagers.items()
        }
        results: dict[str, MemberResult | Exception | None] = {}
        barrier = threading.Barrier(3)

        def member(name: str) -> None:
            barrier.wait()
            try:
                results[name] = averagers[name].average(
                    contributions[name], round=0, codec=make_codec("none"), timeout=30.0
                )
            except Exception as e:  # the outsider's round fails
                results[name] = e

        threads = [threading.Thread(target=member, args=(n,)) for n in averagers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=45)
        expected = reduce_group([contributions["a"], contributions["b"]], codec=make_codec("none"))
        for name in ("a", "b"):
            result = results[name]
            assert getattr(result, "members", None) == expected.members, result
            assert cast(MemberResult, result).averaged == expected.averaged  # it has members, above
        assert x_id not in expected.members
        # The outsider got nothing of theirs: no result, or its own Δ alone after the others refused.
        outsider = results["x"]
        assert outsider is None or isinstance(outsider, Exception) or outsider.members == (x_id,), outsider
    finally:
        for averager in averagers.values():
            averager.shutdown()
