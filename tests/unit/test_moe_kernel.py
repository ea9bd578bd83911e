"""The experts kernel (kernels/moe.py, kernels/cpu/moe_kernels.c) against transformers' own sparse
MoE blocks (Qwen3-MoE's softmax, top k, renormalized; Mixtral's; Qwen2-MoE's, with its shared
expert under a sigmoid gate), their expert weights set to what our blocks hold (the gguf package
dequantizes them: the oracle for the formats)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from kernels import cpu
from kernels.moe import ExpertKernel
from kernels.quant import QuantizedMatrix, QuantizedWeight, QuantType
from tests.support.quant_blocks import random_blocks

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build kernels/cpu with")

HIDDEN, INTER, EXPERTS, TOKENS, SHARED = 256, 256, 8, 13, 512


def _block(family: str, top_k: int = 2, normalize: bool = True) -> torch.nn.Module:
    torch.manual_seed(3)
    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                                            num_experts_per_tok=top_k)
        block = MixtralSparseMoeBlock(config)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                             num_experts_per_tok=top_k, norm_topk_prob=normalize,
                                             shared_expert_intermediate_size=SHARED)
        block = Qwen2MoeSparseMoeBlock(config)
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                             num_experts_per_tok=top_k, norm_topk_prob=normalize)
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5)
    return block.eval()


def _experts(block: torch.nn.Module, gate_up_type: QuantType, down_type: QuantType) -> list:
    """Random blocks of each format for every expert, loaded into ``block`` as the gguf package
    dequantizes them, and as the kernel's weights."""
    experts = []
    with torch.no_grad():
        for e in range(EXPERTS):
            gate_up = random_blocks(gate_up_type, 2 * INTER, HIDDEN, seed=2 * e)
            down = random_blocks(down_type, HIDDEN, INTER, seed=2 * e + 1)
            for parameter, blocks, qtype in ((block.experts.gate_up_proj, gate_up, gate_up_type),
                                             (block.experts.down_proj, down, down_type)):
                values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).astype(np.float32)
                parameter[e] = torch.from_numpy(values.reshape(parameter.shape[1:]))
            gate, up = gate_up[:INTER], gate_up[INTER:]
            experts.append((
                QuantizedWeight([QuantizedMatrix(gate_up_type, np.ascontiguousarray(part), INTER, HIDDEN)
                                 for part in (gate, up)]),
                QuantizedWeight([QuantizedMatrix(down_type, down, HIDDEN, INTER)]),
            ))
    return experts


