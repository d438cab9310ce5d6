"""The volunteer process: training, operations, the drivers of a round (solo, simulator, swarm), CLIs."""
