"""Packed weights in a file (kernels/packed_file.py): made once, mapped after, equal to packing
in memory; replaced when the source changes; never left half-written."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from kernels import cpu, packed_file
from kernels.packed_file import PackSpec, packed_matrices
from kernels.quant import QuantizedMatrix, QuantizedWeight, QuantType
from kernels.settings import settings
from tests.support.quant_blocks import random_blocks

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build kernels/cpu with")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(settings, "cache_dir", tmp_path / "cache")
    return tmp_path / "cache" / "packed"


def _specs(seed: int = 0) -> list[PackSpec]:
    shapes = [("a", QuantType.Q4_K, 48, 512), ("b", QuantType.Q6_K, 33, 256), ("c", QuantType.Q8_0, 20, 96),
              ("d", QuantType.F16, 17, 40)]
    specs = []
    for i, (name, qtype, rows, k) in enumerate(shapes):
        if qtype == QuantType.F16:
            blocks = np.random.default_rng(seed + i).standard_normal((rows, k)).astype(np.float16).view(np.uint8)
        else:
            blocks = random_blocks(qtype, rows, k, seed=seed + i)
        order = np.random.default_rng(seed).permutation(rows) if name == "a" else None
        specs.append(PackSpec(name, qtype, rows, k, blocks, order))
    return specs


def _source(tmp_path: Path) -> str:
    source = tmp_path / "model.gguf"
    source.touch()
    return str(source)


def test_the_file_holds_what_packing_in_memory_makes(tmp_path: Path, cache: Path) -> None:
    specs = _specs()
    seen = []
    mapped = packed_matrices(specs, "v1", "model", _source(tmp_path), 2, seen.append)
    assert sum(seen) == sum(s.blocks.nbytes for s in specs)
    assert len(list(cache.glob("*.bin"))) == 1
    x = np.random.default_rng(9).standard_normal((3, 512)).astype(np.float32)
    for spec in specs:
        alone = QuantizedMatrix(spec.qtype, spec.blocks, spec.rows, spec.k, spec.order)
        assert np.array_equal(mapped[spec.name].data, alone.data)
        assert not mapped[spec.name].data.flags.writeable  # a read-only mapping, not a copy
        inputs = np.ascontiguousarray(x[:, : spec.k])
        assert np.array_equal(QuantizedWeight([mapped[spec.name]]).matmul(inputs),
                              QuantizedWeight([alone]).matmul(inputs))


def test_a_second_load_maps_the_same_file(tmp_path: Path, cache: Path) -> None:
    source = _source(tmp_path)
    packed_matrices(_specs(), "v1", "model", source, 2)
    (path,) = cache.glob("*.bin")
    made = path.stat().st_mtime_ns
    seen = []
    again = packed_matrices(_specs(), "v1", "model", source, 2, seen.append)
    assert path.stat().st_mtime_ns == made and list(cache.glob("*.bin")) == [path]
    assert sum(seen) == sum(s.blocks.nbytes for s in _specs())  # the bar still reaches its end
    assert np.array_equal(again["b"].data, QuantizedMatrix(*_args(_specs()[1])).data)


def _args(spec: PackSpec) -> tuple:
    return spec.qtype, spec.blocks, spec.rows, spec.k, spec.order


def test_a_changed_source_replaces_its_file(tmp_path: Path, cache: Path) -> None:
    source = _source(tmp_path)
    packed_matrices(_specs(), "v1", "model", source, 2)
    (old,) = cache.glob("*.bin")
    new = packed_matrices(_specs(seed=5), "v2", "model", source, 2)  # the same path, new contents
    (path,) = cache.glob("*.bin")
    assert path != old
    assert np.array_equal(new["a"].data, QuantizedMatrix(*_args(_specs(seed=5)[0])).data)


def test_files_of_sources_that_are_gone_are_removed(tmp_path: Path, cache: Path) -> None:
    gone = tmp_path / "gone.gguf"
    gone.touch()
    packed_matrices(_specs(), "v1", "gone", str(gone), 2)
    gone.unlink()
    packed_matrices(_specs(), "v1", "other", _source(tmp_path), 2)
    assert [p.name.split("-")[0] for p in cache.glob("*.bin")] == ["other"]


def test_an_interrupted_pack_leaves_no_file_and_the_next_load_packs(tmp_path: Path, cache: Path) -> None:
    source = _source(tmp_path)

    def fail(nbytes: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        packed_matrices(_specs(), "v1", "model", source, 2, fail)
    assert not list(cache.glob("*.bin")) and not list(cache.glob(".*.tmp"))
    packed_matrices(_specs(), "v1", "model", source, 2)
    assert len(list(cache.glob("*.bin"))) == 1


def test_a_truncated_file_is_packed_again(tmp_path: Path, cache: Path) -> None:
    source = _source(tmp_path)
    packed_matrices(_specs(), "v1", "model", source, 2)
    (path,) = cache.glob("*.bin")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    again = packed_matrices(_specs(), "v1", "model", source, 2)
    assert np.array_equal(again["a"].data, QuantizedMatrix(*_args(_specs()[0])).data)


def test_without_room_on_disk_the_weights_are_packed_in_memory(tmp_path: Path, cache: Path, monkeypatch,
                                                               caplog) -> None:
    monkeypatch.setattr(packed_file, "_SPARE_BYTES", 1 << 60)
    with caplog.at_level(logging.WARNING, logger="kernels.packed_file"):
        packed = packed_matrices(_specs(), "v1", "model", _source(tmp_path), 2)
    assert "packed weights in memory" in caplog.text and "GB free" in caplog.text
    assert not list(cache.glob("*.bin"))
    assert packed["a"].data.flags.writeable and np.array_equal(packed["a"].data,
                                                               QuantizedMatrix(*_args(_specs()[0])).data)


def test_malformed_specs_are_refused(tmp_path: Path) -> None:
    spec = _specs()[0]
    bad = PackSpec("a", spec.qtype, spec.rows + 1, spec.k, spec.blocks)
    with pytest.raises(ValueError, match="a: Q4_K data"):
        packed_matrices([bad], "v1", "model", _source(tmp_path), 2)
