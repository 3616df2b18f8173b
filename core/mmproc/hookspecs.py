"""The hook specifications: the contract between the mmproc core and a model plugin.

There are two layers, both pluggy hooks under the project name ``"mmproc"``:

* **Discovery** (:class:`DiscoverySpec`): a plugin distribution names a light module in the
  ``mmproc.plugins`` entry-point group. That module implements ``mmproc_register_models``
  and registers architecture names (and, optionally, demo models) against lazy
  ``"package.module:name"`` references. It must not import torch or transformers.
* **Model hooks** (:class:`ModelSpec`): a model is a class whose methods, marked with
  ``@mmproc.hookimpl``, implement some of these hooks. Every model hook is ``firstresult``: the
  model's answer wins, and the core's own ``trylast`` defaults (:mod:`mmproc.defaults`) answer
  whatever the model leaves out. Each takes ``ctx``, a :class:`mmproc.context.ModelContext`.

The core tells the hooks how they are called; a hook never infers it from its arguments:
``process_mm_data`` gets a :class:`mmproc.context.ProcessingMode` saying whether the prompt is
the model's dummy text (media only) or the user's, whether pixels must come out raw, and the
device.

A plugin also declares which plugin API it targets, in the ``mmproc.plugin_api`` entry-point group,
so an incompatible plugin is reported without being imported::

    [project.entry-points."mmproc.plugins"]
    my_model = "mmproc_my_model.plugin"

    [project.entry-points."mmproc.plugin_api"]
    my_model = "mmproc.hookspecs:PLUGIN_API_V2"

Threads: discovery runs once per registry, on the thread of its first lookup.
``load_hf_processor``, ``extra_options``, ``supports_concurrency``, ``worker_count_hint``,
``device_norm_spec``, ``media_format`` and ``get_dummy_text`` (once per modality, to learn the
model's placeholders) run once per ``Processor``, on the thread calling ``get_processor``. The
per-request hooks (``process_mm_data``, ``get_mm_fields``,
``get_prompt_updates``, ``get_dummy_text``) run on a worker-pool thread, with that thread's own
processor clone, possibly on several threads at once: keep no per-request state on the model.

Versions: API 2 added ``mode`` to ``process_mm_data``, demo models, and the rule that
``get_prompt_updates`` sees only the items being computed (their resolved updates are cached
with them). Plugins written for API 1 are reported ``incompatible``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from mmproc.context import ModelContext, ProcessingMode
    from mmproc.fields import FieldSpec
    from mmproc.media import MediaFormat
    from mmproc.norm_spec import NormSpec
    from mmproc.prompt_update import PlaceholderRange, PromptUpdate
    from mmproc.worker_count import PreprocessingPath

__all__ = [
    "MODEL_HOOK_NAMES",
    "PLUGIN_API_V2",
    "PLUGIN_API_VERSION",
    "REQUIRED_MODEL_HOOKS",
    "SUPPORTED_PLUGIN_API_VERSIONS",
    "DiscoverySpec",
    "ModelSpec",
    "hookimpl",
    "hookspec",
]

PROJECT_NAME = "mmproc"

#: The plugin API this core provides. Bumped only when the hook contract breaks.
PLUGIN_API_VERSION = 2
#: Plugin API versions a plugin may declare and still be loaded.
SUPPORTED_PLUGIN_API_VERSIONS = frozenset({2})
#: Target of a plugin's ``mmproc.plugin_api`` entry point that declares API version 2.
PLUGIN_API_V2 = 2

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marks a function or method as an mmproc hook implementation.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class DiscoverySpec:
    """Hooks a plugin's entry-point module implements (as module-level functions)."""

    @hookspec
    def mmproc_register_models(self, registry: Any) -> None:
        """Register the architectures (and demo models) this plugin serves.

        Signature: ``mmproc_register_models(registry) -> None``.

        Call ``registry.register(architecture_or_list, "package.module:ModelClass")`` once per
        model class, and optionally ``registry.register_demo(name, "package.module:function",
        description=...)`` per demo model (a function writing a tiny model folder; see
        :class:`mmproc.registry.ModelRegistrar`). References are stored as strings and imported
        only when used. Called once per registry (the process's, or one made in a test), on the
        thread of its first lookup, right after the entry point is imported. If it raises,
        everything it registered is rolled back and the plugin is reported as ``failed``.
        """


