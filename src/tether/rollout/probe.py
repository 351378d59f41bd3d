"""The probe of a weights copy: a fixed text whose log-probs an engine holding its own copy of the weights (an
in-process vLLM engine of a rollout worker, a vLLM server) computes after each update, compared with the trainer's
own (`model_probe_logp`): a copy that kept older or corrupted weights gives other log-probs, so it is an error,
not a silent off-policy bias (`tether.asynchronous.weights`, `tether.rollout.served`)."""

from __future__ import annotations

import torch

#: the fixed text whose log-probs a vLLM worker's engine reports after each weights load (verified sync)
PROBE_TEXT = ("The rollout worker samples with the weights the trainer pushed: 12 + 30 = 42, and every "
              "token of this probe is scored by the engine itself.")


def probe_ids(tokenizer) -> list[int]:
    """The token ids of `PROBE_TEXT` (the same on every side that has the run's tokenizer)."""
    return [int(i) for i in tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]]


@torch.no_grad()
def model_probe_logp(model, ids: list[int]) -> list[float]:
    """log pi(ids[i] | ids[:i]) for i >= 1 under ``model`` (temperature 1): the trainer's side of the probe."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    logits = model(input_ids=x).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0].tolist()


