"""``computed_once``: a cached property computed without a lock held.

``functools.cached_property`` holds one lock per property, for every instance of the class, while
it computes, on Python 3.11 (3.12 dropped it). The extension's settings and store are computed on
first use from ``app.conf``, which takes Celery's own configuration lock the first time, and Celery
calls back into the extension (its beat entry reads the settings) under that lock: two threads
using a fresh app at once (a threaded web server's first requests) deadlocked, each holding one
lock and waiting for the other. Here two threads may both compute the value; the first one stored
is the one every caller gets (as ``cached_property`` does on 3.12), and ``on_lost`` is handed
the others (to close a store nobody will use).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

__all__ = ["computed_once"]

T = TypeVar("T")


class computed_once(Generic[T]):  # noqa: N801 - named as the decorator it is, like cached_property
    def __init__(self, func: Callable[[Any], T], on_lost: Callable[[T], None] | None = None) -> None:
        self.func = func
        self.on_lost = on_lost
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> computed_once[T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> T | computed_once[T]:
        if instance is None:
            return self
        cache = instance.__dict__
        if self.name in cache:
            return cache[self.name]  # type: ignore[no-any-return]
        value = self.func(instance)
        kept: T = cache.setdefault(self.name, value)
        if kept is not value and self.on_lost is not None:
            self.on_lost(value)
        return kept
