"""The conformance suite: the test matrix every model plugin should pass, as a pytest base class.

Subclass :class:`PluginConformance` in your plugin's tests, name the plugin and a model, and
pytest runs the matrix against your plugin alone (an isolated registry: other installed plugins,
even ones claiming the same architecture, play no part)::

    from mmproc.testing.suite import PluginConformance

    class TestMyModel(PluginConformance):
        plugin = "my_model"            # the plugin's entry-point name
        model = "demo:my-model"        # a demo model of the plugin, or a model folder

What it checks, each failure naming the hook to fix:

* the entry-point module imports nothing heavy: torch, transformers, torchvision, numpy or PIL
  (``mmproc_register_models``);
* the model class passes the hook checks (every hook);
* every output of the HF processor has a field (``get_mm_fields``);
* prompts of 0 to 3 items, as text and as token ids, give what the HF processor called directly
  gives: prompt ids (a difference is reported with both placeholder counts and the first
  differing position), per-item tensors, placeholder ranges (``get_prompt_updates``,
  ``process_mm_data``); items of every size of the matrix (large, very wide, very tall and tiny
  images, so that tiling and resizing bounds are reached; videos of several frame counts) and,
  for images, of every Pillow mode too;
* a chat of two turns with an image each, rendered with the model's chat template, matches
  transformers' ``apply_chat_template`` and processor call (:mod:`mmproc.testing.chat`;
  ``get_placeholder_text`` for templates that take strings);
* a request with items of every modality the model takes (images and videos together, for a
  model whose ``get_dummy_text`` gives both) matches the HF processor;
* an item processed in one request with others of other sizes equals the same item processed
  alone: its outputs must not depend on its batch (``get_mm_fields``: padded outputs are cut to
  each item's own length, ``PaddedField``);
* with :attr:`~PluginConformance.request_kwargs` set, a request carrying those per-request
  ``hf_kwargs`` matches the HF processor called with them (``process_mm_data`` passes them on);
* the HF-expansion path and the cached path give identical results (``get_prompt_updates``,
  ``get_dummy_text``); a cache hit gives what the miss gave (read from
  ``processor.cache.stats()``, :class:`mmproc.cache.CacheStats`);
* device normalisation on and off agree (``device_norm_spec``), when the plugin offers it;
* a tokenizer that adds a BOS token (as Llama's do) changes nothing of the above;
* a deep copy of the processor (what each worker makes) does not reach the original through a
  closure or a bound method (``load_hf_processor``), and ``process_mm_data`` uses the processor
  it is given, never a stored one; two workers give what one gives.

Tests that cannot apply to a class are not generated (no skips): the image-mode matrix only for
image classes, the comparisons with HF only with ``compare_with_hf``, the ``hf_kwargs`` check
only with ``request_kwargs``.

Class attributes to adjust: ``modality`` (default ``"image"``), ``processor_options`` (e.g.
``{"backend": "pil"}``), ``compare_with_hf`` (False for a model whose HF processor is not the
reference), ``compare_chat_with_hf`` (False when its ``apply_chat_template`` loads no media),
``sizes`` (image / frame sizes of the matrix; default :data:`IMAGE_SIZES` or
:data:`FRAME_SIZES`), ``frame_counts`` (frames per video, in turn), ``request_kwargs``
(per-request ``hf_kwargs`` the model's processor takes, e.g. a smaller ``size``), ``atol``
(device normalisation).
Importing this module imports pytest; it is used only by tests.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from mmproc.context import ProcessingMode
from mmproc.factory import get_processor
from mmproc.fused_norm import FusedInputNorm
from mmproc.inputs import parse_mm_data
from mmproc.model_hooks import load_model_hooks
from mmproc.processor import ProcessedInputs, Processor
from mmproc.registry import ENTRY_POINT_GROUP, Registry
from mmproc.testing.chat import assert_chat_matches_hf
from mmproc.testing.conformance import assert_matches_hf, placeholder_token
from mmproc.testing.media import call_hf_processor, media_items, noise_image
from mmproc.testing.probes import heavy_imports, links_to_original, poisoned

__all__ = ["FRAME_SIZES", "IMAGE_SIZES", "PluginConformance", "isolated_registry"]

IMAGE_SIZES: tuple[tuple[int, int], ...] = (
    (64, 48),
    (28, 28),
    (301, 39),
    (17, 333),
    (1000, 700),  # large: several tiles of 384, or a grid past a few hundred patches
    (1500, 60),  # very wide
    (60, 1500),  # very tall
    (3, 2),  # tiny: below every minimum size
)
"""The default image sizes (width, height) of the matrix."""

FRAME_SIZES: tuple[tuple[int, int], ...] = ((64, 48), (56, 56), (112, 30))
"""The default frame sizes (width, height) of videos."""

_DEFAULT_SIZES = {"image": IMAGE_SIZES, "video": FRAME_SIZES}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def isolated_registry(plugin: str) -> Registry:
    """A registry that loads the installed plugin ``plugin`` and no other (strict: a plugin that
    fails to load raises with its error)."""
    return Registry(environ={"MMPROC_PLUGINS": plugin}, strict=True)


def _same_value(a: Any, b: Any) -> str | None:
    """None when two outputs are equal in dtype, shape and values, else how they differ."""
    left, right = torch.as_tensor(a), torch.as_tensor(b)
    if left.dtype != right.dtype:
        return f"dtype {left.dtype} vs {right.dtype}"
    if left.shape != right.shape:
        return f"shape {tuple(left.shape)} vs {tuple(right.shape)}"
    if not torch.equal(left, right):
        return "values differ"
    return None


def _outputs_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two HF processor outputs hold the same keys and equal values."""
    return set(a) == set(b) and all(_same_value(a[key], b[key]) is None for key in a)


