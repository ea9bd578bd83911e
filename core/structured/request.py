"""One request's grammar: the compile future it waits on, then its matcher."""

from __future__ import annotations

import re
from concurrent.futures import Future
from typing import Any, NamedTuple

# xgrammar prefixes its errors with "[time] source_file.cc:line: ".
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarKey(NamedTuple):
    """What a compiled grammar depends on: the compiled-grammar cache's key."""

    kind: str  # json, regex, choice, grammar, json_object, structural_tag
    spec: str
    any_whitespace: bool  # JSON: free whitespace between elements, else compact
    max_whitespace: int | None  # JSON with any_whitespace: the longest run (None: unbounded)


class StructuredOutputRequest:
    """Follows a request's generated tokens through its grammar.

    The scheduler keeps the request in WAITING_FOR_FSM until ``future`` is
    done, then calls ``start`` (which builds the matcher, or reports the
    compile error). The matcher is advanced only with tokens the scheduler
    accepted (``update_from_output``), so it always describes exactly the
    request's output tokens, which preemption keeps: a resumed request
    continues with the same matcher.
    """

    __slots__ = ("key", "future", "matcher", "_backend")

    def __init__(self, key: GrammarKey, future: Future, backend_of: Any) -> None:
        self.key = key
        self.future = future
        self.matcher: Any = None
        self._backend = backend_of  # () -> the backend, once the future is done

    def ready(self) -> bool:
        return self.future.done()

    def start(self) -> str | None:
        """Build the matcher once the grammar is compiled; the error message if it did not compile."""
        exc = self.future.exception()
        if exc is not None:
            return f"Invalid structured output ({self.key.kind}): {_SOURCE_PREFIX.sub('', str(exc)).strip()}"
        self.matcher = self._backend().matcher(self.future.result())
        return None

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar accepts from here, up to its end
        (speculative decoding); the matcher is left as it was."""
        accepted = 0
        for token_id in drafts:
            if not self.matcher.accept_token(token_id):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break
        if accepted:
            self.matcher.rollback(accepted)
        return drafts[:accepted]

    def only_end_allowed(self) -> bool:
        """The output is complete: the grammar allows no token but its end (e.g. a JSON
        object's closing brace); asked only when a limit cuts the request there."""
        return self._backend().only_end_allowed(self.matcher)
