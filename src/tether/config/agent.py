"""``rollout.agent``: how an episode runs, a section chosen by its ``kind``.

* ``single_turn``: prompt -> one response (the math tasks); no keys of its own.
* ``multi_turn``: the environment ``rollout.agent.env`` (tool calls and observations, token-exact,
  docs/environments.md), a section chosen by its ``name``, each with the keys it reads: calculator; search (its
  retriever section ``env.retriever``, Search-R1's protocol in one raw turn, docs/search_agents.md);
  ``skyrl_gym:<name>`` and ``verifiers:<env_id>`` (chat turns, their ``options``); a user's ``module:Class`` (every
  key). A key the environment does not read is refused by construction; changing the name keeps the keys the new
  one reads.
* another name: a user's agent ``module:function`` / ``path.py:function`` (docs/extending.md).

``rollout.agent=multi_turn`` is short for ``rollout.agent.kind=multi_turn``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator

from ..sections import Section, alone
from .migration import Choice

#: the turn budget of env.name=search when env.max_turns is 0: 4 searches, then one final turn without search
SEARCH_MAX_TURNS = 5


class _Retriever(Section):
    kind: str
    """a user's retriever module:name, or another name registered in tether.search.retrievers.RETRIEVERS"""
    data_dir: str = ""
    """the search data directory for named QA sets and the corpus ("" = $TETHER_SEARCH_DATA_DIR, else
    <$TETHER_DATA_DIR>/../search)"""
    topk: int = Field(3, ge=1)
    """passages per search"""
    passage_format: Literal["search_r1", "clean"] = "search_r1"
    """how a search's passages are shown to the model: search_r1 (Search-R1's exact bytes, Doc i(Title: "T") text,
    title quotes and newlines as stored; no results: an empty block) | clean (title quotes stripped, one line per
    passage, "No results found.")"""


class _Corpus(Section):
    corpus: str = ""
    """a JSONL corpus of {"id", "contents"} rows ("" = corpus.jsonl of the search data dir)"""


class BM25RetrieverConfig(_Corpus, _Retriever):
    """``rollout.agent.env.retriever.kind=bm25``: bm25s over the corpus (the default, Search-R1's sparse
    retriever)."""

    kind: Literal["bm25"] = "bm25"
    """bm25 (the default) | dense | http | a user's retriever module:name: each kind's keys are in its table"""


class DenseRetrieverConfig(_Corpus, _Retriever):
    """``rollout.agent.env.retriever.kind=dense``: sentence-transformers embeddings in a faiss index over the corpus
    (extra tether[dense])."""

    kind: Literal["dense"] = "dense"
    """dense"""
    dense_model: str = "intfloat/e5-base-v2"
    """a sentence-transformers model name or local directory"""


class _Server(Section):
    url: str = Field("", validate_default=True)
    """the server's base URL; queries go to POST <url>/retrieve"""

    @field_validator("url")
    @classmethod
    def _given(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be set: the retrieval server's base URL (rollout.agent.env.retriever.kind=http "
                             "needs it)")
        return v

    corpus: str = ""
    """optional ("" = none): the corpus the server indexes, to recover the ids of documents it sends without one
    (Search-R1's servers send none) so tether eval can measure gold recall"""
    timeout: float = Field(30.0, gt=0)
    """seconds per request"""
    retries: int = Field(2, ge=0)
    """extra attempts after a failed request; a search that still fails becomes an observation saying so"""


class HTTPRetrieverConfig(_Server, _Retriever):
    """``rollout.agent.env.retriever.kind=http``: a Search-R1 retrieval server at url."""

    kind: Literal["http"] = "http"
    """http"""


class OtherRetrieverConfig(_Corpus, _Retriever):
    """A user's retriever (``module:name``) or another name registered in tether.search.retrievers.RETRIEVERS: every
    key, for it to read."""

    url: str = ""
    """its server's URL, if it has one"""
    dense_model: str = "intfloat/e5-base-v2"
    """its embedding model, if it has one"""
    timeout: float = Field(30.0, gt=0)
    """seconds per request, if it makes requests"""
    retries: int = Field(2, ge=0)
    """extra attempts after a failed request, if it makes requests"""


#: retriever.kind -> its section
RETRIEVER_SECTIONS: dict[str, type[Section]] = {"bm25": BM25RetrieverConfig, "dense": DenseRetrieverConfig,
                                                "http": HTTPRetrieverConfig}
#: the keys every retriever section carried before each kind had its own, and their defaults then
_OLD_RETRIEVER_DEFAULTS = {"corpus": "", "url": "", "dense_model": "intfloat/e5-base-v2", "timeout": 30.0,
                           "retries": 2}

