"""Who may take part in a run: everyone (a public run), or, in a private run, only the peers the run
owner admitted, by a credential it signed or by an allowlist of peer ids.

A credential is an owner-signed statement "peer P may take part in run R until T" (`issue`), as one
line of text (`adloco1.<payload>.<signature>`, base64url). The payload carries the owner's RSA public
key, and the run is named by the owner's id, the libp2p-style id of that key (`identity.peer_id_of`):
`--run-owner` is a short string, and a credential checks against it with nothing else to hand out.
Credentials are not secret: a credential admits the peer id it names, and only the holder of that
peer's key can speak as it (records are bound to their writer's key, streams are authenticated by
libp2p). Each node publishes its own credential in the DHT, under the run's `credentials` key
(`records.RunRecords.publish_credential`), so the others learn it (`Admission.select`).

`Admission.admits(peer)` is asked where a peer's input enters: its state and readiness records
(`records.RunRecords`, `matchmaking`), its averaging stream (`owner_streams.OwnerHandler`), its state
request (`state_transfer.StateServer`). A peer not (yet) known is refused; the callers re-read the
credentials once for each peer they do not know yet, and at most every `REFRESH_S` for peers looked up
in vain, before refusing one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPublicKey

from .identity import Identity, NodeDHT, peer_id_of

TOKEN_PREFIX = "adloco1"
MAX_TOKEN_CHARS = 4096  # an RSA-2048 credential is ~1.2 kB
NOT_ADMITTED = "this is a private run and the peer holds no credential of its owner"
REFRESH_S = 2.0  # the most often the credentials are re-read for peers already looked up in vain
MAX_LOOKED_UP = 10_000
REFRESH_TIMEOUT_S = 10.0
ALLOWLIST_MAX_PEERS = 100_000


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Credential:
    """A verified credential: the run it is for, the peer it admits, until when (unix time), the
    owner's id, and the token it was read from."""

    run_id: str
    peer_id: str
    expires: float
    owner: str
    token: str


def issue(owner: Identity, *, run_id: str, peer_id: str, expires: float) -> str:
    """A credential token admitting `peer_id` to `run_id` until `expires` (unix time), signed by the
    run owner's key."""
    public = owner.key.get_public_key().to_bytes().decode()
    payload = json.dumps(
        {"run": run_id, "peer": peer_id, "expires": int(expires), "owner_key": public}, sort_keys=True
    ).encode()
    signature = _unb64_sig(owner.key.sign(payload))
    return f"{TOKEN_PREFIX}.{_b64(payload)}.{_b64(signature)}"


def _unb64_sig(signature: bytes) -> bytes:
    """hivemind's RSA signatures come base64-encoded (standard alphabet)."""
    return base64.b64decode(signature)


def read_credential(token: str) -> Credential:
    """Parse a token and check its signature against the key it carries (not yet against a run, an
    owner or the clock: `check`); ValueError with the reason."""
    token = token.strip()
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"a credential is at most {MAX_TOKEN_CHARS} characters, this one {len(token)}")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise ValueError(f"not a credential (expected {TOKEN_PREFIX}.<payload>.<signature>)")
    try:
        payload, signature = _unb64(parts[1]), _unb64(parts[2])
        fields: Any = json.loads(payload)
    except Exception:
        raise ValueError("not a credential (bad base64 or JSON)") from None
    if not isinstance(fields, dict) or set(fields) != {"run", "peer", "expires", "owner_key"}:
        raise ValueError("not a credential (unexpected fields)")
    run, peer, expires, owner_key = fields["run"], fields["peer"], fields["expires"], fields["owner_key"]
    if not (isinstance(run, str) and isinstance(peer, str) and isinstance(owner_key, str)):
        raise ValueError("not a credential (fields of the wrong type)")
    if not isinstance(expires, int) or isinstance(expires, bool):
        raise ValueError("not a credential (expiry is not an integer)")
    try:
        public = RSAPublicKey.from_bytes(owner_key.encode())
    except Exception:
        raise ValueError("not a credential (the owner key is not an RSA key)") from None
    if not public.verify(payload, base64.b64encode(signature)):
        raise ValueError("the credential's signature does not match its owner key")
    owner = peer_id_of(_rsa(public))
    return Credential(run_id=run, peer_id=peer, expires=float(expires), owner=owner, token=token)


def _rsa(public: RSAPublicKey) -> rsa.RSAPublicKey:
    key: rsa.RSAPublicKey = public._public_key
    return key


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def check(credential: Credential, *, run_id: str, owner: str, now: float | None = None) -> None:
    """ValueError unless `credential` is for `run_id`, signed by `owner`, and not expired."""
    if credential.owner != owner:
        raise ValueError(f"signed by {credential.owner}, not by the run owner {owner}")
    if credential.run_id != run_id:
        raise ValueError(f"for run {credential.run_id!r}, not {run_id!r}")
    if credential.expires <= (time.time() if now is None else now):
        raise ValueError(f"expired at {utc(credential.expires)}")


