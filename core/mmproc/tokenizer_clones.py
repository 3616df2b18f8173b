"""Tokenizer copies for the requests answered from the cache, on their callers' threads.

A request whose items are all cached is expanded where it was made (no worker): its prompt is
tokenised there. A fast tokenizer keeps its call settings (truncation, padding) on itself, so one
copy must serve one call at a time; with a single copy, one long prompt would hold up every
cached request behind it. :class:`TokenizerClones` lends copies: the original first, then deep
copies made when all are busy, up to a bound.

The original may have other users: a worker pool in its synchronous fallback runs its HF calls
on the original processor, tokenizer included, under a lock of its own (and those calls may set
truncation on it). While it does (``shared()`` says so), the original is not lent, and copies
are made from it under that lock.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TokenizerClones"]


class TokenizerClones:
    """Lends ``original`` or one of at most ``max_copies - 1`` deep copies of it, one borrower
    each at a time. While ``shared()`` is true, others use the original under ``original_lock``:
    it is not lent then (up to ``max_copies`` copies are), and copies are made holding that
    lock."""

    def __init__(
        self,
        original: Any,
        max_copies: int,
        original_lock: contextlib.AbstractContextManager[Any] | None = None,
        shared: Callable[[], bool] = lambda: False,
    ) -> None:
        if max_copies < 1:
            raise ValueError(f"max_copies must be >= 1, got {max_copies}")
        self._original = original
        self._original_lock = original_lock or contextlib.nullcontext()
        self._shared = shared
        self._max = max_copies
        self._free: list[Any] = [original]
        self._made = 1
        self._ready = threading.Condition()

    @property
    def copies(self) -> int:
        """Copies made so far, the original included."""
        with self._ready:
            return self._made

    @contextmanager
    def borrow(self) -> Iterator[Any]:
        """A tokenizer no other thread uses until the ``with`` block ends; waits for one when
        every copy is lent and no more may be made."""
        with self._ready:
            while True:
                shared = self._shared()
                usable = [t for t in self._free if not (shared and t is self._original)]
                if usable or self._made < self._max + (1 if shared else 0):
                    break
                self._ready.wait()
            if usable:
                tokenizer = usable[-1]
                self._free.remove(tokenizer)
            else:
                self._made += 1
        if not usable:
            try:
                # The calls made here ask for no truncation or padding, so a copy made while
                # the original is lent to one of them has its settings as loaded; the other
                # users' calls may set some, so they are kept out meanwhile.
                with self._original_lock if shared else contextlib.nullcontext():
                    tokenizer = copy.deepcopy(self._original)
            except BaseException:
                with self._ready:
                    self._made -= 1
                    self._ready.notify()
                raise
        try:
            yield tokenizer
        finally:
            with self._ready:
                self._free.append(tokenizer)
                self._ready.notify_all()
