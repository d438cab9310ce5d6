"""DHT keys and signed record schemas of a run, validated at the DHT boundary.

Every key of a run is built here from the run prefix (`run_prefix`: run id + protocol version +
model fingerprint). Records are strict pydantic models (hivemind's `SchemaValidator`: no type
coercion) stored under a subkey that carries the writer's RSA public key, so hivemind's
`RSASignatureValidator` signs them on store and drops, on every read, any record whose signature
does not match: a peer can only write its own entry, and a malformed entry never reaches our code.
The key is the writer's libp2p identity (`identity.NodeDHT`): a record naming another peer id than
the one its key derives is dropped where it is read, so a record speaks only for its own peer.

Record kinds:
- `{prefix}_state`: per peer, the round it reached, θ's hash after that round, the schedule it
  holds, and the hash and size of the manifest of its state at that round (`manifest.py`: every
  chunk's hash); joiners and laggards pick the latest round's majority θ hash, fetch the manifest
  from any holder, check it against the hash here, and every chunk against the manifest.
- `{beacon prefix}_beacon`: per peer, its round, tokens trained and recent tokens/s, and when it
  wrote that. The beacon prefix holds the run id but no model fingerprint, so a bootstrap peer,
  which builds no model, can read the swarm's figures for its metrics.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import time
from typing import Any, TypeVar

import hivemind
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, StrictStr, confloat, conint, conlist, constr

from ..algorithms.trust import MAX_WORKERS
from .admission import MAX_TOKEN_CHARS, Admission, credentials_key
from .dht import DHT_RPC_TIMEOUT_S, DHT_STALL_S
from .identity import NodeDHT, peer_of_subkey
from .manifest import MAX_MANIFEST_BYTES

logger = logging.getLogger(__name__)

MAX_PEER_CHARS = 64  # a base58 peer id is 46-52 characters

# 2: state records carry the state's manifest; 3: a round registration says which group it expects;
# 4: and how long a round it opens stays open for that group (its patience); 5: and the peers it
# asks the others to leave out, and those whose work it took lately (who may own parts, `trust`)
PROTOCOL_VERSION = 5


def run_prefix(run_id: str, fingerprint: str) -> str:
    """The namespace of a run: keys and stream handlers of other runs or models never match."""
    digest = hashlib.sha256(f"{PROTOCOL_VERSION}|{run_id}|{fingerprint}".encode()).hexdigest()[:16]
    return f"adloco.{run_id}.{digest}"


class StateRecord(BaseModel):
    """One peer's position: the libp2p id to fetch from, round, θ hash, schedule (JSON text), the
    sha256 and size of the manifest of its state at that round, and the peers whose work it took
    lately (`trust`: a joiner weighs the record writers by them, `sync.live_head`)."""

    peer_id: StrictStr
    round: conint(ge=0, strict=True)  # type: ignore[valid-type]
    theta_hash: constr(regex=r"^[0-9a-f]{64}$", strict=True)  # type: ignore[valid-type]
    schedule: StrictStr
    manifest_hash: constr(regex=r"^[0-9a-f]{64}$", strict=True)  # type: ignore[valid-type]
    manifest_bytes: conint(ge=1, le=MAX_MANIFEST_BYTES, strict=True)  # type: ignore[valid-type]
    workers: conlist(constr(max_length=MAX_PEER_CHARS, strict=True), max_items=MAX_WORKERS) = []  # type: ignore[valid-type]

    class Config:
        extra = "forbid"

    def schedule_dict(self) -> dict[str, Any]:
        value = json.loads(self.schedule)
        if not isinstance(value, dict):
            raise ValueError("schedule is not a JSON object")
        return value


class BeaconRecord(BaseModel):
    """One peer's progress, for swarm-wide metrics: round, tokens trained, tokens/s, written at."""

    round: conint(ge=0, strict=True)  # type: ignore[valid-type]
    tokens: conint(ge=0, strict=True)  # type: ignore[valid-type]
    tokens_per_s: confloat(ge=0, strict=True)  # type: ignore[valid-type]
    updated: confloat(strict=True)  # type: ignore[valid-type]

    class Config:
        extra = "forbid"


