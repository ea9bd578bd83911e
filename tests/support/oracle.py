"""transformers as the oracle for logprobs: log_softmax of its float32 logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers

ATOL = 1e-4


def load_hf(model_dir: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()


def hf_logprobs(model, token_ids: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(token_ids), V]: row p is the log distribution of the token after position p."""
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)])).logits[0].float()
    return (logits / temperature).log_softmax(dim=-1)


def check_entry(
    token_id: int, entry_ids: Sequence[int], entry_logprobs: Sequence[float], rank: int | None,
    reference: torch.Tensor, k: int,
) -> None:
    """One position: the token, its logprob and rank, and its k alternatives, against
    a reference row [V]. Alternatives are checked by value (their own logprob in the
    reference, and the reference's top-k values), so near-ties may order either way."""
    assert len(entry_ids) == len(entry_logprobs) == k + 1
    assert entry_ids[0] == token_id
    assert abs(entry_logprobs[0] - reference[token_id].item()) < ATOL
    if rank is not None:
        value = reference[token_id]
        assert int((reference > value + ATOL).sum()) + 1 <= rank <= int((reference >= value - ATOL).sum())
    if k:
        top = reference.topk(k).values
        torch.testing.assert_close(torch.tensor(entry_logprobs[1:]), top, atol=ATOL, rtol=0)
        for alt, logprob in zip(entry_ids[1:], entry_logprobs[1:]):
            assert abs(reference[alt].item() - logprob) < ATOL


def check_logprobs(entries, tokens: Sequence[int], reference_rows: torch.Tensor, k: int) -> None:
    """``entries`` (app.logprobs.Logprobs) describe ``tokens``, row i against ``reference_rows[i]``."""
    assert len(entries) == len(tokens) == reference_rows.shape[0]
    for i, token in enumerate(tokens):
        check_entry(token, entries.token_ids[i], entries.logprobs[i], entries.ranks[i], reference_rows[i], k)
