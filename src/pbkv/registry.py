"""A name -> class registry with lazy imports, for policies and routers alike.

Built-ins are "package.module:Class" strings, imported only when first asked for, so naming
every policy or router costs no imports. Any "package.module:Class" not registered loads an
out-of-tree class. Invariant: `get` returns a subclass of `base` or raises `error` with a
message naming the kind, the name and what is known. Imports nothing from pbkv (any layer may
use it).
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    def __init__(self, kind: str, plural: str, base: type[T], builtin: dict[str, str], error: type[ValueError]):
        self.kind, self.plural, self.base, self.builtin, self.error = kind, plural, base, builtin, error

    def names(self) -> list[str]:
        return list(self.builtin)

    def register(self, name: str, target: str) -> None:
        """Make `name` resolve to `target` ("package.module:Class")."""
        self.builtin[name] = target

    def get(self, name: str) -> type[T]:
        target = self.builtin.get(name, name if ":" in name else None)
        if target is None:
            raise self.error(f"unknown {self.kind} {name!r}; known {self.plural}: {', '.join(self.builtin)} "
                             f"(or 'package.module:Class')")
        module, _, cls = target.partition(":")
        try:
            found = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError) as e:
            raise self.error(f"{self.kind} {name!r}: cannot load {target!r} ({e})") from None
        except Exception as e:  # noqa: BLE001 - an out-of-tree module that fails as it is imported
            raise self.error(f"{self.kind} {name!r}: cannot load {target!r}: importing {module} raised "
                             f"{type(e).__name__}: {e}") from None
        if not (isinstance(found, type) and issubclass(found, self.base)):
            raise self.error(f"{self.kind} {name!r}: {target!r} is not a pbkv {self.base.__name__} subclass")
        return found
