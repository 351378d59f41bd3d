"""The run configuration: typed dataclasses, YAML files, recipes and dotted CLI overrides.

Resolution order (later wins): field defaults -> the recipe's algorithm (``--recipe`` or the
YAML's ``recipe:``) and its trainer defaults -> the YAML file -> ``key=value`` overrides.
Unknown keys, and keys that have no effect under the resolved settings, are errors with a
did-you-mean. The resolved config is written to the run directory as ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from .algo.recipes import RECIPES, AlgoConfig, ConfigError, recipe, validate
from .algo.registry import unknown_choice
from .models import DTYPES, ModelConfig

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
    reward_timeout: float = 10.0  # user rewards (module:function, path.py:function) run in a worker process, at most this many seconds per call: a call that runs longer is stopped, scores 0 and counts in reward_errors (0 = no limit, the reward runs in the trainer process, as the built-in rewards always do)
    format_weight: float = 0.0  # reward += format_weight when the answer is in the requested format (0 = correctness only, the default: a 0.2 bonus was gamed by responses of repeated "####" lines that collect it without a correct answer, see docs/results.md)
    system_prompt: str = ""  # system message prepended through the model's chat template ("" = none)


@dataclass
class RolloutConfig:
    """Generation: how many responses per step and how they are sampled."""

    engine: str = "hf"  # hf: transformers generate on the training model | vllm: an in-process vLLM engine (its own venv: scripts/setup.sh --vllm; options rollout.vllm_*; reports log-probs for algo.tis_cap) (engines register in tether.rollout.ENGINES)
    agent: str = "single_turn"  # how an episode runs: single_turn (prompt -> one response); agents register in tether.agents.AGENTS
    prompts_per_step: int = 6  # prompts per trainer step
    n: int = 8  # samples per prompt (the group size G; 8 makes fewer groups all-wrong, which carry no signal)
    temperature: float = 0.7  # sampling temperature; log-probs are taken at the same temperature (0.7: at 1.0 SmolLM2-135M is right about 4x less often than greedily, so most groups carry no signal)
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = 0  # top-k sampling (0 = off)
    max_new_tokens: int = 64  # response length cap; longer responses are truncated (search agent: the cap of each policy turn)
    prompt_overflow: str = "error"  # a prompt of more than (the model's context - max_new_tokens) tokens (search agent: more than search.max_context - 1, each turn being cut to the room left): error (a GenerationError naming the example and the lengths; dataset rows are checked before the first step) | truncate (keep its last tokens; warns once)
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

    steps: int = 10  # trainer steps (rollout + update); the default run, with its held-out evaluation before and after, fits 20 minutes on 2 CPU cores. Raised on --resume it extends the run (see train.schedule)
    lr: float = 1e-5  # AdamW learning rate, >= 0 (0: no update, a baseline; EMA-PG used 1e-6 for hundreds of steps; the short CPU default needs more); set on --resume, it applies from the next step
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

    output_dir: str = ""  # run directory ("" = runs/<recipe>-<task>-<timestamp>); a fresh run refuses a non-empty one (see run.overwrite) and locks it (RUN/.lock) while it trains
    overwrite: bool = False  # a fresh run into a non-empty run.output_dir first deletes its contents (config, logs, checkpoints); false refuses it (CLI: --overwrite; needs run.output_dir; not with --resume)
    save_every: int = 10  # checkpoint every N trainer steps (0 = only at the end)
    keep_checkpoints: int = 2  # keep the newest N checkpoints (-1 = keep every checkpoint)
    log_samples: int = 2  # prompts/responses per step written to samples.jsonl
    exact_kl_samples: int = 1  # responses per step whose exact full-vocabulary KL to the anchor is logged (0 = off)
    progress: bool = True  # a progress bar with live reward and KL
    plot: bool = True  # write curves.png when the run ends
    tensorboard: bool = False  # also log to TensorBoard (needs the tensorboard package)
    wandb: bool = False  # also log to Weights & Biases (needs wandb; honours WANDB_* variables)
    wandb_project: str = "tether"  # wandb: project name


@dataclass
class EvalConfig:
    """Held-out evaluation inside a training run: before the first step and after the last (on by default, so
    a run ends by printing the held-out accuracy before -> after), and every N steps if asked; the same
    metrics as `tether eval`, logged as eval/<benchmark>/<metric> (the "before" row at step 0)."""

    before: bool = True  # evaluate the initial policy before the first trainer step (fresh runs; logged at step 0)
    after: bool = True  # evaluate after the last trainer step; the run then prints the accuracy before -> after
    every: int = 0  # also evaluate every N trainer steps (0 = only before / after)
    benchmarks: list = field(default_factory=lambda: ["auto"])  # auto (the training task's held-out set: arithmetic -> its test split, gsm8k -> GSM8K test; other tasks have none, and nothing is evaluated) | arithmetic | gsm8k | math500 | ... | a file
    limit: int = 100  # problems per benchmark (100: a standard error of about 4-5 points on accuracy)
    n: int = 1  # samples per problem
    greedy: bool = True  # temperature 0 (n must be 1); false samples at eval.temperature
    temperature: float = 1.0  # greedy=false: sampling temperature
    max_new_tokens: int = 256  # response length cap during evaluation
    anchor: bool = False  # also evaluate the anchor (fixed / ema / reset / kl_reset), as eval_anchor/...


# eval.benchmarks=auto: the held-out set of a training task (tasks not listed have none)
HELD_OUT = {"arithmetic": "arithmetic", "gsm8k": "gsm8k"}


def eval_benchmarks(cfg: "Config") -> list[str]:
    """eval.benchmarks with ``auto`` replaced by the training task's held-out set (dropped if it has none)."""
    out = []
    for b in cfg.eval.benchmarks:
        if b != "auto":
            out.append(b)
        elif cfg.rollout.agent == "single_turn" and cfg.data.task in HELD_OUT:
            out.append(HELD_OUT[cfg.data.task])
    return list(dict.fromkeys(out))


