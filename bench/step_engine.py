"""The in-process engine that ``bench sampling`` and ``bench structured`` time steps of."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.engine_core import EngineCore

MAX_MODEL_LEN = 512


def stories_engine(max_num_seqs: int, torch_threads: int | None = None) -> EngineCore:
    """An EngineCore on the embedded stories260K, no prefix caching (every case computes its own
    prompts), seeded; torch's intra-op threads set first when given."""
    import torch

    from core.config import EngineArgs
    from core.engine_core import EngineCore
    from core.models.default_model import default_model_dir

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    config = EngineArgs(
        model=default_model_dir(), max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN, seed=0,
        enable_prefix_caching=False,
    ).resolve()
    return EngineCore(config)
