"""Pooling: a prompt's final hidden states -> the one tensor a pooling request returns.

A decoder's prompt may arrive in several prefill chunks, so the pooler keeps
what each unfinished request has gathered (the first token's state for CLS,
a running float32 sum for MEAN, the chunks themselves for ALL) and pools in
the step that reaches the prompt's end. Then, by task: ``embed`` keeps the
first ``dimensions`` components (Matryoshka) and normalises to unit length
when the model (or the request) says so; ``classify`` runs the model's
classification head on the CLS state and, unless the request turns it off,
its activation (sigmoid for one label, softmax for several); ``encode``
returns the pooled states as they are.

A pooling model's step (``PoolingStep``) takes the runner's place after the
layout: the forward pass, then the pooler; it never samples, so the runner's
sampling, speculation and step programs have no part in it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from core.model_config import ModelConfig
from core.pooler_config import PoolerConfig
from core.protocol import PoolingParams
from core.sched.output import ModelRunnerOutput, NewRequestData
from core.worker.input_batch import InputBatch
from core.worker.staging import DeviceInputs, Staged


class Pooler:
    """Pools each request's hidden states; keeps its parameters and, across chunks, what it gathered."""

    def __init__(self, config: PoolerConfig, model: torch.nn.Module) -> None:
        self.pooling_type = config.pooling_type
        self.normalize = bool(config.normalize)
        self.model = model
        self.params: dict[str, PoolingParams] = {}
        self._partial: dict[str, torch.Tensor | list[torch.Tensor]] = {}

    def add_request(self, new: NewRequestData) -> None:
        self.params[new.req_id] = new.pooling_params or PoolingParams()
        self._partial.pop(new.req_id, None)

    def forget(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self._partial.pop(req_id, None)

    def reset(self, req_id: str) -> None:
        """A preempted request starts its prompt over: drop what it gathered."""
        self._partial.pop(req_id, None)

    def token_type_ids(
        self, req_ids: list[str], computed: np.ndarray, counts: np.ndarray, device: torch.device
    ) -> torch.Tensor | None:
        """The step's segment ids, flat (None when no request of the step has any)."""
        params = self.params
        if not any(params[r].token_type_ids for r in req_ids):
            return None
        parts = []
        for req_id, start, count in zip(req_ids, computed.tolist(), counts.tolist()):
            types = params[req_id].token_type_ids
            parts.append(np.asarray(types[start : start + count] if types else np.zeros(count), np.int64))
        return torch.from_numpy(np.concatenate(parts)).to(device)

    def __call__(
        self, hidden: torch.Tensor, req_ids: list[str], starts: np.ndarray, counts: np.ndarray,
        computed: np.ndarray, num_prompt_tokens: np.ndarray, finishing: np.ndarray,
    ) -> list[np.ndarray | None]:
        """Gather each request's rows of ``hidden`` (its chunk at ``starts``, ``counts`` long,
        after ``computed`` earlier tokens) and pool those whose prompt ends here (``finishing``)."""
        kind = self.pooling_type
        pooled: list[torch.Tensor | None] = [None] * len(req_ids)
        for i, req_id in enumerate(req_ids):
            start, count = int(starts[i]), int(counts[i])
            rows = hidden[start : start + count]
            done = bool(finishing[i])
            if kind == "LAST":
                if done:
                    pooled[i] = rows[-1]
            elif kind == "CLS":
                first = rows[0] if computed[i] == 0 else self._partial.pop(req_id)
                if done:
                    pooled[i] = first
                else:
                    self._partial[req_id] = first
            elif kind == "MEAN":
                total = rows.float().sum(0)
                if computed[i]:
                    total += self._partial.pop(req_id)
                if done:
                    pooled[i] = total / int(num_prompt_tokens[i])
                else:
                    self._partial[req_id] = total
            else:  # ALL
                chunks = self._partial.pop(req_id, []) if computed[i] else []
                chunks.append(rows)
                if done:
                    pooled[i] = torch.cat(chunks)
                else:
                    self._partial[req_id] = chunks
        return self._finish(req_ids, pooled)

    def _finish(self, req_ids: list[str], pooled: list[torch.Tensor | None]) -> list[np.ndarray | None]:
        out: list[np.ndarray | None] = [None] * len(req_ids)
        done = [i for i, p in enumerate(pooled) if p is not None]
        classify = [i for i in done if self.params[req_ids[i]].task == "classify"]
        if classify:
            logits = self.model.classify(torch.stack([pooled[i] for i in classify]))  # type: ignore[misc]
            for k, i in enumerate(classify):
                params = self.params[req_ids[i]]
                scores = logits[k]
                if params.use_activation is not False:
                    scores = torch.sigmoid(scores) if scores.numel() == 1 else torch.softmax(scores, -1)
                out[i] = scores.numpy(force=True)
        for i in done:
            if out[i] is not None:
                continue
            params = self.params[req_ids[i]]
            vector = pooled[i].float()  # type: ignore[union-attr]
            if params.task == "embed":
                if params.dimensions is not None:
                    vector = vector[..., : params.dimensions]
                if self.normalize if params.normalize is None else params.normalize:
                    vector = F.normalize(vector, dim=-1)
            elif params.normalize:
                vector = F.normalize(vector, dim=-1)
            out[i] = vector.contiguous().numpy(force=True)
        return out


class PoolingStep:
    """A pooling model's step in place of sampling: the forward pass (with segment ids where an
    encoder has several types of them), then the pooled output of every request whose prompt
    ends in this step (the others gather what their chunk gives)."""

    def __init__(self, pooler: Pooler, model_config: ModelConfig, batch: InputBatch, device: torch.device) -> None:
        self.pooler = pooler
        self.batch = batch
        self.device = device
        # RoBERTa's one type needs no ids; a decoder has none.
        self.token_types = model_config.encoder and model_config.type_vocab_size > 1

    def __call__(
        self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], staged: Staged,
        device_inputs: DeviceInputs,
    ) -> ModelRunnerOutput:
        extra = {}
        if self.token_types:
            types = self.pooler.token_type_ids(staged.req_ids, staged.computed, staged.counts, self.device)
            if types is not None:
                extra["token_type_ids"] = types
        hidden = model(device_inputs.input_ids, device_inputs.positions, kv_caches, device_inputs.meta, **extra)
        batch = self.batch
        batch.num_computed_tokens[staged.rows] = staged.seq_lens
        num_prompt_tokens = batch.num_tokens[staged.rows]  # nothing is sampled: all of them are prompt
        pooled = self.pooler(
            hidden, staged.req_ids, staged.starts, staged.counts, staged.computed, num_prompt_tokens,
            finishing=staged.seq_lens >= num_prompt_tokens,
        )
        return ModelRunnerOutput.for_requests(
            staged.req_ids, sampled_token_ids=[[] for _ in staged.req_ids], pooler_output=pooled
        )
