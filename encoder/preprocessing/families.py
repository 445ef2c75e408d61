"""The preprocessing families by name: a config back from its dump, whichever family it is."""

from __future__ import annotations

from typing import Any

from encoder.preprocessing.config import ProcessorConfig
from encoder.preprocessing.naflex import NaflexPreprocessConfig
from encoder.preprocessing.qwen import PreprocessConfig
from encoder.preprocessing.vit import VitPreprocessConfig


def preprocess_config_from_dump(d: dict[str, Any]) -> ProcessorConfig:
    """The config back from its `model_dump()` (e.g. a replica's `describe()["preprocess"]`), by its `kind`."""
    kinds = {"vit": VitPreprocessConfig, "naflex": NaflexPreprocessConfig}
    cls = kinds.get(d.get("kind"), PreprocessConfig)
    return cls.model_validate(d)
