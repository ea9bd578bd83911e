"""Speculative decoding: drafts proposed after a step, verified by the target in the next.

``speculator.Speculator`` is what the model runner holds (None when speculation
is off); it asks a ``proposer.Proposer`` (n-gram lookup, ``ngram_proposer``, or a
draft model, ``draft_proposer``) for drafts, samples verification steps with
``rejection_sampler``, and lets ``spec_gate`` pause drafting where it does not pay.
"""
