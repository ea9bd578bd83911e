"""GGUF files that cannot be served: each is refused before anything is loaded, with an
error that names what is wrong, and the command line exits with status 2 and no traceback."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from core.config import EngineArgs
from core.models.default_model import DEFAULT_MODEL_DIR
from core.models.gguf_checkpoint import GGUFError
from tests.support.gguf_files import write_gguf
from tests.support.servers import run_app


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("good") / "stories-q8_0.gguf", "q8_0")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RINGLLM_CACHE", str(tmp_path / "cache"))


def _refused(path: Path) -> str:
    with pytest.raises(GGUFError) as info:
        EngineArgs(model=str(path)).resolve()
    return str(info.value)


def _small_file(path: Path, arch: str = "llama", tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType,
                                                                       tuple[int, ...] | None]] | None = None) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    for name, (data, dtype, shape) in (tensors or {}).items():
        writer.add_tensor(name, data, raw_shape=shape or data.shape, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_good_file_resolves(good: Path) -> None:
    config = EngineArgs(model=str(good)).resolve()
    assert config.load_format == "gguf" and config.model == str(good)


def test_wrong_magic(tmp_path: Path, good: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + good.read_bytes()[4:])
    assert "not a GGUF file" in _refused(bad)


def test_not_a_gguf_file_at_all(tmp_path: Path) -> None:
    bad = tmp_path / "text.gguf"
    bad.write_text("hello, this is not a model\n")
    assert "not a GGUF file" in _refused(bad)


@pytest.mark.parametrize("keep", [0.3, 0.7, 0.999])
def test_truncated_file_names_the_first_tensor_that_does_not_fit(tmp_path: Path, good: Path, keep: float) -> None:
    data = good.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    message = _refused(bad)
    assert "truncated or corrupt" in message and "tensor " in message


def test_truncated_inside_the_header(tmp_path: Path, good: Path) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:200])
    assert "not a GGUF file" in _refused(bad)


def test_a_type_not_served_is_named_with_its_tensor(tmp_path: Path) -> None:
    iq3 = np.zeros((4, 98), np.uint8)  # IQ3_XXS: 98 bytes per 256 values
    bad = _small_file(tmp_path / "iq3.gguf",
                      tensors={"blk.0.ffn_up.weight": (iq3, gguf.GGMLQuantizationType.IQ3_XXS, None)})
    message = _refused(bad)
    assert "blk.0.ffn_up.weight" in message and "IQ3_XXS" in message and "Q4_K" in message


def test_an_unknown_type_id(tmp_path: Path, good: Path) -> None:
    """A type id no GGML version defines, written into a good file's tensor table."""
    data = bytearray(good.read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * dims, 250)
    bad = tmp_path / "type250.gguf"
    bad.write_bytes(bytes(data))
    message = _refused(bad)
    assert "token_embd.weight" in message and "unknown type (id 250)" in message


def test_huge_declared_sizes(tmp_path: Path) -> None:
    """A tensor whose shape claims far more bytes than the file holds."""
    small = np.zeros(8, np.float32)
    bad = _small_file(tmp_path / "huge.gguf",
                      tensors={"output_norm.weight": (small, gguf.GGMLQuantizationType.F32, (1 << 31, 1 << 31))})
    message = _refused(bad)
    assert "output_norm.weight" in message and "does not fit" in message


def test_huge_metadata_string_length(tmp_path: Path) -> None:
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 62) + b"general.architecture"
    bad = tmp_path / "string.gguf"
    bad.write_bytes(header + bytes(64))
    assert "not a GGUF file" in _refused(bad)


def test_an_architecture_not_served(tmp_path: Path) -> None:
    bad = _small_file(tmp_path / "gpt2.gguf", arch="gpt2")
    message = _refused(bad)
    assert "'gpt2'" in message and "llama" in message


def test_a_tensor_with_no_place_in_the_model(tmp_path: Path, good: Path) -> None:
    """A good file with one more tensor than a Llama has."""
    reader = gguf.GGUFReader(good)
    writer = gguf.GGUFWriter(tmp_path / "extra.gguf", "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor("blk.0.mystery.weight", np.zeros(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "blk.0.mystery.weight" in _refused(tmp_path / "extra.gguf")


def test_a_directory_with_several_files(tmp_path: Path, good: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(good.read_bytes())
    assert "several GGUF files" in _refused(tmp_path)


def test_the_command_line_exits_2_without_a_traceback(tmp_path: Path, good: Path) -> None:
    data = good.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 2])
    result = run_app("--model", str(bad), "--port", "0")
    assert result.returncode == 2, result.stderr
    assert "truncated or corrupt" in result.stderr and "Traceback" not in result.stderr


def test_metadata_without_the_model_sizes_is_named(tmp_path: Path) -> None:
    """No sizes in the metadata: the missing key is named."""
    message = _refused(_small_file(tmp_path / "bare.gguf"))
    assert "bare.gguf" in message and "vocabulary size" in message


def test_a_tokenizer_transformers_cannot_read_is_named(tmp_path: Path, good: Path) -> None:
    """A SentencePiece vocabulary goes to transformers' GGUF reader (in a child process, so that
    the frontend never imports it): what it could not read comes back as the refusal."""
    data = bytearray(good.read_bytes())
    name = b"tokenizer.ggml.scores"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    data[at - len(name): at] = b"tokenizer.ggml.xxxxxx"  # the scores renamed away
    bad = tmp_path / "no-scores.gguf"
    bad.write_bytes(bytes(data))
    message = _refused(bad)
    assert "no-scores.gguf" in message and "transformers could not read its tokenizer" in message
