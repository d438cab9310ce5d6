"""A node in a real swarm: its round loop, its sync with the swarm, its operations."""
