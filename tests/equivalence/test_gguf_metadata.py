"""A GGUF file's header, config and tokenizer as ringllm reads them (core/models/gguf_header.py,
gguf_metadata.py), against the gguf package's reader and transformers' GGUF conversion."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers

from app.tokenizer import load_tokenizer
from core.model_config import ModelConfig
from core.models import gguf_metadata
from core.models.default_model import DEFAULT_MODEL_DIR
from core.models.gguf_checkpoint import GGUFCheckpoint
from core.models.gguf_header import GGUFFormatError, GGUFHeader, StringArray
from tests.support.gguf_files import qwen_dir, write_gguf

VOCABS = Path(__file__).resolve().parents[3] / "shared" / "chat-formats" / "vocab"
needs_vocabs = pytest.mark.skipif(not VOCABS.is_dir(), reason=f"{VOCABS} is missing (../shared beside the checkout)")

CORPUS = [
    "Hello world! It's a test, isn't it? We'll see. I'M SHOUTING'S 'LL",
    "  leading spaces\n\n\ttabs and\r\nCRLF   trailing   ",
    "数字 12345678 and 3.14159, émigré naïve café, Ελληνικά, русский",
    "def f(x):\n    return x**2  # code\n\n\n",
    "🙂 emoji 👍🏽 <|begin_of_text|> <|eot_id|> <|im_start|>user\nhi<|im_end|> <think>hm</think>",
    "a" * 50 + " " + "1" * 20,
    "\u00a0nbsp\u2003em\u200bzero-width",
    "",
]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RINGLLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def stories_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("stories") / "stories-q8_0.gguf", "q8_0")


def _same(ours: object, theirs: object) -> bool:
    if isinstance(ours, StringArray):
        return ours.tolist() == list(theirs)
    if isinstance(ours, np.ndarray):
        return np.array_equal(ours, np.asarray(theirs))
    if isinstance(ours, float):
        return np.float32(ours) == np.float32(theirs)
    return ours == theirs


@pytest.mark.parametrize("which", ["model", "llama-spm"])
def test_every_field_and_tensor_equals_the_gguf_package(which: str, stories_file: Path) -> None:
    if which != "model" and not VOCABS.is_dir():
        pytest.skip(f"{VOCABS} is missing")
    path = stories_file if which == "model" else VOCABS / f"ggml-vocab-{which}.gguf"
    reader = gguf.GGUFReader(path)
    with GGUFHeader(str(path)) as header:
        fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert set(header.fields) == set(fields)
        for key, field in fields.items():
            assert _same(header.fields[key], field.contents()), key
        assert header.data_offset == reader.data_offset
        assert [t.name for t in reader.tensors] == list(header.tensors)
        for t in reader.tensors:
            info = header.tensors[t.name]
            assert (info.shape, info.ggml_type, info.offset) == (
                tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset))


def test_bad_bytes_are_format_errors(tmp_path: Path, stories_file: Path) -> None:
    data = stories_file.read_bytes()
    for name, body in [("cut", data[:100]), ("magic", b"GGUX" + data[4:]), ("empty", b""),
                       ("big-endian", b"GGUF" + (3).to_bytes(4, "big") + data[8:])]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(body)
        with pytest.raises(GGUFFormatError):
            GGUFHeader(str(bad))


def test_the_metadata_digest_ignores_the_tensors(tmp_path: Path, stories_file: Path) -> None:
    """The tokenizer cache's key: the same for a file whose weights differ, not for another vocabulary."""
    data = bytearray(stories_file.read_bytes())
    with GGUFHeader(str(stories_file)) as header:
        digest, end = header.metadata_digest(), header.fields_end
    data[-100:] = bytes(100)
    other = tmp_path / "other-weights.gguf"
    other.write_bytes(bytes(data))
    with GGUFHeader(str(other)) as header:
        assert header.metadata_digest() == digest
    data[end - 5] ^= 1
    other.write_bytes(bytes(data))
    with GGUFHeader(str(other)) as header:
        assert header.metadata_digest() != digest


