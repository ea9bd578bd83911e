"""``python -m bench membw``: the memory's read bandwidth, the floor a one-stream decode is held to.

A decode step of one stream reads every weight once: its speed is at best the
speed at which the cores can stream memory. This probe maps a 1 GiB buffer
(``--gib``), fills it (so that every page exists), and reads it once per try
with kernels/cpu's ``stream_read`` on all the engine's threads, each a
contiguous share, as the quantized products read their weights; the best of
``--tries`` and the median are reported in GB/s. ``--hugepages`` asks the
kernel for transparent huge pages (the default mapping is the 4 KiB pages that
anonymous memory gets on a machine with THP in ``madvise`` mode).

``bandwidth_fraction`` is what bench compare reports beside a decode's time per
token: the weights' bytes read per token over that time, as a share of this.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

HELP = "memory read bandwidth on all cores (the decode floor)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB")
    parser.add_argument("--tries", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's thread count (the engine's)")
    parser.add_argument("--hugepages", action="store_true", help="madvise(MADV_HUGEPAGE) on the buffer")


def measure(gib: float = 1.0, tries: int = 9, threads: int | None = None, hugepages: bool = False) -> list[float]:
    """GB/s of each try (10^9 bytes per second)."""
    import numpy as np
    import torch

    from kernels import cpu

    lib = cpu.load()
    if lib is None:
        raise RuntimeError("no C compiler to build kernels/cpu with")
    nbytes = int(gib * 2**30) // 4096 * 4096
    buf = mmap.mmap(-1, nbytes)
    if hugepages:
        buf.madvise(mmap.MADV_HUGEPAGE)
    data = np.frombuffer(buf, np.uint8)
    data[:] = 1
    threads = threads or torch.get_num_threads()
    rates = []
    for _ in range(tries):
        start = time.perf_counter()
        lib.stream_read(data.ctypes.data, nbytes, threads)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    del data
    buf.close()
    return rates


def bandwidth_fraction(weight_bytes: float, seconds_per_token: float, probe_gb_s: float) -> float:
    """The share of ``probe_gb_s`` that reading ``weight_bytes`` per token at that speed is."""
    return weight_bytes / seconds_per_token / 1e9 / probe_gb_s


def run(args: argparse.Namespace) -> int:
    rates = measure(args.gib, args.tries, args.threads, args.hugepages)
    print(f"read bandwidth (GB/s): best {max(rates):.1f}, median {statistics.median(rates):.1f}, "
          f"min {min(rates):.1f} over {len(rates)} reads of {args.gib:g} GiB"
          f"{' (huge pages)' if args.hugepages else ''}")
    return 0
