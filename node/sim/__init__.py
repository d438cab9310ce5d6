"""The in-process simulator: N virtual peers running the protocol/ functions over an in-memory transport."""
