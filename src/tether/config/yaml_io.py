"""Reading and writing config YAML files: ``read_yaml_mapping`` (`tether.yamlfile`: trees only, every problem
named with its file and line) and ``save_config``."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..metrics import write_text_atomic
from ..yamlfile import read_yaml_mapping
from .schema import Config, to_dict

__all__ = ["read_yaml_mapping", "save_config"]


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (loadable with ``--config``), atomically (never half a file)."""
    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
