"""The data: corpora and their token caches, tokenizers, the samplers that draw batches from them,
and the state-dict checks (state.py) every stateful object of a peer uses."""
