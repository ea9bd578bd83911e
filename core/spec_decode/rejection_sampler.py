"""Verification of draft tokens against the target model (speculative decoding).

A request that verifies K drafts d_0..d_{K-1} has K+1 logits rows: row j is
the target's distribution p_j for the token after d_{j-1} (row 0: after the
request's last known token), with every sampling constraint applied as for a
normal step (``core.worker.sampler.target_distribution``). Drafts are checked
in order and the first rejected one ends the run:

- greedy rows accept d_j while it is the argmax of p_j, and emit the argmax
  at the first mismatch: exactly the tokens decoding one at a time gives;
- random rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) and,
  at the first rejection, draw from the residual max(p_j - q_j, 0),
  renormalised: the rule of Leviathan et al. and Chen et al., under which the
  tokens emitted are distributed exactly as p, step by step. q_j is the
  distribution the draft was drawn from: a draft model's, or for n-gram
  drafts a point mass at d_j (accept with probability p_j(d_j), resample
  from p_j without d_j).

When all K drafts are accepted the last row gives one more token (the bonus
token), so a verification emits between 1 and K+1 tokens. A seeded request
draws its uniforms and its final token from its own generator, so its output
is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.worker.sampler import SamplingMetadata, TargetDistribution, exponential_noise


@dataclass
class VerifiedTokens:
    """Per request (in sampling order) the tokens emitted, and the logits row of each
    of them (``rows``, flat, request after request): the row it was sampled from."""

    token_ids: list[list[int]]
    rows: np.ndarray


def rejection_sample(
    target: TargetDistribution, md: SamplingMetadata, starts: np.ndarray, num_drafts: np.ndarray,
    draft_ids: np.ndarray, draft_probs: torch.Tensor | None = None,
) -> VerifiedTokens:
    """Verify every request's drafts.

    Request i owns logits rows ``starts[i] .. starts[i] + num_drafts[i]``; row
    ``starts[i] + j`` checks the draft ``draft_ids[starts[i] + j]`` (the last row
    of each request checks none: -1). A request without drafts is sampled as
    the sampler would (its one row is its bonus row). ``draft_probs`` [rows, vocab] holds
    q of each draft row whose draft was drawn from a distribution; a row of zeros (or
    None for all) means a point mass at its draft.
    """
    greedy = md.greedy.cpu().numpy()
    argmax = target.argmax.cpu().numpy()
    is_draft = draft_ids >= 0
    accepted = np.zeros(draft_ids.size, np.bool_)
    greedy_drafts = is_draft & greedy
    accepted[greedy_drafts] = argmax[greedy_drafts] == draft_ids[greedy_drafts]
    random_drafts = np.flatnonzero(is_draft & ~greedy)
    if random_drafts.size:
        assert target.probs is not None
        rows_t, ids_t = torch.from_numpy(random_drafts), torch.from_numpy(draft_ids[random_drafts])
        ratio = target.probs[rows_t, ids_t]
        if draft_probs is not None:
            q = draft_probs[rows_t, ids_t]
            ratio = torch.where(q > 0, ratio / q.clamp_min(1e-30), ratio)
        uniforms = _uniforms(md, random_drafts, starts, num_drafts)
        accepted[random_drafts] = (uniforms < ratio.cpu()).numpy()

    num_accepted = np.empty(starts.size, np.int64)
    for i, (start, k) in enumerate(zip(starts.tolist(), num_drafts.tolist())):
        run = accepted[start : start + k]
        num_accepted[i] = k if run.all() else int(run.argmin())
    final_rows = starts + num_accepted
    final = argmax[final_rows]
    random_final = np.flatnonzero(~greedy[final_rows])
    if random_final.size:
        assert target.probs is not None
        rows = final_rows[random_final]
        probs = target.probs[torch.from_numpy(rows)]
        rejected = np.flatnonzero(num_accepted[random_final] < num_drafts[random_final])
        if rejected.size:  # the residual (the race needs no renormalising)
            at = torch.from_numpy(rejected)
            q = None if draft_probs is None else draft_probs[torch.from_numpy(rows[rejected])]
            point = torch.ones(rejected.size, dtype=torch.bool) if q is None else q.sum(-1) == 0
            if q is not None:
                probs[at] = (probs[at] - q).clamp_min(0.0)
            mass = at[point.cpu()]
            if mass.numel():  # point masses: the rejected draft taken out
                probs[mass, torch.from_numpy(draft_ids[rows[mass.numpy()]])] = 0.0
        generators = [md.generators[r] for r in rows.tolist()]
        final[random_final] = (probs / exponential_noise(probs, generators)).argmax(dim=-1).cpu().numpy()

    token_ids: list[list[int]] = []
    out_rows: list[int] = []
    for start, a, last in zip(starts.tolist(), num_accepted.tolist(), final.tolist()):
        token_ids.append([*draft_ids[start : start + a].tolist(), last])
        out_rows.extend(range(start, start + a + 1))
    return VerifiedTokens(token_ids, np.asarray(out_rows, np.int64))


def _uniforms(md: SamplingMetadata, rows: np.ndarray, starts: np.ndarray, num_drafts: np.ndarray) -> torch.Tensor:
    """U[0, 1) for each of ``rows`` (draft rows of random requests): a seeded request's
    from its generator, in draft order; the others' from one batched draw."""
    uniforms = torch.rand(rows.size)
    seeded = [k for k, row in enumerate(rows.tolist()) if md.generators[row] is not None]
    if seeded:
        owner = np.searchsorted(starts, rows, side="right") - 1  # the request of each row
        for i in np.unique(owner[seeded]).tolist():
            mine = np.flatnonzero(owner == i)
            generator = md.generators[int(rows[mine[0]])]
            draws = torch.rand(int(num_drafts[i]), generator=generator, device=generator.device)
            uniforms[torch.from_numpy(mine)] = draws[: mine.size].cpu()
    return uniforms
