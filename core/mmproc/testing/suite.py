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
  ``process_mm_data``); items of odd sizes and, for images, of every Pillow mode too;
* the HF-expansion path and the cached path give identical results (``get_prompt_updates``,
  ``get_dummy_text``); a cache hit gives what the miss gave;
* device normalisation on and off agree (``device_norm_spec``), when the plugin offers it;
* a tokenizer that adds a BOS token (as Llama's do) changes nothing of the above;
* a deep copy of the processor (what each worker makes) does not reach the original through a
  closure or a bound method (``load_hf_processor``), and ``process_mm_data`` uses the processor
  it is given, never a stored one; two workers give what one gives.

Class attributes to adjust: ``modality`` (default ``"image"``), ``processor_options`` (e.g.
``{"backend": "pil"}``), ``compare_with_hf`` (False for a model whose HF processor is not the
reference), ``sizes`` (image / frame sizes of the matrix), ``atol`` (device normalisation).
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
from mmproc.testing.conformance import assert_matches_hf, placeholder_token
from mmproc.testing.media import call_hf_processor, media_items, noise_image
from mmproc.testing.probes import heavy_imports, links_to_original, poisoned

__all__ = ["PluginConformance", "isolated_registry"]


def isolated_registry(plugin: str) -> Registry:
    """A registry that loads the installed plugin ``plugin`` and no other (strict: a plugin that
    fails to load raises with its error)."""
    return Registry(environ={"MMPROC_PLUGINS": plugin}, strict=True)


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
    processor_options: ClassVar[Mapping[str, Any]] = {}
    compare_with_hf: ClassVar[bool] = True
    sizes: ClassVar[tuple[tuple[int, int], ...]] = ((64, 48), (28, 28), (301, 39), (17, 333))
    atol: ClassVar[float] = 1e-5

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

    def items(self, count: int, seed: int = 0) -> list[Any]:
        return media_items(self.modality, count, seed=seed, sizes=self.sizes)

    def prompt(self, processor: Processor, count: int) -> str:
        placeholders = processor.model.get_dummy_text(processor.ctx, {self.modality: count})
        return f"Describe {placeholders} please."

    def check_against_hf(
        self, processor: Processor, prompt: str, items: list[Any], *, as_ids: bool, context: str
    ) -> ProcessedInputs:
        hf = processor.hf_processor
        given: Any = hf.tokenizer(prompt)["input_ids"] if as_ids else prompt
        out = processor.process(given, {self.modality: items} if items else None)
        reference = call_hf_processor(hf, prompt, {self.modality: items})
        token = placeholder_token(out, self.modality)
        assert_matches_hf(
            out,
            reference,
            fields=processor.model.get_mm_fields(processor.ctx, reference),
            placeholder_token_ids={} if token is None else {self.modality: token},
            atol=self.atol,
            context=f"{context} [hooks: get_prompt_updates, process_mm_data, get_mm_fields]",
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
        if not self.compare_with_hf:
            pytest.skip("compare_with_hf is off: the HF processor is not this model's reference")
        prompt = self.prompt(processor, count)
        items = self.items(count, seed=10 + count)
        self.check_against_hf(
            processor, prompt, items, as_ids=as_ids, context=f"{count} items, {prompt!r}"
        )

    @pytest.mark.parametrize("size_index", range(4))
    def test_odd_sizes_match_the_hf_processor_and_both_paths(
        self, processor: Processor, expanding: Processor, size_index: int
    ) -> None:
        size = self.sizes[size_index % len(self.sizes)]
        items = media_items(self.modality, 1, seed=20 + size_index, sizes=[size])
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
        if self.modality != "image" or not self.compare_with_hf:
            pytest.skip("image modes: for image models whose reference is the HF processor")
        images = [noise_image(w, h, mode, seed=90 + i) for i, (w, h) in enumerate(self.sizes[:2])]
        prompt = self.prompt(processor, len(images))
        self.check_against_hf(processor, prompt, images, as_ids=False, context=f"{mode} images")

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
