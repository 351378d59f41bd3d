"""Evaluation: sample responses to benchmark problems and report avg@n, pass@k and maj@n.

* :mod:`tether.eval.metrics` -- :func:`pass_at_k`, :func:`majority_vote`, :func:`summarize`
  (pure Python: the numbers from scored samples);
* :mod:`tether.eval.runner` -- :func:`evaluate` (one benchmark through an agent the caller built:
  ``tether eval``'s own, or the trainer's with its engine, vLLM included; then scoring) and
  :func:`evaluate_during_training` (flat ``eval/<bench>/<metric>`` numbers for a trainer);
* :mod:`tether.eval.cli` -- the ``tether eval`` command (:func:`run_eval_cli`, :func:`load_eval_model`);
  not re-exported here: the library never imports its command-line layer.

Benchmarks themselves (:func:`load_benchmark`) are data: :mod:`tether.tasks.benchmarks`,
re-exported here for convenience.
"""

from ..errors import EvalError
from ..tasks.benchmarks import Benchmark, load_benchmark, load_benchmarks
from .metrics import MajorityVote, default_ks, majority_vote, normalize_answer, pass_at_k, summarize
from .runner import EvalResult, EvalSettings, evaluate, evaluate_during_training

__all__ = [
    "Benchmark",
    "EvalError",
    "EvalResult",
    "EvalSettings",
    "MajorityVote",
    "default_ks",
    "evaluate",
    "evaluate_during_training",
    "load_benchmark",
    "load_benchmarks",
    "majority_vote",
    "normalize_answer",
    "pass_at_k",
    "summarize",
]
