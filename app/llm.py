"""Offline batch generation on the same engine: ``LLM(model).generate(prompts, params)``.

Uses the in-process client (no IPC) and the same input/output processors as
the server, so tokenization, detokenization and stop strings behave the same.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from app.input_processor import InputProcessor
from app.logprobs import Logprobs
from app.output_processor import OutputProcessor, RequestOutputCollector
from core.client import InprocClient
from core.config import EngineArgs
from core.protocol import LoRARequest, PoolingParams, SamplingParams
from core.utilities import RESET_PREFIX_CACHE


@dataclass
class CompletionResult:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    # When the SamplingParams asked: an entry per generated token, and per prompt token after the first.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        if model is None:
            from core.models.default_model import default_model_dir

            model = default_model_dir()
        self.config = EngineArgs(model=model, **engine_args).resolve()
        self.engine = InprocClient(self.config)
        self.input_processor = InputProcessor.from_config(self.config)
        self.tokenizer = self.input_processor.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        priority: list[int] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[CompletionResult]:
        """Run every prompt to completion, batched by the scheduler; results in input order.

        ``priority`` (one per prompt, lower runs first) matters only under
        the ``priority`` scheduling policy; ``cache_salt`` keeps these
        prompts from sharing prefix cache blocks with differently salted ones.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        priorities = priority if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        output_processor = OutputProcessor(self.tokenizer)
        collectors: list[tuple[list[int], RequestOutputCollector]] = []
        adapters = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        for prompt, p, prio, adapter in zip(prompts, per_prompt, priorities, adapters, strict=True):
            ids = self.input_processor.tokenize_prompt(prompt)
            request = self.input_processor.process(
                f"offline-{next(self._ids)}", ids, p, prio, cache_salt, lora_request=adapter
            )
            collector = RequestOutputCollector()
            output_processor.add_request(request, collector)
            self.engine.add_request(request)
            collectors.append((ids, collector))
        while output_processor.has_unfinished_requests():
            outputs = self.engine.get_output()
            to_abort = output_processor.process_outputs(outputs.outputs, outputs.logprobs)
            if to_abort:
                self.engine.abort_requests(to_abort)
        results = []
        for ids, collector in collectors:
            out = collector.get_nowait()
            assert out is not None and out.finished
            results.append(
                CompletionResult(
                    ids, out.text, list(out.token_ids), out.finish_reason, out.num_cached_tokens,
                    out.logprobs, out.prompt_logprobs,
                )
            )
        return results

    def encode(
        self, prompts: str | list[str] | list[list[int]], pooling_params: PoolingParams | None = None
    ) -> list:
        """A pooling model's output for every prompt (numpy float32 arrays, in input order):
        embeddings, or a classifier's scores (``PoolingParams(task="classify")``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = pooling_params or PoolingParams()
        return self._pool([(self.input_processor.tokenize_prompt(p), params) for p in prompts])

    def score(self, text_1: str, texts_2: list[str]) -> list[float]:
        """A cross-encoder's score of ``text_1`` paired with each of ``texts_2`` (its one label,
        through its activation, as sentence-transformers' ``CrossEncoder.predict``)."""
        pairs = [self.input_processor.tokenize_pair(text_1, text) for text in texts_2]
        outputs = self._pool([(ids, PoolingParams(task="classify", token_type_ids=types)) for ids, types in pairs])
        return [float(out[0]) for out in outputs]

    def _pool(self, prompts: list[tuple[list[int], PoolingParams]]) -> list:
        output_processor = OutputProcessor(self.tokenizer)
        collectors: list[RequestOutputCollector] = []
        for ids, params in prompts:
            request = self.input_processor.process(
                f"offline-{next(self._ids)}", ids, SamplingParams(max_tokens=1), pooling_params=params
            )
            collector = RequestOutputCollector()
            output_processor.add_request(request, collector)
            self.engine.add_request(request)
            collectors.append(collector)
        while output_processor.has_unfinished_requests():
            output_processor.process_outputs(self.engine.get_output().outputs)
        results = []
        for collector in collectors:
            out = collector.get_nowait()
            if out is None or out.pooled is None:
                raise RuntimeError(f"the engine finished a pooling request without its output: {out}")
            results.append(out.pooled.copy())  # its own memory, not the transport's
        return results

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (between generate() calls nothing runs, so it succeeds)."""
        return self.engine.call(RESET_PREFIX_CACHE())

    def shutdown(self) -> None:
        self.engine.shutdown()
