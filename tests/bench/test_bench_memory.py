"""bench's memory of a process tree: RSS counts a shared page in every process, PSS once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from bench.compare import process_tree_pss_mb, process_tree_rss_mb

SHARED_MIB = 64

# A parent and its forked child, both resident in one 64 MiB shared mapping, report "ready"
# once each has touched every page, then wait for their standard input to close.
_TREE = textwrap.dedent(f"""
    import mmap, os, sys
    region = mmap.mmap(-1, {SHARED_MIB} << 20)
    region[:] = b"x" * len(region)
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        sum(region[i] for i in range(0, len(region), mmap.PAGESIZE))
        os.write(write, b"1")
        sys.stdin.read()
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_a_page_that_two_processes_share_counts_once_in_the_pss_and_twice_in_the_rss() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        rss, pss = process_tree_rss_mb(proc.pid), process_tree_pss_mb(proc.pid)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    assert rss >= 2 * SHARED_MIB  # each process's RSS holds the whole mapping
    assert SHARED_MIB <= pss < rss - SHARED_MIB * 0.9  # the PSS holds it once
