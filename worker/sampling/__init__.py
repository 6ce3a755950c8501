"""Drawing each step's tokens from the logits (``sampler.py``), under a grammar when the request has
one (``grammar.py``)."""