#: rollout.agent.env.retriever, chosen by its kind
RETRIEVER = Choice("rollout.agent.env.retriever", RETRIEVER_SECTIONS, OtherRetrieverConfig, "bm25",
                   _OLD_RETRIEVER_DEFAULTS)
RetrieverConfig = RETRIEVER.type
retriever_config = RETRIEVER.section


class _Env(Section):
    choice_key: ClassVar[str] = "name"
    name: str
    """a user's environment module:Class / path.py:Class (a tether.envs.TextEnv subclass, or any object with its
    methods), or another name registered in tether.envs.ENVS"""
    max_turns: int = Field(0, ge=0)
    """policy turns per episode, the last one without tool calls (0 = the environment's own; calculator: 4, so up
    to 3 calls; search: 5, so up to 4 searches)"""
    max_obs_tokens: int = Field(512, ge=1)
    """tokens per observation; longer ones are cut (keeping the environment's closing tag)"""
    max_context: int = Field(4096, ge=1)
    """prompt + response tokens per episode (at most the model's context); an episode that reaches it ends
    ("length")"""


class _Format(Section):
    observation_format: Literal["raw", "chat"] = "raw"
    """raw (observations are text inside the one assistant turn, Search-R1's way) | chat (each observation is a
    turn of the chat template, tokenized as the difference between the conversation rendered with and without
    it, so the policy's ids stay exact; for models trained with tool turns)"""
    observation_role: Literal["tool", "user"] = "tool"
    """observation_format=chat: the role of an observation turn"""

    @field_validator("observation_role")
    @classmethod
    def _chat_only(cls, v: str, info: ValidationInfo) -> str:
        if v != "tool" and info.data.get("observation_format") != "chat" and not alone(info):
            raise ValueError("only applies with observation_format=chat (a raw observation is text in the assistant's "
                             "turn, with no role)")
        return v


class _Options(Section):
    options: dict[str, Any] = Field(default_factory=dict)
    """keyword arguments of the environment's constructor"""


class CalculatorEnvConfig(_Format, _Env):
    """``rollout.agent.env.name=calculator``: <calc> arithmetic tool calls and a #### final answer (data.task
    arithmetic or gsm8k)."""

    name: Literal["calculator"] = "calculator"
    """calculator"""
    #: its constructor takes no options (no key to set)
    options: ClassVar[Mapping[str, Any]] = MappingProxyType({})


class SearchEnvConfig(_Env):
    """``rollout.agent.env.name=search``: Search-R1's protocol over the retriever ``env.retriever``, in one assistant
    turn (data.task names a QA set, docs/search_agents.md)."""

    name: Literal["search"] = "search"
    """search"""
    #: Search-R1's protocol: observations are text in the one assistant turn (no observation keys to set)
    observation_format: ClassVar[str] = "raw"
    observation_role: ClassVar[str] = "tool"
    retriever: RetrieverConfig = Field(default_factory=BM25RetrieverConfig)
    """its retriever, a section chosen by its kind (its keys below)"""

    @field_validator("retriever", mode="before")
    @classmethod
    def _retriever_shorthand(cls, v: Any) -> Any:
        return RETRIEVER.mapping({} if v is None else v)  # an earlier release's unset retriever: bm25's defaults

    def search_turns(self) -> int:
        """The turn budget: max_turns, else :data:`SEARCH_MAX_TURNS`."""
        return self.max_turns or SEARCH_MAX_TURNS


class SkyRLGymEnvConfig(_Env):
    """``rollout.agent.env.name=skyrl_gym:<name>``: a SkyRL environment (extra tether[skyrl-gym],
    docs/ecosystem.md); its observations are chat turns."""

    choice_prefix: ClassVar[str] = "skyrl_gym:"
    name: str = Field(pattern=r"^skyrl_gym:")
    """skyrl_gym:<name>, a SkyRL environment's registered name"""
    observation_format: Literal["chat"] = "chat"
    """chat (its observations are chat messages)"""
    observation_role: Literal["tool", "user"] = "user"
    """the role of an observation turn (user: the role of SkyRL's observations)"""
    options: dict[str, Any] = Field(default_factory=dict)
    """env_config, extras (besides each example's reward_spec.ground_truth) and stop (the stop strings of a turn)"""