def test_a_models_files_in_two_quantizations_share_one_tokenizer(tmp_path: Path, stories_file: Path) -> None:
    """The tokenizer cache's key reads the tokenizer's fields (and the architecture) only: a Q8_0
    and an F32 file of stories260K get one tokenizer directory, made once; another vocabulary
    gets its own."""
    f32 = write_gguf(DEFAULT_MODEL_DIR, tmp_path / "stories-f32.gguf", qtype="f32")
    qwen = write_gguf(qwen_dir(tmp_path / "qwen2", "qwen2", 64, 128, 4, 2, 3), tmp_path / "qwen2.gguf")
    headers = [GGUFHeader(str(p)) for p in (stories_file, f32, qwen)]
    try:
        assert headers[0].metadata_digest() != headers[1].metadata_digest()  # general.file_type differs
        assert headers[0].tokenizer_digest() == headers[1].tokenizer_digest() != headers[2].tokenizer_digest()
    finally:
        for header in headers:
            header.close()
    dirs = [GGUFCheckpoint(str(p)).metadata_dir() for p in (stories_file, f32)]
    assert dirs[0] != dirs[1]
    made = {p.name for p in (tmp_path / "cache" / "gguf-tokenizers").iterdir()}
    assert len(made) == 1 and {p.name for p in dirs[0].iterdir()} == {p.name for p in dirs[1].iterdir()}
    assert (dirs[0] / "tokenizer.json").read_bytes() == (dirs[1] / "tokenizer.json").read_bytes()


@pytest.fixture
def gguf_reads_into_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readers transformers opens a GGUF file with (the gguf package's among them) on the
    file's bytes read into memory rather than a numpy memmap: the same parsing of the same bytes,
    without the memmap subclass's cost on each of the half a million small slices a 128k
    vocabulary's fields take (34 s to 12 s for Llama 3's here)."""

    class InMemory:
        def __new__(cls, path: str | Path, dtype: object = np.uint8, mode: str = "r") -> np.ndarray:
            return np.fromfile(path, dtype=dtype)

    monkeypatch.setattr(gguf.gguf_reader.np, "memmap", InMemory)


@needs_vocabs
@pytest.mark.parametrize("vocab", ["llama-bpe", "qwen2"])
@pytest.mark.usefixtures("gguf_reads_into_memory")
def test_byte_level_tokenizers_encode_as_transformers_does(vocab: str, tmp_path: Path) -> None:
    """Llama 3's and Qwen's vocabularies (128k and 152k tokens): every text of the corpus to the
    same ids, with and without special tokens, and back to the same text."""
    path = VOCABS / f"ggml-vocab-{vocab}.gguf"
    with GGUFHeader(str(path)) as header:
        assert gguf_metadata.write_tokenizer(header, tmp_path)
    ours = load_tokenizer(str(tmp_path))
    oracle = transformers.AutoTokenizer.from_pretrained(str(VOCABS), gguf_file=path.name)
    for text in CORPUS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == oracle.encode(text, add_special_tokens=special)
        ids = oracle.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == oracle.decode(ids)
    assert (ours.bos_token, ours.eos_token) == (oracle.bos_token, oracle.eos_token)


def test_a_sentencepiece_vocabulary_goes_to_transformers(stories_file: Path) -> None:
    with GGUFHeader(str(stories_file)) as header:
        assert header.fields["tokenizer.ggml.model"] == "llama"
        assert not gguf_metadata.write_tokenizer(header, Path("/nonexistent"))  # nothing written, no error


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_config_equals_transformers_reading_the_same_file(arch: str, stories_file: Path, tmp_path: Path) -> None:
    """stories260K (tied head), a Qwen2 (biases, its own head) and a Qwen3 (q/k norms, head_dim
    128 from the file: transformers leaves it at the class default, so it is set as ours reads it)."""
    path = stories_file
    if arch != "llama":
        hidden, head_dim = (64, None) if arch == "qwen2" else (256, 128)
        path = write_gguf(qwen_dir(tmp_path / arch, arch, hidden, 2 * hidden, 4, 2, 3, head_dim=head_dim),
                          tmp_path / f"{arch}.gguf")
    checkpoint = GGUFCheckpoint(str(path))
    try:
        ours = ModelConfig.from_dir(checkpoint.metadata_dir())
        tied = "output.weight" not in checkpoint.tensors
    finally:
        checkpoint.close()
    hf = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf.tie_word_embeddings = tied
    if arch == "qwen3":
        hf.head_dim = 128
    theirs = ModelConfig.from_hf(hf, architecture=gguf_metadata.ARCHITECTURES[arch], eos_token_id=hf.eos_token_id)
    assert ours == theirs