class BeaconSchema(BaseModel):
    beacon: dict[BytesWithPublicKey, BeaconRecord | None]


def beacon_prefix(run_id: str) -> str:
    return f"adloco.{run_id}.v{PROTOCOL_VERSION}"


def beacon_key(run_id: str) -> str:
    return f"{beacon_prefix(run_id)}_beacon"


class RunSchema(BaseModel):
    """The run's DHT keys (field name = key suffix) and what their subkeys may hold."""

    state: dict[BytesWithPublicKey, StateRecord | None]
    credentials: dict[BytesWithPublicKey, constr(max_length=MAX_TOKEN_CHARS, strict=True) | None]  # type: ignore[valid-type]


def state_key(prefix: str) -> str:
    return f"{prefix}_state"


def add_run_validators(dht: NodeDHT, prefix: str, run_id: str) -> bytes:
    """Install the schema validators for this run (the DHT signs with its identity already);
    returns this peer's signing subkey."""
    run = SchemaValidator(RunSchema, prefix=prefix)
    dht.add_validators([run, SchemaValidator(BeaconSchema, prefix=beacon_prefix(run_id))])
    return dht.identity.subkey


def add_beacon_validators(dht: hivemind.DHT, run_id: str) -> None:
    """What a reader of the beacons (the bootstrap) installs: the beacon schema and signatures."""
    dht.add_validators([SchemaValidator(BeaconSchema, prefix=beacon_prefix(run_id)), RSASignatureValidator()])


def parse_states(value: Any) -> list[StateRecord]:
    """The valid state records in a DHT `get` result (a dict subkey -> ValueWithExpiration), each
    naming the peer whose key signed it."""
    return [r for subkey, r in _parse(value, StateRecord) if r.peer_id == peer_of_subkey(subkey)]


def parse_beacons(value: Any) -> list[BeaconRecord]:
    """The valid beacon records in a DHT `get` result."""
    return [r for _, r in _parse(value, BeaconRecord)]


_R = TypeVar("_R", bound=BaseModel)


def _parse(value: Any, model: type[_R]) -> list[tuple[Any, _R]]:
    """(subkey, record) for each entry that parses as `model`."""
    if not isinstance(value, dict):
        return []
    records = []
    for subkey, item in value.items():
        try:
            records.append((subkey, model.parse_obj(item.value)))
        except Exception:  # already validated by the DHT; anything else is ignored
            continue
    return records


