"""A long-lived bootstrap peer with a persistent identity, exporting the swarm's metrics."""
