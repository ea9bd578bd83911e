"""core/heap.py: start-up's freed C memory goes back to the system (a real tokenizer, a real process)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.launcher import REPO
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
