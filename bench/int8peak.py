"""``python -m bench int8peak``: the CPU's int8 multiply-add peak, the ceiling of a prefill.

A prefill's products are compute-bound: integer multiply-adds of int8 weights
and activations. This probe runs kernels/cpu's ``int8_peak_probe`` on all the
engine's threads: independent chains of the widest such instruction the
kernels' build uses (AVX2's vpmaddubsw, AVX-VNNI's and AVX-512 VNNI's
vpdpbusd), with no memory traffic, for about ``--seconds``; the best of
``--tries`` and the median are reported in multiply-adds per second. A core's
rate is its instruction throughput times the lanes, which a vendor's table
gives only for its nominal clock and ideal ports: this measures what the
machine gives now.

``peak_fraction`` is what bench compare reports beside a prefill's prompt
tokens per second: the products' multiply-adds per second as a share of this.
"""

from __future__ import annotations

import argparse
import statistics
import time

HELP = "int8 multiply-add peak on all cores (the prefill ceiling)"
ROUNDS = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="about how long each try runs")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's thread count (the engine's)")


def measure(tries: int = 5, seconds: float = 0.5, threads: int | None = None) -> list[float]:
    """Multiply-adds per second (10^9) of each try; empty where the kernels have no int8 instruction."""
    import torch

    from kernels import cpu

    lib = cpu.load()
    if lib is None:
        raise RuntimeError("no C compiler to build kernels/cpu with")
    threads = threads or torch.get_num_threads()
    start = time.perf_counter()
    if not lib.int8_peak_probe(ROUNDS, threads):
        return []
    rounds = max(1, int(ROUNDS * seconds / (time.perf_counter() - start)))
    rates = []
    for _ in range(tries):
        start = time.perf_counter()
        done = lib.int8_peak_probe(rounds, threads)
        rates.append(done / (time.perf_counter() - start) / 1e9)
    return rates


def peak_fraction(macs_per_token: float, tokens_per_s: float, peak_gmac_s: float) -> float:
    """The share of ``peak_gmac_s`` that ``tokens_per_s`` prompt tokens of ``macs_per_token`` are."""
    return macs_per_token * tokens_per_s / 1e9 / peak_gmac_s


def run(args: argparse.Namespace) -> int:
    rates = measure(args.tries, args.seconds, args.threads)
    if not rates:
        print("this build of the kernels has no int8 vector instruction (portable C): no peak to measure")
        return 1
    print(f"int8 multiply-adds (GMAC/s): best {max(rates):.1f}, median {statistics.median(rates):.1f}, "
          f"min {min(rates):.1f} over {len(rates)} tries")
    return 0
