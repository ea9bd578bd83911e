"""Keep the garbage collector off the serving path, and the start-up's garbage out of memory.

By the time a process starts serving, it holds hundreds of thousands of
long-lived objects (torch, transformers, tokenizer, model modules). Each full
collection walks all of them (bench/README.md has the pause it cost), which
lands on whatever request is in flight (a P99 TTFT spike). Freezing moves
them to the permanent generation, so later collections only look at objects
made while serving. vLLM does the same at the end of EngineCore start-up.

Start-up also frees a lot of C memory: a tokenizer's JSON is parsed into a tree
that is dropped once the tokenizer is built (about twice the tokenizer's own
size for a 128k vocabulary), and glibc keeps freed memory for reuse rather than
return it. ``malloc_trim`` returns it, once, when start-up is over.
"""

from __future__ import annotations

import ctypes
import gc


def freeze_startup_heap() -> None:
    """Collect once, exempt every surviving object from future collections, and hand the C
    heap's free pages back to the system."""
    gc.collect()
    gc.freeze()
    _trim_c_heap()


def _trim_c_heap() -> None:
    """glibc's ``malloc_trim(0)``; nothing where the C library has no such call (musl, macOS).

    Looked up among the symbols the process already has: ``ctypes.util.find_library`` would run
    ``ldconfig`` in a child process, a stray process at the end of every start-up."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
