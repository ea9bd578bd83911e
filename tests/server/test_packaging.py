"""ringllm as an installed package: a wheel built from this tree, installed into a fresh
virtualenv, serves with its C kernels, found by the key of the installed sources."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from app.launcher import REPO, free_port
from kernels import cpu
from kernels.cpu.library import find_compiler
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the build backend is already installed (this machine may have no index).
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True, capture_output=True, text=True,
    )
    (path,) = out.glob("ringllm-*.whl")
    return path


def test_the_wheel_ships_the_server_and_nothing_of_the_checkout(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("kernels/cpu/cpu_kernels.c", "app/static/index.html", "core/models/stories260K/model.safetensors"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("bench/", "tests/"))]


def test_an_installed_wheel_serves_with_the_c_kernels(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    packages = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip())
    # The dependencies are this environment's (a .pth file); ringllm itself only the wheel's.
    (packages / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(packages), str(wheel)],
        check=True, capture_output=True, text=True,
    )
    port = free_port()
    log = tmp_path / "server.log"
    elsewhere = tmp_path / "cwd"  # not the checkout: its packages must not be importable
    elsewhere.mkdir()
    # A fresh cache holding only this checkout's build of the kernels, under its key: a hash of
    # the sources and headers, the compiler, its flags and the CPU. The installed server loads
    # it only if the wheel's sources are these, byte for byte, and all there; compiling them
    # again would prove nothing more (the checkout's build is what every other test runs).
    lib, compiler, built = cpu.load(), find_compiler(), cpu.LIBRARY.cached
    assert lib is not None and compiler is not None and built is not None, "no C compiler here to build the kernels"
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    shutil.copy(built, tmp_path / "cache" / "kernels" / built.name)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RINGLLM_CACHE": str(tmp_path / "cache"), "CC": compiler}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [python, "-m", "app", "--port", str(port)], cwd=elsewhere, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, "the installed server to be ready", 120)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30, json={
            "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
        }).json()
        assert answer["choices"][0]["text"].startswith(", there was a little girl")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    assert f"from {packages / 'core' / 'models' / 'stories260K'}" in text  # the wheel's own files, not the checkout's
    assert "cpu_kernels ready" in text and "torch kernels instead" not in text, text
    assert "compiling cpu_kernels" not in text, text  # the installed sources' key is the checkout's
