"""The search environment's training task, registered in ``tether.tasks.TASKS`` as ``search``: the QA sets of
``tether.search.data`` with the search protocol's instruction in each prompt."""

from __future__ import annotations

from pathlib import Path

from ..sections import default
from ..tasks.registry import TASKS
from .data import SEARCH_DATASETS, load_search_examples


def _search_check(data) -> list[str]:
    """data.split picks a hub id's split; a named QA set or a .jsonl file is one split already (a task that is no
    dataset, such as the default arithmetic, has no split: it is refused where its rows are loaded)."""
    if "split" in type(data).model_fields and data.split != default(data, "split") and (
            data.task.lower() in SEARCH_DATASETS or Path(data.task).expanduser().is_file()):
        return [f"data.split only applies to a hub dataset id with rollout.agent.env.name=search; "
                f"data.task={data.task!r} is one split already (the search data dir's named sets: "
                f"{', '.join(SEARCH_DATASETS)})"]
    return []


@TASKS.register("search", reward="search", env="search", ignores=("data_dir",), check=_search_check,
                about="rollout.agent.env.name=search (its QA sets are read from rollout.agent.env.retriever.data_dir)",
                preset={
    # Search-R1's setting: the search environment on the closed-pool multi-hop set, exact match only
    "rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "search", "data.task": "multihop",
    "data.format_weight": 0.0, "rollout.n": 5,
    "rollout.max_new_tokens": 128})
def search_qa_task(data, env) -> list:
    """QA for the search environment: ``data.task`` names a QA set of the search data dir, a .jsonl file or a hub id
    (its ``data.split``); the prompt carries the search protocol's instruction
    (``load_search_examples``)."""
    return load_search_examples(data.task, data_dir=env.retriever.data_dir or None,
                                question_key=data.prompt_key or "question", answers_key=data.answer_key,
                                max_searches=env.search_turns() - 1, limit=data.limit or None, hub_split=data.split)
