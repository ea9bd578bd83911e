"""The engine on a GPU: Triton kernels, CUDA graphs, deferred sampled ids, the
profiled KV cache, the server, and CUDA tensors through the transport.

Skipped without a GPU. Greedy runs use float32 (exact products: the Triton
kernels use IEEE dots for float32, torch's matmuls do not use TF32 unless
asked) so that tokens can be compared exactly with transformers on the CPU.
"""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers

from core.client import SyncMPClient
from core.config import EngineArgs
from core.models.random_model import write_tokenizer
from core.protocol import EngineCoreRequest, SamplingParams
from core.worker.cuda_graphs import DecodeGraphs
from tests.support.engines import (
    BASE, CHUNKED, MAX_NEW, generate, greedy, hf_greedy, shared_prefix_prompts, tiny_config, tokens,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = {**BASE, "device": "cuda"}


@pytest.fixture
def replays(monkeypatch):
    """Count decode steps that replayed a captured graph."""
    seen = {"replayed": 0, "eager": 0}
    run = DecodeGraphs.run

    def spy(self, size, forward):
        seen["replayed" if size in self._graphs else "eager"] += 1
        return run(self, size, forward)

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_graphs_and_eager_give_the_greedy_tokens_of_transformers(
    llama, reference, replays, async_scheduling  # noqa: F811
):
    _, path = llama
    prompts, expected = reference
    stops = [expected[1][3], expected[3][6]]
    params = greedy(stop_token_ids=stops)
    common = dict(async_scheduling=async_scheduling, **CHUNKED)
    (eager,), _ = generate(path, prompts, params, **GPU, enforce_eager=True, **common)
    assert replays["replayed"] == 0
    (graphed,), _ = generate(path, prompts, params, **GPU, **common)
    assert replays["replayed"] > 0 and replays["eager"] == 0
    assert tokens(graphed) == tokens(eager)
    for got, want in zip(tokens(graphed), expected):
        assert got == want[: len(got)] and got


def test_gpu_engine_survives_preemption_exactly(llama, reference):  # noqa: F811
    _, path = llama
    prompts, expected = reference
    tiny = dict(max_model_len=80, num_gpu_blocks_override=28, max_num_batched_tokens=48)
    (results,), sched = generate(path, prompts, **{**GPU, **tiny}, async_scheduling=True)
    assert sched.num_preemptions > 0
    assert tokens(results) == expected


def test_bfloat16_decodes_match_float32_closely(llama, reference):  # noqa: F811
    """bf16 cannot be compared token for token over long runs; the first tokens can."""
    _, path = llama
    prompts, expected = reference
    (results,), _ = generate(path, prompts, greedy(max_tokens=3), **{**GPU, "dtype": "bfloat16"})
    agree = sum(got[0] == want[0] for got, want in zip(tokens(results), expected))
    assert agree >= len(prompts) - 1


@pytest.mark.parametrize("family", ["mistral", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_windowed_and_expert_families_give_the_greedy_tokens_of_transformers(family, tmp_path):
    """Sliding windows through the Triton kernels and CUDA graphs (Gemma 3's local layers in a
    KV-cache group of their own), and mixtures of experts (torch's grouped experts, eager):
    chunked prompts, then the same prompts again with prefix-cache hits."""
    torch.manual_seed(1234)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval().float()
    with torch.no_grad():  # routers sharp enough that the top k are clear choices
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    prompts = shared_prefix_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    (first, again), _ = generate(str(tmp_path), prompts, passes=2, **GPU, **CHUNKED)
    assert tokens(first) == expected
    assert tokens(again) == expected
    assert again[0].num_cached_tokens >= 44  # its 44-token prefix (and more) from the first pass


def test_kv_cache_fills_the_memory_utilization_share(tmp_path):
    """A 1B-shaped model (dummy weights): the cache gets what 30% of the GPU leaves."""
    from bench.gpu import write_model_dir
    from core.client import InprocClient

    path = write_model_dir(tmp_path / "1b", "1b", max_model_len=2048, dtype="bfloat16")
    total = torch.cuda.mem_get_info()[1]
    args = EngineArgs(
        model=path, load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=2048,
        max_num_seqs=1024, gpu_memory_utilization=0.3,
    )
    client = InprocClient(args.resolve())
    try:
        runner = client.engine_core.model_executor.runner
        cache_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
        num_blocks = runner.kv_caches[0][0].shape[0]
        assert num_blocks < 1024 * runner.max_blocks_per_req  # the budget decided, not the cap
        assert cache_bytes > 0.2 * total  # 30% less ~2.5 GB of weights, the context, activations
        assert torch.cuda.memory_reserved() < 0.3 * total + (256 << 20)
        assert runner.decode_graphs is not None and runner.decode_graphs.captured
    finally:
        client.shutdown()


def test_a_small_model_gets_only_the_blocks_its_requests_can_use(llama):  # noqa: F811
    """Tens of millions of blocks of a tiny model would only hold evicted prefixes."""
    _, path = llama
    from core.client import InprocClient

    client = InprocClient(EngineArgs(model=path, device="cuda", dtype="float32", max_num_seqs=8).resolve())
    try:
        runner = client.engine_core.model_executor.runner
        assert runner.kv_caches[0][0].shape[0] == 8 * runner.max_blocks_per_req + 1
    finally:
        client.shutdown()


def test_cuda_prompt_embeds_reach_the_engine_by_ipc(tiny_llama_dir: str):
    config = EngineArgs(
        model=tiny_llama_dir, device="cuda", dtype="float32", max_model_len=256, enable_prompt_embeds=True
    ).resolve()
    client = SyncMPClient(config)
    try:
        embeds = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        client.add_request(EngineCoreRequest(request_id="cpu", prompt_token_ids=[], prompt_embeds=embeds, sampling_params=params))
        client.add_request(EngineCoreRequest(
            request_id="gpu", prompt_token_ids=[], prompt_embeds=embeds.cuda(), sampling_params=params
        ))
        got = {"cpu": [], "gpu": []}
        done = set()
        while len(done) < 2:
            for out in client.get_output().outputs:
                got[out.request_id] += out.new_token_ids
                if out.finished:
                    assert str(out.finish_reason) == "length", out
                    done.add(out.request_id)
        assert got["cpu"] == got["gpu"] and len(got["cpu"]) == 4
        client.encoder.cuda_ipc.collect()
        assert client.encoder.cuda_ipc.outstanding == 0
    finally:
        client.shutdown()


def test_server_end_to_end_on_gpu(random_model_dir: str, server_factory):
    server = server_factory(["--model", random_model_dir, "--device", "cuda", "--max-model-len", "512"])
    served = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": served, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    first = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    again = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["completion_tokens"] == 16
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert "captured CUDA graphs" in server.log()
