"""The volunteer process: training, operations, the three drivers of a round (solo, simulator, swarm), CLIs."""
