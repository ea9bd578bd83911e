"""Both ends of one out-of-band tensor pool, in one process."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from shm.tensors import TensorPool, TensorPoolReader, TensorPoolWriter


@contextlib.contextmanager
def tensor_pool_pair(capacity: int) -> Iterator[tuple[TensorPoolWriter, TensorPoolReader]]:
    """A producer's and a consumer's view of one pool, as two processes would hold them."""
    pool = TensorPool.create(capacity)
    peer = TensorPool.attach(pool.name)
    pool.unlink()
    try:
        yield TensorPoolWriter(pool), TensorPoolReader(peer)
    finally:
        gc.collect()
        peer.close()
        pool.close()
