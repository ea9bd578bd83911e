"""The environment variables: read in one module, all documented, the kernels' defaults the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core import envs
from kernels.settings import KernelSettings

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bRINGLLM_[A-Z_]+\b")


def _names_in(paths: list[Path]) -> set[str]:
    return {name for path in paths for name in NAME.findall(path.read_text())}


def test_every_variable_the_code_names_is_declared_and_read_in_envs_only() -> None:
    sources = [p for pkg in ("app", "core", "shm", "kernels") for p in (REPO / pkg).rglob("*.py")]
    assert _names_in(sources) <= set(envs.ENV_VARS)
    reads = re.compile(r"(environ|getenv)\W[^\n]*RINGLLM_")
    assert [p for p in sources if reads.search(p.read_text())] == []  # envs.py reads them by name from its table


def test_the_readme_lists_every_variable() -> None:
    assert set(envs.ENV_VARS) <= _names_in([REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def test_unset_variables_give_the_kernels_their_own_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in envs.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert KernelSettings(**envs.kernel_settings()) == KernelSettings()


def test_values_are_read_when_asked_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLLM_CPU_PREFILL_PAIRS", "1024")
    monkeypatch.setenv("RINGLLM_CPU_KERNELS", "0")
    assert envs.RINGLLM_CPU_PREFILL_PAIRS == 1024 and envs.RINGLLM_CPU_KERNELS is False
    assert envs.kernel_settings()["prefill_pairs"] == 1024
    for text, value in (("auto", None), ("0", False), ("1", True)):
        monkeypatch.setenv("RINGLLM_LONE_ROW_PREFETCH", text)
        assert envs.kernel_settings()["lone_row_prefetch"] is value
    monkeypatch.setenv("RINGLLM_CPU_PREFILL_PAIRS", "many")
    with pytest.raises(ValueError, match="RINGLLM_CPU_PREFILL_PAIRS='many' is not valid"):
        envs.get("RINGLLM_CPU_PREFILL_PAIRS")
    with pytest.raises(AttributeError):
        envs.RINGLLM_NO_SUCH_THING  # noqa: B018
