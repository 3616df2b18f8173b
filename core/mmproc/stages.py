"""Where a request's time goes: wall time per pipeline stage, recorded only when asked for.

:meth:`mmproc.Processor.recording_stages` hands out a :class:`StageClock` per request started
while it is open. The pipeline marks the end of each stage it passes; a mark charges the time
since the previous mark to that stage, so the stages of a request add up to its wall time.
Outside a recording every request gets :data:`NO_CLOCK`, whose marks do nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

__all__ = ["NO_CLOCK", "STAGES", "StageClock", "StageLog"]

#: The stages, in pipeline order, with what each covers.
STAGES: Mapping[str, str] = {
    "render": "chat requests: checking the messages, rendering the chat template, tokenising",
    "parse": "reading the items given encoded (bytes only) and loading those given decoded",
    "hash": "keying the items: content hash, hash of the encoded bytes, or caller id",
    "lookup": "cache lookups and claims on items in flight",
    "decode": "parsing and decoding the items given encoded that the cache missed",
    "hops": "handing the request between threads (queue waits included)",
    "hf_call": "the plugin's process_mm_data: the HF processor",
    "split": "splitting the outputs per item (get_mm_fields) and uint8 checks",
    "prompt_updates": "the plugin's get_prompt_updates, resolved per item",
    "cache_insert": "compact per-item copies and cache insertion",
    "tokenize": "tokenising a text prompt",
    "expand": "expanding placeholders, locating ranges, building the features",
    "prompt_outputs": "the plugin's get_prompt_outputs",
}


class StageClock:
    """One request's time per stage (seconds); each :meth:`mark` ends a stage."""

    __slots__ = ("_last", "seconds")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        """Charge the time since the previous mark (or the start) to ``stage``."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now

    @property
    def total(self) -> float:
        """The request's wall time up to its last mark."""
        return sum(self.seconds.values())


class _NoClock(StageClock):
    __slots__ = ()

    def __init__(self) -> None:
        pass

    def mark(self, stage: str) -> None:
        pass


NO_CLOCK: StageClock = _NoClock()
"""The clock of requests started outside a recording: marks do nothing."""


class StageLog:
    """The clocks of the requests started during one recording, in start order."""

    def __init__(self) -> None:
        self.clocks: list[StageClock] = []

    def new_clock(self) -> StageClock:
        clock = StageClock()
        self.clocks.append(clock)  # list.append is atomic: callers on any thread
        return clock

    def __iter__(self) -> Iterator[StageClock]:
        return iter(self.clocks)

    def __len__(self) -> int:
        return len(self.clocks)
