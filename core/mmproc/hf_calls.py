"""The plugin's HF call on a request's missing items, split per item; when a batch fails, the
item at fault named.

:meth:`HFCalls.call` runs the model's ``process_mm_data`` hook on a text and items (on the
worker thread's processor clone, or in its worker process) and splits the outputs per item with
the model's fields. :meth:`HFCalls.media_only` does so with the model's dummy text and, when the
batch fails, finds the item at fault (:mod:`mmproc.item_failures`); when every item passes
alone (some processors cannot batch items of different shapes) it processes them one at a time.
A worker process that died or hung is never an item's fault: its error is raised as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmproc.context import ModelContext, ProcessingMode
from mmproc.errors import FieldSpecError, MmprocError, ProcessingError, WorkerProcessError
from mmproc.fields import prompt_ids_row, split_outputs
from mmproc.item_failures import ItemRef, locate_failing_item

if TYPE_CHECKING:
    from mmproc.model_hooks import ModelHooks
    from mmproc.process_workers import WorkerProcesses

__all__ = ["HFCalls", "PerItem"]

PerItem = dict[str, list[dict[str, Any]]]
"""Outputs per item: modality -> one output mapping per item, in order."""


class HFCalls:
    """The HF calls of one model's processor, in this process or in ``processes``."""

    def __init__(
        self, ctx: ModelContext, model: ModelHooks, processes: WorkerProcesses | None
    ) -> None:
        self.ctx = ctx
        self.model = model
        self.processes = processes

    def call(
        self,
        mode: ProcessingMode,
        text: str,
        items: Mapping[str, list[Any]],
        kwargs: Mapping[str, Any],
        processor: Any,
    ) -> tuple[PerItem, list[int] | None]:
        """The plugin's ``process_mm_data`` on ``items``, split per item (``get_mm_fields``), and
        the prompt's ids when the HF processor expanded ``text``: on this worker thread's clone
        ``processor``, or in its worker process."""
        if self.processes is not None:
            return self.processes.call(mode, text, dict(items), kwargs)
        outputs = self.model.process_mm_data(self.ctx, mode, text, dict(items), processor, kwargs)
        per_item = self._split(outputs, {m: len(v) for m, v in items.items()})
        ids = prompt_ids_row(outputs["input_ids"]) if "input_ids" in outputs else None
        return per_item, ids

    def media_only(
        self,
        refs: Sequence[ItemRef],
        mode: ProcessingMode,
        kwargs: Mapping[str, Any],
        processor: Any,
    ) -> PerItem:
        """The HF processor on the items ``refs`` with the model's dummy text, split per item.
        When the batch fails, the item at fault is named; when every item passes alone, the
        items are processed one at a time."""
        try:
            return self._media_only(refs, mode, kwargs, processor)
        except WorkerProcessError:
            raise  # the worker's fault, not an item's: no bisecting
        except ProcessingError as exc:
            failure = self._locate_failure(exc, refs, mode, kwargs, processor)
            if failure is not exc or len(refs) == 1:
                raise failure from exc
            batch_error = exc
        # No single item fails alone: they fail together (or every part fails, and so will
        # they one by one: the batch's error is the one to report).
        per_item: PerItem = {}
        for ref in refs:
            try:
                alone = self._media_only([ref], mode, kwargs, processor)
            except WorkerProcessError:
                raise
            except ProcessingError:
                raise batch_error from None
            for modality, outputs in alone.items():
                per_item.setdefault(modality, []).extend(outputs)
        return per_item

    def _media_only(
        self,
        refs: Sequence[ItemRef],
        mode: ProcessingMode,
        kwargs: Mapping[str, Any],
        processor: Any,
    ) -> PerItem:
        items: dict[str, list[Any]] = {}
        for modality, _, value in refs:
            items.setdefault(modality, []).append(value)
        counts = {m: len(v) for m, v in items.items()}
        text = self.model.get_dummy_text(self.ctx, counts)
        return self.call(mode, text, items, kwargs, processor)[0]

    def _split(self, outputs: Mapping[str, Any], counts: Mapping[str, int]) -> PerItem:
        try:
            return split_outputs(outputs, self.model.get_mm_fields(self.ctx, outputs), counts)
        except FieldSpecError as exc:
            raise FieldSpecError(f"{self.ctx.model_name}: {exc}") from exc

    def _locate_failure(
        self,
        error: ProcessingError,
        refs: Sequence[ItemRef],
        mode: ProcessingMode,
        kwargs: Mapping[str, Any],
        processor: Any,
    ) -> MmprocError:
        """Name the request item a processor failure comes from (:mod:`mmproc.item_failures`)."""

        def run(part: Sequence[ItemRef]) -> BaseException | None:
            try:
                self._media_only(part, mode, kwargs, processor)
            except WorkerProcessError:
                raise  # the worker died or hung: no item is to blame
            except ProcessingError as exc:
                return exc.__cause__ or exc
            return None

        return locate_failing_item(
            error,
            refs,
            run,
            processor_name=f"the {self.ctx.architecture} processor (plugin {self.ctx.plugin!r})",
        )
