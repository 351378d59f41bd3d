"""The run configuration: typed dataclasses, YAML files, recipes and dotted CLI overrides.

Resolution order (later wins): field defaults -> the recipe's algorithm (``--recipe`` or the
YAML's ``recipe:``) and its trainer defaults -> the YAML file -> ``key=value`` overrides.
Unknown keys, and keys that have no effect under the resolved settings, are errors with a
did-you-mean. The resolved config is written to the run directory as ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from .algo.recipes import RECIPES, AlgoConfig, ConfigError, recipe, validate
from .algo.registry import unknown_choice
from .models import ModelConfig

DEFAULT_RECIPE = "ema_pg"


@dataclass
class DataConfig:
    """Where prompts come from and how responses are scored."""

    task: str = "arithmetic"  # arithmetic (synthetic, no files) | gsm8k | math500 | aime24 | amc | minerva | olympiadbench | a .jsonl/.json/.parquet file | a hub dataset id
    split: str = "train"  # dataset split (named and hub datasets)
    prompt_key: Optional[str] = None  # files/hub: the prompt field (default: first of prompt, question, problem)
    answer_key: Optional[str] = None  # files/hub: the answer field (default: answer)
    data_dir: Optional[str] = None  # named datasets: local directory tried before $TETHER_DATA_DIR and the hub
    limit: int = 0  # use only the first N examples (0 = all)
    shuffle: bool = True  # files/datasets: visit examples in a seeded random order (train.seed)
    difficulty: int = 1  # arithmetic: number of steps per problem (1-4)
    reward: str = "auto"  # auto (by task) | arithmetic | gsm8k | math | module:function | path.py:function
    format_weight: float = 0.2  # reward += format_weight when the answer is in the requested format (0 = correctness only)
    system_prompt: str = ""  # system message prepended through the model's chat template ("" = none)


@dataclass
class RolloutConfig:
    """Generation: how many responses per step and how they are sampled."""

    engine: str = "hf"  # hf: transformers generate on the training model | vllm: an in-process vLLM engine (its own venv: scripts/setup.sh --vllm; options rollout.vllm_*; reports log-probs for algo.tis_cap) (engines register in tether.rollout.ENGINES)
    agent: str = "single_turn"  # how an episode runs: single_turn (prompt -> one response); agents register in tether.agents.AGENTS
    prompts_per_step: int = 6  # prompts per trainer step
    n: int = 4  # samples per prompt (the group size G)
    temperature: float = 1.0  # sampling temperature; log-probs are taken at the same temperature
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = 0  # top-k sampling (0 = off)
    max_new_tokens: int = 48  # response length cap; longer responses are truncated (search agent: the cap of each policy turn)
    min_new_tokens: int = 0  # EOS is banned before this many new tokens (0 = off; benchmarks use it for fixed-length decoding)
    stop: list = field(default_factory=list)  # stop strings; the response ends right after one
    batch_size: int = 32  # sequences per generate call
    share_prompt: bool = True  # pre-fill each distinct prompt once per generate call and copy its KV cache to its n samples
    prune_every: int = 64  # decode in segments of N tokens and drop finished rows between them (0 = never; generate alone decodes finished rows until the longest ends)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and refill with new prompts
    max_refill_rounds: int = 3  # dynamic_sampling: at most this many extra generation rounds per step
    overlong_buffer_frac: float = 0.0  # DAPO soft overlong penalty: linear penalty over the last frac of max_new_tokens (0 = off)
    overlong_penalty: float = 1.0  # overlong_buffer_frac > 0: penalty at (and beyond) max_new_tokens
    mask_truncated: bool = False  # exclude responses cut at max_new_tokens from the loss (DAPO overlong filtering)
    vllm_dtype: str = "auto"  # engine=vllm: the engine's weights dtype: auto (the training model's) | float32 | bfloat16 | float16
    vllm_max_model_len: int = 0  # engine=vllm: longest prompt + response the engine serves (0 = the model's max_position_embeddings)
    vllm_enforce_eager: bool = False  # engine=vllm: run the model eagerly (no torch.compile / CUDA graphs: faster start, slower decode)
    vllm_gpu_memory_utilization: float = 0.5  # engine=vllm, GPU only: fraction of GPU memory vLLM takes for its weights and KV cache (the rest is the trainer's; an error on CPU)
    vllm_kv_cache_gb: int = 0  # engine=vllm, CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE; 0 = vLLM's default; an error on GPU, where vllm_gpu_memory_utilization sizes it)
    vllm_sleep: bool = False  # engine=vllm, GPU only: sleep mode between generations (weights offloaded to CPU, KV cache freed, woken for the next rollout; an error on CPU)
    vllm_sync_bucket_mb: int = 256  # engine=vllm: weights are sent to the engine after each trainer step in buckets of at most this many MB


@dataclass
class SearchConfig:
    """The search agent (rollout.agent=search): retriever and budgets. Defaults follow Search-R1."""

    retriever: str = "bm25"  # bm25 (bm25s over search.corpus) | dense (sentence-transformers + faiss; extra tether[dense]) | http (a Search-R1 retrieval server at search.url)
    corpus: str = ""  # bm25, dense: a JSONL corpus of {"id", "contents"} rows ("" = corpus.jsonl of the search data dir)
    data_dir: str = ""  # the search data directory for named sets and the corpus ("" = $TETHER_SEARCH_DATA_DIR, else <$TETHER_DATA_DIR>/../search)
    url: str = ""  # http: the server's base URL; queries go to POST <url>/retrieve
    dense_model: str = "intfloat/e5-base-v2"  # dense: a sentence-transformers model name or local directory
    topk: int = 3  # passages per search
    max_searches: int = 4  # searches per episode; then one final turn with searching disabled
    max_obs_tokens: int = 512  # tokens per observation; longer ones are cut (the closing tag is kept)
    max_context: int = 4096  # prompt + response tokens per episode; an episode that reaches it ends ("length")
    timeout: float = 30.0  # http: seconds per request
    retries: int = 2  # http: extra attempts after a failed request; a search that still fails becomes an observation saying so


@dataclass
class TrainConfig:
    """Optimization: the update over one rollout batch."""

    steps: int = 14  # trainer steps (rollout + update); the default run fits 20 minutes on 2 CPU cores. Raised on --resume it extends the run (see train.schedule)
    lr: float = 2e-5  # AdamW learning rate (EMA-PG used 1e-6 for hundreds of steps; the short CPU default needs more); set on --resume, it applies from the next step
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    warmup_steps: int = 0  # linear warm-up, in optimizer steps
    schedule: str = "constant"  # constant | cosine | linear (after warm-up, to 0 at the last optimizer step). The LR never jumps on --resume: when train.steps (or the schedule) changes, the decay is re-laid from the multiplier reached to 0 at the new end; a run already decayed to 0 cannot be extended except with constant (train.lr)
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    epochs: int = 1  # passes over each rollout batch (> 1 makes the update off-policy)
    mini_batches: int = 1  # optimizer steps per epoch; each sees 1/mini_batches of the batch
    micro_batch_size: int = 8  # sequences per forward/backward (gradient accumulation)
    logprob_chunk: int = 1024  # tokens per chunk in the log-prob engine (peak memory ~ chunk x vocab)
    share_prompt: bool = True  # forward each group's prompt once per micro-batch and reuse its KV cache for the G responses (exact; off under gradient checkpointing)
    seed: int = 0  # seeds data order, sampling and initialization


@dataclass
class RunConfig:
    """Outputs: run directory, checkpoints, logs."""

    output_dir: str = ""  # run directory ("" = runs/<recipe>-<task>-<timestamp>)
    save_every: int = 10  # checkpoint every N trainer steps (0 = only at the end)
    keep_checkpoints: int = 2  # keep the newest N checkpoints
    log_samples: int = 2  # prompts/responses per step written to samples.jsonl
    exact_kl_samples: int = 1  # responses per step whose exact full-vocabulary KL to the anchor is logged (0 = off)
    progress: bool = True  # a progress bar with live reward and KL
    plot: bool = True  # write curves.png when the run ends
    tensorboard: bool = False  # also log to TensorBoard (needs the tensorboard package)
    wandb: bool = False  # also log to Weights & Biases (needs wandb; honours WANDB_* variables)
    wandb_project: str = "tether"  # wandb: project name


@dataclass
class EvalConfig:
    """Evaluation during training (off by default); the same metrics as `tether eval`."""

    every: int = 0  # evaluate every N trainer steps and after the last one (0 = off)
    benchmarks: list = field(default_factory=lambda: ["arithmetic"])  # arithmetic (the held-out synthetic split) | gsm8k | math500 | ... | a file
    limit: int = 50  # problems per benchmark
    n: int = 1  # samples per problem
    greedy: bool = True  # temperature 0 (n must be 1); false samples at eval.temperature
    temperature: float = 1.0  # greedy=false: sampling temperature
    max_new_tokens: int = 256  # response length cap during evaluation
    anchor: bool = False  # also evaluate the anchor (fixed / ema / reset / kl_reset), as eval_anchor/...


@dataclass
class Config:
    """Everything a training run needs."""

    recipe: str = DEFAULT_RECIPE  # named algorithm (tether.algo.recipes); `algo.*` keys override its fields
    algo: AlgoConfig = field(default_factory=lambda: recipe(DEFAULT_RECIPE))
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    search: SearchConfig = field(default_factory=SearchConfig)


# Trainer settings a recipe brings along (the algorithm alone does not define them).
RECIPE_TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {
    "dapo": {"rollout.dynamic_sampling": True, "rollout.overlong_buffer_frac": 0.25},
    # RPG ties pi to the sampler pi_old: the KL only acts when the update is off-policy.
    **{f"rpg_{r}{v}": {"train.mini_batches": 2} for r in ("", "reinforce_") for v in ("fkl", "rkl", "ufkl", "urkl")},
}


# `tether train --task NAME`: settings a task brings (after the recipe, before YAML and overrides).
TASK_PRESETS: dict[str, dict[str, Any]] = {
    "math": {},  # the default: single-turn math with the arithmetic / GSM8K / MATH data
    # Search-R1's setting: multi-turn search agent on the closed-pool multi-hop set, exact match only
    "search": {"rollout.agent": "search", "data.task": "multihop", "data.format_weight": 0.0,
               "rollout.n": 5, "rollout.max_new_tokens": 128},
}


# ---------------------------------------------------------------- generic dataclass plumbing


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field's declared type."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        args = [a for a in args if a is not type(None)]
        for a in args:  # a value that already has one of the types stays as it is
            plain = typing.get_origin(a) or a
            if isinstance(plain, type) and isinstance(value, plain) and not isinstance(value, bool) or a is bool and isinstance(value, bool):
                return value
        args = sorted(args, key=lambda a: a is str)  # otherwise convert, trying str last
        for a in args:
            try:
                return _coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} is not a valid {tp}")
    if tp in (list, typing.List) or origin in (list, typing.List):
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return list(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value) if not isinstance(value, str) else int(float(value)) if "e" in value.lower() else int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def _set(obj, dotted: str, value: Any, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    fields = _fields(obj)
    full = prefix + head
    if head not in fields:
        close = difflib.get_close_matches(head, list(fields), n=1)
        hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
        raise ConfigError(f"unknown config key {full!r}.{hint} Valid keys here: {', '.join(prefix + f for f in fields)}")
    cur = getattr(obj, head)
    hints = typing.get_type_hints(type(obj))
    if dataclasses.is_dataclass(cur):
        if rest:
            _set(cur, rest, value, full + ".")
            return
        if not isinstance(value, dict):
            raise ConfigError(f"{full!r} is a section; set its keys ({full}.<key>=...) or give a mapping")
        for k, v in value.items():
            _set(cur, str(k), v, full + ".")
        return
    if rest:
        raise ConfigError(f"{full!r} is not a section (cannot set {prefix + dotted!r})")
    setattr(obj, head, _coerce(value, hints[head], full))


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("stop",):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_dict(cfg) -> dict:
    """A plain dict of the config (for YAML and logs)."""
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------- building a config


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['a.b=1', 'c=x'] -> {'a.b': 1, 'c': 'x'} (values parsed as YAML scalars)."""
    out = {}
    for it in items:
        if "=" not in it:
            raise ConfigError(f"override {it!r} is not of the form key=value (e.g. train.lr=1e-5)")
        k, v = it.split("=", 1)
        out[k.strip()] = yaml.safe_load(v) if v.strip() else ""
    return out


