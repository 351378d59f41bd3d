"""Observations as chat-template turns, encoded so that the policy's ids stay exactly as sampled.

In the raw format (Search-R1's) an observation is text appended inside the one assistant turn.
A model trained with a tool-calling template expects the observation as a turn of its own
instead: the assistant's message ends, a ``tool`` (or ``user``) message holds the observation,
and a new assistant message begins. :class:`ChatTurns` produces the tokens between the policy's
turn and its next one as the *difference* of two renderings of the conversation::

    without = render(messages + [assistant(turn)])
    with_   = render(messages + [assistant(turn), tool(observation)], add_generation_prompt=True)
    tokens  = tokenize(close + with_[len(without):])

where ``close`` is what the template writes after the assistant's text (``<|im_end|>\\n`` for
ChatML templates such as SmolLM2's), less the EOS token when the policy sampled it itself. The
policy's turn is never rendered from text: its sampled ids are kept, and only the template's own
text around it is tokenized.

Token-exactness. When the policy's ids are the canonical tokenization of its text (what the
tokenizer gives for that text), the episode's ids equal ``tokenize(render(whole conversation))``
(``tests/test_multi_turn_agent.py`` checks it on SmolLM2's template). When the policy sampled a
non-canonical tokenization (``"ab"`` as ``a`` + ``b`` where the tokenizer has one ``ab`` token;
a sampler may produce any sequence), the ids differ from a re-tokenization of the same text: the
text is the same, and the ids are the ones the policy really produced, which is what its
log-probabilities and the loss must be computed on (re-tokenizing is the bug that verl #3720
and its kin fixed). A template that rewrites earlier turns (e.g. one that drops earlier
reasoning blocks) has no such difference: :meth:`ChatTurns.observation_ids` raises
:class:`ChatTemplateError` naming it, and the raw format is the way to run such a model.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["ChatTemplateError", "ChatTurns", "OBSERVATION_FORMATS", "OBSERVATION_ROLES"]

#: How observations enter the context: ``raw`` (text inside the assistant's turn) | ``chat`` (template turns).
OBSERVATION_FORMATS = ("raw", "chat")
#: The role of an observation turn in the ``chat`` format.
OBSERVATION_ROLES = ("tool", "user")


class ChatTemplateError(ValueError):
    """The chat template cannot add an observation turn without changing what came before it."""


class ChatTurns:
    """Encodes observation turns through ``tokenizer``'s chat template (module docstring).

    Args:
        tokenizer: the policy's tokenizer; it must have a chat template.
        role: the observation's role, one of :data:`OBSERVATION_ROLES`.
        eos_ids: the ids that end the policy's turn (an EOS the policy sampled is not added again).
    """

    def __init__(self, tokenizer, role: str = "tool", eos_ids: Optional[list[int]] = None):
        if role not in OBSERVATION_ROLES:
            raise ValueError(f"unknown observation role {role!r} (known: {', '.join(OBSERVATION_ROLES)})")
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("observation_format=chat needs a tokenizer with a chat template; this one has "
                                    "none (use the raw format)")
        self.tokenizer, self.role = tokenizer, role
        eos = list(eos_ids or []) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.eos = {int(i): tokenizer.decode([int(i)]) for i in eos}

    def render(self, messages: list[dict], generation_prompt: bool = False, tools: Optional[list] = None) -> str:
        """The conversation as the template writes it (with the tool definitions ``tools``, when given)."""
        kw = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kw)

    def observation_ids(self, messages: list[dict], turn_text: str, turn_ids: list[int],
                        observation: str) -> list[int]:
        """The ids after the policy's turn (``turn_ids``, decoded ``turn_text``) that close it, hold the
        observation as a :attr:`role` turn and open the next assistant turn. ``messages``: the
        conversation before the turn (it ends with a generation prompt's assistant turn to come)."""
        return self.continuation_ids(messages, turn_text, turn_ids, [{"role": self.role, "content": observation}])

    def continuation_ids(self, messages: list[dict], turn_text: str, turn_ids: list[int], new_messages: list[dict],
                         tools: Optional[list] = None) -> list[int]:
        """The ids after the policy's turn that close it, hold ``new_messages`` (any roles: tool results, a user's
        reply) and open the next assistant turn, rendered with the tool definitions ``tools`` (the same at every
        turn). Raises ChatTemplateError when the template rewrites what came before."""
        before = self.render(messages, generation_prompt=True, tools=tools)
        turn = {"role": "assistant", "content": turn_text}
        without = self.render(messages + [turn], tools=tools)
        with_ = self.render(messages + [turn, *new_messages], generation_prompt=True, tools=tools)
        if not without.startswith(before + turn_text) or not with_.startswith(without):
            raise ChatTemplateError(
                "the chat template rewrites earlier turns when a turn is added (or changes the assistant's text), "
                "so observations cannot be appended without re-tokenizing what the policy sampled; use the raw "
                "observation format (rollout.agent.env.observation_format=raw)")
        close = without[len(before) + len(turn_text):]
        if turn_ids and int(turn_ids[-1]) in self.eos and close.startswith(self.eos[int(turn_ids[-1])]):
            close = close[len(self.eos[int(turn_ids[-1])]):]  # the policy ended its turn with EOS itself
        return self.tokenizer(close + with_[len(without):], add_special_tokens=False)["input_ids"]
