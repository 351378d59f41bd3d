"""`tether export` on tiny-model runs: the exported directories load with plain transformers / peft
(in a process where tether cannot be imported) and compute the same logits as tether's own policy
and anchor; LoRA merged and adapter-only; tied embeddings; contiguous weights; dtype; atomic output;
errors; the export is accepted back by `tether train` / `tether eval`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import tether
import tether.export as export_mod
from tether.anchor import make_anchor
from tether.cli import main
from tether.eval.run import load_run_model
from tether.export import ExportError, export_run, plain_contiguous, resolve_run_checkpoint
from tether.models import ModelConfig, load_model
from tether.resolve import load_config
from tether.rundir.checkpoint import load_anchor_tensors, load_policy_weights
from tether.testing import TINY_CHAT_TEMPLATE, make_tiny_model_dir
from tether.train import train

TOL = 1e-5  # fp32 logits: export vs tether's own forward pass
SRC = str(Path(tether.__file__).resolve().parent.parent)  # the tether under test, for subprocesses
PROMPTS = ["What is 2 + 2? The answer is", "Hello world! The quick brown fox"]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]

# Runs in a fresh interpreter with every `tether` import blocked: loads each export with plain
# transformers (or peft on the adapter's base), saves logits and tokenizer facts.
LOADER = r'''
import json, sys

class _NoTether:
    def find_spec(self, name, path=None, target=None):
        if name == "tether" or name.startswith("tether."):
            raise ImportError("tether must not be needed to load an export")
        return None

sys.meta_path.insert(0, _NoTether())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

job = json.load(open(sys.argv[1]))
out = {}
for name, d in job["dirs"].items():
    tok = AutoTokenizer.from_pretrained(d["dir"])
    if d["adapter"]:
        from peft import PeftModel
        base_name = json.load(open(d["dir"] + "/adapter_config.json"))["base_model_name_or_path"]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_name), d["dir"])
    else:
        model = AutoModelForCausalLM.from_pretrained(d["dir"])
    model.eval()
    ids = torch.tensor([tok(p)["input_ids"][: job["T"]] for p in job["prompts"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out[name] = {"logits": logits, "ids": ids, "dtype": str(next(model.parameters()).dtype),
                 "chat": tok.apply_chat_template(job["messages"], tokenize=False, add_generation_prompt=True),
                 "eos": model.generation_config.eos_token_id, "pad": tok.pad_token_id}
assert "tether" not in sys.modules, "tether was imported"
torch.save(out, sys.argv[2])
print("ok")
'''

REWARD = "def digits(completion, example):\n    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    (d / "rew.py").write_text(REWARD)
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"question": f"Say some numbers {i}", "answer": str(i)}) + "\n")
    return d


def _run(work, model_dir, run_dir, recipe="ema_pg", steps=2, **over):
    base = {
        "model.name": str(model_dir), "data.task": str(work / "prompts.jsonl"),
        "data.reward": f"{work / 'rew.py'}:digits", "train.steps": steps, "train.lr": 1e-2,
        "rollout.max_new_tokens": 6, "rollout.prompts_per_step": 2, "rollout.n": 2,
        "run.progress": False, "run.plot": False, "run.exact_kl_samples": 0, "run.save_every": 1,
    }
    if recipe == "ema_pg":
        base["algo.anchor.every"] = 1  # the EMA anchor moves at every step of the short run
    base.update(over)
    return train(load_config(None, base, recipe_name=recipe), run_dir, log=lambda *a: None)


@pytest.fixture(scope="module")
def ema_run(work, tiny_model_dir, tmp_path_factory):
    return _run(work, tiny_model_dir, tmp_path_factory.mktemp("runs") / "ema")


@pytest.fixture(scope="module")
def lora_run(work, tiny_model_dir, tmp_path_factory):
    return _run(work, tiny_model_dir, tmp_path_factory.mktemp("runs") / "lora", **{"model.lora_r": 4})


def _ids(model_dir, T=6):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return torch.tensor([tok(p)["input_ids"][:T] for p in PROMPTS])


def tether_logits(run_dir, ids, *, anchor=False, step=None, base_only=False):
    """Logits of tether's own model: the training code path (load_model, checkpoint policy tensors,
    and for the anchor an Anchor restored from the checkpoint and `applied`)."""
    rc = resolve_run_checkpoint(run_dir, step)
    cfg = load_config(str(Path(run_dir) / "config.yaml"))
    model, _ = load_model(cfg.model.model_copy(update={"device": "cpu", "dtype": "float32"}))
    if not base_only:
        load_policy_weights(rc.checkpoint, model)
    model.eval()
    with torch.no_grad():
        if not anchor:
            return model(input_ids=ids).logits
        a = make_anchor(cfg.algo.anchor, model)
        a.load_state_dict({"kind": a.kind, "num_updates": 1, "kl_ma": 0.0,
                           "tensors": load_anchor_tensors(rc.checkpoint)}, model)
        with a.applied(model):
            return model(input_ids=ids).logits


def _maxdiff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def exports(ema_run, lora_run, tmp_path_factory):
    """Every export of the two runs, then one tether-free subprocess loading all of them."""
    root = tmp_path_factory.mktemp("exports")
    dirs = {
        "policy": export_run(ema_run, root / "policy", max_shard_size="20KB"),  # several shards + index
        "lora_merged": export_run(lora_run, root / "lora_merged"),
        "lora_adapter": export_run(lora_run, root / "lora_adapter", lora="adapter"),
        "lora_anchor": export_run(lora_run, root / "lora_anchor", anchor=True, lora="merge"),
        "lora_adapter_anchor": export_run(lora_run, root / "lora_adapter_anchor", anchor=True, lora="adapter"),
    }
    assert main(["export", str(ema_run), str(root / "anchor"), "--anchor"]) == 0  # through the CLI
    dirs["anchor"] = root / "anchor"
    job = {"dirs": {k: {"dir": str(v), "adapter": k.startswith("lora_adapter")} for k, v in dirs.items()},
           "prompts": PROMPTS, "T": 6, "messages": MESSAGES}
    (root / "job.json").write_text(json.dumps(job))
    (root / "loader.py").write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(root / "loader.py"), str(root / "job.json"), str(root / "out.pt")],
                       capture_output=True, text=True, env=env, cwd=str(root), timeout=600)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
    return dirs, torch.load(root / "out.pt")


def test_policy_export_loads_without_tether_and_matches(exports, ema_run, tiny_model_dir):
    dirs, out = exports
    d = dirs["policy"]
    names = sorted(p.name for p in d.iterdir())
    assert "config.json" in names and "generation_config.json" in names and "README.md" in names
    assert "tokenizer.json" in names and "model.safetensors.index.json" in names
    assert sum(n.startswith("model-") and n.endswith(".safetensors") for n in names) > 1
    assert ".tether.json" in names  # the marker of tether.rundir.owned: what --overwrite may replace
    assert not any(n.startswith((".", "policy", "anchor", "optimizer", "state")) for n in names if n != ".tether.json")
    cfg = json.loads((d / "config.json").read_text())
    # the pre-transformers-5 spellings too (older transformers / vLLM would read fp32 and a default rope_theta)
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    ids = out["policy"]["ids"]
    assert torch.equal(ids, _ids(tiny_model_dir))  # the exported tokenizer tokenizes like the base
    ref = tether_logits(ema_run, ids)
    diff = _maxdiff(out["policy"]["logits"], ref)
    print(f"\n[export] policy: max |logit diff| = {diff:.3g}")
    assert diff <= TOL
    assert _maxdiff(ref, tether_logits(ema_run, ids, base_only=True)) > 1e-3  # training moved the policy


def test_anchor_export_matches_tethers_anchor(exports, ema_run):
    dirs, out = exports
    ids = out["anchor"]["ids"]
    ref = tether_logits(ema_run, ids, anchor=True)
    diff = _maxdiff(out["anchor"]["logits"], ref)
    print(f"\n[export] EMA anchor: max |logit diff| = {diff:.3g}")
    assert diff <= TOL
    # the anchor is neither the policy nor the initial model
    assert _maxdiff(out["anchor"]["logits"], out["policy"]["logits"]) > 1e-4
    assert _maxdiff(ref, tether_logits(ema_run, ids, base_only=True)) > 1e-4


def test_exported_tokenizer_and_generation_config(exports, tiny_model_dir):
    dirs, out = exports
    from transformers import AutoTokenizer

    base_tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    want = base_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in want
    for name in ("policy", "anchor", "lora_merged", "lora_adapter"):
        assert out[name]["chat"] == want, name
        assert out[name]["eos"] == base_tok.eos_token_id and out[name]["pad"] == base_tok.pad_token_id
    gen = json.loads((dirs["policy"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == base_tok.eos_token_id
    assert (dirs["policy"] / "chat_template.jinja").read_text() == TINY_CHAT_TEMPLATE


def test_lora_merged_export_matches_adapted_model(exports, lora_run):
    dirs, out = exports
    assert not any("adapter" in p.name for p in dirs["lora_merged"].iterdir())
    keys = set()
    for f in dirs["lora_merged"].glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            keys |= set(s.keys())
    assert keys and not any("lora" in k or "base_layer" in k or "base_model" in k for k in keys)
    ids = out["lora_merged"]["ids"]
    ref = tether_logits(lora_run, ids)
    diff = _maxdiff(out["lora_merged"]["logits"], ref)
    print(f"\n[export] LoRA merged policy: max |logit diff| = {diff:.3g}")
    assert diff <= TOL
    assert _maxdiff(ref, tether_logits(lora_run, ids, base_only=True)) > 1e-4  # the adapters changed the model
    aref = tether_logits(lora_run, ids, anchor=True)
    adiff = _maxdiff(out["lora_anchor"]["logits"], aref)
    print(f"[export] LoRA merged anchor: max |logit diff| = {adiff:.3g}")
    assert adiff <= TOL and _maxdiff(aref, ref) > 1e-5


def test_lora_adapter_only_export_loads_with_peft(exports, lora_run, tiny_model_dir):
    dirs, out = exports
    d = dirs["lora_adapter"]
    names = {p.name for p in d.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"} <= names
    assert "config.json" not in names and not any(n.startswith("model") for n in names)
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and Path(cfg["base_model_name_or_path"]).resolve() == Path(tiny_model_dir).resolve()
    ids = out["lora_adapter"]["ids"]
    ref = tether_logits(lora_run, ids)
    diff = _maxdiff(out["lora_adapter"]["logits"], ref)
    print(f"\n[export] LoRA adapter-only policy: max |logit diff| = {diff:.3g}")
    assert diff <= TOL
    aref = tether_logits(lora_run, ids, anchor=True)  # the anchor's adapters on the same base
    adiff = _maxdiff(out["lora_adapter_anchor"]["logits"], aref)
    print(f"[export] LoRA adapter-only anchor: max |logit diff| = {adiff:.3g}")
    assert adiff <= TOL and _maxdiff(aref, ref) > 1e-5


def test_tied_embeddings_stay_tied(work, tmp_path):
    tied = make_tiny_model_dir(tmp_path / "tied_model", tie_word_embeddings=True)
    run = _run(work, tied, tmp_path / "tied_run", steps=1)
    out = export_run(run, tmp_path / "tied_export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    keys = set(load_file(str(out / "model.safetensors")))
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # a single stored tensor
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    ids = _ids(tied)
    with torch.no_grad():
        diff = _maxdiff(m(input_ids=ids).logits, tether_logits(run, ids))
    assert diff <= TOL
    # the trained embedding (not the initial one) is what was exported
    policy = load_file(str(resolve_run_checkpoint(run).checkpoint / "policy.safetensors"))
    assert torch.equal(m.model.embed_tokens.weight, policy["model.embed_tokens.weight"])


def test_plain_contiguous_undoes_column_major():
    lin = torch.nn.Linear(3, 5)
    want = lin.weight.detach().clone()
    with torch.no_grad():
        lin.weight.data = lin.weight.data.t().contiguous().t()  # what column_major_linear_weights does
    assert not lin.weight.is_contiguous()
    assert plain_contiguous(lin) == 1
    assert lin.weight.is_contiguous() and torch.equal(lin.weight, want)
    assert plain_contiguous(lin) == 0


def test_column_major_weights_exported_contiguous_and_right(ema_run, tmp_path):
    rc = resolve_run_checkpoint(ema_run)
    model, _, _ = load_run_model(rc)  # the loader export and eval share
    strided = [n for n, p in model.named_parameters() if not p.is_contiguous()]
    assert strided, "load_model should store CPU linear weights column-major (the case under test)"
    out = export_run(ema_run, tmp_path / "e")
    exported = load_file(str(out / "model.safetensors"))
    policy = load_file(str(rc.checkpoint / "policy.safetensors"))
    for n in strided:
        assert exported[n].is_contiguous() and exported[n].shape == policy[n].shape, n
        assert torch.equal(exported[n], policy[n]), n  # same values in the plain row-major layout


def test_dtype_bf16(ema_run, tmp_path):
    out = export_run(ema_run, tmp_path / "bf16", dtype="bf16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as s:
        dtypes = {s.get_tensor(k).dtype for k in s.keys()}
    assert dtypes == {torch.bfloat16}
    policy = load_file(str(resolve_run_checkpoint(ema_run).checkpoint / "policy.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    k = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(got[k], policy[k].to(torch.bfloat16))
    fp32 = export_run(ema_run, tmp_path / "fp32")  # default: the run's dtype (float32)
    assert json.loads((fp32 / "config.json").read_text())["dtype"] == "float32"


def test_nonempty_target_refused_by_cli(ema_run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    env = dict(os.environ, PYTHONPATH=SRC)
    p = subprocess.run([sys.executable, "-m", "tether.cli", "export", str(ema_run), str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "not empty" in lines[0] and "--overwrite" in lines[0], p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["keep.txt"]
    # --overwrite does not delete a directory tether did not write (tests/test_faults_overwrite.py)
    assert main(["export", str(ema_run), str(out), "--overwrite"]) == 2
    assert sorted(x.name for x in out.iterdir()) == ["keep.txt"]
    # an empty directory is fine without; an earlier export is replaced with --overwrite
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(ema_run), str(empty)]) == 0 and (empty / "model.safetensors").is_file()
    assert main(["export", str(ema_run), str(empty), "--overwrite", "--anchor"]) == 0
    assert "anchor" in (empty / "README.md").read_text()


def test_failed_export_leaves_nothing(ema_run, tmp_path, monkeypatch):
    real = export_mod._write_weights

    def dies_midway(model, tmp, max_shard_size):
        real(model, tmp, max_shard_size)  # config.json and weights are written...
        assert (Path(tmp) / "config.json").is_file()
        raise RuntimeError("killed while writing")  # ...then the export dies

    monkeypatch.setattr(export_mod, "_write_weights", dies_midway)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="killed"):
        export_run(ema_run, out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # the temp dir is gone too
    # an existing export survives a failed --overwrite
    monkeypatch.setattr(export_mod, "_write_weights", real)
    export_run(ema_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(export_mod, "_write_weights", dies_midway)
    with pytest.raises(RuntimeError):
        export_run(ema_run, out, overwrite=True, anchor=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # a temp dir left by a killed (kill -9) export of a process that is gone is removed by the next export
    stale = tmp_path / ".new.tmp-export-999999999-abc"
    stale_old = tmp_path / ".new.old-export-999999999"  # killed between the two renames of --overwrite
    mine = tmp_path / f".new.tmp-export-{os.getpid()}-xyz"  # a live process's export in progress
    for d in (stale, stale_old, mine):
        d.mkdir()
        (d / "config.json").write_text("{}")
    monkeypatch.setattr(export_mod, "_write_weights", real)
    export_run(ema_run, tmp_path / "new")
    assert not stale.exists() and not stale_old.exists() and mine.exists()
    assert (tmp_path / "new" / "config.json").is_file()


def test_step_and_errors(work, ema_run, tiny_model_dir, tmp_path, capsys):
    # --step picks an earlier checkpoint
    out = tmp_path / "s1"
    assert main(["export", str(ema_run), str(out), "--step", "1"]) == 0
    from transformers import AutoModelForCausalLM

    ids = _ids(tiny_model_dir)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(out)).eval()(input_ids=ids).logits
    assert _maxdiff(got, tether_logits(ema_run, ids, step=1)) <= TOL
    assert _maxdiff(got, tether_logits(ema_run, ids, step=2)) > 1e-4
    assert "1 of 2" in (out / "README.md").read_text()
    capsys.readouterr()

    def err(argv, *want):
        rc = main(argv)
        e = capsys.readouterr().err.strip()
        assert rc == 2 and len(e.splitlines()) == 1, (argv, e)
        for w in want:
            assert w in e, (argv, e)

    o = str(tmp_path / "o")
    err(["export", str(ema_run), o, "--step", "7"], "no checkpoint at step 7", "available steps: 1, 2")
    err(["export", str(tmp_path / "nope"), o], "cannot export", "no such directory")
    err(["export", str(tiny_model_dir), o], "not a tether run directory")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.yaml").write_text((ema_run / "config.yaml").read_text())
    err(["export", str(empty), o], "cannot export", "has no checkpoint")
    err(["export", str(ema_run), o, "--adapter-only"], "needs a LoRA run")
    err(["export", str(ema_run), o, "--merge-lora"], "needs a LoRA run")
    err(["export", str(ema_run), o, "--max-shard-size", "lots"], "not a size")
    err(["export", str(ema_run), str(ema_run.parent)], "contains the run directory")
    dapo = _run(work, tiny_model_dir, tmp_path / "dapo", recipe="dapo", steps=1)
    capsys.readouterr()  # the training run's own warnings
    err(["export", str(dapo), o, "--anchor"], "no anchor", "no KL term")
    with pytest.raises(SystemExit) as e:  # argparse: mutually exclusive
        main(["export", str(ema_run), o, "--merge-lora", "--adapter-only"])
    assert e.value.code == 2
    assert not Path(o).exists()
    with pytest.raises(ExportError, match="lora must be"):
        export_run(ema_run, o, lora="both")


def test_model_card(exports, ema_run):
    from tether.config.recipes import describe

    dirs, _ = exports
    card = (dirs["anchor"] / "README.md").read_text()
    cfg = load_config(str(ema_run / "config.yaml"))
    last = json.loads((ema_run / "metrics.jsonl").read_text().splitlines()[-1])
    assert describe(cfg.algo) in card and "| recipe | ema_pg |" in card
    assert "anchor (ema, eta=" in card and "2 of 2" in card and str(cfg.model.name) in card
    assert f"| reward_mean | {last['reward_mean']:.6g} |" in card
    assert f"| tether | {tether.__version__}" in card


def test_train_and_eval_accept_the_export(exports, work, tmp_path):
    from tether.eval.cli import load_eval_model, resolve_eval_spec

    dirs, out = exports
    d = dirs["policy"]
    assert resolve_eval_spec(str(d)).kind == "model"
    m, tok, desc = load_eval_model(str(d))
    with torch.no_grad():
        assert _maxdiff(m(input_ids=out["policy"]["ids"]).logits, out["policy"]["logits"]) <= TOL
    m2, _ = load_model(ModelConfig(name=str(d)))
    assert tok.chat_template and sum(p.numel() for p in m2.parameters()) == sum(p.numel() for p in m.parameters())
    run = _run(work, d, tmp_path / "from_export", recipe="grpo", steps=1, **{"run.save_every": 0})
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert resolve_run_checkpoint(run).step == 1
