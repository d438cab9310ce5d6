"""Benchmark: a chunked state download over the real p2pd on loopback, from 1 and from 2+ donors.

A synthetic state (θ and m of `--params` float32 parameters each) is offered by each donor (a DHT
peer with its `StateServer`, reading chunks from the tensors on request, as a node does); a joiner
downloads it with `StateServer.download`, verifying every chunk against the manifest. Reported per
donor count: seconds, MB/s and the chunks each donor served, plus how long the manifest took to
build (hashing θ and m chunk by chunk, which every peer does once per round). On one machine all
peers share the CPU, so this measures the protocol's overhead (stream setup, framing, hashing,
p2pd), not a network. `--donor-mbps R` emulates each donor's uplink: a donor hands out one chunk at
a time, each after chunk/R seconds, which shows how the download scales with donors when their
uplinks, not the joiner, are the limit. Run from the repository root:

    python bench/state_download.py                                  # 16M params (128 MB), 1 and 2 donors
    python bench/state_download.py --params 4000000 --chunk-mb 1 --donors 1 2 3 --out /tmp/dl.json
    python bench/state_download.py --params 4000000 --donor-mbps 80 --donors 1 2 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from adloco.protocol.transport.dht import DHT, NetworkConfig, start_dht, visible_maddrs
from adloco.protocol.transport.manifest import ChunkedState, TensorBytes, build_manifest
from adloco.protocol.transport.state_transfer import ServedState, StateServer, TransferSettings

NET = NetworkConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), nat_port_map=False, use_relay=False)
PREFIX = "adloco.bench-state.0"


def _uplink(served: ServedState, rate: float) -> ServedState:
    """The same state behind an emulated uplink of `rate` bytes/s: one chunk at a time."""
    link = threading.Lock()

    def read(index: int) -> bytes:
        data = served.read_chunk(index)
        with link:
            time.sleep(len(data) / rate)
        return data

    return replace(served, read_chunk=read)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=16_000_000, help="parameters in θ (m has as many)")
    p.add_argument("--chunk-mb", type=float, default=4.0)
    p.add_argument("--donors", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--donor-mbps", type=float, default=0.0, help="emulated uplink per donor (0: none)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    torch.manual_seed(0)
    tensors = [("theta.w", torch.randn(args.params)), ("momentum.w", torch.randn(args.params))]
    t0 = time.perf_counter()
    manifest = build_manifest(
        tensors, round=0, theta_hash="0" * 64, schedule={}, chunk_bytes=round(args.chunk_mb * 2**20)
    )
    build_s = time.perf_counter() - t0
    encoded = manifest.encode()
    data = TensorBytes([t for _, t in tensors])
    served = ServedState(manifest, encoded, lambda i: data.read(*manifest.span(i)))
    digest = hashlib.sha256(encoded).hexdigest()
    mb = manifest.total_bytes / 1e6
    print(f"state {mb:.0f} MB in {len(manifest.chunks)} chunks; manifest built in {build_s:.2f} s")

    settings = TransferSettings(chunk_bytes=manifest.chunk_bytes, bandwidth_bps=100e6)
    dhts: list[DHT] = []
    servers: list[StateServer] = []
    results = []
    try:
        dhts.append(start_dht(NET))
        client = StateServer(dhts[0], prefix=PREFIX, offered=lambda _: None, updates=lambda _: [])
        servers.append(client)
        donors: list[str] = []
        for _ in range(max(args.donors)):
            dht = start_dht(replace(NET, peers=tuple(visible_maddrs(dhts[0]))))
            dhts.append(dht)
            offer = _uplink(served, args.donor_mbps * 1e6 / 8) if args.donor_mbps > 0 else served
            offered = lambda d, offer=offer: offer if d == digest else None  # noqa: E731
            servers.append(
                StateServer(dht, prefix=PREFIX, offered=offered, updates=lambda _: [], settings=settings)
            )
            donors.append(dht.peer_id.to_base58())
        client.settings = settings
        for count in args.donors:
            for repeat in range(args.repeats):
                state = ChunkedState(manifest, digest)
                report = client.download(state, donors[:count])
                assert state.complete
                assert all(torch.equal(state.tensors[n], t) for n, t in tensors)
                row = {
                    "donors": count,
                    "repeat": repeat,
                    "seconds": round(report.seconds, 3),
                    "mb_per_s": round(mb / report.seconds, 1),
                    "chunks_per_donor": sorted(report.kept.values()),
                }
                results.append(row)
                print(row)
    finally:
        for server in servers:
            server.shutdown()
        for dht in dhts:
            dht.shutdown()
    summary = {
        "state_mb": round(mb, 1),
        "chunks": len(manifest.chunks),
        "manifest_build_s": build_s,
        "donor_mbps": args.donor_mbps,
    }
    if args.out is not None:
        args.out.write_text(json.dumps({**summary, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
