"""Shared fixtures: tiny random-weight models saved as Hugging Face
directories, and the bundled SmolLM2 when it can be had."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores: keep torch from oversubscribing them in every test process.
os.environ.setdefault("OMP_NUM_THREADS", "2")

from tests import models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama / Qwen2 / Qwen3 checkpoints by name (see models.TINY_SPECS)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: models.build_tiny_model(root / name, name) for name in models.TINY_SPECS}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from ferrox.common.errors import ModelLoadError
    from ferrox.model_files import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as exc:
        if "could not download" not in str(exc):
            raise
        pytest.skip(f"the default model is neither cached nor downloadable: {exc}")


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a chat template, for the live-server tests."""
    from tests.live_server import make_model_dir

    return make_model_dir(tiny_models["llama-gqa-tied"], tmp_path_factory.mktemp("served"))
