"""Prompt encoding: an example's text through the model's chat template, to token ids.

Every agent, the trainer's rollouts and ``tether eval`` encode prompts here, so a model sees
the same prompt in training and in evaluation. :class:`PromptEncoder` (what the agents use)
also fits each prompt in the model's context: a prompt of more than ``context -
max_new_tokens`` tokens is an error naming the example, or is cut to its last tokens
(``rollout.prompt_overflow``).
"""

from __future__ import annotations

import sys
import weakref
from typing import Optional, Sequence

from ..errors import GenerationError
from .base import Example

OVERFLOW_POLICIES = ("error", "truncate")


def chat_messages(example: Example, system_prompt: str = "") -> list[dict]:
    """The conversation that opens an episode: an optional system message, then the user prompt."""
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": example.prompt}]


def _prompt_text(tokenizer, prompt: str, system_prompt: str) -> str:
    """The text the model reads for ``prompt``: through the chat template (plain text if it has none)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(chat_messages(Example(prompt, "", ""), system_prompt), tokenize=False,
                                             add_generation_prompt=True)
    return (system_prompt + "\n\n" if system_prompt else "") + prompt + "\n"


def encode_prompts(tokenizer, examples: Sequence[Example], system_prompt: str = "") -> list[list[int]]:
    """Token ids of each example's prompt through the model's chat template (plain text if it has none)."""
    return [tokenizer(_prompt_text(tokenizer, ex.prompt, system_prompt), add_special_tokens=False)["input_ids"]
            for ex in examples]


def model_context(model, tokenizer=None) -> Optional[int]:
    """The most tokens (prompt + response) ``model`` can attend to, or None when unknown.

    The model config's ``max_position_embeddings`` (``n_positions`` for GPT-2-like configs;
    the SmolLM2 GGUF gives 8192), else the tokenizer's ``model_max_length`` when it is a real
    length (transformers puts 1e30 there when it does not know).
    """
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 0:
            return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**7 else None


_LONGEST_TOKEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest token text in the vocabulary (cached per tokenizer).

    A token never stands for more text than its vocabulary entry spells (byte-level entries
    spell one character per byte, which is at least one character of text), so a text of
    ``c`` characters has at least ``c / longest_token_chars`` tokens: a bound that rejects, or
    cuts, a huge prompt without tokenizing it (20 MB take 20 s to tokenize).
    """
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    n = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    try:
        _LONGEST_TOKEN[tokenizer] = n
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return n


