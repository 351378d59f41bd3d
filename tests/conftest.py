"""Shared fixtures: a tiny offline Llama model directory (see `tether.testing`), and the scripts
under ``bench/`` loaded as modules (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tether.testing import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama + byte-level BPE tokenizer saved as a HF directory (built once per session)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"), vocab=384, seed=0)


@pytest.fixture
def float64():
    """Run a test with float64 as torch's default dtype, restoring the previous default after."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="session")
def bench_script():
    """``bench_script("compare_recipes")`` -> ``bench/compare_recipes.py`` loaded as a module (once per session)."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    loaded = {}

    def load(name):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            loaded[name] = mod
        return loaded[name]

    return load