def load_config(path: Optional[str] = None, overrides: Optional[dict[str, Any]] = None,
                recipe_name: Optional[str] = None, task: Optional[str] = None) -> Config:
    """Resolve a Config: recipe -> task preset (``TASK_PRESETS``) -> YAML file -> overrides, then validate it."""
    file_vals: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config keys")
        file_vals = _flatten(data)
    overrides = dict(overrides or {})
    name = recipe_name or overrides.pop("recipe", None) or file_vals.pop("recipe", None) or DEFAULT_RECIPE
    file_vals.pop("recipe", None)
    overrides.pop("recipe", None)
    if name not in RECIPES:
        from .algo.registry import unknown_choice
        raise ConfigError(unknown_choice("recipe", name, RECIPES))
    cfg = Config(recipe=name, algo=recipe(name))
    for k, v in RECIPE_TRAINER_DEFAULTS.get(name, {}).items():
        _set(cfg, k, v)
    if task is not None:
        if task not in TASK_PRESETS:
            raise ConfigError(unknown_choice("task", task, TASK_PRESETS))
        for k, v in TASK_PRESETS[task].items():
            _set(cfg, k, v)
    for source, vals in ((path or "config file", file_vals), ("override", overrides)):
        for k, v in vals.items():
            try:
                _set(cfg, k, v)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
    base = recipe(name)
    cfg.algo.name = base.name
    cfg.algo.name = name if cfg.algo == base else f"{name}+custom"
    return check(cfg)


