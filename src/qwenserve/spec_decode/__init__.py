"""Speculative decoding: proposers fill draft tokens, the target verifies them in one pass.

``config`` (the ``--speculative-config`` JSON), ``ngram`` (prompt lookup), ``stats`` (plain
counters) need no torch; ``rejection`` (the verifying sampler) and ``draft_model`` do.
"""
