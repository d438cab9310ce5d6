"""The simulator: N virtual peers in one process, in simulated time, averaging in process."""