class Admission:
    """Who may take part in a run (see the module docstring). Public: `Admission()`. Private:
    `owner` (credentials signed by that owner id admit their peer until they expire) and/or
    `allowed` (peer ids admitted outright). Thread-safe enough for its use: sets and dicts are
    replaced or updated whole, and a stale read only refuses a peer a moment longer."""

    def __init__(self, *, run_id: str = "", owner: str | None = None, allowed: Iterable[str] = ()) -> None:
        self.run_id, self.owner = run_id, owner
        self.allowed = frozenset(allowed)
        self.private = owner is not None or bool(self.allowed)
        self._admitted: dict[str, float] = {}  # peer -> credential expiry
        self._last_refresh = -float("inf")
        self._looked_up: set[str] = set()  # peers not admitted when the credentials were last read
        self._dht: NodeDHT | None = None
        self._key = ""
        self.refused = 0  # inputs refused from peers that are not admitted

    def admits(self, peer_id: str, *, now: float | None = None) -> bool:
        if not self.private or peer_id in self.allowed:
            return True
        expires = self._admitted.get(peer_id)
        return expires is not None and expires > (time.time() if now is None else now)

    def learn(self, token: str) -> Credential:
        """Verify a token for this run and remember the peer it admits; ValueError if it does not."""
        if self.owner is None:
            raise ValueError("this run admits no credentials (no run owner)")
        credential = read_credential(token)
        check(credential, run_id=self.run_id, owner=self.owner)
        self._admitted[credential.peer_id] = credential.expires
        return credential

    def learn_all(self, tokens: Iterable[object]) -> int:
        """Learn every valid token among `tokens` (anything else is skipped); returns how many."""
        learned = 0
        for token in tokens:
            if isinstance(token, str):
                try:
                    self.learn(token)
                    learned += 1
                except ValueError:
                    continue
        return learned

    def should_refresh(self, peers: Iterable[str]) -> bool:
        """Whether to re-read the credentials before refusing one of `peers`: at once for a peer not
        looked up yet (an insider that just joined published its credential before it registers or
        asks for anything, so one read finds it, and every member then sees the same group), at most
        every REFRESH_S for one looked up in vain (an outsider asking again and again)."""
        unknown = [p for p in peers if not self.admits(p)] if self.owner is not None else []
        if not unknown:
            return False
        now = time.monotonic()
        new = [p for p in unknown if p not in self._looked_up]
        if not new and now - self._last_refresh < REFRESH_S:
            return False
        if len(self._looked_up) + len(unknown) > MAX_LOOKED_UP:
            self._looked_up.clear()  # made-up peer ids by the thousand: forget, and start over
        self._looked_up.update(unknown)
        self._last_refresh = now
        return True

    def attach(self, dht: NodeDHT, prefix: str) -> None:
        """Read credentials from the run's `credentials` key of `dht` when a peer is not known."""
        self._dht, self._key = dht, credentials_key(prefix)

    def select(self, peers: Iterable[str]) -> set[str]:
        """The admitted ones of `peers`, after one (rate-limited) re-read if any is unknown; blocking."""
        peers = list(peers)
        if self._dht is not None and self.should_refresh(peers):
            try:
                found = self._dht.get(self._key, latest=True, return_future=True).result(
                    timeout=REFRESH_TIMEOUT_S
                )
            except Exception:  # no answer: the unknown peers stay refused until the next read
                found = None
            self._learn_found(found)
        return self._note({p for p in peers if self.admits(p)}, peers)

    async def select_async(self, peers: Iterable[str]) -> set[str]:
        """`select` for code on an event loop."""
        peers = list(peers)
        if self._dht is not None and self.should_refresh(peers):
            try:
                asked = self._dht.get(self._key, latest=True, return_future=True)
                found = await asyncio.wait_for(asked, REFRESH_TIMEOUT_S)
            except Exception:  # as in `select`: the unknown peers stay refused until the next read
                found = None
            self._learn_found(found)
        return self._note({p for p in peers if self.admits(p)}, peers)

    def _learn_found(self, found: Any) -> None:
        value = None if found is None else found.value
        if isinstance(value, dict):
            self.learn_all(getattr(item, "value", None) for item in value.values())

    def _note(self, admitted: set[str], peers: list[str]) -> set[str]:
        self.refused += len(set(peers) - admitted)
        return admitted


def credentials_key(prefix: str) -> str:
    return f"{prefix}_credentials"


def read_allowlist(path: str) -> frozenset[str]:
    """Peer ids, one per line ('#' starts a comment); ValueError naming the line of a malformed one."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    peers = set()
    for number, line in enumerate(lines, 1):
        value = line.split("#", 1)[0].strip()
        if not value:
            continue
        if not value.isalnum() or not 30 <= len(value) <= 64:
            raise ValueError(f"{path}:{number}: {value[:70]!r} is not a peer id")
        peers.add(value)
    if not peers or len(peers) > ALLOWLIST_MAX_PEERS:
        raise ValueError(f"{path}: {len(peers)} peer ids; 1 to {ALLOWLIST_MAX_PEERS} are needed")
    return frozenset(peers)
