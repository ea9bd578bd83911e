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

And it runs code that serving never runs again: importing torch alone makes
tens of megabytes of libtorch resident (its operator registrations, the
initialisers of every module), and the engine's start-up adds the paths of
loading and profiling. Those are clean pages of a library file, which the
kernel would reclaim first under memory pressure; handing them back when
start-up is over (``MADV_PAGEOUT``) leaves resident the code serving uses, which
faults back in on its first step. Pages another process maps too are left.
"""

from __future__ import annotations

import ctypes
import gc
import re
from pathlib import Path

# madvise(2): reclaim these pages now (Linux 5.4 and later; older kernels refuse it, harmlessly).
MADV_PAGEOUT = 21
# A shared library's file name: libfoo.so, libfoo.so.6, foo.cpython-311-x86_64-linux-gnu.so.
_SHARED_LIBRARY = re.compile(r"\.so(\.\d+)*$")


def freeze_startup_heap() -> None:
    """Collect once, exempt every surviving object from future collections, and hand the C
    heap's free pages and the libraries' start-up code back to the system."""
    gc.collect()
    gc.freeze()
    trim_c_heap()
    page_out_libraries()


def trim_c_heap() -> None:
    """glibc's ``malloc_trim(0)``; nothing where the C library has no such call (musl, macOS).
    Also for what loads once while serving and drops a large parse behind it (core/structured).

    Looked up among the symbols the process already has: ``ctypes.util.find_library`` would run
    ``ldconfig`` in a child process, a stray process at the end of every start-up."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def page_out_libraries() -> None:
    """Reclaim the resident pages of the shared libraries' read-only mappings (their code and
    constants; the weights and every other file stay as they are). Nothing where the system has
    no /proc or no ``madvise`` call, or refuses the advice."""
    try:
        madvise = ctypes.CDLL(None).madvise
        maps = Path("/proc/self/maps").read_text()
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or "w" in fields[1] or not _SHARED_LIBRARY.search(fields[5]):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        madvise(start, end - start, MADV_PAGEOUT)
