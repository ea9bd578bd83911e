"""bench's probes: the int8 peak probe's count of its multiply-adds, a GGUF file's
multiply-adds per prompt token against the transformers model it was written from, and
bench compare's decode bandwidth read against the probes around each run."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import int8peak
from bench.compare import bandwidth_line, prefill_macs_per_token
from kernels import cpu

# The probe's independent chains (PEAK_CHAINS in quant_kernels.c) and each path's int8 lanes:
# portable (none), AVX2, AVX2 + AVX-VNNI, AVX-512, AVX-512 VNNI.
CHAINS = 12
LANES = {0: 0, 1: 32, 2: 32, 3: 64, 4: 64}


def test_the_int8_probe_counts_the_multiply_adds_of_its_instruction() -> None:
    lib = cpu.load()
    lanes = LANES[lib.quant_vector_path()]
    assert lib.int8_peak_probe(10, 1) == 10 * CHAINS * lanes
    rates = int8peak.measure(tries=2, seconds=0.01, threads=1)
    assert (len(rates) == 2 and min(rates) > 0) if lanes else rates == []


def test_a_prompt_tokens_multiply_adds_are_the_models_matrices_but_embedding_and_head(tmp_path: Path) -> None:
    """A Qwen3-MoE written to GGUF: every 2-D weight of the transformers model but the embedding
    and the head, its experts' by the share a token uses (k of n)."""
    from tests.support.gguf_files import moe_checkpoint, write_gguf

    hf_dir = moe_checkpoint(tmp_path / "hf", "qwen3_moe")
    path = write_gguf(hf_dir, tmp_path / "moe.gguf", qtype="f32")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    share = model.config.num_experts_per_tok / model.config.num_experts
    expected = sum(
        p.numel() * (share if ".experts." in name or name.endswith(".experts") else 1.0)
        for name, p in model.named_parameters()
        if p.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name
    )
    assert prefill_macs_per_token(str(path)) == pytest.approx(expected)


def test_each_runs_decode_is_read_against_the_bandwidth_probed_around_it() -> None:
    """Two runs of 2 GB a token: 100 ms between probes of 25 and 15 GB/s (20 GB/s: 100 %), 200 ms
    between probes of 20 GB/s (10 GB/s: 50 %); the median of the runs' shares, not the share of
    the runs' median rate against the probes' median."""
    runs = [{"median_tpot_ms": 100.0, "membw_gb_s": [25.0, 15.0]},
            {"median_tpot_ms": 200.0, "membw_gb_s": [20.0, 20.0]}]
    line = bandwidth_line("ours", 2_000_000_000, runs)
    assert "ours, one stream: 2.00 GB of weights per token / TPOT = 15.0 GB/s, 75% of what bench membw" in line
    assert "(runs 100%, 50%; probes 15.0-25.0 GB/s)" in line
