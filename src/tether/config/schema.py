"""The schema of a run's configuration: one dataclass per section, each key documented by the
comment where it is declared (``tether.config.reference`` turns those into docs/config.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .recipes import AlgoConfig, recipe
from ..models import ModelConfig
from ..tasks.registry import TASKS, held_out_benchmark

DEFAULT_RECIPE = "ema_pg"


@dataclass
class DataConfig:
    """Where prompts come from and how responses are scored."""

    task: str = "arithmetic"  # arithmetic (synthetic, no files) | gsm8k | math500 | aime24 | amc | minerva |
    # olympiadbench | a .jsonl/.json/.parquet file | a hub dataset id | a user's task module:function /
    # path.py:function (docs/extending.md); with rollout.agent=search, a QA set of the search data dir
    split: str = "train"  # dataset split (named and hub datasets; rollout.agent=search: hub ids only)
    prompt_key: Optional[str] = None  # files/hub: the prompt field (default: first of prompt, question, problem)
    answer_key: Optional[str] = None  # files/hub: the answer field (default: answer)
    data_dir: Optional[str] = None  # named datasets: local directory tried before $TETHER_DATA_DIR and the hub (the
    # search agent's QA sets: search.data_dir)
    limit: int = 0  # use only the first N examples (0 = all)
    shuffle: bool = True  # files/datasets: visit examples in a seeded random order (train.seed)
    difficulty: int = 1  # arithmetic: number of steps per problem (1-4)
    reward: str = "auto"  # auto (the task's own) | a registered reward | a user's module:function /
    # path.py:function (docs/extending.md)
    reward_timeout: float = 10.0  # user rewards (module:function, path.py:function) run in a worker process, at most
    # this many seconds per call: a call that runs longer is stopped, scores 0 and counts in reward_errors (0 = no
    # limit, the reward runs in the trainer process, as the built-in rewards always do)
    format_weight: float = 0.0  # reward += format_weight when the answer is in the requested format (0 = correctness
    # only, the default: a 0.2 bonus was gamed by responses of repeated "####" lines that collect it without a correct
    # answer, see docs/results.md)
    system_prompt: str = ""  # system message prepended through the model's chat template ("" = none)


@dataclass
class RolloutConfig:
    """Generation: how many responses per step and how they are sampled."""

    engine: str = "hf"  # hf: transformers generate on the training model | vllm: an in-process vLLM engine (its own
    # venv: scripts/setup.sh --vllm; options rollout.vllm_*; reports log-probs for algo.tis_cap)
    agent: str = "single_turn"  # how an episode runs: single_turn (prompt -> one response) | multi_turn (the
    # environment env.name, e.g. calculator: tool calls and observations, docs/environments.md) | search (multi-turn
    # with a retriever, Search-R1's protocol, docs/search_agents.md) | a user's agent module:function /
    # path.py:function (docs/extending.md)
    prompts_per_step: int = 6  # prompts per trainer step
    n: int = 8  # samples per prompt (the group size G; 8 makes fewer groups all-wrong, which carry no signal)
    temperature: float = 0.7  # sampling temperature; log-probs are taken at the same temperature (0.7: at 1.0
    # SmolLM2-135M is right about 4x less often than greedily, so most groups carry no signal)
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = 0  # top-k sampling (0 = off)
    max_new_tokens: int = 64  # response length cap; longer responses are truncated (search agent: the cap of each
    # policy turn)
    prompt_overflow: str = "error"  # a prompt of more than (the model's context - max_new_tokens) tokens (search agent:
    # more than search.max_context - 1, each turn being cut to the room left): error (a GenerationError naming the
    # example and the lengths; dataset rows are checked before the first step) | truncate (keep its last tokens; warns
    # once)
    min_new_tokens: int = 0  # EOS is banned before this many new tokens (0 = off; benchmarks use it for fixed-length
    # decoding)
    stop: list = field(default_factory=list)  # stop strings; the response ends right after one (the held-out
    # evaluations during training stop at them too)
    batch_size: int = 32  # sequences per generate call (engine=hf; vLLM schedules a whole step's batch itself) and
    # per held-out evaluation call (either engine)
    share_prompt: bool = True  # pre-fill each distinct prompt once per generate call and copy its KV cache to its n
    # samples
    prune_every: int = 64  # decode in segments of N tokens and drop finished rows between them (0 = never; generate
    # alone decodes finished rows until the longest ends)
    reuse_kv: bool = True  # multi-turn agents (multi_turn, search): keep each episode's KV cache between its turns, so
    # each token is encoded once (engine=hf: turn t encodes only the tokens added since turn t-1; engine=vllm: its
    # prefix cache); false re-encodes the whole context every turn (same tokens, for A/B comparison; engine=vllm:
    # prefix caching off)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and refill with new prompts
    max_refill_rounds: int = 3  # dynamic_sampling: at most this many extra generation rounds per step
    overlong_buffer_frac: float = 0.0  # DAPO soft overlong penalty: linear penalty over the last frac of max_new_tokens
    # (0 = off)
    overlong_penalty: float = 1.0  # overlong_buffer_frac > 0: penalty at (and beyond) max_new_tokens
    mask_truncated: bool = False  # exclude responses cut at max_new_tokens from the loss (DAPO overlong filtering)
    vllm_dtype: str = "auto"  # engine=vllm: the engine's weights dtype: auto (the training model's) | float32 |
    # bfloat16 | float16
    vllm_max_model_len: int = 0  # engine=vllm: longest prompt + response the engine serves (0 = the model's
    # max_position_embeddings)
    vllm_enforce_eager: bool = False  # engine=vllm: run the model eagerly (no torch.compile / CUDA graphs: faster
    # start, slower decode)
    vllm_gpu_memory_utilization: float = 0.5  # engine=vllm, GPU only: fraction of GPU memory vLLM takes for its weights
    # and KV cache (the rest is the trainer's; an error on CPU)
    vllm_kv_cache_gb: int = 0  # engine=vllm, CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE; 0 = vLLM's
    # default; an error on GPU, where vllm_gpu_memory_utilization sizes it)
    vllm_sleep: bool = False  # engine=vllm, GPU only: sleep mode between generations (weights offloaded to CPU, KV
    # cache freed, woken for the next rollout; an error on CPU)
    vllm_sync_bucket_mb: int = 256  # engine=vllm: weights are sent to the engine after each trainer step in buckets of
    # at most this many MB


@dataclass
class SearchConfig:
    """The search agent (rollout.agent=search): retriever and budgets. Defaults follow Search-R1."""

    retriever: str = "bm25"  # bm25 (bm25s over search.corpus) | dense (sentence-transformers + faiss; extra
    # tether[dense]) | http (a Search-R1 retrieval server at search.url)
    corpus: str = ""  # bm25, dense: a JSONL corpus of {"id", "contents"} rows ("" = corpus.jsonl of the search data
    # dir); http (optional, "" = none): the corpus the server indexes, to recover the ids of documents it sends without
    # one (Search-R1's servers send none) so tether eval can measure gold recall
    data_dir: str = ""  # the search data directory for named sets and the corpus ("" = $TETHER_SEARCH_DATA_DIR, else
    # <$TETHER_DATA_DIR>/../search)
    url: str = ""  # http: the server's base URL; queries go to POST <url>/retrieve
    dense_model: str = "intfloat/e5-base-v2"  # dense: a sentence-transformers model name or local directory
    topk: int = 3  # passages per search
    max_searches: int = 4  # searches per episode; then one final turn with searching disabled
    max_obs_tokens: int = 512  # tokens per observation; longer ones are cut (the closing tag is kept)
    max_context: int = 4096  # prompt + response tokens per episode; an episode that reaches it ends ("length")
    observation_format: str = "search_r1"  # how a search's passages are shown to the model: search_r1 (Search-R1's
    # exact bytes, Doc i(Title: "T") text, title quotes and newlines as stored; no results: an empty block) | clean
    # (tether's earlier layout: title quotes stripped, one line per passage, "No results found.")
    timeout: float = 30.0  # http: seconds per request
    retries: int = 2  # http: extra attempts after a failed request; a search that still fails becomes an observation
    # saying so


@dataclass
class EnvConfig:
    """The environment of rollout.agent=multi_turn and how the agent runs it (docs/environments.md)."""

    name: str = "calculator"  # calculator (<calc> arithmetic, a #### final answer: data.task=arithmetic or gsm8k) | a
    # user's environment module:Class / path.py:Class (a tether.envs.TextEnv subclass, or any object with its methods)
    max_turns: int = 0  # policy turns per episode, the last one without tool calls (0 = the environment's own;
    # calculator: 4, so up to 3 calls)
    max_obs_tokens: int = 512  # tokens per observation; longer ones are cut (keeping the environment's closing tag)
    max_context: int = 4096  # prompt + response tokens per episode (at most the model's context); an episode that
    # reaches it ends ("length")
    observation_format: str = "raw"  # raw (observations are text inside the one assistant turn, Search-R1's way) |
    # chat (each observation is a turn of the chat template, tokenized as the difference between the conversation
    # rendered with and without it, so the policy's ids stay exact; for models trained with tool turns)
    observation_role: str = "tool"  # observation_format=chat: the role of an observation turn: tool | user


@dataclass
class TrainConfig:
    """Optimization: the update over one rollout batch."""

    steps: int = 10  # trainer steps (rollout + update); the default run, with its held-out evaluation before and after,
    # fits 20 minutes on 2 CPU cores. Raised on --resume it extends the run (see train.schedule)
    lr: float = 1e-5  # AdamW learning rate, >= 0 (0: no update, a baseline; EMA-PG used 1e-6 for hundreds of steps; the
    # short CPU default needs more); set on --resume, it applies from the next step
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    warmup_steps: int = 0  # linear warm-up, in optimizer steps
    schedule: str = "constant"  # constant | cosine | linear (after warm-up, to 0 at the last optimizer step). The LR
    # never jumps on --resume: when train.steps (or the schedule) changes, the decay is re-laid from the multiplier
    # reached to 0 at the new end; a run already decayed to 0 cannot be extended except with constant (train.lr)
    lr_scale: str = "none"  # none | ess | seq_ess: scale each optimizer step's LR by the effective sample size of the
    # importance weights pi_old/mu of its mini-batch (VCPO), lr_step = lr_sched * clip((ESS/N)^p, lr_scale_floor, 1),
    # ESS/N = (sum w)^2 / (N sum w^2) of the tokens' r_t (ess) or the responses' prod_t r_t (seq_ess); logged as
    # lr_scale (lr stays the scheduled LR). Needs the engine's log-probs (train.max_staleness >= 1, or
    # rollout.engine=vllm): with neither, mu = pi_old and ESS/N = 1, so it is an error (docs/async.md)
    lr_scale_floor: float = 0.0  # lr_scale ess / seq_ess: the smallest multiplier, in [0, 1) (0 = none: one dominant
    # weight in N takes the step down to (1/N)^p)
    lr_scale_power: float = 1.0  # lr_scale ess / seq_ess: p in (0, 1]; 1 scales the step with the effective batch,
    # 0.5 is VCPO's square-root rule for Adam
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    epochs: int = 1  # passes over each rollout batch (> 1 makes the update off-policy)
    mini_batches: int = 1  # optimizer steps per epoch; each sees 1/mini_batches of the batch
    micro_batch_size: int = 8  # sequences per forward/backward (gradient accumulation)
    micro_batch_tokens: int = 0  # a token budget per forward/backward in place of micro_batch_size (0 = off: rows):
    # each mini-batch's rows sorted by length (a group's rows kept together under share_prompt), a micro-batch takes
    # rows while rows x its padded length (longest prompt + longest response; the sum of lengths under packing) stays
    # within it, a longer row alone; the no-grad passes take twice it. Same gradient; less padding (pad_frac)
    logprob_chunk: int = 1024  # tokens per chunk in the log-prob engine (peak memory ~ chunk x vocab)
    share_prompt: bool = True  # forward each group's prompt once per micro-batch and reuse its KV cache for the G
    # responses (exact; off under gradient checkpointing)
    packing: bool = False  # forward each micro-batch as one row without padding (its sequences one after another,
    # positions restarting at 0 for each; checked against the padded forward at the first step; needs
    # share_prompt=false). Same log-probs and gradient up to float rounding; pad_frac 0
    malloc_trim: bool = False  # after the rollout and after the update, hand glibc's free heap pages back to the OS
    # (malloc_trim(0); tether.memory): lower resident memory between phases, for other processes on the machine
    # (the peak inside the update is not lowered), at the cost of page faults when the next phase allocates; no
    # effect without glibc
    seed: int = 0  # seeds data order, sampling and initialization
    max_staleness: int = 0  # K, asynchronous RL (docs/async.md): rollouts are generated in worker processes while the
    # trainer updates, each batch by weights at most K trainer updates older than the policy it trains (0 = the
    # synchronous loop: generate, then update, with the same weights). K >= 1: no rollout.dynamic_sampling; under
    # torchrun the workers belong to rank 0 and every rank trains on its share of each batch; the workers
    # (rollout.engine hf or vllm) report the engine's log-probs, so algo.tis_cap can correct the lag
    async_correction: bool = True  # max_staleness >= 1 with every rollout-correction key left off (algo.tis_cap,
    # algo.mask_*, algo.kl_sampler at their defaults) and an engine whose workers pass log-probs on (hf, vllm):
    # correct the lag as docs/evidence.md recommends, TIS capped at 2 with IcePop's token mask [0.5, 5]
    # (algo.tis_cap=2 algo.mask_token_low=0.5 algo.mask_token_high=5, written into the resolved config; on the
    # organism at a high learning rate it recovered 13 points of the 23 an uncorrected K = 1 lost, 10 seeds);
    # false = train stale batches uncorrected. Correction keys set by hand are used as given
    rollout_workers: int = 1  # max_staleness >= 1: rollout worker processes, each with its own copy of the model; up
    # to max(max_staleness + 1, rollout_workers) batches are in flight, so more than max_staleness + 1 workers make
    # batches older than K possible (train.stale_batches)
    stale_batches: str = "drop"  # rollout_workers > max_staleness + 1 (the only setting where a batch can be older than
    # K): drop (discard it, its prompts skipped, counted in async/dropped; the default, as K stays a hard bound on what
    # trains) | keep (train on it: the staleness is then bounded by rollout_workers - 1, and algo.tis_cap corrects it)
    verify_sync: bool = False  # max_staleness >= 1: checksum every pushed weights version on both sides (the trainer:
    # what it pushed; a worker: its model's weights read back after loading) and stop with an error on a mismatch
    # (one hash pass over the weights per version and side; tests turn it on). rollout.engine=vllm: the worker's vLLM
    # engine also reports its log-probs of a fixed probe text, compared with the trainer's (train.verify_logp_tol)
    verify_logp_tol: float = 0.02  # verify_sync with rollout.engine=vllm: the largest mean absolute log-prob
    # difference per probe token between a worker's vLLM engine and the trainer at the same version (float32 engines
    # agree to ~1e-5; raise it for bfloat16 if version 0 already fails); above it the run stops: vLLM kept older weights
    partial_rollout_tokens: int = 0  # max_staleness >= 1, rollout.agent=single_turn: 0 = a worker samples a whole
    # batch with one weights version; S > 0 = partial rollouts: it samples in segments of S tokens and takes a newer
    # pushed version between segments (the rest of a response re-encoded with it), recording each token's version;
    # a batch's staleness is its oldest token's (async/token_staleness_mean: the mean over tokens)
    worker_restarts: int = 2  # max_staleness >= 1: how many times in a run a rollout worker that dies (killed, out of
    # memory, its connection lost) is replaced: a local one restarted, a remote one by the next `tether worker` that
    # connects within worker_timeout_s; the jobs it held are resubmitted and it loads the newest version. Beyond
    # that (0 = never), or a worker that raises, the run stops with an error after a checkpoint of its last step
    worker_address: str = ""  # max_staleness >= 1: "" = the rollout workers are local processes; HOST:PORT = the
    # trainer listens there for train.rollout_workers remote `tether worker HOST:PORT` processes (other nodes; jobs,
    # weights per version and batches over TCP, authenticated with the secret in $TETHER_WORKER_KEY on both sides)
    worker_timeout_s: float = 600.0  # worker_address set: how long the trainer waits for its remote workers to
    # connect, and how long a connected worker may stay silent (they send a heartbeat every few seconds, also while
    # generating) before the run stops with an error naming it; a closed connection is an error at once


@dataclass
class RunConfig:
    """Outputs: run directory, checkpoints, logs."""

    output_dir: str = ""  # run directory ("" = runs/<recipe>-<task>-<timestamp>); a fresh run refuses a non-empty one
    # (see run.overwrite) and locks it (RUN/.lock) while it trains
    overwrite: bool = False  # a fresh run into a non-empty run.output_dir first deletes its contents (config, logs,
    # checkpoints); false refuses it (CLI: --overwrite; needs run.output_dir; not with --resume)
    save_every: int = 10  # checkpoint every N trainer steps (0 = only at the end)
    final_checkpoint: bool = True  # write a checkpoint after the last step (false: the final weights stay in memory
    # only, e.g. for a benchmark that evaluates them in process; a stop signal still writes one)
    keep_checkpoints: int = 2  # keep the newest N checkpoints (-1 = keep every checkpoint)
    log_samples: int = 2  # prompts/responses per step written to samples.jsonl
    exact_kl_samples: int = 1  # responses per step whose exact full-vocabulary KL to the anchor is logged (0 = off;
    # an anchor with its own weights: not anchor.kind none or iterative)
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
    benchmarks: list = field(default_factory=lambda: ["auto"])  # auto (the training task's held-out set: arithmetic ->
    # its test split, gsm8k -> GSM8K test; other tasks have none, and nothing is evaluated) | arithmetic | gsm8k |
    # math500 | ... | a file
    limit: int = 100  # problems per benchmark (100: a standard error of about 4-5 points on accuracy)
    n: int = 1  # samples per problem
    greedy: bool = True  # temperature 0 (n must be 1); false samples at eval.temperature
    temperature: float = 1.0  # greedy=false: sampling temperature
    max_new_tokens: int = 256  # response length cap during evaluation
    anchor: bool = False  # also evaluate the anchor (fixed / ema / reset / kl_reset), as eval_anchor/...


# eval.benchmarks=auto: the held-out set of a training task (tasks not listed have none), from the tasks'
# registered ``held_out`` (tether.tasks.registry.TASKS)
HELD_OUT = {k: v for n in TASKS for k, v in TASKS.meta(n)["held_out"].items()}


def eval_benchmarks(cfg: "Config") -> list[str]:
    """eval.benchmarks with ``auto`` replaced by the training task's held-out set (dropped if it has none)."""
    out = []
    for b in cfg.eval.benchmarks:
        if b != "auto":
            out.append(b)
        elif held_out_benchmark(cfg) is not None:
            out.append(held_out_benchmark(cfg))
    return list(dict.fromkeys(out))


def evaluating(cfg: "Config") -> bool:
    """Whether the run evaluates at all (before, after or every N steps) on at least one benchmark."""
    e = cfg.eval
    return bool((e.before or e.after or e.every) and eval_benchmarks(cfg))


@dataclass
class Config:
    """Everything a training run needs."""

    recipe: str = DEFAULT_RECIPE  # named algorithm (tether.config.recipes); `algo.*` keys override its fields
    algo: AlgoConfig = field(default_factory=lambda: recipe(DEFAULT_RECIPE))
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    env: EnvConfig = field(default_factory=EnvConfig)


def to_dict(cfg) -> dict:
    """A plain dict of the config (for YAML and logs)."""
    return dataclasses.asdict(cfg)
