"""A tiny name -> function registry, so a config string selects an algorithm piece."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Maps names to functions. An unknown name raises a ValueError that lists the valid ones."""

    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.what} {name!r} registered twice")
            self._items[name] = fn
            return fn

        return deco

    def __getitem__(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(unknown_choice(self.what, name, self._items)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def names(self) -> list[str]:
        return list(self._items)


def unknown_choice(what: str, name: object, choices) -> str:
    """Error text for an unknown choice: the bad value, a did-you-mean, and every valid choice."""
    choices = list(choices)
    close = difflib.get_close_matches(str(name), choices, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {what} {name!r}.{hint} Valid choices: {', '.join(choices)}"