def check(cfg: Config) -> Config:
    """Validate the algorithm and the trainer settings together; errors list every problem."""
    errs: list[str] = []
    try:
        validate(cfg.algo)
    except ConfigError as e:
        errs.extend(line.strip()[2:] for line in str(e).splitlines()[1:])
    d, r, t = cfg.data, cfg.rollout, cfg.train
    dd, dr = DataConfig(), RolloutConfig()
    if d.task != "arithmetic" and d.difficulty != dd.difficulty:
        errs.append("data.difficulty only applies to data.task=arithmetic")
    if d.task == "arithmetic":
        for k in ("prompt_key", "answer_key", "data_dir", "split", "limit", "shuffle"):
            if getattr(d, k) != getattr(dd, k):
                errs.append(f"data.{k} has no effect with the synthetic arithmetic task (an endless seeded stream)")
        if not 1 <= d.difficulty <= 4:
            errs.append(f"data.difficulty must be 1-4, got {d.difficulty}")
    from .agents import AGENTS
    from .rollout import ENGINES
    if r.engine not in ENGINES:
        errs.append(unknown_choice("rollout.engine", r.engine, ENGINES))
    errs.extend(_check_engine(cfg))
    if r.agent not in AGENTS:
        errs.append(unknown_choice("rollout.agent", r.agent, AGENTS))
    sc, ds = cfg.search, SearchConfig()
    if r.agent != "search":
        for k in ("retriever", "corpus", "data_dir", "url", "dense_model", "topk", "max_searches", "max_obs_tokens",
                  "max_context", "timeout", "retries"):
            if getattr(sc, k) != getattr(ds, k):
                errs.append(f"search.{k} only applies with rollout.agent=search")
    else:
        if sc.retriever not in ("bm25", "dense", "http"):
            errs.append(unknown_choice("search.retriever", sc.retriever, ("bm25", "dense", "http")))
        if sc.retriever == "http" and not sc.url:
            errs.append("search.retriever=http needs search.url (the retrieval server's base URL)")
        if sc.retriever != "http" and sc.url:
            errs.append("search.url only applies with search.retriever=http")
        if sc.retriever == "http" and sc.corpus:
            errs.append("search.corpus does not apply with search.retriever=http (the server holds the corpus)")
        if sc.retriever != "dense" and sc.dense_model != ds.dense_model:
            errs.append("search.dense_model only applies with search.retriever=dense")
        for k in ("timeout", "retries"):
            if sc.retriever != "http" and getattr(sc, k) != getattr(ds, k):
                errs.append(f"search.{k} only applies with search.retriever=http")
        for k in ("topk", "max_obs_tokens", "max_context"):
            if getattr(sc, k) < 1:
                errs.append(f"search.{k} must be >= 1")
        if sc.max_searches < 0 or sc.retries < 0 or sc.timeout <= 0:
            errs.append("search.max_searches and search.retries must be >= 0 and search.timeout > 0")
    if not 0 <= r.min_new_tokens <= r.max_new_tokens:
        errs.append(f"rollout.min_new_tokens must be in [0, rollout.max_new_tokens], got {r.min_new_tokens}")
    if not r.dynamic_sampling and r.max_refill_rounds != dr.max_refill_rounds:
        errs.append("rollout.max_refill_rounds only applies with rollout.dynamic_sampling=true")
    if r.overlong_buffer_frac == 0 and r.overlong_penalty != dr.overlong_penalty:
        errs.append("rollout.overlong_penalty only applies with rollout.overlong_buffer_frac > 0")
    if not 0 <= r.overlong_buffer_frac <= 1:
        errs.append("rollout.overlong_buffer_frac must be in [0, 1]")
    for k in ("prompts_per_step", "n", "max_new_tokens", "batch_size"):
        if getattr(r, k) < 1:
            errs.append(f"rollout.{k} must be >= 1")
    for k in ("steps", "epochs", "mini_batches", "micro_batch_size", "logprob_chunk"):
        if getattr(t, k) < 1:
            errs.append(f"train.{k} must be >= 1")
    if t.schedule not in ("constant", "cosine", "linear"):
        errs.append(f"unknown train.schedule {t.schedule!r}. Valid choices: constant, cosine, linear")
    if len(t.betas) != 2:
        errs.append("train.betas must be two numbers")
    if r.prompts_per_step * r.n < t.mini_batches:
        errs.append("train.mini_batches exceeds the number of sequences per step")
    if (cfg.algo.anchor.kind == "iterative" and t.epochs == 1 and t.mini_batches == 1
            and cfg.algo.kl.estimator != "none"):
        errs.append("anchor 'iterative' with train.epochs=1 and train.mini_batches=1 is exactly on-policy: "
                    "pi_a = pi_old = pi, so the KL term is identically zero; use train.mini_batches > 1 "
                    "or train.epochs > 1, or another anchor")
    e, de = cfg.eval, EvalConfig()
    if e.every == 0:
        for k in ("benchmarks", "limit", "n", "greedy", "temperature", "max_new_tokens", "anchor"):
            if getattr(e, k) != getattr(de, k):
                errs.append(f"eval.{k} has no effect while eval.every=0 (evaluation off)")
    else:
        if e.every < 0 or e.limit < 1 or e.n < 1 or e.max_new_tokens < 1:
            errs.append("eval.every, eval.limit, eval.n and eval.max_new_tokens must be positive")
        if e.greedy and e.n != 1:
            errs.append("eval.greedy=true gives n identical samples; set eval.n=1 or eval.greedy=false")
        if e.greedy and e.temperature != de.temperature:
            errs.append("eval.temperature has no effect with eval.greedy=true")
        if e.anchor and cfg.algo.anchor.kind in ("none", "iterative"):
            errs.append(f"eval.anchor=true needs an anchor with its own weights, not {cfg.algo.anchor.kind!r}")
        if not e.benchmarks:
            errs.append("eval.benchmarks is empty")
    if cfg.run.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except Exception:
            errs.append("run.tensorboard=true needs the tensorboard package (pip install tensorboard)")
    if cfg.run.wandb:
        try:
            import wandb  # noqa: F401
        except Exception:
            errs.append("run.wandb=true needs the wandb package (pip install wandb)")
    if errs:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))
    return cfg


VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _check_engine(cfg: Config) -> list[str]:
    """The engine options (rollout.vllm_*) and rollout correction against the engine's abilities.

    Checks that need the device (GPU-only / CPU-only vLLM options) run when the engine is built
    (``tether.rollout.vllm.VLLMEngine``), where vLLM's platform is known.
    """
    import importlib.util

    from .rollout import ENGINES, engine_reports_logp
    r, dr, errs = cfg.rollout, RolloutConfig(), []
    vllm_keys = [f.name for f in dataclasses.fields(RolloutConfig) if f.name.startswith("vllm_")]
    if r.engine != "vllm":
        errs += [f"rollout.{k} only applies with rollout.engine=vllm" for k in vllm_keys
                 if getattr(r, k) != getattr(dr, k)]
    else:
        if importlib.util.find_spec("vllm") is None:
            errs.append("rollout.engine=vllm needs vLLM, which lives in its own environment: run "
                        "`bash scripts/setup.sh --vllm` and use .venv-vllm/bin/tether")
        if r.vllm_dtype not in VLLM_DTYPES:
            errs.append(unknown_choice("rollout.vllm_dtype", r.vllm_dtype, VLLM_DTYPES))
        if r.vllm_max_model_len < 0:
            errs.append("rollout.vllm_max_model_len must be >= 0 (0 = the model's own)")
        if not 0 < r.vllm_gpu_memory_utilization <= 1:
            errs.append("rollout.vllm_gpu_memory_utilization must be in (0, 1]")
        if r.vllm_kv_cache_gb < 0:
            errs.append("rollout.vllm_kv_cache_gb must be >= 0 (0 = vLLM's default)")
        if r.vllm_sync_bucket_mb < 1:
            errs.append("rollout.vllm_sync_bucket_mb must be >= 1")
        for k in ("share_prompt", "prune_every"):
            if getattr(r, k) != getattr(dr, k):
                errs.append(f"rollout.{k} is an option of engine hf; vLLM schedules its own batches")
    if cfg.algo.tis_cap > 0 and r.engine in ENGINES and not engine_reports_logp(r.engine):
        errs.append(f"algo.tis_cap > 0 (rollout correction) needs an engine that reports its log-probs; "
                    f"rollout.engine={r.engine} reports none (use rollout.engine=vllm)")
    return errs


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (loadable with ``--config``)."""
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from ``to_dict`` output (used on resume), re-validated."""
    data = dict(data)
    name = data.pop("recipe", DEFAULT_RECIPE)
    return load_config(None, _flatten(data), recipe_name=name)


