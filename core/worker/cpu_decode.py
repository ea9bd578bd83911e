"""Decode steps on a CPU as a fixed list of kernel calls over preallocated buffers.

On a GPU, CUDA graphs remove the per-launch host cost of a decode step
(core/worker/cuda_graphs.py). On a CPU the same cost is Python's: building
tensors, module calls, attribute look-ups and argument checks around each
kernel are most of a small model's step. This is the CPU counterpart: for a
decode-only step (one token per request) it runs the model as ten calls a
layer — the C kernels of kernels/cpu through ctypes with their pointers
worked out in advance, and numpy's BLAS writing into fixed output arrays —
reading the runner's persistent input buffers in place, as a replayed graph
does. Its results are those of ``model.forward`` on the same step: the same
kernels in the same order (tests/test_cpu_decode.py checks the logits bit
for bit).

It covers the Llama-family layers (biases and Qwen3's per-head q/k norms
included) with silu, in float32 with the C kernels available;
``DecodeProgram.build`` returns None otherwise, and the runner keeps calling
the model.
"""

from __future__ import annotations

import numpy as np
import torch

from core.worker.input_buffers import InputBuffers
from kernels import cpu


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


class _Layer:
    """One decoder layer's weights as numpy views and raw pointers."""

    def __init__(self, layer: torch.nn.Module, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1 = layer.input_layernorm.weight.data_ptr()
        self.norm2 = layer.post_attention_layernorm.weight.data_ptr()
        # The dense layers, whose ``cpu_weight`` the products use: the forward pass's own
        # (same products, same bits), looked up at each step since a weight reload replaces it.
        self.qkv, self.o = attn.qkv_proj, attn.o_proj
        self.gate_up, self.down = mlp.gate_up_proj, mlp.down_proj
        self.q_norm = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None
        self.k_norm = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None
        self.k_cache, self.v_cache = (c.data_ptr() for c in kv_cache)


class DecodeProgram:
    """``run(n)`` computes the logits of the n decodes staged in the runner's buffers."""

    @classmethod
    def build(
        cls, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
        max_model_len: int,
    ) -> DecodeProgram | None:
        cfg = getattr(model, "config", None)
        weight = model.get_input_embeddings().weight
        if (
            cfg is None or not kv_caches or not cpu.usable(weight, kv_caches[0][0]) or cfg.hidden_act != "silu"
            or getattr(model.lm_head, "cpu_weight", None) is None  # products through torch (RINGLLM_CPU_BLAS=0)
        ):
            return None
        return cls(model, kv_caches, buffers, max_model_len)

    def __init__(
        self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
        max_model_len: int,
    ) -> None:
        cfg = model.config
        self.lib = cpu.load()
        self.buffers = buffers
        self.hidden_size = cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        self.block_size = kv_caches[0][0].shape[1]
        self.embedding = _np(model.get_input_embeddings().weight)
        self.lm_head = model.lm_head
        self.final_norm = model.model.norm.weight.data_ptr()
        self.cos, self.sin = (t.data_ptr() for t in model.model.rotary.tables(torch.device("cpu"), torch.float32))
        self._tables = model.model.rotary.tables(torch.device("cpu"), torch.float32)  # keeps them alive
        self.layers = [_Layer(layer, kv) for layer, kv in zip(model.model.layers, kv_caches, strict=True)]
        rows = buffers.max_num_reqs
        qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        # Activations, one row per decode; the step uses the first n rows of each.
        self.hidden = np.zeros((rows, self.hidden_size), np.float32)  # the residual stream
        self.normed = np.zeros((rows, self.hidden_size), np.float32)
        self.qkv = np.zeros((rows, qkv_width), np.float32)
        self.attn = np.zeros((rows, self.heads * self.head_dim), np.float32)
        self.proj = np.zeros((rows, self.hidden_size), np.float32)  # attention / MLP output
        self.gate_up = np.zeros((rows, 2 * self.intermediate), np.float32)
        self.act = np.zeros((rows, self.intermediate), np.float32)
        self.logits = np.zeros((rows, model.lm_head.weight.shape[0]), np.float32)
        self.threads = torch.get_num_threads()  # attention of large batches is shared among them
        self.scratch_stride = self.heads * max_model_len
        self.scratch = np.zeros(self.threads * self.scratch_stride, np.float32)
        self.head_norms = np.zeros((rows, self.heads, self.head_dim), np.float32)  # q/k norm outputs
        self.row_ids = np.arange(rows, dtype=np.int64)  # decode d is row d and block-table row d
        self.seq_lens = np.zeros(rows, np.int64)
        self.qkv_width = qkv_width
        # The buffers never move: their addresses, and those of the staged inputs, are fixed.
        self._ptr = {name: getattr(self, name).ctypes.data for name in (
            "hidden", "normed", "qkv", "attn", "proj", "gate_up", "act", "scratch", "row_ids", "seq_lens", "head_norms")}
        self._ptr.update(
            positions=buffers.positions.np.ctypes.data, slots=buffers.slot_mapping.np.ctypes.data,
            tables=buffers.block_tables.np.ctypes.data,
        )
        self._table_stride = buffers.block_tables.np.shape[1]
        self._views: dict[int, tuple[np.ndarray, ...]] = {}
        self._logits_t: dict[int, torch.Tensor] = {}

    def _views_for(self, n: int) -> tuple[np.ndarray, ...]:
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = tuple(
                a[:n] for a in (self.hidden, self.normed, self.qkv, self.attn, self.proj, self.gate_up, self.act,
                                self.logits)
            )
            self._logits_t[n] = torch.from_numpy(self.logits[:n])
        return views

    def run(self, n: int) -> torch.Tensor:
        """Logits [n, vocab] (float32) of the n decodes whose inputs the runner staged."""
        lib, b = self.lib, self.buffers
        hidden, normed, qkv, attn, proj, gate_up, act, logits = self._views_for(n)
        size, eps, width = self.hidden_size, self.eps, self.qkv_width
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        p = self._ptr
        hidden_p, normed_p, qkv_p, attn_p, proj_p = p["hidden"], p["normed"], p["qkv"], p["attn"], p["proj"]
        rows_p, lens_p, scratch_p = p["row_ids"], p["seq_lens"], p["scratch"]
        positions_p, slots_p, tables_p = p["positions"], p["slots"], p["tables"]
        gate_up_p, act_p, table_stride = p["gate_up"], p["act"], self._table_stride
        np.take(self.embedding, b.input_ids.np[:n], axis=0, out=hidden)
        self.seq_lens[:n] = b.seq_lens.np[:n]
        k_offset, v_offset = heads * head_dim * 4, (heads + kv_heads) * head_dim * 4
        for i, layer in enumerate(self.layers):
            if i == 0:
                lib.rms_norm(hidden_p, n, size, 1, 0, layer.norm1, normed_p, size, eps)
            else:  # the residual add of the previous layer's MLP, fused with this norm
                lib.add_rms_norm(proj_p, hidden_p, layer.norm1, normed_p, n, size, eps)
            layer.qkv.cpu_weight.matmul(normed, qkv)
            if layer.q_norm is not None:  # per-head norms of q and of k, written back in place
                self._head_norm(n, 0, heads, layer.q_norm)
                self._head_norm(n, heads, kv_heads, layer.k_norm)
            lib.rotary(qkv_p, n, width, heads + kv_heads, head_dim, self.cos, self.sin, positions_p)
            lib.write_kv(qkv_p + k_offset, width, qkv_p + v_offset, width, n, kv_heads * head_dim,
                         layer.k_cache, layer.v_cache, slots_p)
            lib.paged_decode_attention(
                qkv_p, width, rows_p, n, heads, kv_heads, head_dim, layer.k_cache, layer.v_cache, self.block_size,
                tables_p, table_stride, rows_p, lens_p, self.scale, attn_p, heads * head_dim, scratch_p,
                self.scratch_stride, self.threads,
            )
            layer.o.cpu_weight.matmul(attn, proj)
            lib.add_rms_norm(proj_p, hidden_p, layer.norm2, normed_p, n, size, eps)
            layer.gate_up.cpu_weight.matmul(normed, gate_up)
            lib.silu_mul(gate_up_p, n, self.intermediate, act_p)
            layer.down.cpu_weight.matmul(act, proj)
        lib.add_rms_norm(proj_p, hidden_p, self.final_norm, normed_p, n, size, eps)
        self.lm_head.cpu_weight.matmul(normed, logits)
        return self._logits_t[n]

    def _head_norm(self, n: int, first: int, count: int, weight: int) -> None:
        """RMSNorm over heads ``first:first+count`` of each row of qkv, written back."""
        d = self.head_dim
        self.lib.rms_norm(
            self._ptr["qkv"] + first * d * 4, n, self.qkv_width, count, d, weight, self._ptr["head_norms"], d, self.eps
        )
        out = self.head_norms.reshape(-1)[: n * count * d].reshape(n, count * d)
        self.qkv[:n, first * d : (first + count) * d] = out
