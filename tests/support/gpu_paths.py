"""The GPU model runner's paths, run on the CPU.

``GpuPathsRunner`` takes what a GPU always does apart from the device work
itself: decode-only steps padded to a CUDA-graph batch size and run over the
static buffers (eagerly: capture and replay are the GPU-only part), sampled
tokens that reach the persistent batch as placeholders and are fed to the next
step from the sampled-ids tensor, and no CPU step program. ``take_gpu_paths``
makes the engines a test builds in its own process use it.
"""

from __future__ import annotations

import pytest

from core.worker import executor
from core.worker.model_runner import ModelRunner


class GpuPathsRunner(ModelRunner):
    def _gpu_defers_sampled_tokens(self) -> bool:
        return True

    def _gpu_pads_decodes(self) -> bool:
        return True

    def _runs_cpu_program(self) -> bool:
        return False


def take_gpu_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built in this process from now on (until the test ends) run GpuPathsRunner."""
    monkeypatch.setattr(executor, "ModelRunner", GpuPathsRunner)