def _applies(cls: type[PluginConformance]) -> dict[str, bool]:
    """The suite's tests that apply only to some classes, and whether they apply to ``cls``."""
    return {
        "test_requests_match_the_hf_processor": cls.compare_with_hf,
        "test_every_image_mode_matches_the_hf_processor": (
            cls.modality == "image" and cls.compare_with_hf
        ),
        "test_a_request_of_every_modality_the_model_takes_matches_the_hf_processor": (
            cls.compare_with_hf
        ),
        "test_per_request_hf_kwargs_match_the_hf_processor_called_with_them": (
            cls.compare_with_hf and cls.request_kwargs is not None
        ),
        "test_a_chat_request_matches_transformers_chat_rendering": (
            cls.modality == "image" and cls.compare_with_hf and cls.compare_chat_with_hf
        ),
        # Audio items carry no pixels: device normalisation has nothing to do for them.
        "test_device_normalisation_matches_the_float_path": cls.modality != "audio",
    }


def _assert_same(a: ProcessedInputs, b: ProcessedInputs, what: str, hooks: str) -> None:
    """Two results of one request are identical; the message says where and which hooks."""
    fix = f"{what} differ: check {hooks}"
    assert a.prompt_token_ids == b.prompt_token_ids, f"{fix} (prompt ids)"
    assert [(f.modality, f.item_index, f.placeholder) for f in a.features] == [
        (f.modality, f.item_index, f.placeholder) for f in b.features
    ], f"{fix} (features and their placeholder ranges)"
    for fa, fb in zip(a.features, b.features):
        assert set(fa.data) == set(fb.data), f"{fix} ({fa.modality} item {fa.item_index} keys)"
        for key in fa.data:
            left, right = torch.as_tensor(fa.data[key]), torch.as_tensor(fb.data[key])
            assert left.dtype == right.dtype and torch.equal(left, right), (
                f"{fix} ({fa.modality} item {fa.item_index}, output {key!r})"
            )


