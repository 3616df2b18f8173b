"""One model's hooks: import its class, check it against the specs, relay calls to it, typed.

:func:`load_model_hooks` takes a :class:`mmproc.registry.ModelReference` (what the registry maps an
architecture to) and returns a :class:`ModelHooks`: a pluggy relay holding the core's defaults
(``trylast``) and the model object, behind one typed method per hook. The core calls hooks only
through it; it checks what hooks return, and turns a hook's unexpected exception into an mmproc
error naming the plugin, the hook and the model.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from mmproc.context import ModelContext, ProcessingMode
from mmproc.defaults import DefaultModel
from mmproc.errors import MmprocError, PluginSpecError, ProcessingError, ProcessorLoadError
from mmproc.hook_checks import did_you_mean, explain_validation_error, unmarked_hooks
from mmproc.hookspecs import MODEL_HOOK_NAMES, PROJECT_NAME, REQUIRED_MODEL_HOOKS, ModelSpec

if TYPE_CHECKING:
    from mmproc.fields import FieldSpec
    from mmproc.media import MediaFormat
    from mmproc.norm_spec import NormSpec
    from mmproc.prompt_update import PlaceholderRange, PromptUpdate
    from mmproc.registry import ModelReference
    from mmproc.worker_count import PreprocessingPath

__all__ = ["ModelHooks", "build_model_manager", "import_model_class", "load_model_hooks"]


def import_model_class(reference: ModelReference) -> type:
    """Import the class a reference names; errors name the plugin, the target and the cause."""
    module_name, _, attr_path = reference.target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr_path.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise PluginSpecError(
            f"plugin {reference.plugin!r}: cannot import model class {reference.target!r} "
            f"for {reference.architecture}: {type(exc).__name__}: {exc}",
            plugin=reference.plugin,
        ) from exc
    if not isinstance(obj, type):
        raise PluginSpecError(
            f"plugin {reference.plugin!r}: {reference.target!r} is a {type(obj).__name__}, "
            "not a class",
            plugin=reference.plugin,
        )
    return obj


def build_model_manager(model_class: type, *, plugin: str) -> pluggy.PluginManager:
    """A hook relay for one model: the core defaults (trylast), then the model object.

    The model class is checked against the hook specifications first: a method named like a
    hook but not marked ``@mmproc.hookimpl``, a required hook (one the core has no default for)
    left out, a marked method whose name is not a hook, or an argument the hook does not provide
    is an error naming plugin, class and hook.
    """
    where = f"plugin {plugin!r}, class {model_class.__module__}.{model_class.__qualname__}"
    for hook_name in unmarked_hooks(model_class, MODEL_HOOK_NAMES):
        raise PluginSpecError(
            f"{where}: method {hook_name!r} is not marked @mmproc.hookimpl, so it would never "
            "be called",
            plugin=plugin,
        )
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(ModelSpec)
    manager.register(DefaultModel(), name="mmproc.defaults")
    try:
        instance = model_class()
    except Exception as exc:
        raise PluginSpecError(
            f"{where}: constructing the model object failed: {type(exc).__name__}: {exc}",
            plugin=plugin,
        ) from exc
    try:
        manager.register(instance, name=f"{plugin}:{model_class.__qualname__}")
    except pluggy.PluginValidationError as exc:
        explained = explain_validation_error(exc, ModelSpec, MODEL_HOOK_NAMES)
        raise PluginSpecError(f"{where}: {explained}", plugin=plugin) from exc
    unknown = _unknown_hooks(manager)
    if unknown:
        hints = [did_you_mean(name, MODEL_HOOK_NAMES) for name in unknown]
        raise PluginSpecError(
            f"{where}: {', '.join(hints)} {'is not a hook' if len(hints) == 1 else 'are not hooks'}"
            f"; the model hooks are: {', '.join(MODEL_HOOK_NAMES)}",
            plugin=plugin,
        )
    missing = [
        name for name in REQUIRED_MODEL_HOOKS if not callable(getattr(model_class, name, None))
    ]
    if missing:
        raise PluginSpecError(
            f"{where}: does not implement the required hook{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))} (the core has no default for "
            f"{'them' if len(missing) > 1 else 'it'}; see docs/plugins.md)",
            plugin=plugin,
        )
    return manager


def _unknown_hooks(manager: pluggy.PluginManager) -> list[str]:
    names: list[str] = []
    for name in dir(manager.hook):
        caller = getattr(manager.hook, name)
        if isinstance(caller, pluggy.HookCaller) and not caller.has_spec():
            names.append(name)
    return sorted(names)


def load_model_hooks(reference: ModelReference) -> ModelHooks:
    """Import the model class of ``reference`` and build its checked hook relay."""
    model_class = import_model_class(reference)
    return ModelHooks(build_model_manager(model_class, plugin=reference.plugin), reference)


def _counts(mm_items: Mapping[str, Sequence[Any]]) -> str:
    described = ", ".join(
        f"{len(v)} {k}{'' if len(v) == 1 else 's'}" for k, v in mm_items.items() if v
    )
    return described or "no media"


class ModelHooks:
    """The hooks of one architecture's model class, with types and checked results."""

    def __init__(self, manager: pluggy.PluginManager, reference: ModelReference) -> None:
        self._hook = manager.hook
        self.reference = reference
        #: The model object whose methods implement the hooks (the conformance suite's probes
        #: look at what it holds).
        self.model_object = next(
            p for p in manager.get_plugins() if not isinstance(p, DefaultModel)
        )

    @property
    def plugin(self) -> str:
        """Name of the plugin serving this model."""
        return self.reference.plugin

    @property
    def architecture(self) -> str:
        """The architecture name this model was looked up by."""
        return self.reference.architecture

    def _describe(self, hook: str | None = None) -> str:
        where = f"plugin {self.plugin!r}, {self.reference.target}"
        return f"{where}, hook {hook!r}" if hook else where

    def _required(self, hook: str, result: Any) -> Any:
        if result is None:
            raise PluginSpecError(
                f"{self._describe()}: hook {hook!r} returned nothing and has no default; "
                "the model must implement it",
                plugin=self.plugin,
            )
        return result

    def _call(self, hook: str, error: type[MmprocError], **kwargs: Any) -> Any:
        """Call ``hook``; an exception that is not an mmproc error becomes ``error`` naming the
        plugin, the hook and the model (an mmproc error the hook raised passes through)."""
        try:
            return getattr(self._hook, hook)(**kwargs)
        except MmprocError:
            raise
        except Exception as exc:
            raise error(
                f"{self.architecture} ({self._describe(hook)}): {type(exc).__name__}: {exc}"
            ) from exc

    def _typed(self, hook: str, result: Any, kind: type | tuple[type, ...], expected: str) -> Any:
        if not isinstance(result, kind):
            raise PluginSpecError(
                f"{self._describe(hook)}: returned {type(result).__name__}; expected {expected}",
                plugin=self.plugin,
            )
        return result

    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Build the HF processor (see :meth:`mmproc.hookspecs.ModelSpec.load_hf_processor`)."""
        result = self._call("load_hf_processor", ProcessorLoadError, ctx=ctx)
        return self._required("load_hf_processor", result)

    def process_mm_data(
        self,
        ctx: ModelContext,
        mode: ProcessingMode,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Mapping[str, Any]:
        """Run the HF processor; failures name the plugin, the hook, the model and the items."""
        try:
            result = self._hook.process_mm_data(
                ctx=ctx,
                mode=mode,
                prompt=prompt,
                mm_items=mm_items,
                processor=processor,
                hf_kwargs=hf_kwargs,
            )
        except MmprocError:
            raise
        except Exception as exc:
            raise ProcessingError(
                f"{ctx.architecture} ({self._describe('process_mm_data')}): the processor "
                f"failed on a request with {_counts(mm_items)}: {type(exc).__name__}: {exc}"
            ) from exc
        return self._required("process_mm_data", result)

    def get_mm_fields(
        self, ctx: ModelContext, outputs: Mapping[str, Any]
    ) -> Mapping[str, FieldSpec]:
        """How each output splits per item."""
        result = self._call("get_mm_fields", ProcessingError, ctx=ctx, outputs=outputs)
        return self._required("get_mm_fields", result)

    def get_prompt_updates(
        self,
        ctx: ModelContext,
        processor: Any,
        mm_items: Mapping[str, Sequence[Any]],
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """The placeholder insertions / replacements for these items."""
        result = self._call(
            "get_prompt_updates",
            ProcessingError,
            ctx=ctx,
            processor=processor,
            mm_items=mm_items,
            item_outputs=item_outputs,
        )
        return self._required("get_prompt_updates", result)

    def get_prompt_outputs(
        self,
        ctx: ModelContext,
        processor: Any,
        prompt_token_ids: Sequence[int],
        placeholders: Mapping[str, Sequence[PlaceholderRange]],
    ) -> dict[str, Any]:
        """The per-token outputs of the final prompt, as torch tensors (empty: none)."""
        result = self._call(
            "get_prompt_outputs",
            ProcessingError,
            ctx=ctx,
            processor=processor,
            prompt_token_ids=prompt_token_ids,
            placeholders=placeholders,
        )
        if result is None:
            return {}
        self._typed("get_prompt_outputs", result, Mapping, "a mapping of output name to tensor")
        import torch

        outputs: dict[str, Any] = {}
        for name, value in result.items():
            shape = getattr(value, "shape", None)
            if (
                not isinstance(name, str)
                or shape is None
                or tuple(shape) != (len(prompt_token_ids),)
            ):
                raise PluginSpecError(
                    f"{self._describe('get_prompt_outputs')}: output {name!r} has shape "
                    f"{None if shape is None else tuple(shape)}; expected a 1-D tensor or array "
                    f"with one entry per prompt token ({len(prompt_token_ids)})",
                    plugin=self.plugin,
                )
            outputs[name] = torch.as_tensor(value)
        return outputs

    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """Text holding placeholders for ``mm_counts`` items."""
        result = self._call("get_dummy_text", ProcessingError, ctx=ctx, mm_counts=mm_counts)
        return self._typed("get_dummy_text", self._required("get_dummy_text", result), str, "str")

    def extra_options(self, ctx: ModelContext) -> frozenset[str]:
        """Names of the processor options the model reads beyond the core's."""
        names = self._call("extra_options", PluginSpecError, ctx=ctx)
        if isinstance(names, str) or not isinstance(names, Iterable):
            names = None
        else:
            names = tuple(names)
        if names is None or not all(isinstance(name, str) for name in names):
            raise PluginSpecError(
                f"{self._describe('extra_options')}: must return an iterable of option names (str)",
                plugin=self.plugin,
            )
        return frozenset(names)

    def supports_concurrency(self, ctx: ModelContext) -> bool:
        """Whether per-thread clones may run concurrently."""
        return bool(self._call("supports_concurrency", PluginSpecError, ctx=ctx))

    def worker_count_hint(self, ctx: ModelContext, path: PreprocessingPath) -> int | None:
        """The model's suggested worker count for ``path``, if any."""
        hint = self._call("worker_count_hint", PluginSpecError, ctx=ctx, path=path)
        if hint is not None and (not isinstance(hint, int) or isinstance(hint, bool) or hint < 1):
            raise PluginSpecError(
                f"{self._describe('worker_count_hint')}: returned {hint!r}; expected an int >= 1 "
                "or None",
                plugin=self.plugin,
            )
        return hint

    def device_norm_spec(self, ctx: ModelContext, processor: Any) -> NormSpec | None:
        """The device-side normalisation the model supports, if any."""
        from mmproc.norm_spec import NormSpec

        spec = self._call("device_norm_spec", PluginSpecError, ctx=ctx, processor=processor)
        if spec is None:
            return None
        return self._typed("device_norm_spec", spec, NormSpec, "a mmproc.NormSpec or None")

    def media_format(self, ctx: ModelContext, processor: Any) -> MediaFormat:
        """What the model needs its media in (empty: the core's defaults)."""
        from mmproc.media import MediaFormat

        result = self._call("media_format", PluginSpecError, ctx=ctx, processor=processor)
        if result is None:
            return MediaFormat()
        return self._typed(
            "media_format", result, MediaFormat, "a mmproc.media.MediaFormat or None"
        )
