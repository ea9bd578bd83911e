"""core/heap.py: start-up's freed C memory goes back to the system (a real tokenizer, a real process)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from app.launcher import REPO
from core.heap import MADV_PAGEOUT
from core.models import gguf_metadata
from core.models.gguf_header import GGUFHeader

VOCAB = Path(__file__).resolve().parents[3] / "shared" / "chat-formats" / "vocab" / "ggml-vocab-llama-bpe.gguf"

MEASURE = """
import json, re, sys
from app.tokenizer import load_tokenizer
from core.heap import freeze_startup_heap

def anon_kib():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1))

start = anon_kib()
tokenizer = load_tokenizer(sys.argv[1])
loaded = anon_kib()
freeze_startup_heap()
frozen = anon_kib()
print(json.dumps({"start": start, "loaded": loaded, "frozen": frozen,
                  "ids": tokenizer.encode("Hello world", add_special_tokens=False)}))
"""


def has_malloc_trim() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim")
    except OSError:
        return False


@pytest.mark.skipif(not VOCAB.is_file(), reason=f"{VOCAB} is missing (../shared beside the checkout)")
@pytest.mark.skipif(not has_malloc_trim(), reason="this C library has no malloc_trim (glibc's)")
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="RSS is read from /proc")
def test_the_memory_a_tokenizer_freed_while_loading_is_returned_at_the_end_of_start_up(tmp_path: Path) -> None:
    """Llama 3's 128k-token vocabulary: its JSON's parse tree is freed once the tokenizer is built,
    and glibc would keep those pages for the process's life."""
    with GGUFHeader(str(VOCAB)) as header:
        assert gguf_metadata.write_tokenizer(header, tmp_path)
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rss = json.loads(proc.stdout.splitlines()[-1])
    grown, returned = rss["loaded"] - rss["start"], rss["loaded"] - rss["frozen"]
    assert returned > grown / 3, rss  # most of what loading took was its garbage
    assert rss["ids"] == [9906, 1917]  # and the tokenizer still works


PAGE_OUT = """
import json, mmap, os, re, sys
from core.heap import page_out_libraries

def resident_kib(path):
    kib, current = 0, None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = head[5] if len(head) > 5 else None
        elif head[0] == "Rss:" and current == path:
            kib += int(head[1])
    return kib

maps = {}
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        maps[path] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sum(maps[path][i] for i in range(0, len(maps[path]), mmap.PAGESIZE))  # every page resident
before = {path: resident_kib(path) for path in maps}
page_out_libraries()
print(json.dumps({"before": before, "after": {path: resident_kib(path) for path in maps}}))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="residency is read from /proc")
def test_start_up_hands_back_the_pages_of_shared_libraries_and_keeps_other_files(tmp_path: Path) -> None:
    """A file named as a shared library and a weights file, both mapped read-only and read through:
    the library's pages leave, the weights' stay (a model served from a mapping must not fault)."""
    if not kernel_pages_out():
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux 5.4 and later)")
    folder = tmp_path
    if in_memory_filesystem(tmp_path):  # the checkout's disk instead (build/ is ignored by git)
        (REPO / "build").mkdir(exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=REPO / "build"))
    library, weights = folder / "libstartup.so.1", folder / "weights.bin"
    for path in (library, weights):
        with open(path, "wb") as f:
            f.write(os.urandom(4 << 20))
            f.flush()
            os.fsync(f.fileno())  # clean pages: the kernel reclaims them without writing back
    try:
        proc = subprocess.run([sys.executable, "-c", PAGE_OUT, str(library), str(weights)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    finally:
        if folder != tmp_path:
            shutil.rmtree(folder)
    assert proc.returncode == 0, proc.stderr
    rss = json.loads(proc.stdout.splitlines()[-1])
    assert rss["before"][str(library)] >= 4096 and rss["before"][str(weights)] >= 4096, rss
    assert rss["after"][str(library)] < rss["before"][str(library)] / 4, rss
    assert rss["after"][str(weights)] == rss["before"][str(weights)], rss


def in_memory_filesystem(path: Path) -> bool:
    """Whether ``path`` lies on tmpfs or ramfs, whose pages the kernel cannot reclaim without swap."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and str(path).startswith(fields[1].rstrip("/") + "/") and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind in ("tmpfs", "ramfs")


def kernel_pages_out() -> bool:
    """Whether madvise accepts MADV_PAGEOUT here (EINVAL on kernels before 5.4)."""
    area = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        area.madvise(MADV_PAGEOUT)
        return True
    except OSError:
        return False
    finally:
        area.close()
