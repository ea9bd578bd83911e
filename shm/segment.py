"""Named shared-memory segments: what the rings and the tensor pools are made of.

A segment is a file in /dev/shm (the temp dir where there is none) with a
random name under our prefix and mode 0600, mapped by both processes. The
creator writes a magic number and the payload capacity into two 8-byte words
of the header, at ``meta`` bytes; ``attach`` checks both, so a wrong or truncated name fails
loudly instead of mapping garbage. Names are unlinked as soon as the peer
has attached, so nothing is left behind whichever process dies.
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
NAME_PREFIX = "ringllm-"


def create_segment(prefix: str, header: int, capacity: int, magic: int, meta: int = 0) -> tuple[str, mmap.mmap]:
    """A new mapped segment of ``header + capacity`` bytes, stamped with magic and capacity."""
    while True:
        name = prefix + secrets.token_hex(8)
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            continue
        break
    try:
        os.ftruncate(fd, header + capacity)
        mm = mmap.mmap(fd, header + capacity)
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise
    os.close(fd)
    with memoryview(mm) as raw, raw[meta : meta + 16].cast("Q") as words:
        words[0] = magic
        words[1] = capacity
    return name, mm


def attach_segment(
    name: str, prefix: str, header: int, magic: int, what: str, meta: int = 0
) -> tuple[mmap.mmap, int]:
    """Map a segment made by ``create_segment``; returns the mapping and its capacity."""
    if not name.startswith(prefix) or "/" in name:
        raise ValueError(f"not a {what} segment name: {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < header:
            raise ValueError(f"segment {name} is too small ({size} bytes)")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    with memoryview(mm) as raw, raw[meta : meta + 16].cast("Q") as words:
        found, capacity = words[0], words[1]
    if found != magic or size != header + capacity:
        mm.close()
        raise ValueError(f"segment {name} is not a {what}")
    return mm, capacity


def unlink_segment(name: str) -> None:
    """Remove a segment's name; existing mappings stay valid."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
