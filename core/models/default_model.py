"""The embedded default model: llama2.c's TinyStories ``stories260K``, shipped as package data.

``python -m app`` without ``--model`` serves it, so a new user gets readable
text on any CPU with nothing to download. It is a complete Hugging Face
directory (transformers loads it too, which is how tests check the engine
against it) plus the chat template, turn-ending stop strings and licence
described in its README.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "stories260K"
# The first name is the one /v1/models reports; the rest are accepted aliases
# ("ringllm-default" was the embedded model's name before stories260K).
SERVED_NAMES = ("stories260K", "ringllm-default")


def default_model_dir() -> str:
    """Path of the packaged checkpoint; FileNotFoundError if the install lacks it."""
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the embedded model is missing from {DEFAULT_MODEL_DIR}: the package was installed "
            "without its data files; reinstall it, or pass --model DIR"
        )
    return str(DEFAULT_MODEL_DIR)
