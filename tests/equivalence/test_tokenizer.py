"""The frontend's tokenizer (tokenizers + jinja2) against transformers' AutoTokenizer on the same files.

Token ids, decoded text, special tokens and rendered chat templates must be
the same, for the packaged stories260K (sentencepiece-style BPE with byte
fallback and its story chat template), the random-weights test model
(byte-level with a ChatML template) and stories260K with transformers'
clean-up of tokenization spaces turned on.
"""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from app.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Once upon a time", " leading and  double spaces ", "", "你好，世界！😀 café", "tabs\tand\nnewlines\n",
    "<s> a literal special token </s>", "It's what we're doing, isn't it ?",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello! Do you want to play?"}],
    [{"role": "system", "content": "A sunny day at the park."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello, Ben."}, {"role": "user", "content": "Let's play."}],
    [{"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}],
]


@pytest.fixture(params=["stories", "random", "clean-up-spaces"])
def model_dir(request, stories_dir, random_model_dir, tmp_path) -> str:
    if request.param == "stories":
        return stories_dir
    if request.param == "random":
        return random_model_dir
    path = tmp_path / "clean-up-spaces"
    shutil.copytree(stories_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_same_ids_text_and_special_tokens_as_transformers(model_dir: str) -> None:
    ours = load_tokenizer(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(ours, Tokenizer)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_same_rendered_chat_templates_as_transformers(model_dir: str) -> None:
    ours = load_tokenizer(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert ours.chat_template == theirs.chat_template
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            args = dict(add_generation_prompt=generation_prompt, tokenize=False)
            assert ours.apply_chat_template(messages, **args) == theirs.apply_chat_template(messages, **args)
    template = "{% for m in messages %}{{ m.content | tojson }}{% endfor %}{{ raise_exception('no') if x }}"
    messages = [{"role": "user", "content": "héllo \"quoted\""}]
    assert ours.apply_chat_template(messages, chat_template=template, tokenize=False) == theirs.apply_chat_template(
        messages, chat_template=template, tokenize=False
    )
    with pytest.raises(Exception, match="no"):
        ours.apply_chat_template(messages, chat_template=template, tokenize=False, x=True)


def test_the_frontend_never_loads_transformers_or_torch(stories_dir: str) -> None:
    """Start-up: the frontend's modules and its tokenizer leave both unimported."""
    import subprocess
    import sys

    code = (
        "import sys; import app.async_llm, app.server, app.__main__; "
        f"from app.tokenizer import load_tokenizer; load_tokenizer({stories_dir!r}).encode('x'); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
