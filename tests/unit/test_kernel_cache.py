"""The compiled CPU kernels' cache when a home directory is shared by machines of different
CPUs: a library built for another CPU is never loaded (it could die with SIGILL here)."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu
from kernels.cpu import library
from kernels.settings import settings
from tests.support.waiting import wait_for

COMPILER = shutil.which("cc") or shutil.which("gcc")
REPO = Path(__file__).resolve().parents[2]
# gcc's switch for each extension ISA_FLAGS names.
GCC_SWITCH = {
    "avx512_fp16": "-mavx512fp16", "avx512_bf16": "-mavx512bf16", "avx_vnni": "-mavxvnni",
    "avx512_vnni": "-mavx512vnni", "avx512vl": "-mavx512vl", "avx512dq": "-mavx512dq",
    "avx512bw": "-mavx512bw", "avx512f": "-mavx512f",
}

pytestmark = pytest.mark.skipif(COMPILER is None or library.cpu_flags() is None, reason="needs cc and /proc/cpuinfo")


def _reported(path: Path, tmp_path: Path) -> list[str]:
    """missing_extensions of the library at ``path``, loaded from a copy (a fresh name:
    the dynamic loader hands back an already loaded library for a name it knows)."""
    copy = tmp_path / f"check-{len(list(tmp_path.glob('check-*')))}.so"
    shutil.copy(path, copy)
    return library.missing_extensions(ctypes.CDLL(str(copy)))


def test_the_cache_key_follows_the_cpu() -> None:
    flags = [*cpu.FLAGS, *cpu.OPENMP_VARIANTS[0]]
    here = library.native_target(COMPILER)
    assert "march=" in here or "target-cpu" in here  # gcc's or clang's expansion of -march=native
    assert library.native_target(COMPILER) == here  # stable: no temporary names in it
    assert cpu.LIBRARY.path(COMPILER, flags, here) != cpu.LIBRARY.path(COMPILER, flags, here + " -mno-avx2")


def test_a_cached_library_that_needs_an_extension_this_cpu_lacks_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    flags_here = library.cpu_flags() or set()
    lacking = next((f for f in library.ISA_FLAGS if f in GCC_SWITCH and f not in flags_here), None)
    if lacking is None:
        pytest.skip("this CPU has every extension the forged library could claim")
    monkeypatch.setattr(settings, "cache_dir", tmp_path / "cache")
    flags = [*cpu.FLAGS, *cpu.OPENMP_VARIANTS[0]]
    # The kernels' own library class over one of its sources, the one that reports the build's
    # extensions: the whole library (its products above all) takes the compiler a minute here.
    kernels = library.NativeLibrary("cpu_kernels", [cpu.ISA_SOURCE], cpu.FLAGS, cpu.OPENMP_VARIANTS, cpu.HEADERS)
    target = kernels.path(COMPILER, flags, library.native_target(COMPILER))
    target.parent.mkdir(parents=True)
    # The forged entry: this very source, built for a CPU with one more extension, stored
    # where this machine looks for its own build.
    subprocess.run(
        [COMPILER, *flags, GCC_SWITCH[lacking], "-o", str(target), str(cpu.ISA_SOURCE), "-lm"], check=True
    )
    assert _reported(target, tmp_path) == [lacking]

    with caplog.at_level(logging.WARNING, logger="ringllm.kernels"):
        lib = kernels.open(COMPILER, flags)
    assert library.missing_extensions(lib) == []
    assert _reported(target, tmp_path) == []  # the entry now holds this CPU's build
    assert f"uses {lacking}, which this CPU lacks: rebuilding it" in caplog.text
    # no temporary left behind: the build and the lock that kept other processes from building it too
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, target.with_suffix(".lock").name])


TINY_FLAGS = ["-O1", "-shared", "-fPIC", "-fvisibility=hidden"]
# A process loading a library of built_isa.c alone from a cache folder: what it reports on stdout,
# its log on stderr.
LOAD_TINY = f"""
import logging, sys
from pathlib import Path
from kernels.cpu import library
from kernels.settings import settings
logging.basicConfig(level=logging.INFO)
settings.cache_dir = Path(sys.argv[2])
print(library.NativeLibrary("tiny", [Path(sys.argv[1])], {TINY_FLAGS!r}, [[]]).load().built_isa())
"""


def _waiters(lock: Path) -> int:
    """Processes blocked in flock on ``lock`` (/proc/locks marks a waiter "->")."""
    inode = f":{os.stat(lock).st_ino} "
    return sum("->" in line and inode in line + " " for line in Path("/proc/locks").read_text().splitlines())


def test_processes_that_miss_the_cache_together_build_the_library_once(tmp_path: Path) -> None:
    """Two processes needing a library nobody has built yet (the engines of a -dp 2 server
    on a fresh machine): one compiles, the other waits for it and loads its build."""
    source, cache = cpu.ISA_SOURCE, tmp_path / "cache"
    tiny = library.NativeLibrary("tiny", [source], TINY_FLAGS, [[]])
    target = tiny.path(COMPILER, TINY_FLAGS, library.native_target(COMPILER)).relative_to(settings.cache_dir)
    lock = (cache / target).with_suffix(".lock")
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:  # both processes arrive while the lock is taken: a true tie
        fcntl.flock(held, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-c", LOAD_TINY, str(source), str(cache)], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        wait_for(lambda: _waiters(lock) == 2, "both processes to wait for the build lock")
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [out for out, _ in outputs] == ["0\n", "0\n"], outputs  # built for plain x86-64: no extension
    assert sum(err.count("compiling tiny") for _, err in outputs) == 1, outputs
    assert sorted(p.name for p in lock.parent.iterdir()) == sorted([lock.name, target.name])


def test_the_ctypes_signatures_come_from_the_c_prototypes() -> None:
    """Each exported kernel is declared once, in C: its prototype types the ctypes call."""
    declared = library.declared_functions(cpu.SOURCE.read_text())
    assert {"rms_norm", "paged_decode_attention", "paged_prefill_attention", "padded_keys"} <= set(declared)
    assert library.declared_functions(cpu.ISA_SOURCE.read_text()) == {"built_isa": (ctypes.c_uint64, [])}
    assert declared["silu_mul"] == (None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p])
    assert declared["padded_keys"] == (ctypes.c_int64, [ctypes.c_int64])
    lib = cpu.load()
    assert lib is not None and lib.paged_prefill_attention.argtypes[13] is ctypes.c_float  # scale (after the window)
    assert [cpu.padded_keys(n) for n in (1, 8, 9)] == [8, 8, 16]
    with pytest.raises(AttributeError):  # nothing but the API is exported
        lib.rms_norm_row
