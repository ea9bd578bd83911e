"""Logprobs of generated and prompt tokens against transformers (the oracle), offline.

For stories260K and a tiny seeded Llama, every generated token's logprob,
rank and top-5 alternatives, and every prompt token's, must equal
log_softmax of transformers' float32 logits at that position. Small token
budgets split prompts into several chunks (prompt logprobs then come from
several steps); a seeded sampled request checks that logprobs describe the
raw logits whatever was sampled; processed mode describes the distribution
sampled from. Also: logprobs cross the transport as tensors.
"""

from __future__ import annotations

import collections

import msgspec
import numpy as np
import pytest
import torch

from app.llm import LLM
from core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsArrays,
    SamplingParams,
)
from core.worker.logprobs import _gather_on_device, _gather_on_host
from shm.serial import EXT_RAW_TENSOR, EXT_SHM_TENSOR, MsgpackDecoder, MsgpackEncoder
from tests.support.oracle import check_logprobs, hf_logprobs, load_hf
from tests.support.pools import tensor_pool_pair

K = 5
ENGINE = dict(dtype="float32", kv_cache_dtype="float32", device="cpu", block_size=4, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=16)


@pytest.fixture(scope="module", params=["stories260K", "tiny-llama"])
def model(request, stories_dir, llama):
    """(transformers model, its directory) for each checkpoint."""
    if request.param == "stories260K":
        return load_hf(stories_dir), stories_dir
    return llama


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [[1, *torch.randint(3, vocab, (n,), generator=g).tolist()] for n in (3, 21, 40)]


def _check_result(hf, prompt: list[int], result, k: int, temperature: float = 1.0) -> None:
    rows = hf_logprobs(hf, prompt + result.token_ids, temperature)
    check_logprobs(result.logprobs, result.token_ids, rows[len(prompt) - 1 : -1], k)
    if result.prompt_logprobs is not None:
        check_logprobs(result.prompt_logprobs, prompt[1:], rows[: len(prompt) - 1], k)


def test_logprobs_and_prompt_logprobs_match_transformers(model) -> None:
    hf, path = model
    prompts = _prompts(hf.config.vocab_size)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=K)
    llm = LLM(path, **ENGINE)
    try:
        results = llm.generate(prompts + [prompts[1]], [greedy] * len(prompts) + [sampled])
    finally:
        llm.shutdown()
    for prompt, result in zip(prompts, results):
        assert len(result.prompt_logprobs) == len(prompt) - 1
        _check_result(hf, prompt, result, K)
    # Raw logprobs do not depend on how the token was picked.
    assert results[-1].prompt_logprobs is None
    _check_result(hf, prompts[1], results[-1], K)


def test_processed_logprobs_describe_the_sampled_distribution(model) -> None:
    hf, path = model
    prompt = _prompts(hf.config.vocab_size)[1]
    params = SamplingParams(max_tokens=6, temperature=0.5, seed=3, ignore_eos=True, logprobs=K)
    llm = LLM(path, logprobs_mode="processed_logprobs", **ENGINE)
    try:
        (result,) = llm.generate([prompt], params)
    finally:
        llm.shutdown()
    rows = hf_logprobs(hf, prompt + result.token_ids, temperature=0.5)
    check_logprobs(result.logprobs, result.token_ids, rows[len(prompt) - 1 : -1], K)


def test_prompt_logprobs_of_a_one_token_prompt_and_after_preemption(llama) -> None:
    """A one-token prompt has no prompt logprobs (only its null first entry); a
    request preempted after its first token does not send them twice."""
    hf, path = llama
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    llm = LLM(path, **{**ENGINE, "num_gpu_blocks_override": 24, "max_model_len": 64})
    sent: collections.Counter[str] = collections.Counter()
    get_output = llm.engine.get_output

    def counting_get_output() -> EngineCoreOutputs:  # records what the engine sends, changes nothing
        outputs = get_output()
        sent.update(o.request_id for o in outputs.outputs if o.new_prompt_logprobs is not None)
        return outputs

    llm.engine.get_output = counting_get_output
    try:
        results = llm.generate([[1]] + prompts, params)
        preemptions = llm.engine.engine_core.scheduler.num_preemptions
    finally:
        llm.shutdown()
    assert len(results[0].prompt_logprobs) == 0
    assert preemptions > 0
    assert len(sent) == len(results) and set(sent.values()) == {1}
    for prompt, result in zip([[1]] + prompts, results):
        _check_result(hf, prompt, result, 2)


