"""The schema of a run's configuration: one `Section` (a pydantic model) per section, each key documented
by the docstring under its declaration (``tether.resolve.reference`` turns those into docs/config.md).
Sections nest by what they configure: ``rollout.engine`` and ``rollout.agent`` are chosen by their kind
(`tether.config.engine`, `tether.config.agent`),
``train.async`` is an optional section (`tether.config.train_async`)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from ..algo.correction import LR_SCALES
from ..sections import Section, alone, as_dict, only_with
from .agent import AgentConfig, SingleTurnAgentConfig, agent_shorthand
from .data import DATA, ArithmeticDataConfig, DataConfig
from .engine import EngineConfig, HFEngineConfig, engine_shorthand
from .model import ModelConfig
from .recipes import AlgoConfig, recipe
from .train_async import AsyncConfig, async_shorthand

DEFAULT_RECIPE = "ema_pg"
#: ``train.schedule``: the learning rate after warm-up (tether.schedule)
Schedule = Literal["constant", "cosine", "linear"]


def _single_turn(earlier: dict) -> bool:
    """Whether a rollout section's agent, validated above the key, is not the multi-turn one (whose environment sets
    the stops, and whose lengths are per turn)."""
    return getattr(earlier.get("agent"), "kind", None) != "multi_turn"


class RolloutConfig(Section):
    """Generation: how many responses per step and how they are sampled."""

    engine: EngineConfig = Field(default_factory=lambda: HFEngineConfig())
    """the sampling engine, a section chosen by its kind: hf (transformers generate on the training model)
    | vllm (an in-process vLLM engine: its own venv, scripts/setup.sh --vllm; it reports log-probs for
    algo.tis_cap) | vllm_server (vLLM servers, launched by tether or yours, weights through vLLM's weight-transfer
    protocol) | another engine of tether.rollout.ENGINES. `rollout.engine=vllm` is short for
    `rollout.engine.kind=vllm`; each kind's own keys are in its table below"""

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_shorthand(cls, v: Any) -> Any:
        return engine_shorthand(v)

    agent: AgentConfig = Field(default_factory=lambda: SingleTurnAgentConfig())
    """how an episode runs, a section chosen by its kind: single_turn (prompt -> one response) | multi_turn (the
    environment rollout.agent.env: calculator, search or a user's, docs/environments.md) | a user's agent
    module:function / path.py:function (docs/extending.md). `rollout.agent=multi_turn` is short for
    `rollout.agent.kind=multi_turn`; each kind's own keys are in its table below"""

    @field_validator("agent", mode="before")
    @classmethod
    def _agent_shorthand(cls, v: Any) -> Any:
        return agent_shorthand(v)

    prompts_per_step: int = Field(6, ge=1)
    """prompts per trainer step"""
    n: int = Field(8, ge=1)
    """samples per prompt (the group size G; 8 makes fewer groups all-wrong, which carry no signal)"""
    temperature: float = Field(0.7, gt=0, allow_inf_nan=False)
    """sampling temperature; log-probs are taken at the same temperature (0.7: at 1.0 SmolLM2-135M is right about
    4x less often than greedily, so most groups carry no signal)"""
    top_p: float = Field(1.0, gt=0, le=1)
    """nucleus sampling (1 = off)"""
    top_k: int = Field(0, ge=0)
    """top-k sampling (0 = off)"""
    max_new_tokens: int = Field(64, ge=1)
    """response length cap; longer responses are truncated (multi-turn agent: the cap of each policy turn)"""
    prompt_overflow: Literal["error", "truncate"] = "error"
    """a prompt of more than (the model's context - max_new_tokens) tokens (multi-turn agent: more than
    rollout.agent.env.max_context - 1, each turn being cut to the room left): error (a GenerationError naming the
    example and the lengths; dataset rows are checked before the first step) | truncate (keep its last tokens; warns
    once)"""
    min_new_tokens: int = Field(0, ge=0)
    """EOS is banned before this many new tokens (0 = off; benchmarks use it for fixed-length decoding)"""

    @field_validator("min_new_tokens")
    @classmethod
    def _within_max(cls, v: int, info: ValidationInfo) -> int:
        if not alone(info) and v > info.data.get("max_new_tokens", v):
            raise ValueError(f"must be <= rollout.max_new_tokens, got {v}")
        return v

    _unstopped = only_with("min_new_tokens", holds=_single_turn,
                           text="with rollout.agent.kind=multi_turn: it would be ignored by the multi-turn agents")
    stop: list[str] = Field(default_factory=list)
    """stop strings; the response ends right after one (the held-out evaluations during training stop at them too)"""
    _stops = only_with("stop", holds=_single_turn, text="with rollout.agent.kind=multi_turn: it would be ignored: the "
                                                        "environment's stop strings end each turn")
    batch_size: int = Field(32, ge=1)
    """sequences per generate call (engine=hf; vLLM schedules a whole step's batch itself) and per held-out
    evaluation call (either engine)"""
    reuse_kv: bool = True
    """rollout.agent.kind=multi_turn: keep each episode's KV cache between its turns, so each token is
    encoded once (engine=hf: turn t encodes only the tokens added since turn t-1; engine=vllm: its prefix
    cache); false re-encodes the whole context every turn (same tokens, for A/B comparison; engine=vllm: prefix
    caching off)"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill with new prompts"""
    max_refill_rounds: int = Field(3, ge=0)
    """dynamic_sampling: at most this many extra generation rounds per step"""
    _refill = only_with("max_refill_rounds", holds=lambda r: r.get("dynamic_sampling", True),
                        text="only applies with rollout.dynamic_sampling=true")
    overlong_buffer_frac: float = Field(0.0, ge=0, le=1)
    """DAPO soft overlong penalty: linear penalty over the last frac of max_new_tokens (0 = off)"""
    _per_response = only_with("overlong_buffer_frac", holds=_single_turn,
                              text="with rollout.agent.kind=multi_turn: it measures a response against "
                                   "rollout.max_new_tokens, which a multi-turn agent caps each turn with, not the "
                                   "episode (set it to 0)")
    overlong_penalty: float = 1.0
    """overlong_buffer_frac > 0: penalty at (and beyond) max_new_tokens"""
    _overlong = only_with("overlong_penalty", holds=lambda r: r.get("overlong_buffer_frac", 1) > 0,
                          text="only applies with rollout.overlong_buffer_frac > 0")
    mask_truncated: bool = False
    """exclude responses cut at max_new_tokens from the loss (DAPO overlong filtering)"""


