"""Reading and writing config YAML files: ``read_yaml_mapping`` (`tether.userio`: trees only, every problem
named with its file and line) and ``save_config`` (`tether.rundir.guard.write_config`, the one writer of
``config.yaml``: the resolved config as YAML loadable with ``--config``, atomically)."""

from __future__ import annotations

from ..rundir.guard import write_config as save_config
from ..userio import read_yaml_mapping

__all__ = ["read_yaml_mapping", "save_config"]
