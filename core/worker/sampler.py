"""Token sampling for a batch of rows with per-row parameters, in vLLM V1's order.

1. logprobs of the raw logits, for the rows that asked (``raw_logprobs`` mode);
2. logit bias, allowed token ids and banned tokens (bad words, and stop
   tokens before ``min_tokens``), as one additive bias row per request plus
   a list of (row, token) cells set to -inf;
3. penalties: repetition (prompt and output tokens; positive logits divided,
   negative ones multiplied, as Hugging Face defines it), then frequency and
   presence (output tokens; OpenAI's definition);
4. greedy rows take the argmax here;
5. the others are divided by their temperature, cut by min_p (tokens less
   likely than min_p times the most likely one), top-k and top-p, and sampled
   with the "exponential race" (argmax of p / E with E ~ Exp(1)), which draws
   exactly from p and lets each seeded row draw its noise from its own
   generator while unseeded rows share one batched draw;
6. logprobs of the final distribution, for ``processed_logprobs`` mode.

Every optional stage is skipped when no row of the batch uses it, so a batch
of plain requests costs what it did before these existed. A row's result
depends only on its own parameters and history, never on its neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.worker.logprobs import LogprobsTensors, gather_logprobs

_GREEDY_EPS = 1e-5
NO_TOP_K = 2**62


@dataclass
class Penalties:
    """The penalised rows' penalties for one step, already folded from their history.

    A logit x becomes ``x * factor + max(x, 0) * correction + offset``:
    ``factor`` is the repetition penalty r on tokens of the prompt or the
    output (1 elsewhere) and ``correction`` is 1/r - r there, so a positive
    logit is divided by r and any other multiplied by it (Hugging Face's
    definition) with arithmetic alone: on a CPU a comparison or a select
    over the logits costs several times a multiply-add. ``offset`` is minus
    frequency times the token's count in the output, minus presence for
    tokens in the output.
    """

    rows: torch.Tensor | None  # [M] logits rows; None: every row
    factor: torch.Tensor  # [M, V] float32
    correction: torch.Tensor  # [M, V] float32
    offset: torch.Tensor  # [M, V] float32


@dataclass
class SamplingMetadata:
    """One step's per-row parameters as tensors on the logits' device (built by
    ``core.worker.sampling_batch``); optional stages are None when unused."""

    temperature: torch.Tensor  # [N] float32; 1.0 on greedy rows
    top_k: torch.Tensor  # [N] int64; NO_TOP_K means no cut
    top_p: torch.Tensor  # [N] float32; 1.0 means no cut
    greedy: torch.Tensor  # [N] bool
    generators: Sequence[torch.Generator | None]
    all_greedy: bool
    no_top_k: bool
    no_top_p: bool
    min_p: torch.Tensor | None = None  # [N] float32
    bias_rows: torch.Tensor | None = None  # [M] logits rows with a bias row
    bias: torch.Tensor | None = None  # [M, V] float32, added to those rows
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    penalties: Penalties | None = None
    logprob_rows: torch.Tensor | None = None  # [L] rows that want logprobs
    num_logprobs: int = 0  # alternatives computed for each of them (the largest asked)
    processed_logprobs: bool = False  # of the distribution sampled from, not the raw logits



@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None  # rows of ``SamplingMetadata.logprob_rows``, in that order


@dataclass
class TargetDistribution:
    """What each row samples from, once every constraint is applied.

    ``logits`` are the raw ones with bias, bans and penalties; greedy rows take
    their ``argmax``. The other rows are then scaled by temperature and cut by
    min_p, top-k and top-p (``scaled``), and ``probs`` is their softmax: both
    None when every row is greedy.
    """

    logits: torch.Tensor
    argmax: torch.Tensor
    scaled: torch.Tensor | None
    probs: torch.Tensor | None

    def described(self, raw: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The logits returned logprobs describe: the raw ones, or (processed_logprobs)
        those of the distribution sampled from."""
        if not md.processed_logprobs:
            return raw
        if self.scaled is None:
            return self.logits
        return torch.where(md.greedy[:, None], self.logits, self.scaled)


def target_distribution(logits: torch.Tensor, md: SamplingMetadata) -> TargetDistribution:
    """Stages 2-5 of the module doc up to the draw, out of place (``logits`` is left unchanged)."""
    if md.bias is not None:
        logits = logits.index_add(0, md.bias_rows, md.bias)
    if md.banned is not None:
        logits = logits.index_put(md.banned, torch.tensor(float("-inf"), device=logits.device))
    if md.penalties is not None:
        logits = apply_penalties(logits, md.penalties)
    argmax = logits.argmax(dim=-1)
    if md.all_greedy:
        return TargetDistribution(logits, argmax, None, None)
    scaled = logits / md.temperature[:, None]
    if md.min_p is not None:
        scaled = apply_min_p(scaled, md.min_p)
    if not (md.no_top_k and md.no_top_p):
        scaled = apply_top_k_top_p(scaled, md.top_k, md.top_p)
    return TargetDistribution(logits, argmax, scaled, scaled.softmax(dim=-1))


class Sampler:
    """``Sampler()(logits [N, V] float32, metadata) -> SamplerOutput``; ``logits`` is left unchanged."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        target = target_distribution(logits, md)
        token_ids = target.argmax
        if target.probs is not None:
            probs = target.probs
            sampled = (probs / exponential_noise(probs, md.generators)).argmax(dim=-1)
            token_ids = torch.where(md.greedy, token_ids, sampled)
        if md.logprob_rows is None:
            return SamplerOutput(token_ids, None)
        sampled_ids = _take_rows(token_ids, md.logprob_rows)
        described = target.described(logits, md)
        return SamplerOutput(
            token_ids, gather_logprobs(_take_rows(described, md.logprob_rows), sampled_ids, md.num_logprobs)
        )


def _take_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return tensor if rows.shape[0] == tensor.shape[0] else tensor[rows]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Penalised logits (a new tensor), as ``Penalties`` describes."""

    def penalise(x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(p.offset, x, p.factor).addcmul_(torch.relu(x), p.correction)

    if p.rows is None:
        return penalise(logits)
    return logits.index_copy(0, p.rows, penalise(logits[p.rows]))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """-inf for tokens whose probability is below min_p times the row's largest."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


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


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait for the GPU.

    A plain ``.to("cuda")`` from pageable memory synchronises the stream,
    which would stall the host until the forward pass it just enqueued has
    run; a pinned copy with ``non_blocking`` is only enqueued.
    """
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
