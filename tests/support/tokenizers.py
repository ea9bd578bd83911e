"""A real byte-level BPE tokenizer (GPT-2 style), trained in a few ms on a small corpus."""

from __future__ import annotations

CORPUS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "The quick brown fox jumps over the lazy dog; the dog did not mind at all!",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "😀 emoji party 🎉🎊 with family 👨‍👩‍👧 and flags 🇫🇷",
    "Ünïcödé façade, naïve café — “quotes” and ‘more’ … done.",
    "Привет, мир! Как дела? こんにちは世界。안녕하세요.",
    "tabs\tand\nnewlines\n\n  double  spaces  end ",
]


def build_byte_level_tokenizer():
    """A small GPT-2-style byte-level BPE tokenizer, trained on CORPUS in a few ms."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
