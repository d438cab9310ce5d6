"""The node's Prometheus metrics (`--metrics-port`).

Names follow the Prometheus conventions: an `adloco_` namespace, base units in the name (`_seconds`,
`_bytes`), `_total` on counters, no peer id or other unbounded label (one scrape target is one
node; the target's `instance` label says which). Gauges describe the latest applied round; counters
accumulate over the process's life, so rates come from PromQL (`rate(adloco_tokens_total[1m])`).

The node updates these from its round loop (`NodeMetrics.round_applied`, ...); serving runs on
prometheus_client's own HTTP thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ...errors import UserError

logger = logging.getLogger(__name__)

# Averaging waits at most window + 2 × part timeout + 30 s (63 s with the defaults): the buckets
# reach past it so a timed-out round lands in a bucket, not only in +Inf.
AVERAGING_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180)
ROUND_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class NodeMetrics:
    """Every metric a node exports, in its own registry (tests build several in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()

        def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(f"adloco_{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(f"adloco_{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"adloco_{name}", doc, buckets=buckets, registry=r)

        self.inner_loss = gauge("inner_loss", "Mean training loss of the last local round")
        self.val_loss = gauge("val_loss", "Validation loss of θ after the last applied round")
        self.tokens = counter("tokens", "Tokens trained on (contributed or not)")
        self.samples = counter("samples", "Training sequences trained on")
        self.inner_step = histogram(
            "inner_step_duration_seconds", "Duration of one inner optimizer step", STEP_BUCKETS
        )
        self.round = histogram("round_duration_seconds", "Time between two applied rounds", ROUND_BUCKETS)
        self.averaging = histogram(
            "averaging_duration_seconds",
            "Duration of one averaging call (matchmaking window, exchange), successful or not",
            AVERAGING_BUCKETS,
        )
        self.wait = counter(
            "communication_wait_seconds",
            "Time the node sat idle waiting for its group and the transfer (overlap hides the rest)",
        )
        self.sent = counter("wire_sent_bytes", "Bytes sent on averaging streams")
        self.received = counter("wire_received_bytes", "Bytes received on averaging streams")
        self.compression = gauge("compression_ratio", "fp32 size of the pseudo-gradient / its encoded size")
        self.codec = gauge("codec_info", "The codec in use (value 1)", ["codec"])
        self.batch = gauge("batch_size", "Per-instance batch size of the schedule", ["slot"])
        self.accum = gauge("accumulation_steps", "Gradient accumulation steps (switch mode)")
        self.instances = gauge("instances", "MIT instances of the schedule")
        self.inner_steps = gauge("inner_steps", "H: inner steps of the last local round")
        self.group = gauge("group_size", "Members of the last applied averaging group")
        self.staleness = gauge("staleness_rounds", "τ of the last applied contribution")
        self.late = counter(
            "late_contributions",
            "Late contributions by outcome: corrected (HeLoCo changed it), applied (as it was), dropped",
            ["outcome"],
        )
        self.rejected = counter(
            "rejected_parts", "Parts of group members the owners screened out (non-finite, outlier)"
        )
        self.violations = counter(
            "protocol_violations",
            "Rule breaks this node's owners caught (claims, sizes, shapes of a member's parts); each bans",
        )
        self.banned = gauge(
            "banned_members", "Members this node's owners refuse now (owner.BAN_S after a rule break)"
        )
        self.malformed = counter(
            "malformed_reports", "Group members' round reports every member dropped as malformed"
        )
        self.compute_rate = gauge(
            "compute_tokens_per_second",
            "Training tokens per second of compute (the instances' inner steps) in the last local round",
            ["device"],
        )
        self.model_flops = gauge(
            "model_flops_per_second",
            "Model FLOPs per second of compute in the last local round (6·N + 12·L·d·T per token)",
            ["device"],
        )
        self.mfu = gauge(
            "mfu_ratio",
            "Model FLOPs utilization of the last local round against the device's dense bf16 peak"
            " (GPUs with a known peak only)",
            ["device"],
        )
        self.peers = gauge("peers_visible", "Peers of this run with a state record in the DHT")
        self.current_round = gauge("round", "Rounds applied to θ (the swarm's round counter)")
        self.downloads = counter("state_downloads", "Full state downloads (joining, far behind)")
        self.replays = counter("catch_up_replays", "Catch-ups by replaying kept updates")
        for outcome in ("corrected", "applied", "dropped"):
            self.late.labels(outcome)  # export 0 before the first late contribution
        self._codec: str | None = None
        self._slots = 0

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Start the /metrics HTTP endpoint on prometheus_client's thread."""
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise UserError(f"--metrics-port: cannot listen on {host}:{port}: {e.strerror}") from None

    def round_applied(self, fields: Mapping[str, Any], *, batch: Sequence[int], raw_bytes: int) -> None:
        """A round's report (`SwarmNode.report` fields) into the gauges and counters."""
        self.inner_loss.set(fields["inner_loss"])
        self.val_loss.set(fields["val_loss"])
        self.round.observe(fields["round_s"])
        self.wait.inc(fields["wait_s"])
        self.current_round.set(fields["round"])
        self.group.set(fields["group_size"])
        self.staleness.set(fields["staleness"])
        self.inner_steps.set(fields["inner_steps"])
        self.accum.set(fields["accum_steps"])
        self.instances.set(len(batch))
        for slot in range(len(batch), self._slots):
            self.batch.remove(str(slot))
        for slot, b in enumerate(batch):
            self.batch.labels(str(slot)).set(b)
        self._slots = len(batch)
        if fields["contribution_bytes"]:
            self.compression.set(raw_bytes / fields["contribution_bytes"])
        self.set_codec(fields["codec"])

    def compute(
        self, device: str, *, tokens: int, compute_s: float, flops_per_token: float, peak: float | None
    ) -> None:
        """A local round's speed on `device`: tokens and model FLOPs per second of compute, and the
        MFU where the device's peak is known (none is exported for a CPU: no peak figure is made up)."""
        if compute_s <= 0:
            return
        rate = tokens / compute_s
        self.compute_rate.labels(device).set(rate)
        self.model_flops.labels(device).set(rate * flops_per_token)
        if peak:
            self.mfu.labels(device).set(rate * flops_per_token / peak)

    def set_codec(self, codec: str) -> None:
        if codec == self._codec:
            return
        if self._codec is not None:
            self.codec.remove(self._codec)
        self.codec.labels(codec).set(1)
        self._codec = codec
