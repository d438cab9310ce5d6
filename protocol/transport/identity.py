"""A peer's libp2p identity held by this process, so what it writes to the DHT is signed by the key
its peer id is derived from.

A DHT record is signed by hivemind's `RSASignatureValidator` with the key named in its subkey
(`[owner:ssh-rsa ...]`); any process can make such a key. `NodeDHT` starts the DHT's p2pd with an
RSA identity this process holds (the operator's `--identity-path`, else a fresh one) and signs its
records with that same key. A libp2p peer id is the multihash of the peer's public key, so a reader
derives the writer's peer id from the subkey (`peer_of_subkey`) and drops a record naming any other
peer: a record is then as authentic as a stream from its peer, and no one can write in another
peer's name, register a phantom member that others would wait for, or make up peers by the dozen
without holding their keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import hivemind
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.multiaddr import Multiaddr

_OWNER_RE = re.compile(rb"^\[owner:(.+?)\]$")
MAX_SUBKEY_BYTES = 1024  # an RSA-2048 owner marker is ~390 bytes; larger keys are refused


class PeerKey(RSAPrivateKey):  # type: ignore[misc]  # hivemind is untyped
    """An RSA private key loaded from an identity file (hivemind's class generates a new one)."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        self._private_key = private_key


@dataclass(frozen=True)
class Identity:
    """This peer's key, its libp2p peer id (base58) and the subkey its DHT records are stored under."""

    key: PeerKey
    peer_id: str
    subkey: bytes


def peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key: the sha2-256 multihash of its protobuf encoding."""
    der = public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    multihash = bytes([0x12, 0x20]) + hashlib.sha256(encoded).digest()
    return str(PeerID(multihash).to_base58())


@lru_cache(maxsize=4096)
def peer_of_subkey(subkey: bytes) -> str | None:
    """The peer id whose key a DHT subkey names (`[owner:ssh-rsa ...]`); None for anything else."""
    if not isinstance(subkey, bytes) or len(subkey) > MAX_SUBKEY_BYTES:
        return None
    match = _OWNER_RE.match(subkey)
    if match is None:
        return None
    try:
        public = RSAPublicKey.from_bytes(match.group(1))
    except Exception:  # not an SSH-encoded RSA key
        return None
    return peer_id_of(public._public_key)


def load_identity(path: str) -> Identity:
    """The identity in a libp2p private key file; ValueError for an unreadable or non-RSA key."""
    try:
        with open(path, "rb") as f:
            message = crypto_pb2.PrivateKey.FromString(f.read())
        if message.key_type != crypto_pb2.RSA:
            name = crypto_pb2.KeyType.Name(message.key_type)
            raise ValueError(f"{path} holds a {name} key; the node signs its records with RSA keys only")
        private = serialization.load_der_private_key(message.data, password=None)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except ValueError:
        raise
    except Exception as e:  # protobuf or DER parse errors
        raise ValueError(f"{path} is not a libp2p private key file ({type(e).__name__})") from None
    if not isinstance(private, rsa.RSAPrivateKey):
        raise ValueError(f"{path}: an RSA key is needed")
    key = PeerKey(private)
    subkey = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())
    return Identity(key=key, peer_id=peer_id_of(private.public_key()), subkey=subkey)


def create_identity(path: str) -> Identity:
    """Write a new RSA identity file (hivemind's format, mode 0400) and load it."""
    try:
        P2P.generate_identity(path)
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e}") from None
    return load_identity(path)


REJOIN_TIMEOUT_S = 10.0
REUSEPORT_ENV = "LIBP2P_TCP_REUSEPORT"  # go-libp2p's switch for dialing from the listening port


async def _rejoin(dht: hivemind.DHT, node: Any) -> int:
    """`NodeDHT.rejoin`, run in the DHT process."""
    peers = {}
    for maddr in dht.initial_peers or ():
        with contextlib.suppress(Exception):  # a malformed address was refused at start already
            peers[PeerID.from_base58(Multiaddr(str(maddr))["p2p"])] = Multiaddr(str(maddr))
    answered = 0
    for peer_id, maddr in peers.items():
        with contextlib.suppress(Exception):  # libp2p's dial backoff, or still unreachable
            await node.protocol.p2p._client.connect(peer_id, [maddr])
        with contextlib.suppress(Exception):
            answered += await node.protocol.call_ping(peer_id) is not None
    if answered:
        # Cut off, this node's DHT banned every peer it called in vain, for longer after each try
        # (hivemind's blacklist doubles the ban): long after the link is back its reads would skip
        # the peers that hold the swarm's newest records and return the stale copies it holds.
        node.blacklist.clear()
        with contextlib.suppress(Exception):
            await node.find_nearest_nodes([node.node_id])
    return answered


class NodeDHT(hivemind.DHT):  # type: ignore[misc]  # hivemind is untyped
    """A hivemind DHT peer whose p2pd runs with an identity this process holds (`identity`), whose
    records are signed with it. `identity_path`: the key file to use, created if missing; None makes
    a throwaway one in a private temporary folder, removed once p2pd has read it."""

    def __init__(self, *, identity_path: str | None = None, **kwargs: Any) -> None:
        self._key_dir: str | None = None
        if identity_path is None:
            self._key_dir = tempfile.mkdtemp(prefix="adloco-identity-")
            identity_path = os.path.join(self._key_dir, "identity.key")
        if os.path.exists(identity_path):
            self.identity = load_identity(identity_path)
        else:  # a new random key cannot be taken by another peer: no need to ask the swarm
            self.identity = create_identity(identity_path)
            kwargs["check_if_identity_free"] = False
        validators = [RSASignatureValidator(self.identity.key), *kwargs.pop("record_validators", ())]
        try:
            super().__init__(identity_path=identity_path, record_validators=validators, **kwargs)
        except BaseException:
            self._forget_key()
            raise
        if kwargs.get("start") and kwargs.get("await_ready", True):
            self._forget_key()  # p2pd is up and has read it

    def run(self) -> None:
        # The DHT's own process starts p2pd with its environment. go-libp2p dials TCP from its
        # listening port (SO_REUSEPORT) unless told not to: two peers that dial each other at once
        # then meet as one TCP connection (a simultaneous open) on which both act as the dialer, so
        # both dials fail the security handshake and back the address off for 6 s or more. Peers of
        # a group open their streams to each other at the same moment, and their DHT calls cross
        # too: that lost whole rounds (record 073). An operator who sets the variable keeps theirs.
        os.environ.setdefault(REUSEPORT_ENV, "false")
        super().run()

    def shutdown(self) -> None:
        super().shutdown()
        self._forget_key()

    def rejoin(self, timeout_s: float = REJOIN_TIMEOUT_S) -> int:
        """Dial the initial peers again and ping them into the routing table, then look up this
        peer's neighbours; returns how many initial peers answered. A peer whose link was down
        long enough has dropped every other peer from its routing table: its reads then return
        only what it holds itself, and its writes reach no one, until it is told of a peer again
        (hivemind's DHT does not retry its initial peers by itself)."""
        try:
            answered = self.run_coroutine(_rejoin, return_future=True).result(timeout=timeout_s)
        except Exception:  # timed out, or the DHT process is gone: the caller tries again later
            return 0
        return int(answered)

    def _forget_key(self) -> None:
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)
            self._key_dir = None
