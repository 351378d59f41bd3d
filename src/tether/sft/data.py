"""SFT data: conversations read from JSONL and checked row by row, then encoded to token ids with an
exact per-token loss mask (docs/sft.md).

A row is ``{"messages": [{"role", "content"}, ...]}`` (roles ``system``, ``user``, ``assistant``,
``tool``) or ``{"prompt": str, "completion": ...}`` (a user message and the assistant's reply).
An assistant ``content`` is a string (every token trained) or a list of segments
``{"text": str, "train": bool}``: a trajectory in an environment's raw format marks its
observations (``<information>...</information>``, ``<result>...</result>``) ``"train": false``.

Encoding (`ChatEncoder`) gives the ids the policy sees in ``tether train``. For each assistant
message: the chat template's text of the conversation before it with the generation prompt
(``add_generation_prompt=True``: for the first turn exactly the prompt ids ``tether train``
encodes), less the text already encoded, tokenized as one piece and masked; then each segment
tokenized on its own (as an agent appends an observation to the sampled ids) and trained as its
``train`` says; then the token that ends the turn (the first of what the template writes after
the message, a special token such as ``<|im_end|>``), trained when the message's last segment is.
Everything else (system, user and tool messages, the template's own text) is masked.

Every problem is a `DataError` naming the file and line: a row that is not JSON or not an object,
an unknown key or role, a conversation with no assistant turn to train on, a file with no rows,
and (when encoding) a chat template that rewrites earlier turns, or a row longer than
``data.max_length`` under ``data.overflow=error``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..errors import ConfigError
from ..tasks.base import DataError, Example
from ..tasks.files import iter_jsonl
from ..tasks.prompts import encode_prompts, model_context

ROLES = ("system", "user", "assistant", "tool")
_SEGMENT_KEYS = {"text", "train"}
_MESSAGE_KEYS = {"role", "content"}


@dataclass
class Message:
    role: str
    segments: list[tuple[str, bool]]  # (text, trained); one (content, True) for a plain string

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)


@dataclass
class Conversation:
    where: str  # "FILE line N", for errors
    messages: list[Message]


@dataclass
class Encoded:
    """One conversation's token ids and, per id, whether the loss reads it (a trained target)."""

    where: str
    ids: list[int]
    train: list[bool]

    @property
    def n_targets(self) -> int:
        return sum(self.train[1:])  # position 0 is never predicted


# ---------------------------------------------------------------------------- reading and checking rows


def read_conversations(path: str | Path) -> tuple[list[Conversation], str]:
    """The conversations of JSONL file ``path`` and the sha256 of its bytes; DataError naming the
    file and line for any bad row, and for a file without rows."""
    digest = hashlib.sha256()
    rows = [parse_row(row, f"{path} line {n}") for n, row in iter_jsonl(path, raw_hash=digest)]
    if not rows:
        raise DataError(f"{path}: no rows (the file is empty or blank); expected one JSON object per line")
    return rows, digest.hexdigest()


