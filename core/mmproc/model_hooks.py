"""A typed facade over one model's hook relay: the core calls hooks through this, never raw."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from mmproc.context import ModelContext
from mmproc.errors import PluginSpecError, ProcessingError

if TYPE_CHECKING:
    from mmproc.executor import PreprocessingPath
    from mmproc.fields import FieldSpec
    from mmproc.fused_norm import NormSpec
    from mmproc.prompt_update import PromptUpdate
    from mmproc.registry import ModelReference

__all__ = ["ModelHooks"]


class ModelHooks:
    """The hooks of one architecture's model class, with types and checked results."""

    def __init__(
        self, manager: pluggy.PluginManager, reference: ModelReference, model_class: type
    ) -> None:
        self._hook = manager.hook
        self.reference = reference
        self.model_class = model_class
        #: The model object whose methods implement the hooks.
        self.model_instance = next(p for p in manager.get_plugins() if isinstance(p, model_class))

    @property
    def plugin(self) -> str:
        """Name of the plugin serving this model."""
        return self.reference.plugin

    @property
    def architecture(self) -> str:
        """The architecture name this model was looked up by."""
        return self.reference.architecture

    def _describe(self) -> str:
        return f"plugin {self.plugin!r}, class {self.model_class.__qualname__}"

    def _required(self, hook: str, result: Any) -> Any:
        if result is None:
            raise PluginSpecError(
                f"{self._describe()}: hook {hook!r} returned nothing and has no default; "
                "the model must implement it",
                plugin=self.plugin,
            )
        return result

    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Build the HF processor (see :meth:`mmproc.hookspecs.ModelSpec.load_hf_processor`)."""
        return self._required("load_hf_processor", self._hook.load_hf_processor(ctx=ctx))

    def process_mm_data(
        self,
        ctx: ModelContext,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Mapping[str, Any]:
        """Run the HF processor; failures name the plugin and model."""
        try:
            result = self._hook.process_mm_data(
                ctx=ctx, prompt=prompt, mm_items=mm_items, processor=processor, hf_kwargs=hf_kwargs
            )
        except (PluginSpecError, ProcessingError):
            raise
        except Exception as exc:
            counts = (
                ", ".join(f"{len(v)} {k}{'' if len(v) == 1 else 's'}" for k, v in mm_items.items())
                or "no media"
            )
            raise ProcessingError(
                f"{ctx.architecture} ({self._describe()}): the processor failed on a request "
                f"with {counts}: {type(exc).__name__}: {exc}"
            ) from exc
        return self._required("process_mm_data", result)

    def get_mm_fields(
        self, ctx: ModelContext, outputs: Mapping[str, Any]
    ) -> Mapping[str, FieldSpec]:
        """How each output splits per item."""
        return self._required("get_mm_fields", self._hook.get_mm_fields(ctx=ctx, outputs=outputs))

    def get_prompt_updates(
        self,
        ctx: ModelContext,
        processor: Any,
        mm_items: Mapping[str, Sequence[Any]],
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """The placeholder insertions / replacements for these items."""
        result = self._hook.get_prompt_updates(
            ctx=ctx, processor=processor, mm_items=mm_items, item_outputs=item_outputs
        )
        return self._required("get_prompt_updates", result)

    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """Text holding placeholders for ``mm_counts`` items."""
        return self._required(
            "get_dummy_text", self._hook.get_dummy_text(ctx=ctx, mm_counts=mm_counts)
        )

    def extra_options(self, ctx: ModelContext) -> frozenset[str]:
        """Names of the processor options the model reads beyond the core's."""
        names = self._hook.extra_options(ctx=ctx)
        if isinstance(names, str) or not isinstance(names, Iterable):
            names = None
        else:
            names = tuple(names)
        if names is None or not all(isinstance(name, str) for name in names):
            raise PluginSpecError(
                f"{self._describe()}: extra_options must return an iterable of option names (str)",
                plugin=self.plugin,
            )
        return frozenset(names)

    def supports_concurrency(self, ctx: ModelContext) -> bool:
        """Whether per-thread clones may run concurrently."""
        return bool(self._hook.supports_concurrency(ctx=ctx))

    def worker_count_hint(self, ctx: ModelContext, path: PreprocessingPath) -> int | None:
        """The model's suggested worker count for ``path``, if any."""
        hint = self._hook.worker_count_hint(ctx=ctx, path=path)
        if hint is not None and (not isinstance(hint, int) or isinstance(hint, bool) or hint < 1):
            raise PluginSpecError(
                f"{self._describe()}: worker_count_hint returned {hint!r}; expected an int >= 1 "
                "or None",
                plugin=self.plugin,
            )
        return hint

    def device_norm_spec(self, ctx: ModelContext, processor: Any) -> NormSpec | None:
        """The device-side normalisation the model supports, if any."""
        return self._hook.device_norm_spec(ctx=ctx, processor=processor)