def _shared(block: torch.nn.Module, qtype: QuantType) -> tuple:
    """The block's shared expert as random blocks of ``qtype`` (its one-row gate in float32),
    loaded into ``block`` as the gguf package dequantizes them."""
    mlp, weights = block.shared_expert, []
    with torch.no_grad():
        for i, linear in enumerate((mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            rows, k = linear.weight.shape
            blocks = random_blocks(qtype, rows, k, seed=100 + i)
            values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).astype(np.float32)
            linear.weight.copy_(torch.from_numpy(values.reshape(rows, k)))
            weights.append(QuantizedMatrix(qtype, blocks, rows, k))
        block.shared_expert_gate.weight.normal_(0, 0.1)
    gate = QuantizedWeight([QuantizedMatrix.from_floats(block.shared_expert_gate.weight.detach().numpy())])
    return QuantizedWeight(weights[:2]), QuantizedWeight(weights[2:]), gate


def _run(kernel: ExpertKernel, x: torch.Tensor, router: torch.Tensor, quantize: bool, threads: int = 2) -> torch.Tensor:
    out = np.empty(tuple(x.shape), np.float32)
    kernel(x.numpy(), router.numpy(), out, quantize, threads)
    return torch.from_numpy(out)


FORMATS = [(QuantType.F32, QuantType.F32), (QuantType.Q8_0, QuantType.Q8_0), (QuantType.Q4_K, QuantType.Q6_K),
           (QuantType.Q5_K, QuantType.Q4_K), (QuantType.Q3_K, QuantType.Q4_K), (QuantType.Q2_K, QuantType.Q3_K),
           (QuantType.IQ4_XS, QuantType.Q6_K)]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe-unnormalized"])
@pytest.mark.parametrize("formats", FORMATS, ids=lambda f: f"{f[0].name}-{f[1].name}")
def test_experts_equal_transformers(family: str, formats) -> None:
    """Float32 activations (the weights' exact values): as close as float32 sums get; int8
    activations per block, as llama.cpp multiplies: within a few hundredths of the output's scale.
    Qwen2-MoE here: three experts a token, not renormalized, and the shared expert."""
    normalize = not family.endswith("-unnormalized")
    block = _block(family.removesuffix("-unnormalized"), top_k=2 if normalize else 3, normalize=normalize)
    shared = _shared(block, formats[0]) if family.startswith("qwen2_moe") else None
    kernel = ExpertKernel(_experts(block, *formats), block.gate.top_k, normalize, "silu", shared)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = block(x[None])[0]
        router = block.gate(x)[0].contiguous()
    scale = expected.abs().max()
    assert (_run(kernel, x, router, quantize=False) - expected).abs().max() <= 2e-5 * scale
    if formats[0] != QuantType.F32:
        assert (_run(kernel, x, router, quantize=True) - expected).abs().max() <= 3e-2 * scale


def test_bits_do_not_depend_on_threads_or_blocks() -> None:
    """Each expert is run whole by one thread (or by the whole team, when the experts are few) and
    each token's outputs summed in expert order: the same bits on 1, 2, 3 or 8 threads, and with
    the tokens taken in blocks of 1, 4 or all at once (a long prefill chunk's blocks); a shared
    expert too."""
    block = _block("qwen2_moe", top_k=3)
    experts, shared = _experts(block, QuantType.Q4_K, QuantType.Q6_K), _shared(block, QuantType.Q4_K)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        router = block.gate(x)[0].contiguous()
    reference = _run(ExpertKernel(experts, 3, True, "silu", shared), x, router, quantize=True, threads=1)
    for block_rows in (0, 1, 4):
        kernel = ExpertKernel(experts, 3, True, "silu", shared, block_rows=block_rows)
        for threads in (1, 2, 3):
            assert torch.equal(_run(kernel, x, router, quantize=True, threads=threads), reference)
    # One token's four experts on eight threads: the team runs each expert together, sharing its
    # products' tiles, with the same bits.
    kernel = ExpertKernel(experts, 3, True, "silu", shared)
    for quantize in (True, False):
        alone = _run(kernel, x[:1], router[:1], quantize=quantize, threads=1)
        assert torch.equal(_run(kernel, x[:1], router[:1], quantize=quantize, threads=8), alone)
    assert torch.equal(alone, _run(kernel, x, router, quantize=False, threads=1)[:1])


def test_experts_nobody_chose_are_not_multiplied() -> None:
    """Experts 2..7 hold NaN and the router never picks them: the output stays finite."""
    block = _block("mixtral")
    experts = _experts(block, QuantType.Q8_0, QuantType.Q8_0)
    poisoned = np.full((2 * INTER, HIDDEN), np.nan, np.float32)
    nan_expert = (QuantizedWeight([QuantizedMatrix.from_floats(poisoned)]),
                  QuantizedWeight([QuantizedMatrix.from_floats(poisoned[:HIDDEN, :INTER])]))
    kernel = ExpertKernel(experts[:2] + [nan_expert] * (EXPERTS - 2), 2, True, "silu")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(10))
    router = torch.full((TOKENS, EXPERTS), -30.0)
    router[:, :2] = torch.randn(TOKENS, 2)
    out = _run(kernel, x, router, quantize=True)
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_mismatched_experts_are_refused() -> None:
    block = _block("mixtral")
    experts = _experts(block, QuantType.Q8_0, QuantType.Q8_0)
    with pytest.raises(ValueError, match="experts of different shapes"):
        ExpertKernel(experts[:-1] + [(experts[0][1], experts[0][0])], 2, True, "silu")
    with pytest.raises(ValueError, match="9 experts per token of 8"):
        ExpertKernel(experts, 9, True, "silu")