class RunRecords:
    """This peer's view of a run's records in the DHT: it writes its own (signed), reads everyone's.

    Installs the run's validators on construction (`add_run_validators`); `ttl_s` is how long a
    record lives without being rewritten.
    """

    def __init__(
        self, dht: NodeDHT, *, prefix: str, run_id: str, ttl_s: float, admission: Admission | None = None
    ) -> None:
        self._dht = dht
        self._prefix, self._run_id, self._ttl_s = prefix, run_id, ttl_s
        self._subkey = add_run_validators(dht, prefix, run_id)
        self.admission = admission or Admission()
        self.credential: str | None = None  # this peer's, republished with its state record
        self._state_store: Any = None  # the last state record's store, while not waited for

    def publish_state(self, record: StateRecord, *, wait: bool = True) -> None:
        """Store this peer's state record (and its credential in a private run). `wait`: block until
        the DHT has answered; else return at once and log a failure when it comes (a round's record
        between two rounds: a store toward peers that went silent waits out their RPC timeouts, and
        the training thread must not; the newest record wins whatever order the stores land in, as
        its expiration is the latest)."""
        now = get_dht_time()
        stored = self._dht.store(
            state_key(self._prefix),
            record.dict(),
            expiration_time=now + self._ttl_s,
            subkey=self._subkey,
            return_future=True,
        )
        _stored_or_logged(stored, "storing the state record", wait)
        self._state_store = None if wait else stored
        if self.credential is not None:
            self.publish_credential(self.credential, wait=wait)

    def settle(self) -> None:
        """Wait for the last state record stored without waiting to land: a node that stops after its
        last round leaves that round's record for the peers still behind it (a record dropped at
        exit left them unaware the run had gone on without them). A failure is logged."""
        store, self._state_store = self._state_store, None
        if store is None:
            return
        t0 = time.monotonic()
        try:
            store.result(timeout=SETTLE_S)
        except Exception as e:  # still under way (peers that left delay their replicas), or failed
            logger.info("the last state record's store: %r", e)
        logger.info("waited %.2f s for the last state record's store", time.monotonic() - t0)

    def publish_credential(self, token: str, *, wait: bool = True) -> None:
        """Store this peer's credential of a private run, for the others to admit it."""
        self.credential = token
        expires = get_dht_time() + self._ttl_s
        stored = self._dht.store(
            credentials_key(self._prefix),
            token,
            expiration_time=expires,
            subkey=self._subkey,
            return_future=True,
        )
        _stored_or_logged(stored, "storing the credential", wait)

    def publish_beacon(self, record: BeaconRecord) -> None:
        """Store this peer's beacon without waiting (metrics only)."""
        self._dht.store(
            beacon_key(self._run_id),
            record.dict(),
            expiration_time=get_dht_time() + self._ttl_s,
            subkey=self._subkey,
            return_future=True,
        )

    def states(self) -> list[StateRecord]:
        """Every admitted peer's valid state record, as the DHT returns them now."""
        found = dht_result(
            self._dht.get(state_key(self._prefix), latest=True, return_future=True), "reading states"
        )
        records = parse_states(None if found is None else found.value)
        admitted = self.admission.select({r.peer_id for r in records})
        return [r for r in records if r.peer_id in admitted]


def live_beacons(dht: hivemind.DHT, run_id: str, *, alive_s: float) -> list[BeaconRecord]:
    """The beacons of a run written within the last `alive_s` seconds (DHT time); raises on DHT failure."""
    found = dht.get(beacon_key(run_id), latest=True)
    now = get_dht_time()
    return [b for b in parse_beacons(None if found is None else found.value) if now - b.updated < alive_s]


DHT_CALL_TIMEOUT_S = 30.0  # a DHT call of the node's own process that takes longer: the DHT is gone


SETTLE_S = DHT_STALL_S + DHT_RPC_TIMEOUT_S
"""The most a stopping node waits for its last state record's store (`RunRecords.settle`): the
replicas that answer take a round trip; an unresponsive one holds the store for `DHT_STALL_S`, and a
node that left after 5 s had stored its last record nowhere else in the time; one RPC timeout more
is the margin."""


def dht_result(future: Any, what: str) -> Any:
    """The result of a DHT call made with `return_future=True`, or TimeoutError after
    DHT_CALL_TIMEOUT_S: hivemind's blocking calls wait for ever on a DHT process that died."""
    try:
        return future.result(timeout=DHT_CALL_TIMEOUT_S)
    except (TimeoutError, concurrent.futures.TimeoutError):
        raise TimeoutError(f"{what}: the DHT did not answer in {DHT_CALL_TIMEOUT_S:.0f} s") from None


def _stored_or_logged(future: Any, what: str, wait: bool) -> None:
    """Wait for a DHT store (`dht_result`), or have its failure logged whenever it comes."""
    if wait:
        dht_result(future, what)
        return

    def done(f: Any) -> None:
        error = None if f.cancelled() else f.exception()
        if error is not None:
            logger.warning("%s failed: %r", what, error)

    future.add_done_callback(done)


def dht_time() -> float:
    """The DHT's clock (the wall clock, which every record's times are in)."""
    return float(get_dht_time())
