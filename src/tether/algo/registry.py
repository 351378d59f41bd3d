"""Name -> object registries with metadata: every extension point of tether is one of these.

A config string selects a piece by its registered name (``Registry[name]``), and the trainer reads
what the piece needs through ``meta(name)`` instead of parsing names. A user extends a registry
without editing tether: ``resolve(spec)`` also takes ``module:name`` or ``path/to/file.py:name``
(:func:`load_object`), and such an object carries its metadata as attributes of the same names.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

F = TypeVar("F", bound=Callable)

_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class Registry(Generic[F]):
    """Maps names to objects (functions, classes, builders), each with metadata.

    An unknown name raises ``error`` (a ValueError by default) that lists the valid ones.
    ``register(name, **meta)`` records metadata that the trainer reads through ``meta(name)``;
    ``required`` metadata keys must be given at every registration, and ``defaults`` are the
    metadata of an entry (or a user object) that does not give them. ``resolve(spec)`` takes a
    registered name or a user's ``module:name`` / ``path/to/file.py:name``.
    """

    def __init__(self, what: str, required: tuple[str, ...] = (), defaults: Optional[dict[str, Any]] = None,
                 error: type[Exception] = ValueError):
        self.what = what
        self.required = required
        self.defaults = dict(defaults or {})
        self.error = error
        self._items: dict[str, F] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[F], F]:
        missing = [k for k in self.required if k not in meta]
        if missing:
            raise ValueError(f"{self.what} {name!r} registered without {', '.join(missing)}")

        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.what} {name!r} registered twice")
            self._items[name] = fn
            self._meta[name] = {**self.defaults, **meta}
            return fn

        return deco

    def meta(self, name: str) -> dict[str, Any]:
        """The metadata ``name`` was registered with (a copy)."""
        obj = self[name]  # unknown names raise the did-you-mean error
        return dict(self._meta.get(name) or self.object_meta(obj))

    def where(self, **meta: Any) -> tuple[str, ...]:
        """Names whose metadata matches every ``key=value`` given."""
        return tuple(n for n, m in self._meta.items() if all(m.get(k) == v for k, v in meta.items()))

    def __getitem__(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise self.error(unknown_choice(self.what, name, self._items)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        return list(self._items)

    # dict-style replacement (tests swap an entry with ``monkeypatch.setitem``): a replaced entry keeps
    # its metadata; a new one gets the defaults, and the object's attributes named like metadata keys
    def get(self, name: str, default: Any = None) -> Any:
        return self._items.get(name, default)

    def __setitem__(self, name: str, fn: F) -> None:
        self._meta[name] = self._meta.get(name) or self.object_meta(fn)
        self._items[name] = fn

    def __delitem__(self, name: str) -> None:
        del self._items[name]
        self._meta.pop(name, None)

    # user objects, by spec
    def object_meta(self, obj: Any) -> dict[str, Any]:
        """The metadata of an unregistered object: the defaults, replaced by its attributes of the same names."""
        keys = dict.fromkeys([*self.defaults, *self.required])
        return {k: getattr(obj, k, self.defaults.get(k)) for k in keys}

    def resolve(self, spec: str) -> tuple[F, dict[str, Any]]:
        """``(object, metadata)`` of a registered name, or of a user's ``module:name`` /
        ``path/to/file.py:name`` (:func:`load_object`; an unknown name is the did-you-mean error)."""
        if spec in self._items:
            return self._items[spec], self.meta(spec)
        if is_spec(spec):
            obj = load_object(spec, self.what, self.error)
            return obj, self.object_meta(obj)
        self[spec]  # raises the did-you-mean error
        raise AssertionError("unreachable")


def unknown_choice(what: str, name: object, choices) -> str:
    """Error text for an unknown choice: the bad value, a did-you-mean, and every valid choice."""
    choices = list(choices)
    close = difflib.get_close_matches(str(name), choices, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {what} {name!r}.{hint} Valid choices: {', '.join(choices)}"


# ---------------------------------------------------------------- loading a user's object


def is_spec(spec: object) -> bool:
    """Whether ``spec`` has the form of a user object: ``dotted.module:name`` or ``path/to/file.py:name``
    (a hub dataset id ``org/name:config`` has neither form)."""
    if not isinstance(spec, str) or ":" not in spec:
        return False
    target, _, name = spec.rpartition(":")
    return bool(_NAME.fullmatch(name)) and (target.endswith(".py") or bool(_NAME.fullmatch(target)))


def _where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback (where the user's code failed)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _import_error(spec: str, what: str, where: str, exc: BaseException, error: type[Exception]) -> Exception:
    """The error for a module or file that failed while being imported."""
    if isinstance(exc, SyntaxError):
        return error(f"{what} {spec!r}: {exc.filename or where}, line {exc.lineno}: {type(exc).__name__}: {exc.msg}")
    return error(f"{what} {spec!r}: importing {where} raised {type(exc).__name__}: {exc} (at {_where(exc)})")


def _import_file(path: Path, spec: str, what: str, error: type[Exception]):
    path = path.expanduser().resolve()
    if not path.is_file():
        raise error(f"{what} {spec!r}: {what} file not found: {path}")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    mod_name = f"tether_user_{what}_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    imp_spec = importlib.util.spec_from_file_location(mod_name, path)
    if imp_spec is None or imp_spec.loader is None:
        raise error(f"{what} {spec!r}: cannot import {what} file {path}")
    module = importlib.util.module_from_spec(imp_spec)
    sys.modules[mod_name] = module
    try:
        imp_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SyntaxError too; not KeyboardInterrupt
        sys.modules.pop(mod_name, None)
        raise _import_error(spec, what, str(path), e, error) from e
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def load_object(spec: str, what: str = "object", error: type[Exception] = ValueError) -> Any:
    """The callable a user's ``package.module:name`` (imported with importlib; dotted attributes such
    as ``module:Class.method`` work) or ``path/to/file.py:name`` (relative to the working directory)
    names. Failures raise ``error`` naming the spec and the cause: a bad spec, a module not found,
    a syntax error (file and line) or an exception while importing (its type, message and where
    it was raised), a missing attribute, an object that is not callable."""
    target, _, func_name = spec.rpartition(":")
    if not target or not func_name:
        raise error(f"bad {what} spec {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    looks_like_file = target.endswith(".py") or "/" in target or os.sep in target
    if looks_like_file:
        module = _import_file(Path(target), spec, what, error)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise error(f"cannot import {what} module {target!r} (from {spec!r}): {e}") from e
        except (Exception, SystemExit) as e:
            raise _import_error(spec, what, f"module {target!r}", e, error) from e
    obj = module
    for part in func_name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{what} {spec!r}: {what} module {target!r} has no attribute {func_name!r}") from None
    if not callable(obj):
        raise error(f"{what} {spec!r} is not callable")
    return obj