def parse_row(row, where: str) -> Conversation:
    """One JSONL row as a `Conversation`, checked (DataError naming ``where``)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with \"messages\" or \"prompt\" and \"completion\", "
                        f"got a {type(row).__name__}")
    if "messages" in row:
        if "prompt" in row or "completion" in row:
            raise DataError(f"{where}: a row has either \"messages\" or \"prompt\" / \"completion\", not both")
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
        messages = [_message(m, f"{where}: message {i + 1}") for i, m in enumerate(msgs)]
    elif "prompt" in row or "completion" in row:
        for key in ("prompt", "completion"):
            if key not in row:
                raise DataError(f"{where}: a prompt / completion row needs \"{key}\"")
        if not isinstance(row["prompt"], str):
            raise DataError(f"{where}: \"prompt\" must be a string, got {type(row['prompt']).__name__}")
        messages = [Message("user", [(row["prompt"], False)]),
                    _message({"role": "assistant", "content": row["completion"]}, f"{where}: completion")]
    else:
        raise DataError(f"{where}: expected \"messages\" or \"prompt\" and \"completion\"; the row has "
                        f"{', '.join(map(repr, row)) or 'no keys'}")
    if not any(m.role == "assistant" and any(tr and t for t, tr in m.segments) for m in messages):
        raise DataError(f"{where}: no assistant turn to train on (the loss reads only assistant text marked "
                        f"\"train\": true)")
    return Conversation(where, messages)


def _message(m, where: str) -> Message:
    if not isinstance(m, dict):
        raise DataError(f"{where}: expected an object {{\"role\", \"content\"}}, got a {type(m).__name__}")
    extra = sorted(set(m) - _MESSAGE_KEYS)
    if extra or "role" not in m or "content" not in m:
        what = f"unknown key(s) {', '.join(map(repr, extra))}" if extra else "a missing \"role\" or \"content\""
        raise DataError(f"{where}: {what}; a message is {{\"role\": ..., \"content\": ...}}")
    role, content = m["role"], m["content"]
    if role not in ROLES:
        raise DataError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if isinstance(content, str):
        return Message(role, [(content, role == "assistant")])
    if role != "assistant" or not isinstance(content, list):
        allowed = "a string or a list of {\"text\", \"train\"} segments" if role == "assistant" else "a string"
        raise DataError(f"{where}: the content of a {role} message must be {allowed}, got "
                        f"{type(content).__name__}")
    if not content:
        raise DataError(f"{where}: an assistant message's segment list is empty")
    segments = []
    for i, seg in enumerate(content):
        if (not isinstance(seg, dict) or set(seg) != _SEGMENT_KEYS or not isinstance(seg["text"], str)
                or not isinstance(seg["train"], bool)):
            raise DataError(f"{where}, segment {i + 1}: a segment is exactly {{\"text\": string, \"train\": "
                            f"true/false}}, got {seg!r}"[:300])
        segments.append((seg["text"], seg["train"]))
    return Message(role, segments)


def split_validation(rows: list, fraction: float, seed: int, path: str) -> tuple[list, list]:
    """``(training rows, validation rows)``: ``fraction`` of ``rows`` (at least one) chosen with ``seed``."""
    n_val = max(1, round(len(rows) * fraction))
    if n_val >= len(rows):
        raise DataError(f"{path}: data.val_fraction={fraction} of its {len(rows)} rows leaves no training row")
    picked = set(random.Random(seed).sample(range(len(rows)), n_val))
    return [r for i, r in enumerate(rows) if i not in picked], [r for i, r in enumerate(rows) if i in picked]


# ---------------------------------------------------------------------------- encoding


class ChatEncoder:
    """Token ids and loss mask of conversations through ``tokenizer``'s chat template (module docstring).

    A tokenizer without a chat template encodes one exchange (an optional system message, a user
    message, an assistant message) as ``tether train`` encodes such prompts, then the assistant's
    segments and the EOS token.
    """

    def __init__(self, tokenizer, max_length: int, overflow: str):
        self.tok, self.max_length, self.overflow = tokenizer, max_length, overflow
        self.template = bool(getattr(tokenizer, "chat_template", None))
        self._ends = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def encode(self, conv: Conversation) -> Encoded:
        """``conv``'s ids and mask, fitted to ``max_length`` (DataError naming the row when it cannot be)."""
        ids, train = self._encode_chat(conv) if self.template else self._encode_plain(conv)
        cut = len(ids) > self.max_length
        if cut:
            if self.overflow == "error":
                raise DataError(f"{conv.where}: {len(ids)} tokens, more than data.max_length={self.max_length} "
                                f"(raise data.max_length, or set data.overflow=truncate to keep its first tokens)")
            ids, train = ids[:self.max_length], train[:self.max_length]
        if not any(train[1:]):  # the first token is never predicted
            within = f" within its first data.max_length={self.max_length} tokens (data.overflow=truncate)" * cut
            raise DataError(f"{conv.where}: no trained token{within}; the loss would read nothing of it")
        return Encoded(conv.where, ids, train)

    def _render(self, conv: Conversation, messages: list[Message], generation: bool) -> str:
        try:
            return self.tok.apply_chat_template([{"role": m.role, "content": m.text} for m in messages],
                                                tokenize=False, add_generation_prompt=generation)
        except Exception as e:  # a template that refuses a role or an order raises its own exception
            raise DataError(f"{conv.where}: the model's chat template refuses this conversation: "
                            f"{type(e).__name__}: {e}") from None

    def _encode_chat(self, conv: Conversation) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        train: list[bool] = []
        done = ""  # the rendered text the ids cover so far
        for k, m in enumerate(conv.messages):
            if m.role != "assistant":
                continue
            head = self._render(conv, conv.messages[:k], True)
            if not head.startswith(done):
                raise DataError(f"{conv.where}: the chat template renders the turns before message {k + 1} "
                                f"differently once later turns follow, so the ids of earlier turns cannot be the "
                                f"ones the policy saw; split the conversation at message {k + 1}")
            piece = self.ids(head[len(done):])
            ids, train = ids + piece, train + [False] * len(piece)
            for text, trained in m.segments:
                piece = self.ids(text)
                ids, train = ids + piece, train + [trained] * len(piece)
            full = self._render(conv, conv.messages[:k + 1], False)
            if not full.startswith(head + m.text):
                raise DataError(f"{conv.where}: the chat template changes the text of assistant message {k + 1} "
                                f"(e.g. strips its whitespace or drops part of it), so its tokens cannot be "
                                f"masked exactly; give the text as the template writes it")
            end = next((t for t in self._ends if full.startswith(t, len(head) + len(m.text))), None)
            if end is None:
                raise DataError(f"{conv.where}: the chat template ends assistant message {k + 1} with "
                                f"{full[len(head) + len(m.text):][:20]!r}, not a special token, so tether cannot "
                                f"tell which token ends a turn")
            ids.append(self.tok.convert_tokens_to_ids(end))
            train.append(m.segments[-1][1])
            done = head + m.text + end
        return ids, train

    def _encode_plain(self, conv: Conversation) -> tuple[list[int], list[bool]]:
        roles = [m.role for m in conv.messages]
        if roles not in (["user", "assistant"], ["system", "user", "assistant"]):
            raise DataError(f"{conv.where}: the model's tokenizer has no chat template, so a conversation can only "
                            f"be one exchange (an optional system message, a user message, an assistant message); "
                            f"this one has {', '.join(roles)}")
        system = conv.messages[0].text if roles[0] == "system" else ""
        ids = encode_prompts(self.tok, [Example(conv.messages[-2].text, "", "")], system)[0]
        train = [False] * len(ids)
        for text, trained in conv.messages[-1].segments:
            piece = self.ids(text)
            ids, train = ids + piece, train + [trained] * len(piece)
        return ids + [self.tok.eos_token_id], train + [conv.messages[-1].segments[-1][1]]


def encode_all(convs: Sequence[Conversation], encoder: ChatEncoder, progress: bool = False,
               desc: str = "encoding") -> list[Encoded]:
    """`ChatEncoder.encode` of every conversation (a tqdm bar when ``progress``)."""
    it = convs
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(convs, desc=desc, unit="row", dynamic_ncols=True, leave=False)
    return [encoder.encode(c) for c in it]


def resolve_max_length(cfg_max: int, model, tokenizer) -> int:
    """``data.max_length`` resolved: 0 means the model's context; more than the context is a ConfigError."""
    context: Optional[int] = model_context(model, tokenizer)
    if cfg_max == 0:
        if context is None:
            raise ConfigError("data.max_length=0 means the model's context, which this model does not state; set "
                              "data.max_length")
        return context
    if context is not None and cfg_max > context:
        raise ConfigError(f"data.max_length={cfg_max} exceeds the model's context of {context} tokens")
    return cfg_max
