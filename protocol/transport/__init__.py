"""Between peers: hivemind's DHT and P2P (records, our all-reduce, state) and the in-process transport."""