class PluginConformance:
    """The conformance matrix of one plugin and model; subclass it and set :attr:`plugin` and
    :attr:`model` (see the module docs)."""

    plugin: ClassVar[str]
    """The plugin's entry-point name (in group ``mmproc.plugins``)."""
    model: ClassVar[str]
    """``"demo:NAME"`` (a demo model the plugin registers) or a model folder."""
    modality: ClassVar[str] = "image"
    """The modality of the matrix: ``"image"``, ``"video"`` or ``"audio"``."""
    processor_options: ClassVar[Mapping[str, Any]] = {}
    """Extra ``get_processor`` options, e.g. ``{"backend": "pil"}``."""
    compare_with_hf: ClassVar[bool] = True
    """False for a model whose HF processor is not the reference (its comparisons are then not
    generated)."""
    compare_chat_with_hf: ClassVar[bool] = True
    """False for a model whose HF processor's ``apply_chat_template`` does not load the media of
    the messages (a processor class of the plugin's own, not transformers')."""
    sizes: ClassVar[tuple[tuple[int, int], ...] | None] = None
    """Image / frame sizes (width, height) of the matrix; None: :data:`IMAGE_SIZES` for images,
    :data:`FRAME_SIZES` for videos."""
    frame_counts: ClassVar[tuple[int, ...]] = (4, 3, 2, 5)
    """Frames of the matrix's videos, taken in turn (odd counts too: a temporal patch of 2
    repeats the last frame)."""
    request_kwargs: ClassVar[Mapping[str, Any] | None] = None
    """Per-request ``hf_kwargs`` the model's processor takes (e.g. ``{"size": {...}}`` for a
    smaller image size), chosen so that they change its outputs; the suite then checks a
    request carrying them against the HF processor called with them. None: not checked."""
    atol: ClassVar[float] = 1e-5
    """Tolerance of device-normalised pixels against the float path."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Tests that cannot apply to the class are not generated, rather than skipped: the
        # attribute is hidden (None), and brought back for a subclass they apply to again.
        super().__init_subclass__(**kwargs)
        for name, applies in _applies(cls).items():
            if name in cls.__dict__:
                continue  # the subclass's own version
            inherited = next(c.__dict__[name] for c in cls.__mro__ if c.__dict__.get(name))
            setattr(cls, name, inherited if applies else None)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrise ``item_size`` over the class's sizes."""
        if "item_size" in metafunc.fixturenames:
            sizes = self.sizes_of(self.modality)
            metafunc.parametrize("item_size", sizes, ids=[f"{w}x{h}" for w, h in sizes])

    # --- fixtures -------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def mmproc_registry(cls) -> Registry:
        """This plugin alone (see :func:`isolated_registry`)."""
        return isolated_registry(cls.plugin)

    @pytest.fixture(scope="class")
    @classmethod
    def model_folder(cls, mmproc_registry: Registry, tmp_path_factory: Any) -> Path:
        """The model folder under test (a demo model is written once per class)."""
        if cls.model.startswith("demo:"):
            demo = mmproc_registry.demo_model(cls.model.removeprefix("demo:"))
            return demo.write(tmp_path_factory.mktemp("conformance") / demo.name)
        return Path(cls.model)

    @classmethod
    def open(cls, registry: Registry, folder: Path, **options: Any) -> Processor:
        """A processor for ``folder`` with this class's options and ``options``."""
        return get_processor(folder, registry=registry, **{**cls.processor_options, **options})

    @pytest.fixture(scope="class")
    @classmethod
    def processor(cls, mmproc_registry: Registry, model_folder: Path) -> Iterator[Processor]:
        """The processor under test (its defaults: cached path, device normalisation if any)."""
        with cls.open(mmproc_registry, model_folder, warm_up=True) as processor:
            yield processor

    @pytest.fixture(scope="class")
    @classmethod
    def expanding(cls, mmproc_registry: Registry, model_folder: Path) -> Iterator[Processor]:
        """The same model with ``hf_prompt_expansion`` (the HF processor expands the prompt)."""
        with cls.open(mmproc_registry, model_folder, hf_prompt_expansion=True) as processor:
            yield processor

    # --- helpers --------------------------------------------------------------------------------

    @classmethod
    def sizes_of(cls, modality: str) -> tuple[tuple[int, int], ...]:
        """The item sizes of ``modality``: the class's :attr:`sizes` for its own modality, else
        the default."""
        if modality == cls.modality and cls.sizes is not None:
            return cls.sizes
        return _DEFAULT_SIZES.get(modality, IMAGE_SIZES)

    def items(self, count: int, seed: int = 0, modality: str | None = None) -> list[Any]:
        """``count`` synthetic items of ``modality`` (default the class's), sizes in turn."""
        modality = modality or self.modality
        return media_items(
            modality,
            count,
            seed=seed,
            sizes=self.sizes_of(modality),
            frame_counts=self.frame_counts,
        )

    def prompt(self, processor: Processor, count: int | Mapping[str, int]) -> str:
        """A prompt holding the model's placeholders for ``count`` items (of the class's
        modality, or a modality -> count mapping)."""
        counts = count if isinstance(count, Mapping) else {self.modality: count}
        placeholders = processor.model.get_dummy_text(processor.ctx, dict(counts))
        return f"Describe {placeholders} please."

    def check_against_hf(
        self,
        processor: Processor,
        prompt: str,
        items: list[Any] | Mapping[str, list[Any]],
        *,
        as_ids: bool,
        context: str,
        hf_kwargs: Mapping[str, Any] | None = None,
        hooks: str = "get_prompt_updates, process_mm_data, get_mm_fields",
    ) -> ProcessedInputs:
        """Process a request and assert it equals the HF processor called directly on it
        (with ``hf_kwargs`` on both sides)."""
        mm_data = dict(items) if isinstance(items, Mapping) else {self.modality: items}
        mm_data = {modality: list(given) for modality, given in mm_data.items() if given}
        hf = processor.hf_processor
        given: Any = hf.tokenizer(prompt)["input_ids"] if as_ids else prompt
        out = processor.process(given, mm_data or None, hf_kwargs=hf_kwargs)
        reference = call_hf_processor(hf, prompt, mm_data, **dict(hf_kwargs or {}))
        tokens = {m: placeholder_token(out, m) for m in mm_data}
        assert_matches_hf(
            out,
            reference,
            fields=processor.model.get_mm_fields(processor.ctx, reference),
            placeholder_token_ids={m: t for m, t in tokens.items() if t is not None},
            atol=self.atol,
            context=f"{context} [hooks: {hooks}]",
        )
        return out

    # --- the matrix -----------------------------------------------------------------------------

    def test_the_entry_point_module_imports_nothing_heavy(self) -> None:
        from importlib.metadata import entry_points

        (entry,) = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == self.plugin]
        heavy = heavy_imports(entry.value.partition(":")[0])
        assert not heavy, (
            f"importing the entry-point module {entry.value} imports {', '.join(heavy)}: keep it "
            "to the mmproc_register_models hook and strings (model code goes behind the lazy "
            "'package.module:ModelClass' reference), so listing plugins stays instant"
        )

    def test_the_model_class_passes_the_hook_checks(
        self, mmproc_registry: Registry, model_folder: Path
    ) -> None:
        hooks = load_model_hooks(mmproc_registry.resolve_folder(model_folder))
        assert hooks.plugin == self.plugin

    def test_every_output_has_a_field(self, processor: Processor) -> None:
        items = self.items(2, seed=1)
        prompt = self.prompt(processor, 2)
        outputs = call_hf_processor(processor.hf_processor, prompt, {self.modality: items})
        fields = processor.model.get_mm_fields(processor.ctx, outputs)
        from mmproc.fields import DEFAULT_IGNORED_KEYS

        # Per-token outputs of the prompt the plugin gives through get_prompt_outputs are not
        # item outputs (assert_matches_hf compares them with HF's).
        prompt_outputs = processor.process(prompt, {self.modality: items}).prompt_outputs
        missing = sorted(set(outputs) - set(fields) - DEFAULT_IGNORED_KEYS - set(prompt_outputs))
        assert not missing, f"outputs {missing} have no field: add them to the get_mm_fields hook"

    @pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
    @pytest.mark.parametrize("count", [0, 1, 2, 3])
    def test_requests_match_the_hf_processor(
        self, processor: Processor, count: int, as_ids: bool
    ) -> None:
        prompt = self.prompt(processor, count)
        items = self.items(count, seed=10 + count)
        self.check_against_hf(
            processor, prompt, items, as_ids=as_ids, context=f"{count} items, {prompt!r}"
        )

    def test_odd_sizes_match_the_hf_processor_and_both_paths(
        self, processor: Processor, expanding: Processor, item_size: tuple[int, int]
    ) -> None:
        size = item_size
        index = self.sizes_of(self.modality).index(size)
        items = media_items(
            self.modality, 1, seed=20 + index, sizes=[size], frame_counts=self.frame_counts
        )
        prompt = self.prompt(processor, 1)
        if self.compare_with_hf:
            self.check_against_hf(
                processor, prompt, items, as_ids=False, context=f"{self.modality} of {size}"
            )
        _assert_same(
            expanding.process(prompt, {self.modality: items}),
            processor.process(prompt, {self.modality: items}),
            f"HF-expansion and cached paths for an item of {size}",
            "get_prompt_updates and get_dummy_text",
        )

    @pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "P+transparency", "1", "CMYK"])
    def test_every_image_mode_matches_the_hf_processor(
        self, processor: Processor, mode: str
    ) -> None:
        sizes = self.sizes_of("image")[:2]
        images = [noise_image(w, h, mode, seed=90 + i) for i, (w, h) in enumerate(sizes)]
        prompt = self.prompt(processor, len(images))
        self.check_against_hf(processor, prompt, images, as_ids=False, context=f"{mode} images")

    def test_a_request_of_every_modality_the_model_takes_matches_the_hf_processor(
        self, processor: Processor
    ) -> None:
        # Two items of the class's modality, one of each other modality the model declares.
        counts = {m: 2 if m == self.modality else 1 for m in processor.modalities}
        mm_data = {
            m: self.items(n, seed=100 + i, modality=m) for i, (m, n) in enumerate(counts.items())
        }
        prompt = self.prompt(processor, counts)
        self.check_against_hf(
            processor,
            prompt,
            mm_data,
            as_ids=False,
            context=f"a request of {counts}",
            hooks="get_prompt_updates (each modality's), get_dummy_text, process_mm_data, "
            "get_mm_fields",
        )

    def test_an_item_in_a_batch_of_others_equals_the_item_processed_alone(
        self, processor: Processor
    ) -> None:
        sizes = self.sizes_of(self.modality)
        count = min(3, len(sizes)) if self.modality != "audio" else 3
        # Consecutive sizes from the large ones on: one batch pads or tiles each differently.
        items = self.items(count, seed=4 % len(sizes) if self.modality != "audio" else 1)
        processor.cache.clear()  # every item computed in this one batch
        together = processor.process(self.prompt(processor, count), {self.modality: items})
        for index, item in enumerate(items):
            processor.cache.clear()  # not served from the batch's entry
            alone = processor.process(self.prompt(processor, 1), {self.modality: [item]})
            mine, theirs = together.features[index], alone.features[0]
            where = (
                f"{self.modality} item {index} of {count} processed together (with others of "
                "other sizes) and the same item alone"
            )
            fix = (
                "an item's outputs must not depend on the other items of its batch: check "
                "get_mm_fields (an output padded to the batch's longest needs PaddedField, cut "
                "to each item's own length; a FlatField's sizes must be each item's own) and "
                "process_mm_data"
            )
            assert mine.placeholder.length == theirs.placeholder.length, (
                f"{where} expand to {mine.placeholder.length} and {theirs.placeholder.length} "
                f"tokens: {fix}, and get_prompt_updates"
            )
            assert set(mine.data) == set(theirs.data), (
                f"{where} have outputs {sorted(mine.data)} and {sorted(theirs.data)}: {fix}"
            )
            for key in mine.data:
                difference = _same_value(mine.data[key], theirs.data[key])
                assert difference is None, f"{where} differ in {key!r} ({difference}): {fix}"

    def test_per_request_hf_kwargs_match_the_hf_processor_called_with_them(
        self, processor: Processor, expanding: Processor
    ) -> None:
        kwargs = dict(self.request_kwargs or {})
        items = self.items(2, seed=110)
        prompt = self.prompt(processor, 2)
        mm_data = {self.modality: items}
        hf = processor.hf_processor
        if _outputs_equal(
            call_hf_processor(hf, prompt, mm_data), call_hf_processor(hf, prompt, mm_data, **kwargs)
        ):
            raise AssertionError(
                f"request_kwargs {kwargs} change nothing of the HF processor's outputs for "
                f"these items, so the check proves nothing: choose kwargs that do (e.g. a "
                "smaller size)"
            )
        processor.process(prompt, mm_data)  # the same items without them first, now cached
        what = (
            f"a request with hf_kwargs={kwargs} (process_mm_data must pass the request's "
            "hf_kwargs on to the HF processor; they are part of every cache key)"
        )
        self.check_against_hf(
            processor,
            prompt,
            items,
            as_ids=False,
            context=what,
            hf_kwargs=kwargs,
            hooks="process_mm_data, get_prompt_updates, get_mm_fields",
        )
        _assert_same(
            expanding.process(prompt, mm_data, hf_kwargs=kwargs),
            processor.process(prompt, mm_data, hf_kwargs=kwargs),
            f"HF-expansion and cached paths with hf_kwargs={kwargs}",
            "process_mm_data (pass hf_kwargs on) and get_prompt_updates",
        )

    @pytest.mark.parametrize("count", [1, 2, 3])
    def test_the_hf_expansion_and_cached_paths_agree(
        self, processor: Processor, expanding: Processor, count: int
    ) -> None:
        prompt = self.prompt(processor, count)
        items = self.items(count, seed=30 + count)
        mm_data = {self.modality: items}
        _assert_same(
            expanding.process(prompt, mm_data),
            processor.process(prompt, mm_data),
            f"HF-expansion and cached paths ({count} items)",
            "get_prompt_updates (each item's expansion) and get_dummy_text",
        )
        ids = processor.hf_processor.tokenizer(prompt)["input_ids"]
        _assert_same(
            processor.process(ids, mm_data),
            processor.process(prompt, mm_data),
            f"token-id and text prompts ({count} items)",
            "get_prompt_updates' targets (token ids vs text)",
        )

    def test_a_chat_request_matches_transformers_chat_rendering(self, processor: Processor) -> None:
        hf = processor.hf_processor
        if not (getattr(hf, "chat_template", None) or getattr(hf.tokenizer, "chat_template", None)):
            pytest.skip("the model folder has no chat template")
        images = self.items(2, seed=45)
        messages = [
            {"role": "user", "content": [{"type": "image", "image": images[0]}, _text("One?")]},
            {"role": "assistant", "content": [_text("One.")]},
            {"role": "user", "content": [_text("And"), {"type": "image", "image": images[1]}]},
        ]
        out = assert_chat_matches_hf(processor, messages, atol=self.atol)
        assert [f.item_index for f in out.features] == [0, 1], (
            "the chat's images are not items 0 and 1 in message order: check get_prompt_updates"
        )

    def test_a_cache_hit_gives_what_the_miss_gave(self, processor: Processor) -> None:
        items = self.items(2, seed=40)
        prompt = self.prompt(processor, 2)
        miss = processor.process(prompt, {self.modality: items})
        hits = processor.cache.stats().hits
        hit = processor.process(prompt, {self.modality: items})
        assert processor.cache.stats().hits == hits + 2, "the second request did not hit"
        _assert_same(hit, miss, "a cache hit and its miss", "get_prompt_updates")

    def test_device_normalisation_matches_the_float_path(
        self, mmproc_registry: Registry, model_folder: Path
    ) -> None:
        # Fresh processors: the class's may have switched device normalisation off already.
        with self.open(mmproc_registry, model_folder) as raw_processor:
            if (
                raw_processor.model.device_norm_spec(raw_processor.ctx, raw_processor.hf_processor)
                is None
            ):
                pytest.skip("the plugin gives no device normalisation (device_norm_spec)")
            items = self.items(2, seed=50)
            prompt = self.prompt(raw_processor, 2)
            raw = raw_processor.process(prompt, {self.modality: items})
            assert raw_processor.norm_spec is not None, (
                "device normalisation switched itself off: with rescale and normalise off, the "
                "pixels were not whole numbers in [0, 255] (process_mm_data must honour "
                "mode.raw_pixels and the do_rescale / do_normalize switches it is given)"
            )
        with self.open(mmproc_registry, model_folder, device_normalize=False) as floats_processor:
            floats = floats_processor.process(prompt, {self.modality: items})
        for a, b in zip(raw.features, floats.features):
            assert a.norm is not None and b.norm is None
            for key in a.norm.pixel_keys:
                if key not in a.data:
                    continue
                assert a.data[key].dtype == torch.uint8, (
                    f"{key!r} is not uint8 with device normalisation on: check device_norm_spec's "
                    "pixel_keys and process_mm_data (mode.raw_pixels)"
                )
                normalised = FusedInputNorm(a.norm, dtype=torch.float32)(a.data[key])
                error = float((normalised - torch.as_tensor(b.data[key])).abs().max())
                assert error <= self.atol, (
                    f"{key!r} normalised on the device differs from the CPU path by {error:.3g}: "
                    "check device_norm_spec (mean, std, rescale, layout)"
                )

    def test_a_bos_adding_tokenizer_changes_nothing_of_the_above(
        self, mmproc_registry: Registry, model_folder: Path, tmp_path: Path
    ) -> None:
        folder = _with_bos(model_folder, tmp_path / "bos")
        if folder is None:
            pytest.skip("the model's tokenizer does not read a post-processor from tokenizer.json")
        with (
            self.open(mmproc_registry, folder) as processor,
            self.open(mmproc_registry, folder, hf_prompt_expansion=True) as expanding,
        ):
            tokenizer = processor.hf_processor.tokenizer
            assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id
            for count in (1, 2):
                prompt = self.prompt(processor, count)
                items = self.items(count, seed=60 + count)
                if self.compare_with_hf:
                    for as_ids in (False, True):
                        self.check_against_hf(
                            processor, prompt, items, as_ids=as_ids, context="with a BOS"
                        )
                _assert_same(
                    expanding.process(prompt, {self.modality: items}),
                    processor.process(prompt, {self.modality: items}),
                    "HF-expansion and cached paths with a BOS-adding tokenizer",
                    "get_prompt_updates and get_dummy_text",
                )

    def test_a_deep_copy_of_the_processor_does_not_reach_the_original(
        self, processor: Processor
    ) -> None:
        original = processor.hf_processor
        findings = links_to_original(original, copy.deepcopy(original))
        assert not findings, (
            "each worker deep-copies the processor, but the copy still calls into the original "
            "(fix load_hf_processor): " + "; ".join(findings)
        )

    def test_process_mm_data_uses_the_processor_it_is_given(
        self, mmproc_registry: Registry, model_folder: Path
    ) -> None:
        from mmproc.fused_norm import raw_pixel_kwargs
        from mmproc.worker_count import fast_processor_kwargs

        with self.open(mmproc_registry, model_folder, warm_up=False) as processor:
            hooks, ctx = processor.model, processor.ctx
            clone = copy.deepcopy(processor.hf_processor)
            # What the pool hands the hook: parsed items (mmproc.inputs), not the caller's.
            items = parse_mm_data({self.modality: self.items(1, seed=70)}, media=processor.media)
            text = hooks.get_dummy_text(ctx, {self.modality: 1})
            # Both modes the pool uses: a plugin's own fast path may serve only one of them.
            for raw in {False, processor.norm_spec is not None}:
                mode = ProcessingMode(media_only=True, raw_pixels=raw, device="cpu")
                kwargs = fast_processor_kwargs(clone, "cpu") | (raw_pixel_kwargs() if raw else {})
                with poisoned(processor.hf_processor, hooks.model_object, what="a stored one"):
                    outputs = hooks.process_mm_data(ctx, mode, text, items, clone, kwargs)
                assert outputs, "process_mm_data returned nothing"

    def test_the_pool_follows_the_path_rules(
        self, mmproc_registry: Registry, model_folder: Path, monkeypatch: Any
    ) -> None:
        from mmproc.worker_count import PreprocessingPath

        monkeypatch.delenv("MMPROC_WORKERS", raising=False)  # the defaults are under test
        with self.open(mmproc_registry, model_folder, warm_up=False) as cpu:
            hooks, ctx = cpu.model, cpu.ctx
            concurrent = hooks.supports_concurrency(ctx)
            hint = hooks.worker_count_hint(ctx, PreprocessingPath.CPU)
            default = (hint or 2) if concurrent else 1
            assert (cpu.path, cpu.workers) == (PreprocessingPath.CPU, default), (
                f"on the CPU path the model gets {cpu.workers} workers, not {default} (2, or "
                "its worker_count_hint; 1 without supports_concurrency)"
            )
        # Building (not running) a processor for a GPU needs no GPU.
        with self.open(mmproc_registry, model_folder, warm_up=False, device="cuda") as gpu:
            if gpu.path is PreprocessingPath.DEVICE:
                assert gpu.workers == 1, "preprocessing on the serving GPU gets one worker"
        with self.open(mmproc_registry, model_folder, warm_up=False, workers=3) as three:
            assert three.workers == (3 if concurrent else 1), "an explicit worker count wins"

    def test_two_workers_give_what_one_gives(
        self, mmproc_registry: Registry, model_folder: Path
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        requests = [(self.items(1 + i % 3, seed=80 + i), 1 + i % 3) for i in range(6)]
        results = {}
        for workers in (1, 2):
            with self.open(
                mmproc_registry, model_folder, workers=workers, cache_bytes=0, warm_up=True
            ) as processor:
                prompts = [self.prompt(processor, n) for _, n in requests]
                with ThreadPoolExecutor(4) as callers:
                    results[workers] = list(
                        callers.map(
                            lambda pair: processor.process(pair[0], {self.modality: pair[1]}),
                            zip(prompts, (items for items, _ in requests)),
                        )
                    )
        for one, two in zip(results[1], results[2]):
            _assert_same(two, one, "two workers and one worker", "load_hf_processor's clones")


def _with_bos(folder: Path, target: Path) -> Path | None:
    """A copy of ``folder`` whose tokenizer starts every encoding with a BOS token (its own, or
    else its first special token); None when the tokenizer does not honour that."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    if not (folder / "tokenizer.json").is_file():
        return None
    shutil.copytree(folder, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "auto_map" in config:
        # A tokenizer class of the folder's own code: transformers would ask to run it. mmproc
        # never does, so the copy names transformers' class for a tokenizer.json instead.
        del config["auto_map"]
        config["tokenizer_class"] = "TokenizersBackend"
        config_path.write_text(json.dumps(config), encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    specials = list(tokenizer.all_special_tokens)
    bos = tokenizer.bos_token or (specials[0] if specials else None)
    if bos is None:
        return None
    backend = Tokenizer.from_file(str(target / "tokenizer.json"))
    bos_id = backend.token_to_id(bos)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    backend.save(str(target / "tokenizer.json"))
    config["bos_token"] = bos
    config_path.write_text(json.dumps(config), encoding="utf-8")
    reloaded = AutoTokenizer.from_pretrained(target, local_files_only=True)
    if reloaded("x")["input_ids"][:1] != [bos_id]:
        return None
    return target
