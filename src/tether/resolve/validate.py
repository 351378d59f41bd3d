"""Validation of a resolved config: ``check`` lists every problem at once, section by section.

Each ``_check_*`` returns its section's problems; a key that has no effect under the resolved
settings is a problem too (it would silently do nothing). The train.* section's checks (sizes,
micro-batches, asynchronous training) are in `tether.resolve.validate_train`.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..agents import AGENTS
from ..algo.objectives import uses_sampler_logp
from ..algo.registry import unknown_choice
from ..anchor import ANCHOR_KINDS
from ..config.agent import (
    OtherEnvConfig,
    SearchEnvConfig,
    VerifiersEnvConfig,
    env_of,
)
from ..config.model import ModelConfig
from ..config.recipes import validate
from ..config.schema import Config, EvalConfig, RunConfig
from ..envs import ENVS
from ..envs.verifiers import OPTIONS as VERIFIERS_OPTIONS
from ..envs.verifiers import TOOL_FORMATS, is_task_api
from ..errors import ConfigError
from ..rollout import ENGINES, engine_reports_logp, worker_records_logp
from ..search.retrievers import RETRIEVERS
from ..sections import default
from ..tasks.registry import TASKS, call_task, task_name
from ..tasks.rewards import REWARDS
from .held_out import HELD_OUT, eval_benchmarks
from .validate_train import check_train


def check(cfg: Config) -> Config:
    """Validate the algorithm and the trainer settings together; errors list every problem."""
    errs: list[str] = []
    for section in (_check_algo, _check_data, _check_rollout_choices, _check_env,
                    check_train, _check_eval, _check_run, _check_values):
        errs.extend(section(cfg))
    raise_problems(errs)
    return cfg


def raise_problems(errs: list[str]) -> None:
    """One ConfigError listing every problem of a config (one per line under the first), if there is any."""
    if len(errs) == 1:
        raise ConfigError(f"invalid config: {errs[0]}")
    if errs:
        raise ConfigError(f"invalid config ({len(errs)} problems):\n  - " + "\n  - ".join(errs))


def _check_algo(cfg: Config) -> list[str]:
    """The algorithm (``tether.algo.validate``), its problems one by one."""
    try:
        validate(cfg.algo)
    except ConfigError as e:
        return [line.strip()[2:] for line in str(e).splitlines()[1:]]
    return []


def _check_data(cfg: Config) -> list[str]:
    """data.*: the keys of its section the task has no use for and its own checks (its registered metadata: an
    environment's task, a user's registered one; the keys each kind of task has, and the reward timeout's need for a
    user reward, are its section's)."""
    d, errs = cfg.data, []
    name = task_name(cfg)
    if name is None:
        errs.extend(_check_spec("data.task", d.task, TASKS))
    else:
        meta = TASKS.meta(name)
        for k in (k for k in meta["ignores"] if k in type(d).model_fields):
            ref = default(Config, "data").task if k == "task" else default(type(d), k)  # an environment's task
            if getattr(d, k) != ref:
                users = [n for n in TASKS if k not in TASKS.meta(n)["ignores"]]
                errs.append(f"data.{k} has no effect with {meta['about']}" if meta["about"] else
                            f"data.{k} only applies to data.task={' or '.join(users)}")
        errs.extend(call_task(meta["check"], cfg) if meta["check"] else [])
    return errs


def _check_rollout_choices(cfg: Config) -> list[str]:
    """The engine (and its options) and the agent (a name in tether.agents.AGENTS
    or a user's module:function)."""
    r, errs = cfg.rollout, []
    if r.engine.kind not in ENGINES:
        errs.append(unknown_choice("rollout.engine.kind", r.engine.kind, ENGINES))
    errs.extend(_check_engine(cfg))
    if r.agent.kind not in AGENTS:
        errs.extend(_check_spec("rollout.agent.kind", r.agent.kind, AGENTS))
    return errs


def _check_env(cfg: Config) -> list[str]:
    """rollout.agent.env (multi_turn): a name no section of its own holds is registered or a user's module:Class, and
    so is a retriever kind no section holds. A key the environment or the retriever does not read is refused by its
    section (`tether.config.agent`: the retriever is search's, options are not the calculator's or search's, search
    runs in one raw turn, SkyRL and verifiers environments in chat turns, timeout and retries are http's)."""
    e = env_of(cfg)
    if e is None:
        return []
    errs, p = [], "rollout.agent.env"
    if isinstance(e, VerifiersEnvConfig):
        errs += _check_verifiers(e, p, cfg)
    elif isinstance(e, OtherEnvConfig) and e.name not in ENVS:
        errs.extend(_check_spec(f"{p}.name", e.name, ENVS))
    if isinstance(e, SearchEnvConfig) and e.retriever.kind not in RETRIEVERS:
        errs += _check_spec(f"{p}.retriever.kind", e.retriever.kind, RETRIEVERS)
    return errs


def _check_verifiers(e, p: str, cfg: Config) -> list[str]:
    """A verifiers environment (``verifiers:<env_id>``): chat turns, its options (load_environment's ``args``, the
    ``tool_format``), no observation role (its messages carry theirs), no system prompt (its rows carry theirs)."""
    errs = []
    if is_task_api():  # verifiers 0.4: its own options, checked where the environment is built (envs/verifiers_v1.py)
        if cfg.data.system_prompt:
            errs.append(f"data.system_prompt has no effect with {p}.name={e.name} (its tasks carry their own)")
        return errs
    bad = sorted(set(e.options) - set(VERIFIERS_OPTIONS))
    if bad:
        errs.append(f"{p}.options of {e.name}: unknown key(s) {bad} (known: {', '.join(VERIFIERS_OPTIONS)}; "
                    f"load_environment's arguments go in {p}.options.args)")
    if "tool_format" in e.options and e.options["tool_format"] not in TOOL_FORMATS:
        errs.append(unknown_choice(f"{p}.options.tool_format", str(e.options["tool_format"]), TOOL_FORMATS))
    if "args" in e.options and not isinstance(e.options["args"], dict):
        errs.append(f"{p}.options.args must be a mapping (load_environment's keyword arguments), got "
                    f"{e.options['args']!r}")
    if cfg.data.system_prompt:
        errs.append(f"data.system_prompt has no effect with {p}.name={e.name} (its rows carry their own)")
    return errs


def _check_eval(cfg: Config) -> list[str]:
    """eval.*: what the section's own rules (declared with its keys) cannot see: the anchor's weights, the
    benchmarks of the training task."""
    d, e, de, errs = cfg.data, cfg.eval, EvalConfig(), []
    if e.scheduled:
        if e.anchor and not _anchor_has_weights(cfg.algo.anchor.kind):
            errs.append(f"eval.anchor=true needs an anchor with its own weights, not {cfg.algo.anchor.kind!r}")
        if not eval_benchmarks(cfg) and (e.every or e.benchmarks != de.benchmarks):
            errs.append(f"eval.benchmarks=auto: data.task={d.task!r} has no held-out set tether knows "
                        f"(auto knows {', '.join(HELD_OUT)}); name the benchmarks, e.g. eval.benchmarks=[gsm8k]")
    return errs


def _anchor_has_weights(kind: str) -> bool:
    """Whether anchor ``kind`` has its own weights (its registered ``needs_forward``; not none nor iterative)."""
    return kind in ANCHOR_KINDS and ANCHOR_KINDS.meta(kind)["needs_forward"]


def _check_run(cfg: Config) -> list[str]:
    """run.*: the loggers need their packages; the exact-KL diagnostic needs an anchor with its own weights."""
    errs = check_outputs(cfg.run)
    n, kind = cfg.run.exact_kl_samples, cfg.algo.anchor.kind
    if n and n != RunConfig().exact_kl_samples and not _anchor_has_weights(kind):
        errs.append(f"run.exact_kl_samples logs the exact KL to the anchor, and anchor.kind={kind} has no anchor "
                    f"pass (none: no anchor; iterative: the anchor is the sampler); set it to 0 or leave it out")
    return errs


def check_outputs(run) -> list[str]:
    """The output keys a training run and an SFT run share (``run``: a `RunConfig` or
    `tether.config.sft.SFTRunConfig`): the loggers need their packages (overwrite's need for an output directory is
    declared with the keys, `tether.config.schema.OutputsConfig`)."""
    errs = []
    if run.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except Exception:
            errs.append("run.tensorboard=true needs the tensorboard package (pip install tensorboard)")
    if run.wandb:
        try:
            import wandb  # noqa: F401
        except Exception:
            errs.append("run.wandb=true needs the wandb package (pip install wandb)")
    return errs


def _check_values(cfg: Config) -> list[str]:
    """What the keys' declarations cannot say, since it depends on this machine or on what is installed: the model's
    device, the reward's spec (the warm-up against the run's length is `tether.config.schema.TrainConfig`'s)."""
    errs = check_model(cfg.model)
    errs.extend(_check_reward_spec(cfg.data.reward))
    return errs


def check_model(m: ModelConfig) -> list[str]:
    """The model section's device: one this machine has (its dtype, the LoRA ranges and the LoRA keys' need for
    lora_r > 0 are declared with the keys)."""
    return check_device(m.device)


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


_PY_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _check_reward_spec(spec: str) -> list[str]:
    """data.reward: 'auto', a reward name, or the syntax of 'module:function' / 'path.py:function'.

    Nothing is imported here (the reward loads, and its module is imported, when training starts,
    before the model); a file spec's file must exist.
    """
    return _check_spec("data.reward", spec, REWARDS, ("auto",))


def _check_spec(key: str, spec: str, registry, extra: tuple[str, ...] = ()) -> list[str]:
    """``key``'s value: a name in ``registry`` (or ``extra``), or the syntax of a user's 'module:function' /
    'path.py:function' (nothing imported; a file spec's file must exist)."""
    names = [*extra, *registry]
    if spec in names:
        return []
    if ":" not in spec:
        return [unknown_choice(key, spec, names) + ", or module:function / path.py:function"]
    target, _, func = spec.rpartition(":")
    form = f"{key} {spec!r}: expected module:function or path/to/file.py:function"
    if not target or not _PY_NAME.fullmatch(func):
        return [f"{form} (the function must be a Python name)"]
    if target.endswith(".py") or "/" in target or "\\" in target:
        if not target.endswith(".py"):
            return [f"{form} (a {registry.what} file must be a .py file)"]
        if not Path(target).expanduser().is_file():
            return [f"{key} {spec!r}: {registry.what} file {target} not found"]
        return []
    if not _PY_NAME.fullmatch(target):
        return [f"{form} (the module must be a dotted Python name)"]
    return []


def _check_engine(cfg: Config) -> list[str]:
    """rollout.engine against the rest: vLLM installed, the model's own code, and rollout correction against the
    engine's log-probs. The engine section's own keys are typed and ranged where they are declared
    (`tether.config.engine`); the GPU-only and CPU-only vLLM keys are checked when the engine is built
    (``tether.rollout.vllm.VLLMEngine``), where vLLM's platform is known."""
    import importlib.util  # noqa: PLC0415 (find_spec of an optional dependency, only for this engine)

    r, errs = cfg.rollout, []
    kind = r.engine.kind
    if kind == "vllm_server":
        errs.extend(r.engine.problems())
    if kind in ("vllm", "vllm_server"):
        if importlib.util.find_spec("vllm") is None:
            errs.append(f"rollout.engine.kind={kind} needs vLLM, which lives in its own environment: run "
                        "`bash scripts/setup.sh --vllm` and use .venv-vllm/bin/tether")
        if cfg.model.trust_remote_code:
            errs.append(f"model.trust_remote_code=true with rollout.engine.kind={kind}: vLLM samples from a snapshot "
                        "of the weights with its own implementation of the architecture, not the model's custom code; "
                        "use rollout.engine.kind=hf")
    if uses_sampler_logp(cfg.algo) and kind in ENGINES:
        if cfg.train.max_staleness == 0 and not engine_reports_logp(kind):
            errs.append(f"algo.tis_cap > 0 / algo.mask_* / algo.kl_sampler=mu (rollout correction) needs an engine "
                        f"that reports its log-probs; rollout.engine.kind={kind} reports none (use "
                        f"rollout.engine=vllm, or train.async: the rollout workers record them)")
        elif cfg.train.max_staleness >= 1 and not worker_records_logp(kind):  # the workers' hf or vllm do
            errs.append(f"algo.tis_cap > 0 / algo.mask_* / algo.kl_sampler=mu (rollout correction) needs the "
                        f"engine's log-probs, and the rollout workers' rollout.engine.kind={kind} passes none on (the "
                        f"hf and vllm engines do)")
    return errs
