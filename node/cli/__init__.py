"""Entry points: adloco-node, adloco-sim, adloco-swarm."""
