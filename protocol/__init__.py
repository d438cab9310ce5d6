"""What peers agree on: codecs, outer step, batch tests, schedule consensus, late-update correction."""
