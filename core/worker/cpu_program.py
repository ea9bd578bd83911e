"""Decode steps and single prefill chunks on a CPU as a fixed list of kernel calls.

On a GPU, CUDA graphs remove the per-launch host cost of a decode step
(core/worker/cuda_graphs.py). On a CPU the same cost is Python's: building
tensors, module calls, attribute look-ups and argument checks around each
kernel are most of a small model's step. This is the CPU counterpart: it runs
the model as ten calls a layer — the C kernels of kernels/cpu through ctypes
with their pointers worked out in advance, and numpy's BLAS writing into
fixed output arrays — reading the runner's persistent input buffers in place,
as a replayed graph does. It takes the steps that are most often alone on
the critical path: a decode-only step (one token per request, ``run``), and a
step that is one request's prefill chunk (``run_chunk``: the first token of a
request that arrived at an idle engine), and a verification step of
speculative decoding (``run_queries``: each request's last token and its
drafts, every query attending like a decode over the context up to its own
position, all of them through each product at once). Its results are those of
``model.forward`` on the same step: the same kernels in the same order, the
attention kernel chosen as the dispatcher in kernels/ chooses it
(tests/engine/test_cpu_program.py checks the logits bit for bit).

The model describes itself as a recipe (``recipe()``, core/models/recipe.py:
each layer's operations in the order its forward pass runs them), and the
program runs those operations, so it names no family and no attribute of
the model's modules: a new family's layers run here as they are. It takes
float32 models with the C kernels available and the gated activations the
kernels have (silu, tanh GELU), and mixtures of experts whose experts the
expert kernel runs (kernels/moe.py: a layer's experts, a shared one included,
are one operation); ``CpuStepProgram.build`` returns None otherwise, and the
runner keeps calling the model, as it does for every other step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from core.models.recipe import (
    ACT, ATTN, GATE_UP, HIDDEN, NORMED, PROJ, QKV, ROUTER, Attention, GatedActivation, HeadNorms, LayerOp,
    MixtureOfExperts, Norm, Product, Recipe, ResidualNorm,
)
from core.worker.input_buffers import InputBuffers
from kernels import cpu
from kernels.cpu.program import Op, Program
from kernels.kv_format import KVFormat
from kernels.linear import SMALL_WEIGHT_BYTES, CpuWeight, DenseRows
from kernels.quant import QuantizedMatrix, QuantizedWeight
from kernels.settings import settings


# The gated activations the C kernels compute (the others stay on the forward pass).
_KERNEL_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class _Layer:
    """One decoder layer's operations, with its KV caches, and its KV cache group's staged
    slots and block tables (core/kv/kv_groups.py), as raw pointers."""

    def __init__(
        self, ops: tuple[LayerOp, ...], kv_cache: tuple[torch.Tensor, torch.Tensor], buffers: InputBuffers,
        group: int,
    ) -> None:
        self.ops = ops
        self.k_cache, self.v_cache = (c.data_ptr() for c in kv_cache)
        self.slots = buffers.group_slots[group].np.ctypes.data
        self.tables = buffers.group_tables[group].np.ctypes.data


class CpuStepProgram:
    """``run(n)``: the logits of the n decodes staged in the runner's buffers;
    ``run_chunk(n, sample)``: those of one request's staged prefill chunk of n tokens;
    ``run_queries(n, table_rows, lens)``: those of n staged queries, each its own decode.

    With LoRA adapters in the step (``--enable-lora``), each product is followed by its
    adapters' grouped deltas (kernels/lora.py), as in the forward pass."""

    applies_lora = True

    @classmethod
    def build(
        cls, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
        max_model_len: int, layer_group: tuple[int, ...] = (),
    ) -> CpuStepProgram | None:
        """The program over ``model``'s recipe, or None where it has no C operation for a step's
        work; ``layer_group``: each layer's KV cache group (default: one group)."""
        describe = getattr(model, "recipe", None)
        if describe is None or not kv_caches:
            return None
        recipe: Recipe = describe()
        if any(isinstance(op, MixtureOfExperts) and op.moe.kernel is None for ops in recipe.layers for op in ops):
            return None  # experts the C kernel does not run (not float32 on a CPU): the forward pass runs them
        activations = {op.kind for ops in recipe.layers for op in ops if isinstance(op, GatedActivation)}
        if (
            not cpu.usable(cache=kv_caches[0][0]) or not activations <= set(_KERNEL_ACTIVATIONS)
            or recipe.lm_head.cpu_weight is None  # products through torch (settings.cpu_blas off)
        ):
            return None
        if NativeStepProgram.takes(recipe):
            return NativeStepProgram(recipe, kv_caches, buffers, max_model_len, layer_group)
        return cls(recipe, kv_caches, buffers, max_model_len, layer_group)

    def __init__(
        self, recipe: Recipe, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
        max_model_len: int, layer_group: tuple[int, ...] = (), threads: int | None = None,
    ) -> None:
        cfg = recipe.config
        self.lib = cpu.load()
        self.buffers = buffers
        self.hidden_size = cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.intermediate = cfg.intermediate_size
        self.num_experts = cfg.moe.num_experts if cfg.moe is not None else 0
        self.experts = [op.moe.kernel for ops in recipe.layers for op in ops if isinstance(op, MixtureOfExperts)]
        self.eps = cfg.rms_norm_eps
        self.block_size = kv_caches[0][0].shape[1]
        self.embedding = recipe.embedding.table()  # float or block-format rows, looked up by id
        self.embed_scale = recipe.embed_scale
        self.lm_head = recipe.lm_head
        self.final_norm = recipe.final_norm
        # Each rotary table's (cos, sin±) pointers, the tables kept alive here.
        self._rotary: dict[int, tuple[int, int]] = {}
        self._tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        for op in (op for ops in recipe.layers for op in ops if isinstance(op, Attention)):
            if id(op.rotary) not in self._rotary:
                self._tables.append(op.rotary.tables(torch.device("cpu"), torch.float32))
                self._rotary[id(op.rotary)] = tuple(t.data_ptr() for t in self._tables[-1])
        groups = layer_group or (0,) * len(kv_caches)
        self.layers = [
            _Layer(ops, kv, buffers, group) for ops, kv, group in zip(recipe.layers, kv_caches, groups, strict=True)
        ]
        # Where LoRA adapters are attached, every product has a slot reading one batch: the first tells.
        self._first_product = next(op.linear for op in recipe.layers[0] if isinstance(op, Product))
        self.qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.logits = np.zeros((buffers.max_num_reqs, cfg.vocab_size), np.float32)  # grown by run_queries
        self._logits_t: dict[int, torch.Tensor] = {}
        self.threads = threads or torch.get_num_threads()  # attention of large batches is shared among them
        self.kv_format = int(KVFormat.of(kv_caches[0][0]))  # the kernels' code for the cache's storage
        # Per thread: a decode's scores for every head, or a chunk's scores for one head (padded keys).
        self.scratch_stride = max(self.heads * max_model_len, cpu.padded_keys(max_model_len))
        self.scratch = np.zeros(self.threads * self.scratch_stride, np.float32)
        self.seq_lens = np.zeros(buffers.max_num_reqs, np.int64)
        self._table_stride = buffers.block_tables.np.shape[1]
        self._chunk_kernel = self.head_dim in cpu.PREFILL_KERNEL_HEAD_DIMS
        self._kv_scratch = np.zeros(0, np.float32)  # the chunk kernel's transposed keys and values, grown on demand
        self._rows = 0
        self._reserve(buffers.max_num_reqs)

    def _reserve(self, rows: int) -> None:
        """Activation buffers for steps of up to ``rows`` tokens: one row per decode, or
        per token of a chunk. They grow (and their addresses change) when a chunk is
        longer than any before, so they are as large as the longest chunk run."""
        if rows <= self._rows:
            return
        self._rows = rows
        self.hidden = np.zeros((rows, self.hidden_size), np.float32)  # the residual stream
        self.normed = np.zeros((rows, self.hidden_size), np.float32)
        self.qkv = np.zeros((rows, self.qkv_width), np.float32)
        self.attn = np.zeros((rows, self.heads * self.head_dim), np.float32)
        self.proj = np.zeros((rows, self.hidden_size), np.float32)  # attention / MLP output
        self.gate_up = np.zeros((rows, 2 * self.intermediate), np.float32)
        self.act = np.zeros((rows, self.intermediate), np.float32)
        self.router = np.zeros((rows, self.num_experts), np.float32)  # router logits (mixtures of experts)
        self.head_norms = np.zeros((rows, self.heads, self.head_dim), np.float32)  # q/k norm outputs
        self.row_ids = np.arange(rows, dtype=np.int64)  # decode d is row d and block-table row d
        self.chunk_tables = np.zeros(rows, np.int64)  # every query of a chunk reads block-table row 0
        self.chunk_lens = np.zeros(rows, np.int64)  # the context each query of a chunk sees
        self.query_tables = np.zeros(rows, np.int64)  # run_queries: each query's block-table row
        self.query_lens = np.zeros(rows, np.int64)  # and the context it sees
        # The buffers never move between growths: their addresses, and those of the staged inputs, are fixed.
        self._ptr = {name: getattr(self, name).ctypes.data for name in (
            "hidden", "normed", "qkv", "attn", "proj", "gate_up", "act", "router", "scratch", "row_ids", "seq_lens",
            "head_norms", "chunk_tables", "chunk_lens", "query_tables", "query_lens")}
        b = self.buffers
        self._ptr.update(positions=b.positions.np.ctypes.data)
        self._views: dict[int, dict[str, np.ndarray]] = {}
        self._steps = self._compile()

    def _views_for(self, n: int) -> dict[str, np.ndarray]:
        """The first n rows of each buffer, by the recipe's buffer names."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = {
                name: getattr(self, name)[:n] for name in (HIDDEN, NORMED, QKV, ATTN, PROJ, GATE_UP, ACT, ROUTER)
            }
        return views

    def _logits(self, n: int) -> torch.Tensor:
        logits = self._logits_t.get(n)
        if logits is None:
            logits = self._logits_t[n] = torch.from_numpy(self.logits[:n])
        return logits

    def run(self, n: int) -> torch.Tensor:
        """Logits [n, vocab] (float32) of the n decodes whose inputs the runner staged."""
        self.seq_lens[:n] = self.buffers.seq_lens.np[:n]
        p = self._ptr
        rows_p, lens_p, scratch_p = p["row_ids"], p["seq_lens"], p["scratch"]
        lib, table_stride = self.lib, self._table_stride
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        qkv_p, attn_p, width = p["qkv"], p["attn"], self.qkv_width

        def attend(op: Attention, layer: _Layer) -> None:
            lib.paged_decode_attention(
                qkv_p, width, rows_p, n, heads, kv_heads, head_dim, layer.k_cache, layer.v_cache, self.kv_format,
                self.block_size, layer.tables, table_stride, rows_p, lens_p, op.window, op.scale, attn_p,
                heads * head_dim, scratch_p, self.scratch_stride, self.threads,
            )

        normed = self._layers(n, attend)
        self.lm_head.cpu_weight.matmul(normed, self.logits[:n])
        return self._logits(n)

    def _reserve_logits(self, rows: int) -> bool:
        """Room for ``rows`` rows of logits; True when the buffer moved."""
        if rows <= self.logits.shape[0]:
            return False
        self.logits = np.zeros((rows, self.logits.shape[1]), np.float32)
        self._logits_t.clear()
        return True

    def run_queries(self, n: int, table_rows: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        """Logits [n, vocab] of the n staged tokens, query i attending over the first
        ``lens[i]`` tokens of block-table row ``table_rows[i]`` (a verification step:
        a request's queries share its row and see one more token each)."""
        self._reserve(n)
        self._reserve_logits(n)
        self.query_tables[:n] = table_rows
        self.query_lens[:n] = lens
        p = self._ptr
        lib, table_stride = self.lib, self._table_stride
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        qkv_p, attn_p, width = p["qkv"], p["attn"], self.qkv_width

        def attend(op: Attention, layer: _Layer) -> None:
            lib.paged_decode_attention(
                qkv_p, width, p["row_ids"], n, heads, kv_heads, head_dim, layer.k_cache, layer.v_cache,
                self.kv_format, self.block_size, layer.tables, table_stride, p["query_tables"], p["query_lens"],
                op.window, op.scale, attn_p, heads * head_dim, p["scratch"], self.scratch_stride, self.threads,
            )

        normed = self._layers(n, attend)
        self.lm_head.cpu_weight.matmul(normed, self.logits[:n])
        return self._logits(n)

    @staticmethod
    def takes_chunk(query_len: int, seq_len: int) -> bool:
        """Whether a chunk of ``query_len`` tokens reaching ``seq_len`` is one the C
        kernels attend (the dispatcher leaves longer ones to torch's SDPA)."""
        return query_len * seq_len <= settings.prefill_pairs

    def run_chunk(self, n: int, sample: bool) -> torch.Tensor | None:
        """Logits [1, vocab] of the last token of the one request's chunk of n tokens
        staged in the runner's buffers (None with ``sample`` false: a chunk that ends
        inside the prompt samples nothing). Its KV goes to the caches either way."""
        self._reserve(n)
        seq_len = int(self.buffers.seq_lens.np[0])
        p = self._ptr
        lib, block_size, threads = self.lib, self.block_size, self.threads
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        qkv_p, attn_p, width, out_stride = p["qkv"], p["attn"], self.qkv_width, heads * head_dim
        if self._chunk_kernel:
            kv_floats, _ = cpu.prefill_scratch(seq_len, kv_heads, head_dim, threads)
            if self._kv_scratch.size < kv_floats:
                self._kv_scratch = np.zeros(kv_floats, np.float32)
            kv_p = self._kv_scratch.ctypes.data

            def attend(op: Attention, layer: _Layer) -> None:
                lib.paged_prefill_attention(
                    qkv_p, width, n, heads, kv_heads, head_dim, layer.k_cache, layer.v_cache, self.kv_format,
                    block_size, layer.tables, seq_len, op.window, op.scale, attn_p, out_stride, kv_p, p["scratch"],
                    threads,
                )
        else:  # one query at a time, each over the context up to its own position
            np.add(self.row_ids[:n], seq_len - n + 1, out=self.chunk_lens[:n])
            rows_p, tables_p, lens_p = p["row_ids"], p["chunk_tables"], p["chunk_lens"]

            def attend(op: Attention, layer: _Layer) -> None:
                lib.paged_decode_attention(
                    qkv_p, width, rows_p, n, heads, kv_heads, head_dim, layer.k_cache, layer.v_cache, self.kv_format,
                    block_size, layer.tables, self._table_stride, tables_p, lens_p, op.window, op.scale, attn_p,
                    out_stride, p["scratch"], self.scratch_stride, threads,
                )

        normed = self._layers(n, attend)
        if not sample:
            return None
        self.lm_head.cpu_weight.matmul(normed[n - 1 : n], self.logits[:1])
        return self._logits(1)

    def _layers(self, n: int, attend: Callable[[Attention, _Layer], None]) -> np.ndarray:
        """Every layer's operations over the n staged tokens, then the final norm: the normed rows."""
        views = self._views_for(n)
        self.embedding.take_rows(self.buffers.input_ids.np[:n], out=views[HIDDEN])
        if self.embed_scale is not None:
            self.lib.scale_rows(self._ptr[HIDDEN], n, self.hidden_size, self.embed_scale)
        slot = self._first_product.adapters
        adapted = slot is not None and bool(slot.batch.groups)  # this step has rows of LoRA adapters
        for step in self._steps:
            step(n, views, attend, adapted)
        return views[NORMED]

    def _compile(self) -> list[Callable[..., None]]:
        """The recipe's operations as calls with their weights' and buffers' addresses bound
        (made again when the buffers move): what ``_layers`` runs, with nothing to look up."""
        lib, p = self.lib, self._ptr
        size, eps, width, inter = self.hidden_size, self.eps, self.qkv_width, self.intermediate
        hidden_p, normed_p, qkv_p, proj_p = p[HIDDEN], p[NORMED], p[QKV], p[PROJ]
        positions_p = p["positions"]

        def residual_norm(op: ResidualNorm, pending: bool) -> Callable[..., None]:
            w = op.norm.weight.data_ptr()
            if pending:  # the residual add of the block before, fused with this norm
                return lambda n, *_: lib.add_rms_norm(proj_p, hidden_p, w, normed_p, n, size, eps)
            return lambda n, *_: lib.rms_norm(hidden_p, n, size, 1, 0, w, normed_p, size, eps)

        def product(op: Product) -> Callable[..., None]:
            linear, src, out = op.linear, op.src, op.out

            def run(n: int, views: dict[str, np.ndarray], attend: object, adapted: bool) -> None:
                x, y = views[src], views[out]
                linear.cpu_weight.matmul(x, y)
                if adapted and linear.adapters is not None:
                    linear.adapters.add_numpy(x, y)
            return run

        def attention(op: Attention, layer: _Layer) -> Callable[..., None]:
            heads, kv_heads, d = op.heads, op.kv_heads, op.head_dim
            cos, sin = self._rotary[id(op.rotary)]
            k_p, v_p, row = qkv_p + heads * d * 4, qkv_p + (heads + kv_heads) * d * 4, kv_heads * d

            def run(n: int, views: object, attend: Callable[[Attention, _Layer], None], adapted: bool) -> None:
                lib.rotary(qkv_p, n, width, heads + kv_heads, d, cos, sin, positions_p)
                lib.write_kv(k_p, width, v_p, width, n, row, layer.k_cache, layer.v_cache, layer.slots,
                             self.kv_format)
                attend(op, layer)
            return run

        steps: list[Callable[..., None]] = []
        pending = False  # PROJ holds a block's output the residual stream has not taken yet
        for layer in self.layers:
            for op in layer.ops:
                kind = type(op)
                if kind is Product:
                    steps.append(product(op))
                    pending = pending or op.out == PROJ
                elif kind is ResidualNorm:
                    steps.append(residual_norm(op, pending))
                    pending = False
                elif kind is Attention:
                    steps.append(attention(op, layer))
                elif kind is HeadNorms:  # per-head norms of q and of k, written back in place
                    q_w, k_w, heads, kv_heads = op.q_norm.weight.data_ptr(), op.k_norm.weight.data_ptr(), \
                        op.heads, op.kv_heads
                    steps.append(lambda n, *_, q_w=q_w, k_w=k_w, heads=heads, kv_heads=kv_heads: (
                        self._head_norm(n, 0, heads, q_w), self._head_norm(n, heads, kv_heads, k_w)))
                elif kind is GatedActivation:
                    gated = lib.silu_mul if op.kind == "silu" else lib.gelu_tanh_mul
                    steps.append(lambda n, *_, gated=gated: gated(p[GATE_UP], n, inter, p[ACT]))
                elif kind is Norm:  # a block's output normed in place
                    w = op.norm.weight.data_ptr()
                    steps.append(lambda n, *_, w=w: lib.rms_norm(proj_p, n, size, 1, 0, w, proj_p, size, eps))
                elif kind is MixtureOfExperts:  # the router's logits in ROUTER: the experts' mixture
                    steps.append(lambda n, views, *_, experts=op.moe.kernel: experts(
                        views[NORMED], views[ROUTER], views[PROJ], settings.quantize_activations, self.threads))
                    pending = True
                else:
                    raise TypeError(f"the CPU step program has no kernel for {kind.__name__}")
        steps.append(residual_norm(self.final_norm, pending=True))
        return steps

    def _head_norm(self, n: int, first: int, count: int, weight: int) -> None:
        """RMSNorm over heads ``first:first+count`` of each row of qkv, written back."""
        d = self.head_dim
        self.lib.rms_norm(
            self._ptr["qkv"] + first * d * 4, n, self.qkv_width, count, d, weight, self._ptr["head_norms"], d, self.eps
        )
        out = self.head_norms.reshape(-1)[: n * count * d].reshape(n, count * d)
        self.qkv[:n, first * d : (first + count) * d] = out


class NativeStepProgram(CpuStepProgram):
    """The step program as one call: the same steps, each written once as a program of C
    kernel operations (kernels/cpu/program.py) and run on one team of threads that meets at
    a barrier between operations, instead of ten calls a layer. Its products are the
    forward pass's kernels: kernels.quant's tiled formats (GGUF files, ``--quantization``),
    or float32 weights for the row counts the forward pass gives kernels/cpu's dense
    kernel (kernels/linear.py); a step of other row counts of a float32 model runs as the
    Python program. LoRA deltas are one more operation after each adapted product
    (kernels/cpu's LoRA kernel reading the step's groups from the descriptors the batch
    rewrites each step). Its results are ``model.forward``'s bit for bit, as the Python
    program's are."""

    @staticmethod
    def takes(recipe: Recipe) -> bool:
        """Whether every product of ``recipe`` has a tiled weight or a float32 one the dense
        kernel reads, and its embedding a table the program can read."""
        embedding = recipe.embedding.table()
        readable = isinstance(embedding, QuantizedMatrix) or (
            isinstance(embedding, DenseRows) and embedding.table.dtype == np.float32
            and embedding.table.flags.c_contiguous
        )
        return readable and all(
            isinstance(weight, QuantizedWeight) or isinstance(weight, CpuWeight) and weight.few_rows > 1
            for weight in (linear.cpu_weight for linear in recipe.products())
        )

    def __init__(
        self, recipe: Recipe, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
        max_model_len: int, layer_group: tuple[int, ...] = (),
    ) -> None:
        self._programs: dict[str, Program] = {}
        self._scratch = np.zeros(0, np.uint8)
        # What the programs point into, kept alive here. A weight reload replaces them: the
        # runner then builds a new program (ModelRunner.replace_model).
        weights = [linear.cpu_weight for linear in recipe.products()]
        self._tiled = [weight for weight in weights if isinstance(weight, QuantizedWeight)]
        dense = [weight for weight in weights if isinstance(weight, CpuWeight)]
        # The most rows of a step the dense kernel takes (0: no float32 products).
        self._dense_rows = min((weight.few_rows for weight in dense), default=0)
        experts = [op.moe.experts for ops in recipe.layers for op in ops if isinstance(op, MixtureOfExperts)]
        small = all(weight.nbytes <= SMALL_WEIGHT_BYTES for weight in self._tiled) and all(
            weight.weight_t.nbytes <= SMALL_WEIGHT_BYTES for weight in dense) and all(
            sum(g.nbytes + d.nbytes for g, d in layer.quantized) <= SMALL_WEIGHT_BYTES for layer in experts)
        # A small model's step is over before a second thread would be awake: one thread.
        super().__init__(recipe, kv_caches, buffers, max_model_len, layer_group, threads=1 if small else None)
        # LoRA adapters run here where each adapted product has the C kernel's descriptor.
        self.applies_lora = all(
            linear.adapters is None or linear.adapters.desc is not None for linear in recipe.products()
        )

    def _in_program(self, rows: int) -> bool:
        """Whether products of ``rows`` rows run as the forward pass runs them (float32 ones go
        through the dense kernel for 2 to its limit, and for one row where set to)."""
        return not self._dense_rows or (rows > 1 or settings.few_rows_for_one) and rows <= self._dense_rows

    def _reserve(self, rows: int) -> None:
        if rows <= self._rows:
            return
        super()._reserve(rows)
        self._programs.clear()  # the buffers moved
        need = max((self.lib.linear_scratch_bytes(weight.desc_address, rows) for weight in self._tiled), default=0)
        self._scratch = np.zeros(need, np.uint8)
        need = max((experts.scratch_bytes(rows, self.threads) for experts in self.experts), default=0)
        self._moe_scratch = np.zeros(need, np.uint8)

    def run(self, n: int) -> torch.Tensor:
        if not self._in_program(n):
            return super().run(n)
        self.seq_lens[:n] = self.buffers.seq_lens.np[:n]
        self._program("decode").run(n, 0, self.threads)
        return self._logits(n)

    def run_queries(self, n: int, table_rows: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        if not self._in_program(n):
            return super().run_queries(n, table_rows, lens)
        self._reserve(n)
        if self._reserve_logits(n):
            self._programs.clear()  # every program that computes logits points at the old buffer
        self.query_tables[:n] = table_rows
        self.query_lens[:n] = lens
        self._program("queries").run(n, 0, self.threads)
        return self._logits(n)

    def run_chunk(self, n: int, sample: bool) -> torch.Tensor | None:
        if not self._in_program(n) or sample and not self._in_program(1):  # (the head: the last row)
            return super().run_chunk(n, sample)
        self._reserve(n)
        seq_len = int(self.buffers.seq_lens.np[0])
        if self._chunk_kernel:
            kv_floats, _ = cpu.prefill_scratch(seq_len, self.kv_heads, self.head_dim, self.threads)
            if self._kv_scratch.size < kv_floats:
                self._kv_scratch = np.zeros(kv_floats, np.float32)
                self._programs.pop("chunk", None)
                self._programs.pop("chunk+sample", None)
        self._program("chunk+sample" if sample else "chunk").run(n, seq_len, self.threads)
        return self._logits(1) if sample else None

    def _program(self, kind: str) -> Program:
        program = self._programs.get(kind)
        if program is None:
            program = self._programs[kind] = self._write(kind)
        return program

    def _linear(self, program: Program, linear: object, x: int, out: int, out_stride: int,
                last_row: bool = False) -> None:
        weight = linear.cpu_weight  # type: ignore[attr-defined]
        if isinstance(weight, CpuWeight):  # float32 [out, in], its transposed view's memory
            k, n = weight.weight_t.shape
            bias = 0 if weight.bias is None else weight.bias.ctypes.data
            program.add(Op.DENSE, weight.weight_t.ctypes.data, n, k, bias, x, out, out_stride, int(last_row))
            return
        program.add(Op.LINEAR, weight.desc_address, x, out, out_stride, int(settings.quantize_activations),
                    self._scratch.ctypes.data, int(last_row))

    def _write(self, kind: str) -> Program:
        """The program of a decode step ("decode"), of independent queries ("queries": a
        decode step whose queries name their block-table row and context length), or of
        a prefill chunk ("chunk", and "chunk+sample", which also computes the last
        token's logits): the recipe's operations, emitted one by one."""
        p, program = self._ptr, Program()
        size, eps, width, inter = self.hidden_size, self.eps, self.qkv_width, self.intermediate
        ids = self.buffers.input_ids.np.ctypes.data
        if isinstance(self.embedding, QuantizedMatrix):
            table = self.embedding
            program.add(Op.EMBED_PACKED, table.data.ctypes.data, int(table.qtype), table.k, ids, p[HIDDEN])
        else:
            program.add(Op.EMBED_FLOAT, self.embedding.table.ctypes.data, size, ids, p[HIDDEN])
        if self.embed_scale is not None:
            program.add(Op.SCALE, p[HIDDEN], size, float(self.embed_scale))
        chunk = kind.startswith("chunk")
        if chunk and not self._chunk_kernel:
            program.add(Op.CHUNK_LENS, p["chunk_lens"])
        pending = False  # PROJ holds a block's output the residual stream has not taken yet
        for layer in self.layers:
            for op in layer.ops:
                kind_of = type(op)
                if kind_of is Product:
                    width, k = getattr(self, op.out).shape[1], getattr(self, op.src).shape[1]
                    self._linear(program, op.linear, p[op.src], p[op.out], width)
                    slot = op.linear.adapters
                    if slot is not None and slot.desc is not None:  # this step's LoRA deltas, if any
                        program.add(Op.LORA, slot.desc.ctypes.data, p[op.src], k, p[op.out], width)
                    pending = pending or op.out == PROJ
                elif kind_of is ResidualNorm:
                    self._emit_residual_norm(program, op, pending)
                    pending = False
                elif kind_of is Attention:
                    self._emit_attention(program, op, layer, kind)
                elif kind_of is HeadNorms:  # per-head norms of q and of k, in place
                    d = op.head_dim
                    program.add(Op.HEAD_NORM, p[QKV], width, op.heads, d, op.q_norm.weight.data_ptr(), eps)
                    program.add(Op.HEAD_NORM, p[QKV] + op.heads * d * 4, width, op.kv_heads, d,
                                op.k_norm.weight.data_ptr(), eps)
                elif kind_of is GatedActivation:
                    gated = Op.SILU_MUL if op.kind == "silu" else Op.GELU_TANH_MUL
                    program.add(gated, p[GATE_UP], inter, p[ACT])
                elif kind_of is Norm:  # a block's output normed in place
                    program.add(Op.RMS_NORM, p[PROJ], op.norm.weight.data_ptr(), p[PROJ], size, eps)
                elif kind_of is MixtureOfExperts:  # the router's logits in ROUTER: the experts' mixture
                    program.add(Op.MOE, op.moe.kernel.desc_address, p[NORMED], p[ROUTER], p[PROJ],
                                int(settings.quantize_activations), self._moe_scratch.ctypes.data)
                    pending = True
                else:
                    raise TypeError(f"the C step program has no operation for {kind_of.__name__}")
        self._emit_residual_norm(program, self.final_norm, pending=True)
        if kind != "chunk":
            vocab = self.logits.shape[1]
            self._linear(program, self.lm_head, p[NORMED], self.logits.ctypes.data, vocab, last_row=chunk)
        return program

    def _emit_residual_norm(self, program: Program, op: ResidualNorm, pending: bool) -> None:
        p, size, eps, weight = self._ptr, self.hidden_size, self.eps, op.norm.weight.data_ptr()
        if pending:  # the residual add of the block before, fused with this norm
            program.add(Op.ADD_RMS_NORM, p[PROJ], p[HIDDEN], weight, p[NORMED], size, eps)
        else:
            program.add(Op.RMS_NORM, p[HIDDEN], weight, p[NORMED], size, eps)

    def _emit_attention(self, program: Program, op: Attention, layer: _Layer, kind: str) -> None:
        """Rotary, the KV write and attention of one layer, for a step of ``kind``."""
        p, width = self._ptr, self.qkv_width
        heads, kv_heads, head_dim = op.heads, op.kv_heads, op.head_dim
        k_offset, v_offset = heads * head_dim * 4, (heads + kv_heads) * head_dim * 4
        cos, sin = self._rotary[id(op.rotary)]
        program.add(Op.ROTARY, p[QKV], width, heads + kv_heads, head_dim, cos, sin, p["positions"])
        program.add(Op.WRITE_KV, p[QKV] + k_offset, width, p[QKV] + v_offset, width, kv_heads * head_dim,
                    layer.k_cache, layer.v_cache, layer.slots, self.kv_format)
        if kind.startswith("chunk") and self._chunk_kernel:
            program.add(Op.PREFILL_ATTENTION, p[QKV], width, heads, kv_heads, head_dim, layer.k_cache,
                        layer.v_cache, self.kv_format, self.block_size, layer.tables, op.scale, p[ATTN],
                        heads * head_dim, self._kv_scratch.ctypes.data, p["scratch"], op.window)
            return
        # decodes, or a chunk's queries one at a time (each over the context to its position)
        tables, lens = {
            "decode": (p["row_ids"], p["seq_lens"]), "queries": (p["query_tables"], p["query_lens"]),
        }.get(kind, (p["chunk_tables"], p["chunk_lens"]))
        program.add(Op.DECODE_ATTENTION, p[QKV], width, p["row_ids"], heads, kv_heads, head_dim,
                    layer.k_cache, layer.v_cache, self.kv_format, self.block_size, layer.tables,
                    self._table_stride, tables, lens, op.scale, p[ATTN], heads * head_dim, p["scratch"],
                    self.scratch_stride, op.window)