def _wire_round_trip(outputs: EngineCoreOutputs) -> tuple[list, EngineCoreOutputs]:
    with tensor_pool_pair(1 << 20) as (writer, reader):
        frames = MsgpackEncoder(pool=writer).encode(outputs)
        decoded = MsgpackDecoder(EngineCoreOutputs, pool=reader).decode(frames)
        copy = msgspec_copy(decoded)
    return frames, copy


def msgspec_copy(outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    """Own copies of the arrays (pool views die with the pool)."""
    def own(a: LogprobsArrays | None) -> LogprobsArrays | None:
        return None if a is None else LogprobsArrays(a.token_ids.copy(), a.logprobs.copy(), a.ranks.copy())

    for out in outputs.outputs:
        out.new_prompt_logprobs = own(out.new_prompt_logprobs)
    outputs.logprobs = own(outputs.logprobs)
    return outputs


def _arrays(n: int, k: int) -> LogprobsArrays:
    rng = np.random.default_rng(n)
    return LogprobsArrays(
        rng.integers(0, 500, (n, k + 1)).astype(np.int32),
        -rng.random((n, k + 1)).astype(np.float32),
        rng.integers(1, 50, n).astype(np.int32),
    )


def test_logprobs_cross_the_transport_as_tensors() -> None:
    """A step's logprobs are three small arrays (inline); a long prompt's go
    through the shared pool; neither becomes a list of floats in msgpack."""
    step = _arrays(3, K)
    prompt = _arrays(1000, K)
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(request_id="a", new_token_ids=[5], logprobs_start=0, new_prompt_logprobs=prompt),
            EngineCoreOutput(request_id="b", new_token_ids=[6]),
            EngineCoreOutput(request_id="c", new_token_ids=[7], logprobs_start=1),
        ],
        logprobs=step,
    )
    frames, decoded = _wire_round_trip(outputs)
    assert len(frames) == 1  # nothing in aux frames
    body = msgspec.msgpack.decode(frames[0])  # untyped: what is really in the msgpack body
    step_arrays = body[-1]
    prompt_arrays = body[1][0][EngineCoreOutput.__struct_fields__.index("new_prompt_logprobs")]
    for (dtype, shape, data), want in zip(step_arrays, (step.token_ids, step.logprobs, step.ranks)):
        assert (np.dtype(dtype), shape) == (want.dtype, list(want.shape))
        assert isinstance(data, msgspec.msgpack.Ext) and data.code == EXT_RAW_TENSOR  # small: inline bytes
    for _, _, data in prompt_arrays:
        assert isinstance(data, msgspec.msgpack.Ext) and data.code == EXT_SHM_TENSOR  # large: the shared pool
    assert len(frames[0]) < 400
    for got, want in ((decoded.logprobs, step), (decoded.outputs[0].new_prompt_logprobs, prompt)):
        assert got.token_ids.dtype == np.int32 and got.logprobs.dtype == np.float32 and got.ranks.dtype == np.int32
        assert np.array_equal(got.token_ids, want.token_ids) and np.array_equal(got.logprobs, want.logprobs)
        assert np.array_equal(got.ranks, want.ranks)
    assert [o.logprobs_start for o in decoded.outputs] == [0, -1, 1]


@pytest.mark.parametrize("k", [0, 1, 5])
def test_host_and_device_gathers_agree(k) -> None:
    """On a CPU logprobs are gathered in numpy; the torch path (a GPU's) must agree,
    ranks included, with tokens inside and outside the top k and exact ties."""
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(40, 64, generator=g)
    logits[3, 10:14] = logits[3].max() + 1  # a four-way tie at the top
    logprobs = logits.log_softmax(-1)
    tokens = torch.randint(0, 64, (40,), generator=g)
    tokens[0] = int(logits[0].argmax())
    tokens[3] = 12
    top = logprobs.topk(k, dim=-1) if k else None
    device = _gather_on_device(logprobs, tokens, top)
    host = _gather_on_host(logprobs.numpy(), tokens.numpy(), None if top is None else (top.values.numpy(), top.indices.numpy()))
    for a, b in zip(device.to_numpy(), host.to_numpy()):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert host.ranks[0] == 1 and host.ranks[3] == 4
    expected = (logprobs >= logprobs.gather(1, tokens[:, None])).sum(1)
    assert host.ranks.tolist() == expected.tolist()
