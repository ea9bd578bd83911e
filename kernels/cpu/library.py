"""C sources built on first use for this very CPU, cached per CPU, and typed from their own prototypes.

A library is compiled with the machine's C compiler (``cc``, or ``$CC``) for
this CPU (``-march=native``) into ``kernels.settings``' cache directory,
once per source version and CPU (tens of seconds on a small machine: the quantized products'
specialised kernels are most of it). A cache may be shared by machines of different
CPUs (a home directory on NFS, an image built elsewhere), and a library
built for another CPU may use instructions this one lacks (SIGILL). So the
cache is keyed by the sources, the flags and what ``-march=native`` means to
the compiler here (the CPU model and each extension on or off), and a
library is used only if the extensions it was built with (its
``built_isa()``) are all in the CPU's flags; one that is not is rebuilt.

The exported functions are those the sources mark ``API``; their prototypes
are parsed to type the ctypes calls, so a signature is written once, in C.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kernels.settings import settings

logger = logging.getLogger("ringllm.kernels")

# The extensions built_isa() reports, bit k for ISA_FLAGS[k], named as /proc/cpuinfo names them.
ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni",
    "avx_vnni", "avx512_bf16", "avx512_fp16",
)
_C_TYPES = {
    "void": None, "float": ctypes.c_float, "double": ctypes.c_double, "int": ctypes.c_int,
    "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
}
# "API <attributes> <return type> <name>(<parameters>) {" at the start of a line
_PROTOTYPE = re.compile(r"^API\b(?:\s+__attribute__\(\([^;{}\n]*?\)\))*\s+(\w+)\s+(\w+)\s*\(([^)]*)\)\s*\{", re.M)


def declared_functions(source: str) -> dict[str, tuple[type | None, list[type]]]:
    """name -> (restype, argtypes) of every function ``source`` marks API; any pointer
    is a void pointer (callers pass addresses), other types must be in _C_TYPES."""
    functions = {}
    for ret, name, params in _PROTOTYPE.findall(source):
        argtypes: list[type] = []
        for param in params.split(","):
            param = " ".join(param.split())
            if param in ("", "void"):
                continue
            if "*" in param:
                argtypes.append(ctypes.c_void_p)
                continue
            base = param.replace("const ", "").rsplit(" ", 1)[0]
            if base not in _C_TYPES or _C_TYPES[base] is None:
                raise ValueError(f"{name}: parameter type {base!r} has no ctypes mapping")
            argtypes.append(_C_TYPES[base])  # type: ignore[arg-type]
        if ret not in _C_TYPES:
            raise ValueError(f"{name}: return type {ret!r} has no ctypes mapping")
        functions[name] = (_C_TYPES[ret], argtypes)
    return functions


def native_target(compiler: str) -> str:
    """What ``-march=native`` expands to for this compiler on this CPU (the CPU model,
    each extension on or off, cache sizes): the part of the cache key that differs
    between machines. Paths (temporary files) are left out, so it is stable."""
    probe = subprocess.run(
        [compiler, "-march=native", "-###", "-x", "c", "-c", os.devnull, "-o", os.devnull],
        capture_output=True, text=True,
    )
    return " ".join(token for token in probe.stderr.split() if "/" not in token)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags as the kernel reports them; None where /proc/cpuinfo has none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def missing_extensions(lib: ctypes.CDLL) -> list[str]:
    """The extensions ``lib`` was built to use that this CPU lacks (none where unknown)."""
    flags = cpu_flags()
    if flags is None:
        return []
    try:
        report = lib.built_isa
    except AttributeError:  # not one of our libraries
        return ["extensions it does not report"]
    report.argtypes, report.restype = [], ctypes.c_uint64
    built = report()
    return [name for k, name in enumerate(ISA_FLAGS) if built >> k & 1 and name not in flags]


def _run_side_by_side(commands: list[list[str]], at_once: int) -> None:
    """Run ``commands``, up to ``at_once`` at a time; CalledProcessError (with the compiler's
    messages) for the first that fails."""
    with ThreadPoolExecutor(max_workers=max(at_once, 1)) as pool:
        runs = [pool.submit(subprocess.run, c, check=True, capture_output=True, text=True) for c in commands]
        for run in runs:
            run.result()


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


class NativeLibrary:
    """``sources`` compiled into one shared library, tried with each of ``variants``
    (extra flags) in order; ``load()`` returns it typed, or None where it cannot be built."""

    def __init__(self, name: str, sources: Sequence[Path], flags: Sequence[str], variants: Sequence[Sequence[str]],
                 headers: Sequence[Path] = ()) -> None:
        self.name = name
        self.sources = list(sources)
        self.headers = list(headers)  # included by the sources: part of the cache key
        self.flags = list(flags)
        self.variants = [list(v) for v in variants]
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self.cached: Path | None = None  # the loaded library's file in the cache (a fresh build loads by another name)

    def path(self, compiler: str, flags: Sequence[str], target: str) -> Path:
        """Where the library for these sources, compiler, flags and CPU target is cached."""
        digest = hashlib.sha256()
        for source in [*self.sources, *self.headers]:
            digest.update(source.read_bytes())
        digest.update("\0".join([compiler, *flags, target]).encode())
        return Path(settings.cache_dir) / "kernels" / f"{self.name}-{digest.hexdigest()[:16]}.so"

    def _compile(self, compiler: str, flags: Sequence[str], target: Path) -> Path:
        """Compile to a private name next to ``target`` (concurrent first starts never load a
        half-written file); returns that name, which the caller renames. The sources are
        compiled side by side, one compiler per core, then linked."""
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            with tempfile.TemporaryDirectory(dir=target.parent) as objects:
                outputs = [os.path.join(objects, f"{i}.o") for i in range(len(self.sources))]
                jobs = [[compiler, *flags, "-c", str(source), "-o", out] for source, out in zip(self.sources, outputs)]
                _run_side_by_side(jobs, os.cpu_count() or 1)
                subprocess.run([compiler, *flags, "-o", tmp, *outputs, "-lm"], check=True, capture_output=True,
                               text=True)
        except BaseException:
            os.unlink(tmp)
            raise
        return Path(tmp)

    def open(self, compiler: str, flags: Sequence[str]) -> ctypes.CDLL:
        """The library for these flags: from the cache if it was built for this CPU, else built now.
        Processes that miss the cache together (engines of one server, servers started side by
        side) build it once: the others wait on a lock beside it, then load what it built."""
        target = self.path(compiler, flags, native_target(compiler))
        if target.exists() and not missing_extensions(lib := ctypes.CDLL(str(target))):
            self.cached = target
            return lib  # the usual path: no lock, so a read-only cache serves too
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lib = self._open_or_build(compiler, flags, target)
        self.cached = target
        return lib

    def _open_or_build(self, compiler: str, flags: Sequence[str], target: Path) -> ctypes.CDLL:
        if target.exists():  # built while this process waited, or built for another CPU
            lib = ctypes.CDLL(str(target))
            missing = missing_extensions(lib)
            if not missing:
                return lib
            logger.warning("the cached %s %s uses %s, which this CPU lacks: rebuilding it",
                           self.name, target, ", ".join(missing))
        logger.info("compiling %s for this CPU (once per version of its sources)", self.name)
        fresh = self._compile(compiler, flags, target)
        try:
            lib = ctypes.CDLL(str(fresh))  # by its fresh name: the loader would hand back a library of the old one
            missing = missing_extensions(lib)
            if missing:
                raise OSError(f"the compiler built {self.name} using {', '.join(missing)}, which this CPU lacks")
            os.replace(fresh, target)
        finally:
            if fresh.exists():
                fresh.unlink()
        return lib

    def load(self) -> ctypes.CDLL | None:
        """The library, built on first use and typed; None where it cannot be built."""
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            self._tried = True
            compiler = find_compiler()
            if compiler is None:
                logger.warning("no C compiler found: %s is not available (torch kernels instead, slower)", self.name)
                return None
            lib, detail = None, None
            for variant in self.variants:
                try:
                    lib = self.open(compiler, [*self.flags, *variant])
                    break
                except (OSError, subprocess.CalledProcessError) as exc:
                    detail = getattr(exc, "stderr", "") or exc
            if lib is None:
                logger.warning("could not build %s, using torch kernels instead: %s", self.name, detail)
                return None
            declared = {}
            for source in self.sources:
                declared.update(declared_functions(source.read_text()))
            for name, (restype, argtypes) in declared.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
            logger.info("%s ready", self.name)
            self._lib = lib
            return lib
