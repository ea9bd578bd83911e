"""The runner's speculative decoding: drafts after each step, their verification in the next.

After a step the speculator asks its proposer for drafts for the requests that
just sampled (none while the batch is as large as ``disable_by_batch_size``,
or while the gate finds that they cost more than they save) and holds them
until the engine takes them for the scheduler. A request the scheduler gives
k of them verifies them in its next step: it has k + 1 logits rows, which are
sampled under the request's constraints and handed to the rejection sampler;
the tokens it emits are appended to the persistent batch. Each request's
budget for the next step follows how its last verification went.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from core import envs
from core.config import EngineConfig
from core.protocol import LogprobsArrays
from core.sched.output import DraftTokenIds, ModelRunnerOutput, NewRequestData, SchedulerOutput
from core.spec_decode.draft_proposer import DraftModelProposer
from core.spec_decode.ngram_proposer import NgramProposer
from core.spec_decode.proposer import Proposer
from core.spec_decode.rejection_sampler import VerifiedTokens, rejection_sample
from core.spec_decode.spec_gate import SpeculationGate
from core.worker.input_batch import InputBatch
from core.worker.logprobs import gather_logprobs
from core.worker.prompt_logprobs import PromptLogprobs
from core.worker.sampler import SamplingMetadata, target_distribution
from core.worker.staging import Staged, Stager, apply_grammar, force_tokens


class Speculator:
    """What the runner holds when speculation is on (None when it is off)."""

    def __init__(
        self, config: EngineConfig, device: torch.device, dtype: torch.dtype, stager: Stager,
        prompt_logprobs: PromptLogprobs,
    ) -> None:
        speculative = config.speculative_config
        assert speculative is not None
        self.config, self.device, self.dtype = config, device, dtype
        self.stager = stager
        self.batch: InputBatch = stager.batch
        self.prompt_logprobs = prompt_logprobs
        self.k = speculative.num_speculative_tokens
        # n-gram lookup now; a draft model with the KV cache, whose size it follows (start_proposer).
        self.proposer: Proposer | None = NgramProposer(speculative) if speculative.method == "ngram" else None
        self.pause_batch_size = speculative.disable_by_batch_size or 2**31
        self.gate = SpeculationGate(enabled=envs.RINGLLM_SPEC_DECODE_GATE)
        self._drafts: DraftTokenIds | None = None  # proposed after the last step, until taken
        # Drafts a request may be given next: one after a verification that accepted none
        # (its drafts are not to be trusted), k after one that accepted any.
        self._budget: dict[str, int] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}  # a draft model's q of each request's drafts
        self._proposal_seconds = 0.0  # what proposing the drafts of the next step cost

    def start_proposer(self, num_target_blocks: int) -> None:
        """The draft model, once the target's KV cache has its size (kept across sleeps)."""
        if self.proposer is None:
            self.proposer = DraftModelProposer(self.config, self.device, self.dtype, num_target_blocks)

    # ------------------------------------------------------------ requests

    def add_request(self, new: NewRequestData) -> None:
        """Nothing until the request samples: its first drafts come after that step."""

    def forget(self, req_id: str) -> None:
        self._budget.pop(req_id, None)
        self._draft_probs.pop(req_id, None)
        if self.proposer is not None:
            self.proposer.forget(req_id)

    def reset(self, req_id: str) -> None:
        """A preempted request is drafted for afresh when it is back: as if it had finished."""
        self.forget(req_id)

    # --------------------------------------------------------------- steps

    def verify(
        self, so: SchedulerOutput, staged: Staged, sample_rows: np.ndarray, logits: torch.Tensor
    ) -> ModelRunnerOutput:
        """Sample a step in which some requests verify drafts: each request's logits rows
        (one, or one per draft and one more) under its constraints, then the rejection
        sampler; the tokens it emits are appended and reported, a list per request."""
        assert staged.num_drafts is not None
        batch = self.batch
        sampling = batch.sampling
        num_rows = staged.num_drafts + 1
        starts, drafts_before = self.stager.segments(num_rows)
        logits_rows = np.repeat(sample_rows, num_rows)  # each logits row's batch row
        if so.grammar_bitmask is not None:  # a row per logits row of the requests under a grammar
            apply_grammar(so, staged, logits, starts)
        if so.forced_token_ids:  # rows whose token a reasoning budget forces
            force_tokens(so, staged, logits, starts)
        md = sampling.metadata(logits_rows, batch.num_tokens, batch.token_ids, drafts_before)
        target = target_distribution(logits, md)
        # The draft each row checks: the token after the ones it follows (-1 on the last row).
        draft_ids = batch.token_ids[logits_rows, batch.num_tokens[logits_rows] + drafts_before]
        draft_ids[starts + staged.num_drafts] = -1
        verified = rejection_sample(
            target, md, starts, staged.num_drafts, draft_ids, self._draft_probs_rows(staged, starts, logits)
        )

        sampled: list[list[int]] = [[] for _ in staged.req_ids]
        longest = 0
        for i, row, tokens, drafts in zip(
            staged.sample.tolist(), sample_rows.tolist(), verified.token_ids, staged.num_drafts.tolist()
        ):
            for tok in tokens:
                batch.append_token(row, tok)
            sampled[i] = tokens
            longest = max(longest, len(tokens))
            if drafts:
                self._budget[staged.req_ids[i]] = self.k if len(tokens) > 1 else 1
        lengths = np.fromiter(map(len, verified.token_ids), np.int64, len(verified.token_ids))
        if sampling.num_rows_with["penalties"]:
            for k in range(longest):  # penalties fold the emitted tokens in order
                emitted = np.flatnonzero(lengths > k)
                sampling.record_sampled(
                    sample_rows[emitted],
                    torch.tensor([verified.token_ids[e][k] for e in emitted.tolist()], device=logits.device),
                )
        arrays, rows = None, None
        if md.logprob_rows is not None:
            described = target.described(logits, md)
            arrays, rows = self._verified_logprobs(staged, sample_rows, verified, lengths, described, md)
        return ModelRunnerOutput.for_requests(
            staged.req_ids,
            sampled_token_ids=sampled,
            logprobs=arrays,
            logprobs_rows=rows,
            prompt_logprobs=self.prompt_logprobs.finished(staged.req_ids, staged.sample, sample_rows),
        )

    def after_step(self, staged: Staged, sample_rows: np.ndarray, output: ModelRunnerOutput, started: float) -> None:
        """Tell the gate what a decode step (begun at ``started``) gave, then propose the next
        step's drafts."""
        now = time.perf_counter()
        if staged.decodes_only:
            # A verification's cost includes proposing its drafts (the step before).
            verified = staged.num_drafts is not None
            seconds = now - started + (self._proposal_seconds if verified else 0.0)
            self.gate.observe(verified, sum(map(len, output.sampled_token_ids)), seconds)
        proposed = self._propose(staged, sample_rows)
        self._proposal_seconds = time.perf_counter() - now if proposed else 0.0

    def take_drafts(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (each handed out once)."""
        drafts, self._drafts = self._drafts, None
        return drafts

    def _propose(self, staged: Staged, sample_rows: np.ndarray) -> bool:
        """Drafts for the requests that just sampled, from their known tokens; whether there are any."""
        proposer = self.proposer
        assert proposer is not None
        if self.batch.num_reqs >= self.pause_batch_size or not self.gate.open:
            return False
        sampled_ids = [staged.req_ids[i] for i in staged.sample.tolist()]
        budgets = [self._budget.get(r, self.k) for r in sampled_ids]
        proposals = proposer.draft(sampled_ids, sample_rows.tolist(), self.batch, budgets)
        for req_id, proposal in proposals.items():
            if proposal.probs is not None:
                self._draft_probs[req_id] = proposal.probs
        if proposals:
            self._drafts = DraftTokenIds(list(proposals), [p.token_ids for p in proposals.values()])
        return bool(proposals)

    def _draft_probs_rows(self, staged: Staged, starts: np.ndarray, logits: torch.Tensor) -> torch.Tensor | None:
        """A draft model's q of each logits row's draft (zeros elsewhere), for the sampled
        requests that verify drafts; None when there are none (n-gram drafts: point masses)."""
        if not self._draft_probs:
            return None
        assert staged.num_drafts is not None
        rows: torch.Tensor | None = None
        for i, start, k in zip(staged.sample.tolist(), starts.tolist(), staged.num_drafts.tolist()):
            q = self._draft_probs.pop(staged.req_ids[i], None)
            if q is None or not k:
                continue
            if rows is None:
                rows = torch.zeros_like(logits)
            rows[start : start + k] = q[:k]
        return rows

    def _verified_logprobs(
        self, staged: Staged, sample_rows: np.ndarray, verified: VerifiedTokens, lengths: np.ndarray,
        described: torch.Tensor, md: SamplingMetadata,
    ) -> tuple[LogprobsArrays, list[int]]:
        """The logprobs of every emitted token of the requests that asked, each from the
        logits row it was sampled from, in request order; and each request's first row."""
        asked = np.flatnonzero(self.batch.sampling.num_logprobs[sample_rows] >= 0)
        out_start = np.cumsum(lengths) - lengths
        picked = np.concatenate([verified.rows[out_start[a] : out_start[a] + lengths[a]] for a in asked])
        ids = torch.tensor([t for a in asked.tolist() for t in verified.token_ids[a]], device=described.device)
        rows_t = torch.from_numpy(picked).to(described.device)
        arrays = LogprobsArrays(*gather_logprobs(described[rows_t], ids, md.num_logprobs).to_numpy())
        rows = [-1] * len(staged.req_ids)
        first = np.cumsum(lengths[asked]) - lengths[asked]
        for a, start in zip(asked.tolist(), first.tolist()):
            rows[int(staged.sample[a])] = start
        return arrays, rows
