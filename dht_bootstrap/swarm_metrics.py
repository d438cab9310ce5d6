"""Swarm-wide Prometheus metrics of a run, exported by the bootstrap peer.

Every node writes a signed beacon to the DHT after each round (`protocol.records.BeaconRecord`:
round, tokens trained, recent tokens/s, when). The bootstrap reads them every --poll-s seconds:
a node is alive while its last beacon is younger than --alive-s (make it longer than a round).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from ..protocol.transport.dht import DHT
from ..protocol.transport.records import add_beacon_validators, live_beacons

logger = logging.getLogger(__name__)


class SwarmMetrics:
    """The gauges, and the DHT reads that update them."""

    def __init__(self, run_id: str, *, alive_s: float, registry: CollectorRegistry | None = None) -> None:
        self.run_id, self.alive_s = run_id, alive_s
        r = self.registry = registry or CollectorRegistry()
        self.peers = Gauge("adloco_swarm_peers_alive", "Nodes of the run that reported recently", registry=r)
        self.round = Gauge("adloco_swarm_round", "The highest round a live node has reached", registry=r)
        self.tokens_per_s = Gauge(
            "adloco_swarm_tokens_per_second", "Sum of the live nodes' recent training throughput", registry=r
        )
        self.tokens = Gauge("adloco_swarm_tokens", "Tokens the live nodes have trained on", registry=r)
        self.polls_failed = Gauge(
            "adloco_swarm_poll_failures", "Consecutive failed reads of the DHT (0 when healthy)", registry=r
        )

    def serve(self, port: int, host: str) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"--metrics-port: must be in [0, 65535], got {port}")
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ValueError(f"--metrics-port: cannot listen on {host}:{port}: {e.strerror}") from None

    def attach(self, dht: DHT) -> None:
        add_beacon_validators(dht, self.run_id)
        self.poll(dht)

    def poll(self, dht: DHT) -> None:
        try:
            alive = live_beacons(dht, self.run_id, alive_s=self.alive_s)
        except Exception as e:  # the DHT process is busy or restarting: report it, keep the old figures
            self.polls_failed.inc()
            logger.warning("reading the swarm's beacons failed: %r", e)
            return
        self.polls_failed.set(0)
        self.peers.set(len(alive))
        self.round.set(max((b.round for b in alive), default=0))
        self.tokens_per_s.set(sum(b.tokens_per_s for b in alive))
        self.tokens.set(sum(b.tokens for b in alive))
