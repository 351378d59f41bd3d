"""Shared fixtures: a tiny offline Llama model directory (see `tether.testing`), a tiny run's directory
(``make_workdir``; its overrides are in tests/helpers.py), one torch thread, and the scripts under
``bench/`` loaded as modules (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tether.testing import make_tiny_model_dir


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped where torch sees no CUDA device (``pytest -m cuda`` then collects
    and skips them)."""
    cuda = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in cuda:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama + byte-level BPE tokenizer saved as a HF directory (built once per session)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"), vocab=384, seed=0)


@pytest.fixture(scope="session")
def make_workdir(tmp_path_factory):
    """``make_workdir(name, reward_source, n_rows=40)`` -> a fresh directory holding ``rew.py`` (the
    reward module, ``reward_source``) and ``prompts.jsonl``: row i is ``{"question": "Say some numbers i",
    "answer": "i"}``. Each test module wraps it in its own module-scoped fixture."""

    def make(name: str, reward_source: str, n_rows: int = 40) -> Path:
        d = tmp_path_factory.mktemp(name)
        (d / "rew.py").write_text(reward_source)
        (d / "prompts.jsonl").write_text("".join(json.dumps({"question": f"Say some numbers {i}", "answer": str(i)})
                                                 + "\n" for i in range(n_rows)))
        return d

    return make


@pytest.fixture
def one_thread():
    """One torch thread for the test: the same float rounding on every machine (the thread count changes
    the matmuls' summation order, and so which tokens get sampled), and no thread oversubscription on a
    shared machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
