"""One peer's computation: model, data, MIT instances, the Peer, catch-up, the records of a round."""
