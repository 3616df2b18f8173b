"""Tokenizer copies for the requests answered from the cache, on their callers' threads.

A request whose items are all cached is expanded where it was made (no worker): its prompt is
tokenised there. A fast tokenizer keeps its call settings (truncation, padding) on itself, so one
copy must serve one call at a time; with a single copy, one long prompt would hold up every
cached request behind it. :class:`TokenizerClones` lends copies: the original first, then deep
copies made when all are busy, up to a bound.

The original may have another user: a worker pool in its synchronous fallback runs its HF calls
on the original processor, tokenizer included, under a lock of its own (whose calls may set
truncation on it). The original is lent, and copied, holding that lock too.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TokenizerClones"]


class TokenizerClones:
    """Lends ``original`` or one of at most ``max_copies - 1`` deep copies of it, one borrower
    each at a time; ``original_lock``: held while the original is lent or copied, when others
    use it under that lock."""

    def __init__(
        self,
        original: Any,
        max_copies: int,
        original_lock: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        if max_copies < 1:
            raise ValueError(f"max_copies must be >= 1, got {max_copies}")
        self._original = original
        self._original_lock = original_lock or contextlib.nullcontext()
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
        make = False
        with self._ready:
            while not self._free and self._made >= self._max:
                self._ready.wait()
            if self._free:
                tokenizer = self._free.pop()
            else:
                self._made += 1
                make = True
        if make:
            try:
                # The calls made here ask for no truncation or padding, so a copy made while
                # the original is lent to one of them has its settings as loaded; other users'
                # calls may set some, so they are kept out meanwhile.
                with self._original_lock:
                    tokenizer = copy.deepcopy(self._original)
            except BaseException:
                with self._ready:
                    self._made -= 1
                    self._ready.notify()
                raise
        try:
            if tokenizer is self._original:
                with self._original_lock:
                    yield tokenizer
            else:
                yield tokenizer
        finally:
            with self._ready:
                self._free.append(tokenizer)
                self._ready.notify()
