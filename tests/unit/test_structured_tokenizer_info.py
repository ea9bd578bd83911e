"""The structured-output backend's view of a vocabulary (core/structured/xgrammar_backend.py),
against the tokenizers library's own, and xgrammar loaded without transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import tokenizers

from core.models.default_model import DEFAULT_MODEL_DIR
from core.structured.xgrammar_backend import _TokenizerFile, _vocabulary
from tests.support.chat_models import write_vocabulary
from tests.support.servers import REPO


def _tokenizers_view(path: Path) -> tuple[dict[str, int], dict[int, tuple[str, bool]]]:
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    added = {i: (t.content, t.special) for i, t in tokenizer.get_added_tokens_decoder().items()}
    return tokenizer.get_vocab(with_added_tokens=True), added


def _ours(path: Path) -> tuple[dict[str, int], dict[int, tuple[str, bool]]]:
    doc = msgspec.json.decode(path.read_bytes(), type=_TokenizerFile)
    return _vocabulary(doc), {t.id: (t.content, t.special) for t in doc.added_tokens}


@pytest.mark.parametrize("vocab", ["llama-bpe", "qwen2", "stories260K"])
def test_a_real_vocabulary_reads_as_the_tokenizers_library_lists_it(vocab: str, tmp_path: Path) -> None:
    """Llama 3's and Qwen2's byte-level BPE (their real vocabularies, added tokens included) and
    stories260K's SentencePiece-style BPE with byte fallback."""
    directory = DEFAULT_MODEL_DIR if vocab == "stories260K" else write_vocabulary(vocab, None, tmp_path)
    path = Path(directory) / "tokenizer.json"
    assert _ours(path) == _tokenizers_view(path)


@pytest.mark.parametrize("kind", ["unigram", "wordpiece"])
def test_the_other_model_kinds_read_as_the_tokenizers_library_lists_them(kind: str, tmp_path: Path) -> None:
    pieces = ["<unk>", "a", "b", "ab", "▁c", "##d"]
    if kind == "unigram":
        model = tokenizers.models.Unigram([(p, -float(i)) for i, p in enumerate(pieces)], unk_id=0)
    else:
        model = tokenizers.models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="<unk>")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.add_special_tokens(["<s>", "a"])  # a new token, and one the model has
    tokenizer.add_tokens(["xyz"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    assert _ours(path) == _tokenizers_view(path)


def test_xgrammar_is_loaded_without_transformers_and_transformers_stays_importable() -> None:
    script = (
        "import sys\n"
        "from core.structured.xgrammar_backend import xgr\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "info = xgr.TokenizerInfo(['a', 'b', '{', '}', '\"'], vocab_size=5, stop_token_ids=[1])\n"
        "compiled = xgr.GrammarCompiler(info).compile_json_schema('{\"type\": \"object\"}')\n"
        "matcher = xgr.GrammarMatcher(compiled)\n"
        "assert matcher.accept_token(2) and not matcher.accept_token(0)\n"
        "import transformers\n"
        "assert hasattr(transformers, 'PreTrainedTokenizerFast') and transformers.__version__\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
