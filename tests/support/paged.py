"""A minimal engine loop over a paged KV cache, for driving a model the way the engine does."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.metadata import AttentionMetadata


@dataclass
class _Req:
    tokens: list[int]
    prompt_len: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedHarness:
    """A minimal engine loop: chunked prefill mixed with decodes over a paged cache."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 256, block_size: int = 4, budget: int = 7):
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        weight = next(model.parameters())
        self.device = weight.device
        self.kv_caches = [
            tuple(torch.zeros(shape, dtype=weight.dtype, device=self.device) for _ in "kv")
            for _ in range(cfg.num_layers)
        ]
        # Block 0 stays unused (it pads block tables); the rest are handed out shuffled.
        self.free = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1).tolist()
        self.model, self.block_size, self.budget = model, block_size, budget
        self.mixed_steps = 0  # steps holding a continued prefill chunk and a decode together

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        reqs = [_Req(list(p), len(p)) for p in prompts]
        step = 0
        while any(len(r.tokens) - r.prompt_len < max_new_tokens for r in reqs):
            arrived = [r for r in reqs[: step + 1] if len(r.tokens) - r.prompt_len < max_new_tokens]
            scheduled, budget = [], self.budget
            for r in arrived:
                n = min(len(r.tokens) - r.computed, budget)
                if n == 0:
                    break
                scheduled.append((r, n))
                budget -= n
            self._step(scheduled)
            step += 1
        return [r.tokens[r.prompt_len :] for r in reqs]

    def _step(self, scheduled: list[tuple[_Req, int]]) -> None:
        bs = self.block_size
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for r, n in scheduled:
            end = r.computed + n
            while len(r.blocks) * bs < end:
                r.blocks.append(self.free.pop())
            pos = list(range(r.computed, end))
            ids += r.tokens[r.computed : end]
            positions += pos
            slots += [r.blocks[p // bs] * bs + p % bs for p in pos]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
        width = max(len(r.blocks) for r, _ in scheduled)
        tables = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r, _ in scheduled], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        kinds = {("decode" if n == 1 else "chunk") for r, n in scheduled if n == 1 or r.computed > 0}
        self.mixed_steps += kinds == {"decode", "chunk"}
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.kv_caches, meta)
        last_rows = []
        for i, (r, n) in enumerate(scheduled):
            r.computed += n
            if r.computed == len(r.tokens):
                last_rows.append((r, qsl[i + 1] - 1))
        if last_rows:
            logits = self.model.compute_logits(hidden[torch.tensor([row for _, row in last_rows], device=dev)])
            for (r, _), tok in zip(last_rows, logits.argmax(-1).tolist()):
                r.tokens.append(tok)



def single_prefill(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits for every position of one prompt prefilled in one chunk."""
    harness = PagedHarness(model)
    n, bs, dev = len(ids), harness.block_size, harness.device
    blocks = [harness.free.pop() for _ in range(-(-n // bs))]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)], device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=dev),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), harness.kv_caches, meta)
        return model.compute_logits(hidden).cpu()


def assert_matches_transformers(
    hf: torch.nn.Module, ours: torch.nn.Module, long_prompt: list[int], prompts: list[list[int]], max_new: int
) -> PagedHarness:
    """``ours`` against transformers' ``hf`` on the same weights (float32): one prefill's logits
    within 1e-4, then every prompt's greedy tokens through the paged harness (returned, for
    what else a test asks of it)."""
    from tests.support.engines import hf_greedy

    with torch.no_grad():
        expected = hf(torch.tensor([long_prompt])).logits[0]
    torch.testing.assert_close(single_prefill(ours, long_prompt), expected, atol=1e-4, rtol=1e-4)
    harness = PagedHarness(ours)
    assert harness.generate(prompts, max_new) == [hf_greedy(hf, p, max_new) for p in prompts]
    return harness