def reference() -> str:
    """Markdown reference of every config key, generated from the comments at their declarations."""
    import inspect
    import re

    from .algo.recipes import AnchorConfig, KLConfig
    from .algo.trust_region import RegionConfig

    sections = [("model", ModelConfig), ("data", DataConfig), ("rollout", RolloutConfig), ("train", TrainConfig),
                ("run", RunConfig), ("eval", EvalConfig), ("algo", AlgoConfig), ("algo.region", RegionConfig),
                ("algo.kl", KLConfig), ("algo.anchor", AnchorConfig)]
    out = ["# Configuration keys", "",
           "Generated by `tether config --reference` from the comments where each key is declared.",
           "Set keys in a YAML file (`--config`) or as `key=value` overrides; `recipe` picks the `algo.*` defaults",
           "(the defaults below are the field defaults; each recipe overrides some `algo.*` keys).", ""]
    pat = re.compile(r"^\s+(\w+):\s*[^#]*#\s*(.+)$")
    for prefix, cls in sections:
        out += [f"## `{prefix}`", "", (cls.__doc__ or "").strip().splitlines()[0], "",
                "| key | default | meaning |", "| --- | --- | --- |"]
        comments = {m.group(1): m.group(2) for m in map(pat.match, inspect.getsource(cls).splitlines()) if m}
        default = cls()
        for f in dataclasses.fields(cls):
            value = getattr(default, f.name)
            if dataclasses.is_dataclass(value):
                continue  # its own section
            if f.name not in comments:
                raise AssertionError(f"config key {prefix}.{f.name} has no comment at its declaration")
            out.append(f"| `{prefix}.{f.name}` | `{value!r}` | {comments[f.name].replace('|', '/')} |")
        out.append("")
    return "\n".join(out)
