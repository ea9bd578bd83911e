"""Helpers the stream parsers share."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could begin ``marker``: text a stream
    must hold back, since the next delta may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def held_back(text: str, marker: str) -> int:
    """How much of the end of ``text`` a stream holds back before ``marker``: what may begin
    it, and the whitespace before that (dropped when the marker does come)."""
    head = text[: len(text) - partial_suffix(text, marker)]
    return len(text) - len(head.rstrip())
