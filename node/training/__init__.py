"""One peer's round: the Peer, its MIT instances, catch-up, replicated state, the records of a round."""
