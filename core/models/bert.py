"""BERT-family encoders: ``BertModel`` (embeddings) and ``BertForSequenceClassification``
(cross-encoders), and the same for RoBERTa and XLM-RoBERTa, for the pooling runner.

Every token attends to every token of its own prompt (bidirectional), so a
prompt is always run whole in one step and nothing is kept between steps: no
KV cache. The step's prompts arrive flat, back to back, as for the decoders;
the dense layers run on that flat batch (no padding is multiplied), and only
attention pads the prompts to one length, with a mask.

Module and parameter names are Hugging Face's, so a checkpoint loads by name (RoBERTa's
``roberta.`` body is kept under ``bert.``; q, k and v are fused).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from core.model_config import ModelConfig
from core.models.layers import Embedding, Linear, Module
from kernels.metadata import AttentionMetadata

_QKV = ("query", "key", "value")  # Hugging Face's projections, in the order of our fused rows
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def _embedding(num: int, dim: int) -> Embedding:
    return Embedding(num, dim, _weight=torch.empty(num, dim))  # no random init: the checkpoint fills it


class BertEmbeddings(Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_offset = cfg.position_offset
        self.position_embeddings = _embedding(cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size)
        self.token_type_embeddings = _embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        if self.position_offset:
            positions = positions + self.position_offset
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        hidden += self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


class _Padded:
    """Where a step's flat prompts sit in a [prompts, longest] grid, for attention:
    ``index`` picks each grid cell's flat row (padding cells pick an extra zero row),
    ``valid`` the grid cells that hold tokens, ``mask`` which keys each prompt sees."""

    def __init__(self, starts: list[int], device: torch.device) -> None:
        lengths = torch.tensor([b - a for a, b in zip(starts, starts[1:])], device=device)
        self.num_tokens = starts[-1]
        self.longest = int(lengths.max())
        columns = torch.arange(self.longest, device=device)
        inside = columns[None, :] < lengths[:, None]  # [prompts, longest]
        flat = torch.tensor(starts[:-1], device=device)[:, None] + columns[None, :]
        self.index = torch.where(inside, flat, self.num_tokens).reshape(-1)
        self.valid = inside.reshape(-1).nonzero().squeeze(1)
        self.mask = inside[:, None, None, :]
        self.num_prompts = len(starts) - 1


class BertSelfAttention(Module):
    """Hugging Face's query, key and value projections fused into one (``qkv``: their rows
    one after another), as ``BertModel.load_weights`` fills it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size)

    def forward(self, hidden: torch.Tensor, grid: _Padded) -> torch.Tensor:
        heads, dim = self.num_heads, self.head_dim
        qkv = self.qkv(hidden)  # projected flat: no padding is multiplied
        if grid.num_prompts == 1:  # one prompt: no padding, no mask
            q, k, v = qkv.view(1, -1, 3, heads, dim).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v)
            return out.transpose(1, 2).reshape(hidden.shape[0], heads * dim)
        # Laid out in the grid; padding cells read an extra zero row.
        grid_qkv = F.pad(qkv, (0, 0, 0, 1)).index_select(0, grid.index)
        q, k, v = grid_qkv.view(grid.num_prompts, grid.longest, 3, heads, dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=grid.mask)
        out = out.transpose(1, 2).reshape(-1, heads * dim)
        return out.index_select(0, grid.valid)


class BertLayer(Module):
    """Post-norm: attention, residual, LayerNorm; feed-forward, residual, LayerNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(cfg)
        self.attention.output = nn.Module()
        self.attention.output.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.attention.output.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Module()
        self.output.dense = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, hidden: torch.Tensor, grid: _Padded) -> torch.Tensor:
        attn = self.attention
        context = attn.self(hidden, grid)
        hidden = attn.output.LayerNorm(attn.output.dense(context) + hidden)
        inner = self.act(self.intermediate.dense(hidden))
        return self.output.LayerNorm(self.output.dense(inner) + hidden)


class BertEncoder(nn.Module):
    """The body: embeddings and layers (``BertModel``'s tensors, without its prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))


class BertModel(nn.Module):
    """An encoder serving pooled embeddings, or (``num_labels``) a sequence classifier.

    ``forward`` has the decoders' signature; the KV caches it is given are empty and
    unused, and every prompt of the step must be whole (the scheduler sees to it).
    """

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.bert = BertEncoder(cfg)
        if cfg.num_labels and cfg.roberta:
            # RoBERTa's head: dense + tanh on the first token, then the output projection.
            self.classifier = nn.Module()
            self.classifier.dense = Linear(cfg.hidden_size, cfg.hidden_size)
            self.classifier.out_proj = Linear(cfg.hidden_size, cfg.num_labels)
        elif cfg.num_labels:
            # BertPooler (dense + tanh on the CLS token) and the classifier on top.
            self.bert.pooler = nn.Module()
            self.bert.pooler.dense = Linear(cfg.hidden_size, cfg.hidden_size)
            self.classifier = Linear(cfg.hidden_size, cfg.num_labels)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.bert.embeddings.word_embeddings

    def tie_weights(self) -> None:
        """Nothing is tied (the loader's interface)."""

    def prepare_for_inference(self) -> None:
        """Nothing to prepare: an encoder's products have hundreds of rows (every token of every
        prompt), where torch's oneDNN kernels beat numpy's BLAS, and mixing the two libraries'
        thread pools in one forward pass slows both (kernels/linear.py is for decode-sized rows)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flat tokens of whole prompts [T] at ``positions`` [T] -> last hidden states [T, hidden]."""
        if inputs_embeds is not None:
            raise ValueError("an encoder takes token ids, not prompt embeddings")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        body = self.bert
        hidden = body.embeddings(input_ids, positions, token_type_ids)
        grid = _Padded(attn_metadata.query_start_loc_cpu, hidden.device)
        for layer in body.encoder.layer:
            hidden = layer(hidden, grid)
        return hidden

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """The classifier's logits [N, num_labels] (float32) from each prompt's CLS hidden state."""
        if self.config.roberta:
            return self.classifier.out_proj(torch.tanh(self.classifier.dense(first_tokens))).float()
        pooled = torch.tanh(self.bert.pooler.dense(first_tokens))
        return self.classifier(pooled).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face tensors by name (a classifier's body under ``bert.``). A plain
        BertModel's own pooler is not used by sentence embeddings and is skipped."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        hidden = self.config.hidden_size
        for name, tensor in weights:
            if name.endswith("position_ids") or name.startswith(("cls.", "lm_head.")):
                continue  # buffers, and masked-LM heads
            for prefix in ("bert.", "roberta."):
                if name.startswith(prefix):
                    name = f"bert.{name[len(prefix):]}"
                    break
            else:
                if not name.startswith("classifier."):
                    name = f"bert.{name}"  # a bare body (BertModel, RobertaModel)
            if name.startswith("bert.pooler.") and not hasattr(self.bert, "pooler"):
                continue  # a plain model's own pooler: sentence embeddings do not use it
            rows = slice(None)
            for shard, part in enumerate(_QKV):
                if f".self.{part}." in name:
                    name = name.replace(f".self.{part}.", ".self.qkv.")
                    rows = slice(shard * hidden, (shard + 1) * hidden)
                    loaded.add(f"{name}#{shard}")
                    break
            else:
                loaded.add(name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            target = param.data[rows]
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
            target.copy_(tensor)
        return loaded

    def expected_weights(self) -> set[str]:
        return {
            f"{name}#{shard}" if ".qkv." in name else name
            for name, _ in self.named_parameters()
            for shard in (range(3) if ".qkv." in name else [0])
        }