class OptimizerConfig(Section):
    """AdamW and its learning-rate schedule: the ``train`` keys ``tether train`` and ``tether sft`` share (both
    sections derive from this one, so each key means the same in both; tether.optim, tether.schedule)."""

    lr: float = Field(1e-5, ge=0, allow_inf_nan=False)
    """AdamW learning rate, >= 0 (0: no update, a baseline); set on --resume, it applies from the next step"""
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    """AdamW weight decay"""
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas, two numbers in [0, 1)"""

    @field_validator("betas", mode="wrap")
    @classmethod
    def _two_betas(cls, v: Any, numbers: ValidatorFunctionWrapHandler) -> list[float]:
        try:  # one sentence for every way of missing it: an item that is not a number, a bool, the count, the range
            betas = numbers(v)
        except ValidationError:
            betas = None
        if betas is None or len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"must be two numbers in [0, 1), got {v!r}")
        return betas

    warmup_steps: int = Field(0, ge=0)
    """linear warm-up, in optimizer steps"""
    schedule: Schedule = "constant"
    """constant | cosine | linear (after warm-up, to 0 at the last optimizer step). The LR never jumps on --resume:
    when train.steps (or the schedule) changes, the decay is re-laid from the multiplier reached to 0 at the new
    end; a run already decayed to 0 cannot be extended except with constant (train.lr)"""
    grad_clip: float = Field(1.0, ge=0, allow_inf_nan=False)
    """max global grad norm (0 = off)"""

    def warmup_problem(self, total: int, total_is: str = "") -> Optional[str]:
        """The problem of a warm-up longer than the run's ``total`` optimizer steps (``total_is``: how they are
        counted), or None: the rule `TrainConfig`, `tether.config.sft.SFTTrainConfig` and the SFT loop (once the
        rows give the length) share."""
        if self.warmup_steps <= total:
            return None
        how = f" ({total_is})" if total_is else ""
        return (f"train.warmup_steps={self.warmup_steps} exceeds the run's {total} optimizer steps{how}: the LR "
                "would never reach train.lr")


class TrainConfig(OptimizerConfig):
    """Optimization: the update over one rollout batch (the optimizer's keys first, `OptimizerConfig`)."""

    steps: int = Field(10, ge=1)
    """trainer steps (rollout + update); the default run, with its held-out evaluation before and after, fits 20
    minutes on 2 CPU cores. Raised on --resume it extends the run (see train.schedule)"""
    lr_scale: Literal[LR_SCALES] = "none"
    """none | ess | seq_ess: scale each optimizer step's LR by the effective sample size of the importance weights
    pi_old/mu of its mini-batch (VCPO), lr_step = lr_sched * clip((ESS/N)^p, lr_scale_floor, 1), ESS/N = (sum
    w)^2 / (N sum w^2) of the tokens' r_t (ess) or the responses' prod_t r_t (seq_ess); logged as lr_scale (lr
    stays the scheduled LR). Needs the engine's log-probs (train.async.max_staleness >= 1, or rollout.engine=vllm):
    with neither, mu = pi_old and ESS/N = 1, so it is an error (docs/async.md)"""
    lr_scale_floor: float = Field(0.0, ge=0, lt=1)
    """lr_scale ess / seq_ess: the smallest multiplier, in [0, 1) (0 = none: one dominant weight in N takes the
    step down to (1/N)^p)"""
    lr_scale_power: float = Field(1.0, gt=0, le=1)
    """lr_scale ess / seq_ess: p in (0, 1]; 1 scales the step with the effective batch, 0.5 is VCPO's square-root
    rule for Adam"""
    _lr_scaled = only_with("lr_scale_floor", "lr_scale_power", holds=lambda t: t.get("lr_scale", "ess") != "none",
                           text="only applies with train.lr_scale ess or seq_ess")
    epochs: int = Field(1, ge=1)
    """passes over each rollout batch (> 1 makes the update off-policy)"""
    mini_batches: int = Field(1, ge=1)
    """optimizer steps per epoch; each sees 1/mini_batches of the batch"""

    @model_validator(mode="after")
    def _warmup_within_run(self, info: ValidationInfo):
        problem = self.warmup_problem(self.steps * self.epochs * self.mini_batches,
                                      "train.steps x train.epochs x train.mini_batches")
        if problem and not alone(info):
            raise ValueError(problem)
        return self
    micro_batch_tokens: int = Field(0, ge=0)
    """a token budget per forward/backward in place of micro_batch_size (0 = off: rows): each mini-batch's rows
    sorted by length (a group's rows kept together under share_prompt), a micro-batch takes rows while rows x
    its padded length (longest prompt + longest response; the sum of lengths under packing) stays within it, a
    longer row alone; the no-grad passes take twice it. Same gradient; less padding (pad_frac)"""
    micro_batch_size: int = Field(8, ge=1)
    """sequences per forward/backward (gradient accumulation)"""
    _rows = only_with("micro_batch_size", holds=lambda t: t.get("micro_batch_tokens", 0) == 0,
                      text="has no effect with train.micro_batch_tokens > 0 (micro-batches are cut by the token "
                           "budget): set one of them")
    logprob_chunk: int = Field(1024, ge=1)
    """tokens per chunk in the log-prob engine (peak memory ~ chunk x vocab)"""
    share_prompt: bool = True
    """forward each group's prompt once per micro-batch and reuse its KV cache for the G responses (exact; off
    under gradient checkpointing)"""
    packing: bool = False
    """forward each micro-batch as one row without padding (its sequences one after another, positions restarting
    at 0 for each; checked against the padded forward at the first step; needs share_prompt=false). Same
    log-probs and gradient up to float rounding; pad_frac 0"""
    _packed = only_with("packing", holds=lambda t: not t.get("share_prompt", False),
                        text="runs each row's prompt in its own packed sequence, so train.share_prompt would have no "
                             "effect: set train.share_prompt=false with train.packing=true")
    malloc_trim: bool = False
    """after the rollout and after the update, hand glibc's free heap pages back to the OS (malloc_trim(0);
    tether.memory): lower resident memory between phases, for other processes on the machine (the peak inside
    the update is not lowered), at the cost of page faults when the next phase allocates; no effect without
    glibc"""
    seed: int = 0
    """seeds data order, sampling and initialization"""
    async_: Optional[AsyncConfig] = Field(None, alias="async")
    """asynchronous RL (docs/async.md): rollouts are generated in worker processes while the trainer updates,
    each batch by weights at most async.max_staleness trainer updates older than the policy it trains. None
    (the default) = the synchronous loop: generate, then update, with the same weights. `train.async=1` is
    short for `train.async.max_staleness=1`, `train.async=none` turns it off"""

    @field_validator("async_", mode="before")
    @classmethod
    def _async_shorthand(cls, v: Any) -> Any:
        return async_shorthand(v)

    @property
    def max_staleness(self) -> int:
        """K: train.async.max_staleness, 0 for the synchronous loop (train.async none)."""
        return self.async_.max_staleness if self.async_ is not None else 0


class OutputsConfig(Section):
    """Outputs: run directory, checkpoints, logs (the keys ``tether train``'s and ``tether sft``'s ``run``
    sections share)."""

    output_dir: str = ""
    """run directory ("" = runs/<recipe>-<task>-<timestamp>; tether sft: runs/sft-<data>-<timestamp>); a fresh run
    refuses a non-empty one (see run.overwrite) and locks it (RUN/.lock) while it trains"""
    overwrite: bool = False
    """a fresh run into a non-empty run.output_dir first deletes the run there (config, logs, checkpoints: only what
    tether wrote, a run of the same command); false refuses it (CLI: --overwrite; needs run.output_dir; not with
    --resume)"""

    @model_validator(mode="after")
    def _overwrite_names_a_dir(self, info: ValidationInfo):
        if not alone(info) and self.overwrite and not self.output_dir:
            raise ValueError("run.overwrite=true needs run.output_dir (--output-dir): the default run directory is a "
                             "new one, so there is nothing to overwrite")
        return self
    save_every: int = Field(10, ge=0)
    """checkpoint every N trainer steps (0 = only at the end)"""
    keep_checkpoints: int = 2
    """keep the newest N checkpoints, >= 1 (-1 = keep every checkpoint)"""

    @field_validator("keep_checkpoints")
    @classmethod
    def _keep(cls, v: int) -> int:
        if v < 1 and v != -1:
            raise ValueError(f"must be >= 1 (or -1 = keep every checkpoint), got {v}")
        return v

    progress: bool = True
    """a progress bar with the live reward and KL (tether sft: the live loss)"""
    plot: bool = True
    """write curves.png when the run ends"""
    tensorboard: bool = False
    """also log to TensorBoard (needs the tensorboard package)"""
    wandb: bool = False
    """also log to Weights & Biases (needs wandb; honours WANDB_* variables)"""
    wandb_project: str = "tether"
    """wandb: project name"""


class RunConfig(OutputsConfig):
    """Outputs: run directory, checkpoints, logs."""

    final_checkpoint: bool = True
    """write a checkpoint after the last step (false: the final weights stay in memory only, e.g. for a benchmark
    that evaluates them in process; a stop signal still writes one)"""
    log_samples: int = Field(2, ge=0)
    """prompts/responses per step written to samples.jsonl"""
    exact_kl_samples: int = Field(1, ge=0)
    """responses per step whose exact full-vocabulary KL to the anchor is logged (0 = off; an anchor with its own
    weights: not anchor.kind none or iterative)"""


def _evaluating(earlier: dict) -> bool:
    """Whether an eval section's keys validated so far (``before``, ``after``, ``every``) turn evaluation on."""
    return bool(earlier.get("before", True) or earlier.get("after", True) or earlier.get("every", 1))


class EvalConfig(Section):
    """Held-out evaluation inside a training run: before the first step and after the last (on by default, so
    a run ends by printing the held-out accuracy before -> after), and every N steps if asked; the same
    metrics as `tether eval`, logged as eval/<benchmark>/<metric> (the "before" row at step 0)."""

    before: bool = True
    """evaluate the initial policy before the first trainer step (fresh runs; logged at step 0)"""
    after: bool = True
    """evaluate after the last trainer step; the run then prints the accuracy before -> after"""
    every: int = Field(0, ge=0)
    """also evaluate every N trainer steps, and after the last one whatever eval.after says, so the curve ends at the
    run's end (0 = only before / after)"""
    benchmarks: list[str] = Field(default_factory=lambda: ["auto"], min_length=1)
    """auto (the training task's held-out set: arithmetic -> its test split, gsm8k -> GSM8K test; other tasks have
    none, and nothing is evaluated) | arithmetic | gsm8k | math500 | ... | a file"""
    limit: int = Field(100, ge=1)
    """problems per benchmark (100: a standard error of about 4-5 points on accuracy)"""
    greedy: bool = True
    """temperature 0 (n must be 1); false samples at eval.temperature"""
    n: int = Field(1, ge=1)
    """samples per problem"""
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    """greedy=false: sampling temperature (0: greedy)"""
    top_p: float = Field(1.0, gt=0, le=1)
    """greedy=false: nucleus sampling mass (1.0 = off)"""
    max_new_tokens: int = Field(256, ge=1)
    """response length cap during evaluation"""
    anchor: bool = False
    """also evaluate the anchor (fixed / ema / reset / kl_reset), as eval_anchor/..."""

    # the keys of an evaluation are refused while there is none
    _off = only_with("benchmarks", "limit", "n", "greedy", "temperature", "top_p", "max_new_tokens", "anchor",
                     holds=_evaluating,
                     text="has no effect while evaluation is off (eval.before=false, eval.after=false, eval.every=0)")
    _sampled = only_with("temperature", "top_p", holds=lambda e: not e.get("greedy", False),
                         text="has no effect with eval.greedy=true")

    @property
    def scheduled(self) -> bool:
        """Whether evaluation is on: before, after or every N steps (`tether.resolve.evaluating` asks, too, that
        there be a benchmark to evaluate)."""
        return _evaluating(vars(self))

    @field_validator("n")
    @classmethod
    def _one_sample(cls, v: int, info: ValidationInfo) -> int:
        if v != 1 and _evaluating(info.data) and info.data.get("greedy", False) and not alone(info):
            raise ValueError(f"must be 1 with eval.greedy=true (greedy decoding gives {v} identical samples), or set "
                             f"eval.greedy=false")
        return v


class Config(Section):
    """Everything a training run needs."""

    recipe: str = DEFAULT_RECIPE
    """named algorithm (tether.config.recipes); `algo.*` keys override its fields"""
    algo: AlgoConfig = Field(default_factory=lambda: recipe(DEFAULT_RECIPE))
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=ArithmeticDataConfig)
    """where prompts come from and how responses are scored, a section chosen by its task (its keys below;
    changing the task keeps the keys the new one reads). `data=gsm8k` is short for `data.task=gsm8k`"""

    @field_validator("data", mode="before")
    @classmethod
    def _data_shorthand(cls, v: Any) -> Any:
        return DATA.mapping(v)

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)


def to_dict(cfg) -> dict:
    """A plain dict of the config with the keys users write (for YAML and logs)."""
    return as_dict(cfg)