class PromptEncoder:
    """Encodes prompts (:func:`encode_prompts`) and fits them in the model's context.

    Args:
        tokenizer: the policy's tokenizer.
        system_prompt: a system message before every prompt ("" = none).
        context: the model's context in tokens (:func:`model_context`); None = unknown, no check.
        overflow: what to do with a prompt of more than ``context - max_new_tokens`` tokens:
            ``"error"`` (a ``GenerationError`` naming the example and the lengths) or
            ``"truncate"`` (keep its last tokens, so the end of the question and the chat
            template's assistant header stay; a warning on stderr the first time).
        reserve: tokens kept for the response; None = each call's ``max_new_tokens``. (The
            search agent keeps 1: it cuts every turn to the room left under its cap.)
    """

    def __init__(self, tokenizer, system_prompt: str = "", context: Optional[int] = None, overflow: str = "error",
                 reserve: Optional[int] = None):
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"prompt overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        self.tokenizer, self.system_prompt, self.context, self.overflow = tokenizer, system_prompt, context, overflow
        self.reserve = reserve
        self.truncated = 0  # prompts cut so far
        self._template_tokens: Optional[int] = None

    def limit(self, max_new_tokens: int) -> Optional[int]:
        """The most prompt tokens that leave room for the response (None = no limit)."""
        if self.context is None:
            return None
        room = self.context - self._reserve(max_new_tokens)
        if room < 1:
            raise GenerationError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                                  f"context of {self.context} tokens; lower max_new_tokens")
        return room

    def _reserve(self, max_new_tokens: int) -> int:
        return int(max_new_tokens) if self.reserve is None else self.reserve

    def _lengths(self, limit: int, max_new_tokens: int) -> str:
        return (f"more than the {limit} that fit in the model's context ({self.context} tokens, less "
                f"{self._reserve(max_new_tokens)} for the response)")

    def _too_long(self, ex: Example, what: str, limit: int, max_new_tokens: int) -> GenerationError:
        return GenerationError(
            f"example {ex.id}: the prompt has {what}, {self._lengths(limit, max_new_tokens)}; shorten it, lower "
            f"max_new_tokens, or let training cut it to its last tokens (rollout.prompt_overflow=truncate)")

    def encode(self, examples: Sequence[Example], max_new_tokens: int) -> list[list[int]]:
        """Token ids of each example's prompt, fitted in ``context - max_new_tokens`` tokens."""
        limit = self.limit(max_new_tokens)
        if limit is None:
            return encode_prompts(self.tokenizer, examples, self.system_prompt)
        longest = longest_token_chars(self.tokenizer)
        out = []
        for ex in examples:
            prompt = ex.prompt
            if len(prompt) > limit * longest:  # certainly too long: no need to tokenize all of it
                if self.overflow == "error":
                    raise self._too_long(ex, f"{len(prompt)} characters (so at least {len(prompt) // longest} tokens)",
                                         limit, max_new_tokens)
                prompt = prompt[-limit * longest:]  # still at least `limit` tokens: the cut below decides
            out.append(self.fit(self.tokenizer(_prompt_text(self.tokenizer, prompt, self.system_prompt),
                                               add_special_tokens=False)["input_ids"], ex, max_new_tokens))
        return out

    def fit(self, ids: list[int], ex: Example, max_new_tokens: int) -> list[int]:
        """An encoded prompt ``ids`` of example ``ex`` fitted in ``context - max_new_tokens`` tokens: as it is,
        an error, or its last tokens (``overflow``)."""
        limit = self.limit(max_new_tokens)
        if limit is None or len(ids) <= limit:
            return ids
        if self.overflow == "error":
            raise self._too_long(ex, f"{len(ids)} tokens", limit, max_new_tokens)
        if not self.truncated:
            print(f"[tether] warning: example {ex.id}: the prompt has {len(ids)} tokens, "
                  f"{self._lengths(limit, max_new_tokens)}; keeping its last {limit} tokens "
                  f"(rollout.prompt_overflow=truncate; warned once)", file=sys.stderr)
        self.truncated += 1
        return ids[-limit:]

    def check(self, examples: Sequence[Example], max_new_tokens: int) -> None:
        """Raise the error :meth:`encode` would for the first overlong prompt of ``examples``
        (overflow ``"error"`` only), tokenizing only the rows that might not fit.

        A row whose prompt and system prompt take at most ``limit - template`` UTF-8 bytes
        fits (a token is at least one byte; ``template`` = the tokens the chat template adds,
        plus a margin), so a dataset of ordinary prompts costs one pass over its characters;
        a row this estimate misses still fails at the step that draws it.
        """
        limit = self.limit(max_new_tokens)
        if limit is None or self.overflow != "error":
            return
        if self._template_tokens is None:
            self._template_tokens = len(encode_prompts(self.tokenizer, [Example("", "", "")], self.system_prompt)[0])
        budget = limit - self._template_tokens - len(self.system_prompt.encode("utf-8")) - 8
        # (a character is at most 4 bytes: most rows are cleared without encoding them)
        suspects = [ex for ex in examples if 4 * len(ex.prompt) > budget and len(ex.prompt.encode("utf-8")) > budget]
        for ex in suspects:
            self.encode([ex], max_new_tokens)


def agent_prompt_encoder(engine, tokenizer, system_prompt: str = "", overflow: str = "error",
                         max_context: Optional[int] = None, reserve: Optional[int] = None) -> PromptEncoder:
    """The :class:`PromptEncoder` of an agent driving ``engine``: the context is that of the
    engine's model (``engine.model``; unknown for an engine without one), capped at
    ``max_context`` when given."""
    context = model_context(getattr(engine, "model", None), tokenizer)
    if max_context is not None:
        context = max_context if context is None else min(context, max_context)
    return PromptEncoder(tokenizer, system_prompt, context=context, overflow=overflow, reserve=reserve)
