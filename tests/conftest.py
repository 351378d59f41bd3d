"""Shared fixtures: a tiny offline Llama model directory (see `tether.testing`), a tiny run's directory
(``make_workdir``; its overrides are in tests/helpers.py), one torch thread, and the scripts under
``bench/`` loaded as modules (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import json
import os
import time
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


#: a `slow` test's expected minutes on the slowest machine CI has run on, where its marker does not say
#: (``pytest.mark.slow(minutes=N)``); tests not marked slow are expected to take seconds
SLOW_MINUTES = 2


def pytest_runtest_setup(item):
    """``TETHER_TEST_DEADLINE`` (seconds since the epoch; .ci/run sets it, since CI must end within 90 minutes): a
    test expected to end past it is skipped, with the deadline in its reason (``-rs`` lists them); past it, every
    test is. A test's expected time is its ``slow`` marker's ``minutes`` (``SLOW_MINUTES`` without one), 0 for the
    others."""
    deadline = os.environ.get("TETHER_TEST_DEADLINE")
    if not deadline:
        return
    slow = item.get_closest_marker("slow")
    minutes = 0 if slow is None else slow.kwargs.get("minutes", SLOW_MINUTES)
    left = float(deadline) - time.time()
    if minutes * 60 > left or left <= 0:
        pytest.skip(f"TETHER_TEST_DEADLINE: expected to take {minutes} min, {max(left, 0) / 60:.1f} min left "
                    f"(run it alone: bash scripts/test.sh {item.nodeid})")


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
