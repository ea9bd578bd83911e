"""How a pooling model turns a prompt's hidden states into its one output (vLLM's PoolerConfig).

A sentence-transformers directory says it in ``modules.json``: the Pooling
module's ``config.json`` gives the pooling mode, a Normalize module asks for
unit vectors. ``--override-pooler-config`` wins over what the directory says;
with neither, a checkpoint gets vLLM's defaults (CLS for BERT encoders, LAST
for decoders, normalised). A classifier (``...ForSequenceClassification``)
pools its CLS token through its own head and is scored, not embedded.

Modules that change the vector after pooling (Dense projections, custom code)
are refused, not skipped: serving a different embedding than the model's
authors meant would be silently wrong.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

from core.model_config import ModelConfig

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# sentence-transformers' Pooling config key -> our pooling type.
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULE_KINDS = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``pooling_type``: which hidden states make the output (LAST token, MEAN of all,
    CLS: the first, ALL: every token's). ``normalize``: scale embeddings to unit length.
    ``task``: ``embed`` or ``classify`` (the model's classification head on its CLS token)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    task: str | None = None

    def resolved(self, model: ModelConfig, model_dir: str | None) -> PoolerConfig:
        """This override over the directory's sentence-transformers modules and the
        model's defaults, every field set (ValueError for what cannot be served)."""
        found = sentence_transformers_pooler(model_dir) if model_dir else None
        task = self.task or ("classify" if model.num_labels else "embed")
        if task == "classify" and not model.num_labels:
            raise ValueError("task classify needs a classification head (a ...ForSequenceClassification checkpoint)")
        if task not in ("embed", "classify"):
            raise ValueError(f"pooler task must be embed or classify, got {task!r}")
        default_type = "CLS" if model.encoder else "LAST"
        pooling_type = (self.pooling_type or (found and found.pooling_type) or default_type).upper()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
        if task == "classify" and pooling_type != "CLS":
            raise ValueError("a classifier pools its CLS token: pooling_type must be CLS")
        normalize = self.normalize
        if normalize is None:
            normalize = found.normalize if found is not None else task == "embed"
        return PoolerConfig(pooling_type=pooling_type, normalize=bool(normalize), task=task)


def parse_override(text: str) -> PoolerConfig:
    """``--override-pooler-config`` JSON (ValueError naming what is wrong)."""
    try:
        return msgspec.json.decode(text, type=PoolerConfig)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"invalid pooler config {text!r}: {exc}") from None


def sentence_transformers_pooler(model_dir: str) -> PoolerConfig | None:
    """What a sentence-transformers directory's modules say (None: not such a directory)."""
    modules_file = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as f:
        modules: list[dict[str, Any]] = json.load(f)
    pooling_type, normalize = None, False
    for module in modules:
        kind = _ST_MODULE_KINDS.get(str(module.get("type", "")).rsplit(".", 1)[-1])
        if kind is None:
            raise ValueError(
                f"{modules_file}: module {module.get('type')!r} is not served (only Transformer, Pooling "
                "and Normalize: a module that changes the vector after pooling would be skipped silently)"
            )
        if kind == "normalize":
            normalize = True
        elif kind == "pooling":
            with open(os.path.join(model_dir, module.get("path", ""), "config.json")) as f:
                pooling_type = _st_pooling_type(json.load(f), modules_file)
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def _st_pooling_type(config: dict[str, Any], where: str) -> str:
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{where}: pooling without the prompt's instruction tokens (include_prompt false) is not served")
    mode = config.get("pooling_mode")
    if isinstance(mode, str):  # sentence-transformers 5 and later also write the mode by name
        names = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
        if mode not in names:
            raise ValueError(f"{where}: pooling mode {mode!r} is not served (lasttoken, mean, cls)")
        return names[mode]
    chosen = [ours for key, ours in _ST_MODES.items() if config.get(key)]
    unsupported = [key for key in _ST_UNSUPPORTED if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(f"{where}: pooling {unsupported or chosen} is not served (exactly one of lasttoken, mean, cls)")
    return chosen[0]