def evaluating(cfg: "Config") -> bool:
    """Whether the run evaluates at all (before, after or every N steps) on at least one benchmark."""
    e = cfg.eval
    return bool((e.before or e.after or e.every) and eval_benchmarks(cfg))


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
    """Convert a YAML/CLI value to the field's declared type.

    A bool is never taken for a number or a string (YAML reads ``steps: true`` or ``name: no``
    as booleans, and ``int(True)`` is 1); a bool key takes true/false, yes/no, on/off or 0/1.
    """
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
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if isinstance(value, bool) and tp in _TYPE_NAMES:  # bool is an int subclass: int(True) would be 1
        raise ConfigError(f"{key}: expected {_TYPE_NAMES[tp]}, got {value!r}")
    if tp is int:
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value) if not isinstance(value, str) else int(float(value)) if "e" in value.lower() else int(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


# how _coerce names the expected type when it gets a bool
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string (quote it in YAML)"}


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


class _YamlTreeError(yaml.YAMLError):
    """A YAML document that parses but is no config tree: a duplicate key, or an alias to an
    enclosing node. ``line`` is 1-based; ``read_yaml_mapping`` adds the file name."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line, self.message = line, message


def _key_path(parent: str, key: Any) -> str:
    return f"{parent}.{key}" if parent else str(key)


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that accepts trees only.

    * A duplicate key in any mapping is refused (PyYAML silently keeps the last one, so a
      setting written twice would quietly lose its first value). Keys a merge (``<<: *base``)
      brings in may be overridden, as YAML intends.
    * A node that contains itself through an alias (``train: &t {steps: 2, more: *t}``) is
      refused: it is an endless value (flattening it into dotted keys never ends).

    Both are checked on the composed document before anything is constructed (`_check_tree`
    records each mapping's own keys, since PyYAML rewrites a mapping's pairs in place when it
    resolves merges); `construct_mapping` then compares the keys as YAML values (``yes`` and
    ``true`` are one key).
    """

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        self._paths: dict[int, str] = {}  # id(mapping node) -> its dotted path
        self._own_keys: dict[int, list] = {}  # id(mapping node) -> its key nodes as written
        self._check_tree(node)
        return self.construct_document(node)

    def _check_tree(self, root: yaml.Node) -> None:
        """Refuse a node reachable from itself; record each mapping's path and key nodes.

        Iterative, and each node is entered once: a shared (aliased) node is not walked again, so a
        document of nested aliases ("billion laughs") costs its number of nodes, not its expansion.
        """
        done: set[int] = set()
        on_path: set[int] = set()  # the nodes from the root down to the current one
        stack: list = [("enter", root, "", 1)]
        while stack:
            what, node, path, line = stack.pop()
            if what == "leave":
                on_path.discard(id(node))
                done.add(id(node))
                continue
            if id(node) in on_path:
                raise _YamlTreeError(line, f"key {path!r} refers to a node that contains it (a recursive alias, "
                                           f"as in `a: &x {{b: *x}}`); a config must be a tree of values")
            if id(node) in done or not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
                continue
            on_path.add(id(node))
            stack.append(("leave", node, path, line))
            if isinstance(node, yaml.MappingNode):
                self._paths[id(node)] = path
                self._own_keys[id(node)] = [k for k, _ in node.value if k.tag != _MERGE_TAG]
                children = [(v, _key_path(path, k.value if isinstance(k, yaml.ScalarNode) else "?"),
                             k.start_mark.line + 1) for k, v in node.value]
            else:
                children = [(v, f"{path}[{i}]", v.start_mark.line + 1) for i, v in enumerate(node.value)]
            stack.extend(("enter", v, p, ln) for v, p, ln in reversed(children))

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}  # key -> the line it first appears on
            for key_node in self._own_keys.get(id(node), ()):
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeConstructor reports it below
                    continue
                if first is not None:
                    name = _key_path(self._paths.get(id(node), ""), key)
                    raise _YamlTreeError(line, f"duplicate key {name!r} (first at line {first}); YAML would "
                                               f"keep only the last value: write each key once")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path) -> dict:
    """The mapping at the top of a YAML config file (an empty file is ``{}``).

    Raises ConfigError naming the file (and the line, where the problem has one) when it is
    missing or unreadable, not UTF-8, not valid YAML, or its top level is not a mapping; also
    when a key appears twice in one mapping, at any depth (naming the dotted key and both
    lines: YAML itself would silently keep the last), or a node contains itself through an
    alias (``a: &x {b: *x}``, naming the key). Every YAML file tether reads (``--config``
    files, a run's config.yaml on ``--resume``, ``tether eval`` and ``tether export``) goes
    through here.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} {'is not a file' if p.exists() else 'does not exist'}")
    from .errors import read_utf8
    text = read_utf8(p, f"config file {path}", ConfigError)
    try:
        data = yaml.load(text, Loader=_ConfigLoader)
    except _YamlTreeError as e:
        raise ConfigError(f"config file {path} line {e.line}: {e.message}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"config file {path}{where}: not valid YAML: {what}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of config keys "
                          f"(key: value lines), got a {type(data).__name__}")
    return data


def load_config(path: Optional[str] = None, overrides: Optional[dict[str, Any]] = None,
                recipe_name: Optional[str] = None, task: Optional[str] = None) -> Config:
    """Resolve a Config: recipe -> task preset (``TASK_PRESETS``) -> YAML file -> overrides, then validate it."""
    file_vals: dict[str, Any] = {}
    if path:
        file_vals = _flatten(read_yaml_mapping(path))
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
    if not (d.reward_timeout >= 0 and d.reward_timeout != float("inf")):
        errs.append(f"data.reward_timeout must be >= 0 seconds (0 = no limit), got {d.reward_timeout}")
    elif d.reward_timeout != dd.reward_timeout and (d.reward == "auto" or ":" not in d.reward):
        errs.append("data.reward_timeout only applies to a user reward (data.reward=module:function or "
                    "path.py:function); the built-in rewards run in the trainer process")
    if r.prompt_overflow not in ("error", "truncate"):
        errs.append(unknown_choice("rollout.prompt_overflow", r.prompt_overflow, ("error", "truncate")))
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
    if r.prompts_per_step * r.n < t.mini_batches:
        errs.append("train.mini_batches exceeds the number of sequences per step")
    if (cfg.algo.anchor.kind == "iterative" and t.epochs == 1 and t.mini_batches == 1
            and cfg.algo.kl.estimator != "none"):
        errs.append("anchor 'iterative' with train.epochs=1 and train.mini_batches=1 is exactly on-policy: "
                    "pi_a = pi_old = pi, so the KL term is identically zero; use train.mini_batches > 1 "
                    "or train.epochs > 1, or another anchor")
    e, de = cfg.eval, EvalConfig()
    if e.every < 0:
        errs.append(f"eval.every must be >= 0, got {e.every}")
    if not (e.before or e.after or e.every):
        for k in ("benchmarks", "limit", "n", "greedy", "temperature", "max_new_tokens", "anchor"):
            if getattr(e, k) != getattr(de, k):
                errs.append(f"eval.{k} has no effect while evaluation is off (eval.before=false, eval.after=false, "
                            f"eval.every=0)")
    else:
        if e.limit < 1 or e.n < 1 or e.max_new_tokens < 1:
            errs.append("eval.limit, eval.n and eval.max_new_tokens must be positive")
        if e.greedy and e.n != 1:
            errs.append("eval.greedy=true gives n identical samples; set eval.n=1 or eval.greedy=false")
        if e.greedy and e.temperature != de.temperature:
            errs.append("eval.temperature has no effect with eval.greedy=true")
        if e.anchor and cfg.algo.anchor.kind in ("none", "iterative"):
            errs.append(f"eval.anchor=true needs an anchor with its own weights, not {cfg.algo.anchor.kind!r}")
        if not e.benchmarks:
            errs.append("eval.benchmarks is empty")
        elif not eval_benchmarks(cfg) and (e.every or e.benchmarks != de.benchmarks):
            errs.append(f"eval.benchmarks=auto: data.task={d.task!r} has no held-out set tether knows "
                        f"(auto knows {', '.join(HELD_OUT)}); name the benchmarks, e.g. eval.benchmarks=[gsm8k]")
    if cfg.run.overwrite and not cfg.run.output_dir:
        errs.append("run.overwrite=true needs run.output_dir (--output-dir): the default run directory is a new "
                    "one, so there is nothing to overwrite")
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
    errs.extend(_check_values(cfg))
    if len(errs) == 1:
        raise ConfigError(f"invalid config: {errs[0]}")
    if errs:
        raise ConfigError(f"invalid config ({len(errs)} problems):\n  - " + "\n  - ".join(errs))
    return cfg


def _check_values(cfg: Config) -> list[str]:
    """Ranges of single values that would otherwise fail late (at the model load, or mid-run):
    optimizer, sampling, model, LoRA, checkpointing and reward settings."""
    m, r, t, run, errs = cfg.model, cfg.rollout, cfg.train, cfg.run, []
    if not (math.isfinite(t.lr) and t.lr >= 0):  # 0 is allowed: a no-update baseline (noise floor of a comparison)
        errs.append(f"train.lr must be a finite number >= 0, got {t.lr!r}")
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0):
        errs.append(f"train.weight_decay must be a finite number >= 0, got {t.weight_decay!r}")
    if len(t.betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in t.betas):
        errs.append(f"train.betas must be two numbers in [0, 1), got {t.betas!r}")
    if not (math.isfinite(t.grad_clip) and t.grad_clip >= 0):
        errs.append(f"train.grad_clip must be a finite number >= 0 (0 = off), got {t.grad_clip!r}")
    total = t.steps * t.epochs * t.mini_batches
    if t.warmup_steps < 0:
        errs.append(f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    elif t.warmup_steps > total > 0:
        errs.append(f"train.warmup_steps={t.warmup_steps} exceeds the run's {total} optimizer steps "
                    f"(train.steps x train.epochs x train.mini_batches): the LR would never reach train.lr")
    if not (math.isfinite(r.temperature) and r.temperature > 0):
        errs.append(f"rollout.temperature must be a finite number > 0 (training samples; log-probs are taken at "
                    f"the same temperature), got {r.temperature!r}")
    if not 0 < r.top_p <= 1:
        errs.append(f"rollout.top_p must be in (0, 1] (1 = off), got {r.top_p!r}")
    if r.top_k < 0:
        errs.append(f"rollout.top_k must be >= 0 (0 = off), got {r.top_k}")
    if str(m.dtype).lower() not in DTYPES:
        errs.append(unknown_choice("model.dtype", m.dtype, DTYPES))
    errs.extend(check_device(m.device))
    errs.extend(_check_lora(m))
    if run.save_every < 0:
        errs.append(f"run.save_every must be >= 0 (0 = only at the end), got {run.save_every}")
    if run.keep_checkpoints < 1 and run.keep_checkpoints != -1:
        errs.append(f"run.keep_checkpoints must be >= 1 (or -1 = keep every checkpoint), got {run.keep_checkpoints}")
    if not math.isfinite(cfg.data.format_weight):
        errs.append(f"data.format_weight must be a finite number, got {cfg.data.format_weight!r}")
    errs.extend(_check_reward_spec(cfg.data.reward))
    return errs


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_device(device: str, key: str = "model.device") -> list[str]:
    """Problems with a device setting (``key`` names it in the messages): it must be 'auto', or a
    torch device string (cpu, cuda, cuda:N, mps) whose device this machine has."""
    import torch

    if device == "auto":
        return []
    choices = "cpu | cuda | cuda:N | mps | auto"
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return [f"{key} {device!r} is not a device; use {choices}"]
    if d.type == "cpu":
        return []
    if d.type == "cuda":
        if not torch.cuda.is_available():
            return [f"{key} {device!r}: CUDA is not available on this machine; use cpu "
                    f"(or auto: cuda when available, else cpu)"]
        n = torch.cuda.device_count()
        if d.index is not None and d.index >= n:
            return [f"{key} {device!r}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}"]
        return []
    if d.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return [] if mps is not None and mps.is_available() else [
            f"{key} {device!r}: MPS is not available on this machine; use cpu"]
    return [f"{key} {device!r}: device type {d.type!r} is not supported; use {choices}"]


def _check_lora(m: ModelConfig) -> list[str]:
    """The LoRA keys: ranges, and no lora_* setting without LoRA (model.lora_r=0)."""
    errs, dm = [], ModelConfig()
    if m.lora_r < 0:
        errs.append(f"model.lora_r must be >= 0 (0 = full fine-tuning), got {m.lora_r}")
    if m.lora_r <= 0:
        errs += [f"model.{k} only applies with model.lora_r > 0 (LoRA)"
                 for k in ("lora_alpha", "lora_dropout", "lora_target_modules") if getattr(m, k) != getattr(dm, k)]
        return errs
    if m.lora_alpha <= 0:
        errs.append(f"model.lora_alpha must be > 0, got {m.lora_alpha}")
    if not 0 <= m.lora_dropout < 1:
        errs.append(f"model.lora_dropout must be in [0, 1), got {m.lora_dropout!r}")
    targets = m.lora_target_modules
    names = [targets] if isinstance(targets, str) else list(targets)
    if not names or not all(isinstance(x, str) and x.strip() for x in names):
        errs.append(f"model.lora_target_modules must name at least one module (or 'all-linear'), got {targets!r}")
    return errs


_PY_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _check_reward_spec(spec: str) -> list[str]:
    """data.reward: 'auto', a reward name, or the syntax of 'module:function' / 'path.py:function'.

    Nothing is imported here (the reward loads, and its module is imported, when training starts,
    before the model); a file spec's file must exist.
    """
    from .tasks.rewards import BUILTIN_REWARDS, SEARCH_REWARDS

    names = ["auto", *BUILTIN_REWARDS, *SEARCH_REWARDS]
    if spec in names:
        return []
    if ":" not in spec:
        return [unknown_choice("data.reward", spec, names) + ", or module:function / path.py:function"]
    target, _, func = spec.rpartition(":")
    form = f"data.reward {spec!r}: expected module:function or path/to/file.py:function"
    if not target or not _PY_NAME.fullmatch(func):
        return [f"{form} (the function must be a Python name)"]
    if target.endswith(".py") or "/" in target or "\\" in target:
        if not target.endswith(".py"):
            return [f"{form} (a reward file must be a .py file)"]
        if not Path(target).expanduser().is_file():
            return [f"data.reward {spec!r}: reward file {target} not found"]
        return []
    if not _PY_NAME.fullmatch(target):
        return [f"{form} (the module must be a dotted Python name)"]
    return []


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
    """Write the resolved config as YAML (loadable with ``--config``), atomically (never half a file)."""
    from .metrics import write_text_atomic

    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


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
