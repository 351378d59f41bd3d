"""Shared fixtures: a tiny offline Llama model directory (see `tether.testing`)."""

from __future__ import annotations

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
