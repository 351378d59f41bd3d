"""User errors end as one ``tether: error: ...`` line and exit code 2, never a traceback.

Config values, YAML files, data files and models are checked as a user meets them: through
``tether.cli.main`` in-process (the many config cases: a fresh interpreter per case would take
minutes) or ``python -m tether`` in a subprocess (the other subcommands, and one of each kind
for train). Config problems must be found before any heavy work: the model named on those
command lines does not exist, so a check that ran only after the model load would show up as a
model error, and the run directory must not have been created.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import assert_clean_error, run_module
from tether.cli import main

BAD_UTF8 = b"\xff\xfe"


def cli(capsys, *args) -> tuple[int, str, str]:
    """``tether.cli.main(ARGS)`` in this process: (exit code, stdout, stderr)."""
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------- config values, checked up front


BAD_VALUES = [  # (overrides, text the error must contain: the key and the value or the valid range)
    (["train.lr=-1e-5"], "train.lr must be a finite number >= 0, got -1e-05"),
    (["train.lr=.nan"], "train.lr must be a finite number >= 0, got nan"),
    (["train.weight_decay=-0.1"], "train.weight_decay must be a finite number >= 0, got -0.1"),
    (["train.betas=[0.9]"], "train.betas must be two numbers in [0, 1), got [0.9]"),
    (["train.betas=[0.9,1.0]"], "train.betas must be two numbers in [0, 1), got [0.9, 1.0]"),
    (["train.betas=[a,b]"], "train.betas must be two numbers in [0, 1)"),
    (["train.warmup_steps=-1"], "train.warmup_steps must be >= 0, got -1"),
    (["train.warmup_steps=100", "train.steps=5"], "train.warmup_steps=100 exceeds the run's 5 optimizer steps"),
    (["train.grad_clip=-1"], "train.grad_clip must be a finite number >= 0"),
    (["rollout.temperature=0"], "rollout.temperature must be a finite number > 0"),
    (["rollout.temperature=.inf"], "rollout.temperature must be a finite number > 0"),
    (["rollout.top_p=0"], "rollout.top_p must be in (0, 1]"),
    (["rollout.top_p=1.5"], "rollout.top_p must be in (0, 1], got 1.5"),
    (["rollout.top_k=-1"], "rollout.top_k must be >= 0, got -1"),
    (["model.dtype=float8"], "unknown model.dtype 'float8'"),
    (["model.device=gpu0"], "model.device 'gpu0' is not a device"),
    (["model.device=cuda:99"], "model.device 'cuda:99'"),
    (["model.lora_r=-1"], "model.lora_r must be >= 0"),
    (["model.lora_r=4", "model.lora_alpha=0"], "model.lora_alpha must be > 0, got 0"),
    (["model.lora_r=4", "model.lora_dropout=1"], "model.lora_dropout must be in [0, 1), got 1.0"),
    (["model.lora_r=4", "model.lora_target_modules=[]"], "model.lora_target_modules must name at least one"),
    (["model.lora_alpha=32"], "model.lora_alpha only applies with model.lora_r > 0"),
    (["run.save_every=-1"], "run.save_every must be >= 0, got -1"),
    (["run.keep_checkpoints=0"], "run.keep_checkpoints must be >= 1 (or -1 = keep every checkpoint), got 0"),
    (["data.format_weight=.nan"], "data.format_weight must be a finite number"),
    (["data.reward=nosuch"], "unknown data.reward 'nosuch'"),
    (["data.reward=mymod:1fn"], "data.reward 'mymod:1fn': expected module:function"),
    (["data.reward=my-mod:fn"], "the module must be a dotted Python name"),
    (["data.reward=rewards/score.txt:fn"], "a reward file must be a .py file"),
    (["data.reward=/no/such/dir/rew.py:fn"], "reward file /no/such/dir/rew.py not found"),
    (["train.steps=true"], "train.steps: expected an integer, got True"),
    (["rollout.temperature=yes"], "rollout.temperature: expected a number, got True"),
    (["data.system_prompt=no"], "data.system_prompt: expected a string (quote it in YAML), got False"),
    (["run.plot=2"], "run.plot: expected true/false, got 2"),
    (["run.output_dir=elsewhere"], "and run.output_dir=elsewhere set the same key to different values; give one"),
    (["--steps", "3", "train.steps=5"], "--steps 3 and train.steps=5 set the same key to different values"),
]


@pytest.mark.parametrize("overrides,needle", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_train_bad_value_is_one_line_before_the_model_and_run_dir(overrides, needle, tmp_path, capsys):
    run = tmp_path / "run"
    rc, out, err = cli(capsys, "train", "--model", tmp_path / "no-such-model", "--output-dir", run, *overrides)
    assert_clean_error(rc, err, needle)
    assert "no-such-model" not in err  # the value check came first, not the model load
    assert not run.exists()


@pytest.mark.parametrize("overrides", [
    ["train.lr=1e-3", "train.weight_decay=0.01", "train.betas=[0.0,0.95]", "train.warmup_steps=10"],
    ["rollout.temperature=0.7", "rollout.top_p=1", "rollout.top_k=0"],
    ["model.dtype=bf16", "model.device=auto"],
    ["model.device=cpu", "model.lora_r=4", "model.lora_alpha=8", "model.lora_dropout=0.05",
     "model.lora_target_modules=[q_proj,v_proj]"],
    ["run.save_every=0", "run.keep_checkpoints=-1"],
    ["data.reward=math"], ["data.reward=tether.tasks.rewards:math_reward"], ["run.plot=0", "run.progress=1"],
], ids=lambda o: " ".join(o))
def test_valid_values_still_load(overrides):
    from tether.config import parse_overrides
    from tether.resolve import load_config

    load_config(None, parse_overrides(overrides))


def test_reward_file_spec_is_checked_without_importing_it(tmp_path):
    """A path.py:function spec whose file exists passes check(); the file is not run there."""
    from tether.resolve import load_config

    f = tmp_path / "rew.py"
    f.write_text("raise SystemExit('imported at config time')\n")
    assert load_config(None, {"data.reward": f"{f}:score"}).data.reward == f"{f}:score"


def test_keep_checkpoints_minus_one_keeps_every_checkpoint(tmp_path):
    """The documented 'keep all' value: pruning with keep=-1 removes nothing."""
    from tether.rundir.checkpoint import _prune

    for i in range(1, 5):
        (tmp_path / f"step-{i:06d}").mkdir()
    _prune(tmp_path, -1)
    assert len(list(tmp_path.glob("step-*"))) == 4


def test_several_problems_stay_one_per_line(capsys, tmp_path):
    rc, _, err = cli(capsys, "train", "--model", tmp_path / "nope", "--output-dir", tmp_path / "run",
                     "train.lr=-1", "rollout.top_p=2", "run.keep_checkpoints=0")
    error = assert_clean_error(rc, err, "override: 3 problems:")
    problems = error.splitlines()[1:]
    assert len(problems) == 3 and all(p.startswith("  - ") for p in problems), error
    assert [p.split()[1] for p in problems] == ["rollout.top_p", "train.lr", "run.keep_checkpoints"]  # sections' order


def test_real_cli_config_problem_exits_2_before_any_work(tmp_path):
    """The same through ``python -m tether``: exit 2, stderr only the error, no run directory."""
    run = tmp_path / "run"
    r = run_module("train", "--model", tmp_path / "nope", "--output-dir", run, "train.lr=-1", "run.save_every=-1")
    assert_clean_error(r.returncode, r.stderr, "train.lr", "run.save_every")
    assert not run.exists() and r.stdout == ""


# ---------------------------------------------------------------- YAML config files


YAML_FILES = [  # (file name, bytes, text the error must contain besides the file name)
    ("latin1.yaml", b"train:\n  steps: 3\ndata:\n  system_prompt: caf\xe9\n", "line 4: not valid UTF-8"),
    ("broken.yaml", b"train:\n  lr: [1e-5,\n", "line 3 column 1: not valid YAML"),
    ("tabs.yaml", b"train:\n\tlr: 1e-5\n", "line 2 column 1: not valid YAML"),
    ("list.yaml", b"- train.lr=1e-5\n", "the top level must be a mapping of config keys"),
    ("scalar.yaml", b"train.lr=1e-5\n", "the top level must be a mapping"),
]


@pytest.mark.faults
@pytest.mark.parametrize("name,data,needle", YAML_FILES, ids=[c[0] for c in YAML_FILES])
def test_bad_yaml_config_names_the_file(name, data, needle, tmp_path, capsys):
    f = tmp_path / name
    f.write_bytes(data)
    run = tmp_path / "run"
    rc, _, err = cli(capsys, "train", "--config", f, "--model", tmp_path / "nope", "--output-dir", run)
    assert_clean_error(rc, err, f"config file {f}", needle)
    assert not run.exists()


def test_missing_config_file_and_directory(tmp_path, capsys):
    rc, _, err = cli(capsys, "config", "--config", tmp_path / "absent.yaml")
    assert_clean_error(rc, err, f"config file {tmp_path / 'absent.yaml'} does not exist")
    rc, _, err = cli(capsys, "config", "--config", tmp_path)
    assert_clean_error(rc, err, f"config file {tmp_path} is not a file")


@pytest.mark.faults
def test_real_cli_non_utf8_config(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"train:\n  steps: " + BAD_UTF8 + b"\n")
    run = tmp_path / "run"
    r = run_module("train", "--config", f, "--model", tmp_path / "nope", "--output-dir", run)
    assert_clean_error(r.returncode, r.stderr, str(f), "line 2", "not valid UTF-8")
    assert not run.exists()


# ---------------------------------------------------------------- data files


def _parquet_bytes() -> bytes:
    return b"PAR1" + b"\x00" * 16  # the magic, then no valid footer


DATA_FILES = [  # (file name, bytes, text the error must contain besides the file name)
    ("rows.json", b'[{"prompt": "caf\xe9", "answer": "1"}]', "line 1: not valid UTF-8"),
    ("rows.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n',
     "line 2: not valid UTF-8"),
    ("rows.parquet", _parquet_bytes(), "cannot read parquet file"),
]


@pytest.mark.faults
@pytest.mark.parametrize("name,data,needle", DATA_FILES, ids=[c[0] for c in DATA_FILES])
def test_bad_data_file_fails_before_the_model_load(name, data, needle, tmp_path, capsys):
    f = tmp_path / name
    f.write_bytes(data)
    rc, out, err = cli(capsys, "train", "--data", f, "--model", tmp_path / "no-such-model",
                       "--output-dir", tmp_path / "run", "run.progress=false")
    assert_clean_error(rc, err, str(f), needle)
    assert "loading model" not in out and "no-such-model" not in err


@pytest.mark.faults
def test_non_utf8_search_data_file(tmp_path, capsys):
    f = tmp_path / "qa.jsonl"
    f.write_bytes(b'{"question": "caf\xe9?", "golden_answers": ["x"]}\n')
    rc, out, err = cli(capsys, "train", "--task", "search", "--data", f, "--model", tmp_path / "no-such-model",
                       "--output-dir", tmp_path / "run", "run.progress=false")
    assert_clean_error(rc, err, f"{f} line 1: not valid UTF-8")
    assert "loading model" not in out


# ---------------------------------------------------------------- models


def _copy_model(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _set_model_type(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "no_such_architecture"
    (d / "config.json").write_text(json.dumps(cfg))


MODELS = {  # name -> (how to make the model argument from (tmp_path, tiny_model_dir), text the error must contain)
    "missing_path": (lambda t, m: t / "no" / "such" / "model", "not found"),
    "missing_gguf": (lambda t, m: t / "absent.gguf", "not found"),
    "broken_gguf": (lambda t, m: (t / "cut.gguf").write_bytes(b"GGUF\x03\x00") and t / "cut.gguf",
                    "cannot be read"),
    "broken_config_json": (lambda t, m: _copy_model(m, t / "m", lambda d: (d / "config.json").write_text("{oops")),
                           "config"),
    "broken_tokenizer": (lambda t, m: _copy_model(m, t / "m", lambda d: (d / "tokenizer.json").write_text("nope")),
                         "tokenizer"),
    "missing_weights": (lambda t, m: _copy_model(m, t / "m", lambda d: (d / "model.safetensors").unlink()),
                        "model.safetensors"),
    "empty_directory": (lambda t, m: (t / "empty").mkdir() or t / "empty",
                        "holds no model: no config.json (a Hugging Face model directory), no .gguf file"),
    "two_ggufs": (lambda t, m: [(t / "g" / n).parent.mkdir(exist_ok=True) or (t / "g" / n).write_bytes(b"GGUF")
                                for n in ("a.gguf", "b.gguf")] and t / "g", "no config.json and 2 .gguf files"),
}


@pytest.mark.faults
@pytest.mark.parametrize("case", list(MODELS))
def test_model_load_error_names_the_model(case, tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path / "cache"))  # where a GGUF would be converted
    make, needle = MODELS[case]
    model = make(tmp_path, Path(tiny_model_dir))
    rc, _, err = cli(capsys, "train", "--model", model, "--output-dir", tmp_path / "run", "run.progress=false")
    assert_clean_error(rc, err, needle, Path(model).name)


@pytest.mark.faults
def test_real_cli_unknown_architecture(tmp_path, tiny_model_dir):
    """In a subprocess: transformers logs a warning first (to the real stderr), then the one error line."""
    model = _copy_model(Path(tiny_model_dir), tmp_path / "m", _set_model_type)
    r = run_module("train", "--model", model, "--output-dir", tmp_path / "run", "run.progress=false")
    assert_clean_error(r.returncode, r.stderr, f"Could not load model '{model}'", "no_such_architecture")


@pytest.mark.faults
def test_lora_target_module_the_model_lacks(tmp_path, tiny_model_dir, capsys):
    rc, _, err = cli(capsys, "train", "--model", tiny_model_dir, "--output-dir", tmp_path / "run",
                     "run.progress=false", "model.lora_r=2", "model.lora_target_modules=[no_such_proj]")
    assert_clean_error(rc, err, "model.lora_target_modules=['no_such_proj']")


@pytest.mark.faults
def test_real_cli_hub_id_offline(tmp_path):
    r = run_module("train", "--model", "tether-nonexistent/model-xyz", "--output-dir", tmp_path / "run",
                   "run.progress=false", env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")})
    assert_clean_error(r.returncode, r.stderr, "tether-nonexistent/model-xyz", "Hugging Face Hub")


# ---------------------------------------------------------------- the other subcommands


def _fake_run(d: Path, config: bytes = b"recipe: grpo\n", metrics: bytes | None = None) -> Path:
    """A run directory with config.yaml and one (empty) checkpoint: enough to be recognized as a run."""
    ck = d / "checkpoints" / "step-000001"
    ck.mkdir(parents=True)
    (ck / "state.json").write_text('{"step": 1}')
    (ck / "policy.safetensors").write_bytes(b"")
    (d / "config.yaml").write_bytes(config)
    if metrics is not None:
        (d / "metrics.jsonl").write_bytes(metrics)
    return d


def _subcommands(t: Path) -> dict:
    """name -> (argv, text the error must contain), built in the test's tmp dir ``t``."""
    good = t / "good.jsonl"
    good.write_text('{"prompt": "1+1", "answer": "2"}\n')
    latin = t / "latin.json"
    latin.write_bytes(b'[{"prompt": "caf\xe9", "answer": "1"}]')
    bad_cfg = _fake_run(t / "bad_cfg_run", config=b"model:\n  name: caf\xe9\n")
    bad_metrics = _fake_run(t / "bad_metrics_run", metrics=b'{"step": 1}\n' + BAD_UTF8 + b'\n{"step": 3}\n')
    corpus = t / "corpus.jsonl"
    corpus.write_bytes(b'{"id": "1", "contents": "\\"T\\"\\ncaf\xe9"}\n')
    missing = t / "missing_run"
    return {
        "eval_missing_run": (["eval", "--model", missing, "--benchmarks", good], str(missing)),
        "eval_missing_benchmark": (["eval", "--model", missing, "--benchmarks", t / "absent.jsonl"], "absent.jsonl"),
        "eval_non_utf8_benchmark": (["eval", "--model", missing, "--benchmarks", latin], f"{latin} line 1"),
        "eval_non_utf8_run_config": (["eval", "--model", bad_cfg, "--benchmarks", good],
                                     f"{bad_cfg / 'config.yaml'} line 2: not valid UTF-8"),
        "eval_bad_device": (["eval", "--model", missing, "--benchmarks", good, "--device", "gpu0"], "--device 'gpu0'"),
        "export_missing_run": (["export", missing, t / "out"], str(missing)),
        "export_non_utf8_run_config": (["export", bad_cfg, t / "out"],
                                       f"{bad_cfg / 'config.yaml'} line 2: not valid UTF-8"),
        "plot_missing_run": (["plot", missing], f"run directory {missing} does not exist"),
        "plot_non_utf8_metrics": (["plot", bad_metrics], str(bad_metrics / "metrics.jsonl")),
        "retrieve_missing_corpus": (["retrieve", "serve", "--corpus", t / "absent.jsonl", "--port", "0"],
                                    "absent.jsonl"),
        "retrieve_non_utf8_corpus": (["retrieve", "serve", "--corpus", corpus, "--port", "0"],
                                     f"{corpus} line 1: not valid UTF-8"),
        "train_resume_missing_run": (["train", "--resume", missing], f"cannot resume {missing}: no such directory"),
        "train_resume_a_file": (["train", "--resume", good], f"cannot resume {good}: a file, not a run directory"),
    }


SUBCOMMANDS = [  # the keys of _subcommands (built per test: each needs its own files)
    "eval_missing_run", "eval_missing_benchmark", "eval_non_utf8_benchmark", "eval_non_utf8_run_config",
    "eval_bad_device", "export_missing_run", "export_non_utf8_run_config", "plot_missing_run",
    "plot_non_utf8_metrics", "retrieve_missing_corpus", "retrieve_non_utf8_corpus", "train_resume_missing_run",
    "train_resume_a_file"]


@pytest.mark.faults
@pytest.mark.parametrize("case", SUBCOMMANDS)
def test_subcommand_error_is_one_line(case, tmp_path):
    argv, needle = _subcommands(tmp_path)[case]
    r = run_module(*argv, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert_clean_error(r.returncode, r.stderr, needle)
    assert not (tmp_path / "out").exists()


def test_cuda_without_cuda_says_so(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, _, err = cli(capsys, "train", "--model", tmp_path / "nope", "--output-dir", tmp_path / "run",
                     "model.device=cuda")
    assert_clean_error(rc, err, "model.device 'cuda': CUDA is not available on this machine")
