"""LoRA adapters made with peft, and peft's own greedy continuations: the oracle of tests/*/test_lora*.py.

An adapter is a seeded ``LoraConfig`` over a base checkpoint with random A and B
(B non-zero, unlike a fresh adapter's, so that it changes what the model says),
saved by ``save_pretrained`` as PEFT saves a trained one. The reference reads it
back with ``PeftModel.from_pretrained``: the same files the server reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str, out_dir: Path, seed: int, targets: list[str] | None = None, rank: int = 8, alpha: float = 16,
    rslora: bool = False, std: float = 0.15,
) -> str:
    """Save a random adapter of ``base_dir`` in ``out_dir``; its path."""
    import peft  # here, not above: it takes seconds, and every pytest worker collects this module's users

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, use_rslora=rslora,
        init_lora_weights=False,
    )
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    adapted.save_pretrained(out_dir)
    return str(out_dir)


def peft_model(base_dir: str, adapter_dir: str | None) -> torch.nn.Module:
    """The base model with the adapter read back by peft (None: the base model alone)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    return peft.PeftModel.from_pretrained(model, adapter_dir).eval()


def peft_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()
