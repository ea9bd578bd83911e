"""Our models against transformers, the oracle: same weights, same greedy tokens.

Each tiny checkpoint is built and saved by transformers' own classes, loaded
by our loader, and driven through a paged KV cache the way the engine drives
it: requests arrive one step apart, prompts are prefilled in chunks that
share steps with other requests' decodes, blocks are scattered at random.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers

from core.config import EngineArgs
from core.model_config import ModelConfig
from core.models.default_model import DEFAULT_MODEL_DIR as STORIES_DIR
from core.models.default_model import SERVED_NAMES, default_model_dir
from core.models.layers import rope_inv_freq
from core.models.loader import PROGRESS_MIN_BYTES, iter_safetensors, load_model
from core.models.random_model import CHAT_TEMPLATE, ensure_random_model
from kernels.metadata import AttentionMetadata
from tests.support.paged import PagedHarness, single_prefill

STORIES_GREEDY = (
    ", there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)


# ---------------------------------------------------------------- oracle helpers


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere: transformers inits biases to 0 and norms to 1,
    which would let a mis-mapped bias or q/k norm pass unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise)


def _save_hf(hf_config: transformers.PretrainedConfig, model_cls: type, path: Path, **save_kw) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = model_cls(hf_config).float().eval()
    _randomize(hf, seed=1)
    hf.save_pretrained(path, **save_kw)
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    hf.generation_config.pad_token_id = 0
    return hf


def _ours(path: Path, **kw) -> torch.nn.Module:
    return load_model(EngineArgs(model=str(path), **kw).resolve(), "cpu", torch.float32)


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit mask: without one, prompt tokens equal to pad_token_id count as padding.
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


CONFIGS = {
    "llama-gqa-llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        ),
        {},
    ),
    "llama-tied-linear-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        {},
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None), {}),
    "qwen2-bias-sharded": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        dict(max_shard_size="40KB"),
    ),
    "qwen3-qk-norm-head-dim": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32), {}),
}
TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config_cls, model_cls, extra, save_kw = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_hf(config_cls(**TINY, **extra), model_cls, path, **save_kw)
    return request.param, path, hf


def test_greedy_matches_transformers_with_chunked_prefill_and_decodes(checkpoint):
    name, path, hf = checkpoint
    if name == "qwen2-bias-sharded":
        assert (path / "model.safetensors.index.json").exists()
    ours = _ours(path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (5, 13, 1, 22)]
    harness = PagedHarness(ours)
    got = harness.generate(prompts, max_new_tokens=10)
    assert harness.mixed_steps > 0, "the schedule never mixed a prefill chunk with a decode"
    for prompt, tokens in zip(prompts, got):
        assert tokens == _hf_greedy(hf, prompt, 10)


def test_logits_match_transformers(checkpoint):
    _, path, hf = checkpoint
    ours = _ours(path)
    ids = torch.randint(0, TINY["vocab_size"], (19,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = single_prefill(ours, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_inputs_embeds_replace_token_lookup(checkpoint):
    _, path, _ = checkpoint
    ours = _ours(path)
    harness = PagedHarness(ours)
    ids = [3, 1, 4, 1, 5]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(4, 9), query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32), block_tables=torch.tensor([[1, 2, 3]], dtype=torch.int32),
        max_query_len=5, max_seq_len=5, query_start_loc_cpu=[0, 5], seq_lens_cpu=[5],
    )
    with torch.inference_mode():
        a = ours(torch.tensor(ids), torch.arange(5), harness.kv_caches, meta)
        embeds = ours.get_input_embeddings()(torch.tensor(ids))
        b = ours(torch.zeros(5, dtype=torch.long), torch.arange(5), harness.kv_caches, meta, inputs_embeds=embeds)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------- loader


def test_config_reading_from_dict_and_pretrained_config_agree():
    hf = transformers.Qwen3Config(**TINY, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 123.0})
    from_obj = ModelConfig.from_hf(hf, architecture="Qwen3ForCausalLM")
    from_dict = ModelConfig.from_hf(json.loads(hf.to_json_string()), architecture="Qwen3ForCausalLM")
    assert from_obj == from_dict
    assert from_dict.head_dim == 32 and from_dict.rope_theta == 123.0 and from_dict.sliding_window is None
    legacy = {**TINY, "rope_theta": 77.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    cfg = ModelConfig.from_hf(legacy, architecture="LlamaForCausalLM")
    assert cfg.rope_theta == 77.0 and cfg.rope_scaling["rope_type"] == "linear"


def test_rope_scaling_matches_transformers_and_rejects_unknown_types():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_cfg = transformers.LlamaConfig(**TINY, rope_parameters=dict(params))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(16, 500000.0, params), expected)
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        rope_inv_freq(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def _write_config(path: Path, **overrides) -> None:
    cfg = {**TINY, "architectures": ["LlamaForCausalLM"], **overrides}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM"):
        _ours(tmp_path, load_format="dummy")


def test_a_sliding_window_shorter_than_the_context_is_served_in_every_layer(tmp_path):
    """Mistral's window reaches every layer's attention (tests/equivalence/test_families.py checks the tokens)."""
    from core.models.recipe import Attention

    _write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=64)
    model = _ours(tmp_path, load_format="dummy")
    windows = [op.window for ops in model.recipe().layers for op in ops if isinstance(op, Attention)]
    assert windows == [64] * model.config.num_layers


def test_missing_tensor_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_hf(transformers.LlamaConfig(**TINY), transformers.LlamaForCausalLM, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tensors.*qkv_proj"):
        _ours(tmp_path)


def test_dummy_weights_are_seeded_and_finite(tmp_path):
    _write_config(tmp_path)

    def state(seed: int) -> dict[str, torch.Tensor]:
        return _ours(tmp_path, load_format="dummy", seed=seed).state_dict()

    a, b, c = state(0), state(0), state(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    model = _ours(tmp_path, load_format="dummy")
    tokens = PagedHarness(model).generate([[1, 2, 3]], max_new_tokens=3)
    logits = single_prefill(model, [1, 2, 3, 4])
    assert torch.isfinite(logits).all() and len(tokens[0]) == 3


def test_kv_cache_bytes_per_block():
    hf = {**TINY, "num_key_value_heads": 2, "num_attention_heads": 4, "hidden_size": 64}
    cfg = ModelConfig.from_hf(hf, architecture="LlamaForCausalLM")
    # 2 (K and V) * 2 layers * 16 tokens * 2 kv heads * 16 head_dim * 2 bytes
    assert cfg.kv_bytes_per_block(16, torch.bfloat16.itemsize) == 2 * 2 * 16 * 2 * 16 * 2


# ---------------------------------------------------------------- real checkpoint


def test_stories260k_greedy_matches_transformers_and_known_text():
    tok = transformers.AutoTokenizer.from_pretrained(STORIES_DIR)
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES_DIR, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompt = tok("Once upon a time")["input_ids"]
    ours = _ours(STORIES_DIR)
    got = PagedHarness(ours, budget=5).generate([prompt], max_new_tokens=40)[0]
    assert got == _hf_greedy(hf, prompt, 40)
    assert STORIES_GREEDY in tok.decode(got)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(single_prefill(ours, prompt), expected, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- random model


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory) -> str:
    return ensure_random_model(str(tmp_path_factory.mktemp("cache")))


def test_random_model_is_built_once(random_dir):
    weights = Path(random_dir) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_random_model(str(Path(random_dir).parent)) == random_dir
    assert weights.stat().st_mtime_ns == stamp
    leftovers = [p for p in os.listdir(Path(random_dir).parent) if p.startswith(".")]
    assert leftovers == []


def test_random_model_env_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGLLM_CACHE", str(tmp_path))
    path = Path(ensure_random_model())
    assert path.parent == tmp_path and (path / "tokenizer.json").exists()


def test_random_model_tokenizer_and_chat_template(random_dir):
    tok = transformers.AutoTokenizer.from_pretrained(random_dir, local_files_only=True)
    text = "héllo\n\tworld 🙂"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode())  # one token per byte, no BOS
    assert tok.decode(ids) == text
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},  # OpenAI-style parts
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == rendered
    assert tok.eos_token == "<|eos|>" and tok.chat_template == CHAT_TEMPLATE
    gen_cfg = json.loads((Path(random_dir) / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen_cfg["eos_token_id"]


def test_random_model_matches_transformers(random_dir):
    tok = transformers.AutoTokenizer.from_pretrained(random_dir, local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(random_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    n_params = sum(p.numel() for p in hf.parameters())
    assert 1_000_000 < n_params < 10_000_000
    messages = [{"role": "user", "content": "Hello!"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    got = PagedHarness(_ours(Path(random_dir))).generate([prompt], max_new_tokens=8)[0]
    assert got == _hf_greedy(hf, prompt, 8)


# ------------------------------------------------------- embedded default model


def test_packaged_default_model_has_its_licence_and_ringllm_files():
    names = {p.name for p in STORIES_DIR.iterdir()}
    assert {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja", "ringllm.json", "LICENSE", "NOTICE", "README.md",
    } <= names
    assert "MIT License" in (STORIES_DIR / "LICENSE").read_text()
    assert "llama2.c" in (STORIES_DIR / "NOTICE").read_text()
    assert default_model_dir() == str(STORIES_DIR) and SERVED_NAMES[0] == "stories260K"
    # A story ends where the next would begin: <s> is an end-of-sequence id as well.
    assert json.loads((STORIES_DIR / "generation_config.json").read_text())["eos_token_id"] == [2, 1]
    assert json.loads((STORIES_DIR / "ringllm.json").read_text()) == {"chat_stop": ['"', "\n"]}


def test_packaged_chat_template_tells_the_chat_as_a_story():
    tok = transformers.AutoTokenizer.from_pretrained(STORIES_DIR, local_files_only=True)
    messages = [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, Ben."},
        {"role": "user", "content": [{"type": "text", "text": " Let's play. "}]},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<s>Once upon a time, there was a little girl named Lily. She had a friend named Ben.\n"
        'Ben said, "Hello!"\nLily said, "Hi, Ben."\nBen said, "Let\'s play."\nLily said, "'
    )
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[1:5] == tok.encode("Once upon a time", add_special_tokens=False)
    story = [{"role": "system", "content": "Once upon a time, a dog named Max met a cat named Tom."},
             {"role": "user", "content": "Woof!"}]
    assert tok.apply_chat_template(
        story, tokenize=False, add_generation_prompt=True, user_name="Max", assistant_name="Tom"
    ) == '<s>Once upon a time, a dog named Max met a cat named Tom.\nMax said, "Woof!"\nTom said, "'


def test_weight_loading_shows_progress_only_for_large_checkpoints(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(PROGRESS_MIN_BYTES // 4 + 1)}, str(tmp_path / "model.safetensors"))
    shown = io.StringIO()
    assert [name for name, _ in iter_safetensors(tmp_path, file=shown)] == ["w"]
    assert "Loading weights" in shown.getvalue() and "100%" in shown.getvalue()
    quiet = io.StringIO()
    assert len(list(iter_safetensors(STORIES_DIR, file=quiet))) > 0
    assert quiet.getvalue() == ""


def test_a_line_logged_while_weights_load_starts_a_line_of_its_own(tmp_path, capsys):
    """The C kernels' build logs from another thread while the bar is drawn: the line goes above
    the bar, not after the bar's text on the bar's line."""
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(PROGRESS_MIN_BYTES // 4 + 1)}, str(tmp_path / "model.safetensors"))
    handler = logging.StreamHandler(sys.stderr)  # the console handler logging.basicConfig makes
    logging.root.addHandler(handler)
    try:
        for _ in iter_safetensors(tmp_path, file=sys.stderr):
            logging.getLogger("ringllm").warning("cpu_kernels ready")
    finally:
        logging.root.removeHandler(handler)
    err = capsys.readouterr().err
    assert "Loading weights" in err and re.search(r"[\r\n]cpu_kernels ready\n", err), repr(err)
