"""Whether speculative decoding pays here: measured, not assumed.

Verifying k drafts costs k + 1 query rows. On a large model that streams its
weights from memory those rows cost about what one does; on a tiny model
that lives in the caches, or when drafts are mostly rejected, they cost more
than the tokens they save. The gate compares the tokens per second of decode
steps that verified drafts with those of steps that did not (exponential
moving averages over the runner's own step times) and closes for a while
when drafting is the slower: the steps while it is closed measure plain
decoding anew, and when it opens again the drafts get another chance.
``RINGLLM_SPEC_DECODE_GATE=0`` keeps it open (tests that need drafts at
every step, whatever the machine measures).
"""

from __future__ import annotations

# Weight of the newest step in the moving averages.
SMOOTHING = 0.1
# Steps the gate stays closed: after losing (doubled at each loss in a row, up to
# MAX_CLOSED_STEPS, so that a model where drafts never pay hardly ever tries them),
# and to measure plain steps when there were none.
CLOSED_STEPS = 32
MAX_CLOSED_STEPS = 1024
# Steps with drafts before the gate closes once just to measure the plain rate.
STEPS_BEFORE_A_PLAIN_MEASURE = 16


class SpeculationGate:
    """``open``: whether to draft at the next step; ``enabled=False`` keeps it open."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.rates: dict[bool, float | None] = {True: None, False: None}  # tokens/s, with and without drafts
        self.closed_for = 0  # steps left with the gate closed
        self.penalty = CLOSED_STEPS  # how long the next loss closes it
        self.steps_with_drafts = 0

    @property
    def open(self) -> bool:
        return self.closed_for == 0

    def observe(self, with_drafts: bool, tokens: int, seconds: float) -> None:
        """One decode step (every request in it at its last token, with or without drafts):
        ``tokens`` emitted in ``seconds``."""
        if self.closed_for:
            self.closed_for -= 1
            if not self.closed_for:
                self.rates[True] = None  # drafts get a fresh measure, not their old average
        if not self.enabled or seconds <= 0.0 or tokens <= 0:
            return
        rate = tokens / seconds
        previous = self.rates[with_drafts]
        self.rates[with_drafts] = rate if previous is None else previous + SMOOTHING * (rate - previous)
        if not with_drafts:
            return
        self.steps_with_drafts += 1
        plain, drafted = self.rates[False], self.rates[True]
        if plain is None:
            if self.steps_with_drafts >= STEPS_BEFORE_A_PLAIN_MEASURE:
                self.closed_for = CLOSED_STEPS  # drafts at every step so far: measure without them
        elif drafted is not None and drafted < plain:
            self.closed_for = self.penalty
            self.penalty = min(2 * self.penalty, MAX_CLOSED_STEPS)
        else:
            self.penalty = CLOSED_STEPS
