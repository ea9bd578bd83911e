"""Token sampling for a batch of rows with per-row parameters.

Greedy rows take the argmax. Other rows are scaled by temperature, cut to
their top-k and top-p (nucleus), and sampled with the "exponential race"
(argmax of p / E with E ~ Exp(1)), which draws exactly from p and lets each
seeded row draw its noise from its own generator while the unseeded rows
share one batched draw from torch's global generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from core.protocol import SamplingParams

_GREEDY_EPS = 1e-5


class RowState(Protocol):
    """What the sampler needs from a request's row in the persistent batch."""

    params: SamplingParams
    generator: torch.Generator | None


@dataclass
class SamplingMetadata:
    """Per-row parameters as tensors, plus flags that let common batches skip work."""

    temperature: torch.Tensor  # [N] float32; rows with < _GREEDY_EPS are greedy
    top_k: torch.Tensor  # [N] int64; >= vocab means no cut
    top_p: torch.Tensor  # [N] float32; 1.0 means no cut
    generators: list[torch.Generator | None]
    greedy: list[bool]
    all_greedy: bool
    no_top_k: bool
    no_top_p: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SamplingMetadata:
        """Build from SamplingParams; ``generators[i]`` (if any) makes row i reproducible."""
        gens = list(generators) if generators is not None else [None] * len(params)
        greedy = [p.temperature < _GREEDY_EPS or p.top_k == 1 for p in params]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            top_k=torch.tensor([k if k > 0 else 2**62 for k in top_k], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            generators=gens,
            greedy=greedy,
            all_greedy=all(greedy),
            no_top_k=all(k == 0 for k in top_k),
            no_top_p=all(p.top_p >= 1.0 for p in params),
        )

    @classmethod
    def from_rows(cls, rows: Sequence[RowState]) -> SamplingMetadata:
        return cls.from_params([r.params for r in rows], [r.generator for r in rows])


class Sampler:
    """``Sampler()(logits [N, V] float32, metadata) -> token ids LongTensor [N]``."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy_ids
        device = logits.device
        logits = logits / to_device(metadata.temperature, device)[:, None]
        if not (metadata.no_top_k and metadata.no_top_p):
            logits = apply_top_k_top_p(logits, to_device(metadata.top_k, device), to_device(metadata.top_p, device))
        probs = logits.softmax(dim=-1)
        sampled = (probs / exponential_noise(probs, metadata.generators)).argmax(dim=-1)
        greedy = to_device(torch.tensor(metadata.greedy), device)
        return torch.where(greedy, greedy_ids, sampled)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait for the GPU.

    A plain ``.to("cuda")`` from pageable memory synchronises the stream,
    which would stall the host until the forward pass it just enqueued has
    run; a pinned copy with ``non_blocking`` is only enqueued.
    """
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its nucleus.

    The nucleus is the smallest set of most likely tokens (after top-k) whose
    probability reaches top_p; the most likely token is always kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def exponential_noise(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like probs; row i comes from generators[i] when set."""
    noise = torch.empty_like(probs)
    if any(gen is None for gen in generators):
        noise.exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            row = torch.empty(probs.shape[-1], dtype=probs.dtype, device=gen.device)
            noise[i] = to_device(row.exponential_(generator=gen), probs.device)
    return noise