class VerifiersEnvConfig(_Env):
    """``rollout.agent.env.name=verifiers:<env_id>``: a verifiers environment, its module's load_environment (0.3)
    or its task API (0.4): its dataset is the training data, its rubric the reward (extra tether[verifiers],
    docs/ecosystem.md); its messages are chat turns that carry their roles."""

    choice_prefix: ClassVar[str] = "verifiers:"
    name: str = Field(pattern=r"^verifiers:")
    """verifiers:<env_id>, the module with load_environment (or the 0.4 task API's environment)"""

    @field_validator("name")
    @classmethod
    def _names_one(cls, v: str) -> str:
        if not v[len(cls.choice_prefix):]:
            raise ValueError("names no environment (verifiers:<env_id>, the module with load_environment)")
        return v

    observation_format: Literal["chat"] = "chat"
    """chat (its messages are chat turns)"""
    #: its messages carry their own roles (no observation_role to set)
    observation_role: ClassVar[str] = "tool"
    options: dict[str, Any] = Field(default_factory=dict)
    """args (load_environment's keyword arguments) and tool_format (auto | hermes | llama3_json: how the policy
    writes tool calls); verifiers 0.4: its own options (docs/ecosystem.md)"""


class OtherEnvConfig(_Options, _Format, _Env):
    """A user's environment (``module:Class`` / ``path.py:Class``, docs/environments.md) or another name registered
    in tether.envs.ENVS: every key, for it to read."""


#: env.name -> its section (a key ending in ":" holds every name it starts)
ENV_SECTIONS: dict[str, type[Section]] = {"calculator": CalculatorEnvConfig, "search": SearchEnvConfig,
                                          "skyrl_gym:": SkyRLGymEnvConfig, "verifiers:": VerifiersEnvConfig}

#: the keys every environment carried before each had its own section, and their defaults then
_OLD_ENV_DEFAULTS = {"observation_format": "raw", "observation_role": "tool", "options": {}, "retriever": None}


#: rollout.agent.env, chosen by its name
ENV = Choice("rollout.agent.env", ENV_SECTIONS, OtherEnvConfig, "calculator", _OLD_ENV_DEFAULTS, key="name")
EnvConfig = ENV.type


class SingleTurnAgentConfig(Section):
    """``rollout.agent.kind=single_turn``: prompt -> one response (the default)."""

    kind: Literal["single_turn"] = "single_turn"
    """single_turn"""


class MultiTurnAgentConfig(Section):
    """``rollout.agent.kind=multi_turn``: the environment ``env`` run turn by turn, token-exact."""

    kind: Literal["multi_turn"] = "multi_turn"
    """multi_turn"""
    env: EnvConfig = Field(default_factory=CalculatorEnvConfig)
    """the environment and the agent's budgets, a section chosen by its name (its keys below; changing the name
    keeps the keys the new environment reads)"""

    @field_validator("env", mode="before")
    @classmethod
    def _env_shorthand(cls, v: Any) -> Any:
        return ENV.mapping(v)


class OtherAgentConfig(Section):
    """A user's agent (``module:function`` / ``path.py:function``, docs/extending.md) or another agent registered in
    tether.agents.AGENTS: no keys of its own."""

    kind: str
    """its module:function, path.py:function or registered name"""


def _agent_tag(value: Any) -> str:
    kind = value.get("kind", "single_turn") if isinstance(value, dict) else getattr(value, "kind", "single_turn")
    return kind if kind in ("single_turn", "multi_turn") else "other"


AgentConfig = Annotated[Union[Annotated[SingleTurnAgentConfig, Tag("single_turn")],
                              Annotated[MultiTurnAgentConfig, Tag("multi_turn")],
                              Annotated[OtherAgentConfig, Tag("other")]], Discriminator(_agent_tag)]


def agent_shorthand(value: Any) -> Any:
    """``rollout.agent=NAME`` (a string) is ``{kind: NAME}``; a mapping without ``kind`` is multi_turn's if it
    has an ``env``, else single_turn's. The
    earlier ``search`` agent is the search environment now: a ValueError naming the new keys."""
    if value == "search" or isinstance(value, dict) and value.get("kind") == "search":
        raise ValueError("rollout.agent=search is now the search environment: rollout.agent.kind=multi_turn with "
                         "rollout.agent.env.name=search (its retriever: rollout.agent.env.retriever.*)")
    if isinstance(value, str):
        return {"kind": value}
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": "multi_turn" if "env" in value else "single_turn", **value}
    return value


def env_of(cfg) -> Optional[EnvConfig]:
    """The environment section of ``cfg``'s agent (``rollout.agent.env``), None for an agent without one."""
    return getattr(cfg.rollout.agent, "env", None)


def env_name(cfg) -> Optional[str]:
    """The name of ``cfg``'s environment (``rollout.agent.env.name``), None for an agent without one."""
    env = env_of(cfg)
    return None if env is None else env.name