class ModelSpec:
    """Hooks a model class implements; every one is ``firstresult``."""

    @hookspec(firstresult=True)
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Build the HF processor for the model folder ``ctx.model_path``.

        Signature: ``load_hf_processor(ctx) -> processor``.

        Default: transformers' ``AutoProcessor`` with ``local_files_only=True`` and
        ``ctx.processor_options.hf_processor_kwargs``. A model customises the object here (patch
        methods with ``types.MethodType`` so deep copies rebind them to each worker's clone).
        Called once per ``Processor``, on the thread calling ``get_processor``; worker threads
        deep-copy the result. An exception other than an mmproc error reaches the caller as a
        :class:`~mmproc.errors.ProcessorLoadError` naming the plugin, hook and model.
        """

    @hookspec(firstresult=True)
    def process_mm_data(
        self,
        ctx: ModelContext,
        mode: ProcessingMode,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Mapping[str, Any] | None:
        """Run the HF processor on ``prompt`` and the loaded media items.

        Signature: ``process_mm_data(ctx, mode, prompt, mm_items, processor, hf_kwargs) ->
        outputs``.

        ``mode`` (:class:`mmproc.context.ProcessingMode`) says how the core calls: with the
        model's dummy text or the user's prompt, raw pixels or normalised ones, on which device.
        ``mm_items`` maps modality to the loaded items (see :mod:`mmproc.inputs`: PIL images,
        video arrays, :class:`~mmproc.inputs.AudioItem`); ``hf_kwargs`` is everything to pass to
        the HF processor besides text and media. The result maps output names (``input_ids``,
        ``pixel_values``, ...) to batched tensors. It must use the ``processor`` it is given (the
        worker thread's own clone), never one stored on the model. Return ``None`` to let the
        default run (the HF processor called with each modality under its HF keyword, and with
        the text unless ``mode.media_only``). Called on a worker-pool thread.
        """

    @hookspec(firstresult=True)
    def get_mm_fields(
        self, ctx: ModelContext, outputs: Mapping[str, Any]
    ) -> Mapping[str, FieldSpec]:
        """Say how each processor output splits per item.

        Signature: ``get_mm_fields(ctx, outputs) -> {output_name: FieldSpec}``.

        Use :mod:`mmproc.fields` specs (batched, flat with per-item sizes, shared). Every output
        except the prompt's own (``input_ids``, ``attention_mask``, ...) must be covered. Called
        on a worker-pool thread after each processor call. No default: a model must implement it.
        """

    @hookspec(firstresult=True)
    def get_prompt_updates(
        self,
        ctx: ModelContext,
        processor: Any,
        mm_items: Mapping[str, Sequence[Any]],
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """Describe how placeholders in the prompt expand, per item.

        Signature: ``get_prompt_updates(ctx, processor, mm_items, item_outputs) -> [PromptUpdate]``.

        ``mm_items`` and ``item_outputs`` hold the items being computed now (not those served
        from the cache), ``item_outputs`` as per-item output dicts (already split by fields), so
        a replacement can size itself from the item's grid. Return
        :class:`mmproc.prompt_update.PromptReplacement` / ``PromptInsertion`` objects; a content
        callable gets the item's index in ``item_outputs``. The core resolves each item's
        contents right away and caches them with the item, so a content must depend on that item
        alone. Called on a worker-pool thread, with its processor clone. No default.
        """

    @hookspec(firstresult=True)
    def get_prompt_outputs(
        self,
        ctx: ModelContext,
        processor: Any,
        prompt_token_ids: Sequence[int],
        placeholders: Mapping[str, Sequence[PlaceholderRange]],
    ) -> Mapping[str, Any] | None:
        """Compute the outputs that belong to the final prompt rather than to an item.

        Signature: ``get_prompt_outputs(ctx, processor, prompt_token_ids, placeholders) ->
        {output_name: tensor}``.

        Some HF processors return, beside ``input_ids``, one value per token of the expanded
        prompt (transformers' ``mm_token_type_ids``, for example). The core expands prompts
        itself and caches items apart from prompts, so such outputs are computed here, from the
        final ``prompt_token_ids`` and ``placeholders`` (modality -> the items'
        :class:`~mmproc.prompt_update.PlaceholderRange` in item order). Each value must be a 1-D
        tensor or array with one entry per prompt token; the request carries them as
        ``ProcessedInputs.prompt_outputs``. Default: none. Called for every request (text-only
        ones too), after its prompt is expanded: on a worker-pool thread with its processor
        clone, or, when every item was cached, on the thread calling ``process`` with the
        original processor, which the hook may read (token ids, settings) but must not call.
        """

    @hookspec(firstresult=True)
    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """Return text holding the right placeholders for ``mm_counts`` items.

        Signature: ``get_dummy_text(ctx, mm_counts) -> str``.

        Used to run the HF processor on media alone (cache misses, token-id prompts), and, for one
        item of each modality, to learn the model's placeholders: a modality whose dummy text is
        empty is one the model does not take. Called on a worker-pool thread, and at
        construction. No default: a model must implement it.
        """

    @hookspec(firstresult=True)
    def supports_concurrency(self, ctx: ModelContext) -> bool:
        """Whether preprocessing may run on several per-thread processor clones at once.

        Signature: ``supports_concurrency(ctx) -> bool``. Default ``True``. Opt out (one worker)
        when the processor's calls cannot run at the same time on different copies, e.g. when
        they share a resource outside the processor. (A processor that cannot be deep-copied at
        all needs no opt-out: the pool then falls back to one synchronous worker itself.) Called
        once when the worker pool is sized.
        """

    @hookspec(firstresult=True)
    def worker_count_hint(self, ctx: ModelContext, path: PreprocessingPath) -> int | None:
        """Suggest a worker count for preprocessing on ``path`` (CPU or DEVICE).

        Signature: ``worker_count_hint(ctx, path) -> int | None``. Default ``None`` (2 on the CPU
        path, 1 on the DEVICE path). On the DEVICE path the cap of 1 wins over the hint; an
        explicit user request wins over both. Called once when the worker pool is sized.
        """

    @hookspec(firstresult=True)
    def device_norm_spec(self, ctx: ModelContext, processor: Any) -> NormSpec | None:
        """Describe the pixel normalisation the engine can do on the device, if supported.

        Signature: ``device_norm_spec(ctx, processor) -> NormSpec | None``. Default ``None`` (the
        CPU normalises). With a spec and ``device_normalize`` on, the core calls
        ``process_mm_data`` with ``mode.raw_pixels`` and rescale / normalise switched off,
        pixels travel as uint8 and the engine applies :class:`mmproc.fused_norm.FusedInputNorm`.
        Called once per ``Processor``.
        """

    @hookspec(firstresult=True)
    def media_format(self, ctx: ModelContext, processor: Any) -> MediaFormat | None:
        """Say what the model needs its media in: video sampling, audio rate and channels.

        Signature: ``media_format(ctx, processor) -> MediaFormat | None``. Default ``None``:
        video files sampled at 2 fps, audio kept at its own rate and channels. Read the values
        from ``processor`` (e.g. its video processor's fps, its feature extractor's
        ``sampling_rate``) rather than writing constants. Every audio item is converted to the
        format, and keyed as converted; the caller's ``video_sampling`` option wins over the
        model's sampling. Called once per ``Processor``.
        """

    @hookspec(firstresult=True)
    def extra_options(self, ctx: ModelContext) -> Iterable[str]:
        """Name the processor options this model reads beyond the core's own.

        Signature: ``extra_options(ctx) -> Iterable[str]``. Default: none. ``get_processor``
        rejects any option that is neither the core's nor named here, so that a misspelled
        option is an error instead of silently doing nothing. Called once per ``Processor``,
        before the HF processor is loaded (``ctx.options`` is empty then).
        """


#: Names of the model hooks, in the order they are documented.
MODEL_HOOK_NAMES: tuple[str, ...] = tuple(
    name for name in vars(ModelSpec) if not name.startswith("_")
)

#: The model hooks with no default: every model class implements them.
REQUIRED_MODEL_HOOKS: tuple[str, ...] = ("get_mm_fields", "get_prompt_updates", "get_dummy_text")
