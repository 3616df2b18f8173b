"""The identity matrix of an image model with two image backends: a pytest base class.

For a model whose transformers processor has a PIL and a torchvision image processor (Qwen2-VL,
PaddleOCR-VL, ...), :class:`ImageIdentityMatrix` runs mmproc against that processor called
directly, built without the plugin, on every (backend, device normalisation) pair: every size of
:attr:`~ImageIdentityMatrix.sizes` in every Pillow mode, per-request ``hf_kwargs`` (and that they
are part of the cache key), a bad item failing its request and the next served, the 200:1 aspect
limit, a 4000 x 3000 image, both folder layouts loading the model's real settings, the tokenizer,
and an unknown backend. What must match: prompt ids, per-item tensors (joined by
:attr:`~ImageIdentityMatrix.fields`), placeholder ranges; with device normalisation
``FusedInputNorm`` of the uint8 pixels within 1e-6 of transformers' floats, without it equal.

Subclass it and set the class attributes that describe the model::

    class TestIdentity(ImageIdentityMatrix):
        image = "<|vision_start|><|image_pad|><|vision_end|>"
        placeholder_tokens = {"image": "<|image_pad|>"}
        image_processor_classes = {"pil": MyImageProcessorPil, "torchvision": MyImageProcessor}
        fields = {...}                     # default GRID_FIELDS; stated, not read from the plugin
        settings = {"patch_size": 14, ...} # the hub settings the folder must load
        tokenizer_text = "..."             # a chat-formatted prompt, tokenised alike
        single_tokens = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")

        @staticmethod
        def write_folder(path, layout="hub"):
            return write_my_model_folder(path, layout=layout)

The plugin's own tests (fast paths, token counts, video) go in the same class or next to it; the
fixtures ``folder``, ``references``, ``processors`` and ``combo`` are theirs to use. Importing
this module imports pytest; it is used only by tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar

import pytest

import mmproc
from mmproc.errors import ConfigurationError, MmprocError
from mmproc.fields import BatchedField, FieldSpec, FlatField
from mmproc.testing.conformance import assert_matches_hf
from mmproc.testing.media import call_hf_processor, noise_image

__all__ = ["BACKENDS", "GRID_FIELDS", "MODES", "ImageIdentityMatrix"]

BACKENDS = ("pil", "torchvision")
"""The image backends of the matrix."""

MODES = ("RGB", "L", "LA", "RGBA", "P", "P+transparency", "1", "CMYK")
"""The Pillow modes every size is tried in."""

GRID_FIELDS: Mapping[str, FieldSpec] = {
    "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
    "image_grid_thw": BatchedField("image"),
}
"""The image fields of a grid model (Qwen2-VL's layout): patches of all images concatenated,
one ``(t, h, w)`` grid row per image."""

# (backend, device_normalize): every test that takes `combo` runs on all four processors.
COMBOS = [(backend, norm) for backend in BACKENDS for norm in (True, False)]
COMBO_IDS = [f"{backend}-{'device_norm' if norm else 'cpu_norm'}" for backend, norm in COMBOS]


class ImageIdentityMatrix:
    """The identity matrix of one image model; subclass it (see the module docs)."""

    image: ClassVar[str]
    """The prompt text of one image (its placeholder with the tokens around it)."""
    placeholder_tokens: ClassVar[Mapping[str, str]]
    """Modality -> the token its items expand to."""
    image_processor_classes: ClassVar[Mapping[str, type]]
    """Backend -> transformers' image processor class for it."""
    fields: ClassVar[Mapping[str, FieldSpec]] = GRID_FIELDS
    """How each output joins across items, as the test states it (not read from the plugin)."""
    settings: ClassVar[Mapping[str, Any]]
    """The hub settings each of :attr:`settings_components` must load (``min_pixels`` and
    ``max_pixels`` read from ``size``)."""
    settings_components: ClassVar[tuple[str, ...]] = ("image_processor",)
    """The processor's parts that hold :attr:`settings`."""
    tokenizer_text: ClassVar[str]
    """A chat-formatted prompt that mmproc's tokenizer and transformers' must tokenise alike."""
    single_tokens: ClassVar[tuple[str, ...]]
    """The model's media tokens, each of which must be one id."""
    prompt: ClassVar[str] = "describe {image} please"
    """The prompt of one-image requests (``{image}`` is :attr:`image`)."""
    sizes: ClassVar[Sequence[tuple[int, int]]] = (
        (1, 1),
        (10, 1000),
        (1000, 10),
        (200, 1),
        (1, 200),
        (400, 2),
        (4000, 20),
        (28, 28),
        (57, 113),
    )
    """(width, height) of the size-and-mode matrix: tiny, thin, extreme (200:1 both ways, the
    largest ratio accepted), odd."""
    kwargs_image: ClassVar[tuple[int, int]] = (800, 600)
    """The image of the ``hf_kwargs`` test: larger than both of :attr:`kwargs_budgets`."""
    kwargs_budgets: ClassVar[tuple[int, int]] = (200, 100)
    """Two smaller ``longest_edge`` budgets, in 28 x 28 cells, the ``hf_kwargs`` test asks for."""

    @staticmethod
    def write_folder(path: Path, layout: str = "hub") -> Path:
        """Write the model folder at ``path`` (``layout``: ``"hub"`` or ``"save_pretrained"``)."""
        raise NotImplementedError("set write_folder to the plugin's folder writer")

    # --- helpers --------------------------------------------------------------------------------

    @classmethod
    def build_reference(cls, folder: Path, backend: str) -> Any:
        """transformers' processor for ``folder``, built without the plugin."""
        from transformers import AutoProcessor

        image_processor = cls.image_processor_classes[backend].from_pretrained(  # type: ignore[attr-defined]
            folder, local_files_only=True
        )
        return AutoProcessor.from_pretrained(
            folder, local_files_only=True, image_processor=image_processor
        )

    def assert_identical(
        self,
        out: mmproc.ProcessedInputs,
        hf: Any,
        tokenizer: Any,
        *,
        normalised: bool,
        bf16: bool = True,
        context: str = "",
    ) -> None:
        """``out`` equals transformers' output ``hf`` for the same request."""
        tokens = {m: tokenizer.convert_tokens_to_ids(t) for m, t in self.placeholder_tokens.items()}
        assert_matches_hf(
            out,
            hf,
            fields=self.fields,
            placeholder_token_ids=tokens,
            normalised=normalised,
            check_bf16=bf16,
            context=context,
        )

    def assert_real_settings(self, processor: Any) -> None:
        """The processor's parts hold :attr:`settings`."""
        for name in self.settings_components:
            component = getattr(processor, name)
            loaded = {
                key: (
                    component.size["shortest_edge"]
                    if key == "min_pixels"
                    else component.size["longest_edge"]
                    if key == "max_pixels"
                    else getattr(component, key)
                )
                for key in self.settings
            }
            for key in ("image_mean", "image_std"):
                if key in loaded:
                    loaded[key] = tuple(loaded[key])
            if "resample" in loaded:
                loaded["resample"] = int(loaded["resample"])
            assert loaded == dict(self.settings), type(component).__name__
            assert component.do_rescale and component.do_normalize and component.do_convert_rgb

    def one_image_prompt(self) -> str:
        """:attr:`prompt` with the image in it."""
        return self.prompt.format(image=self.image)

    # --- fixtures -------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def folder(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The model folder in the hub's layout."""
        return cls.write_folder(tmp_path_factory.mktemp("identity") / "hub")

    @pytest.fixture(scope="class")
    @classmethod
    def references(cls, folder: Path) -> dict[str, Any]:
        """Backend -> transformers' processor."""
        return {backend: cls.build_reference(folder, backend) for backend in BACKENDS}

    @pytest.fixture(scope="class")
    @classmethod
    def processors(cls, folder: Path) -> Iterator[dict[tuple[str, bool], mmproc.Processor]]:
        """The four (backend, device_normalize) processors, on the defaults for the rest."""
        with ExitStack() as stack:
            environment = stack.enter_context(pytest.MonkeyPatch.context())
            for name in ("MMPROC_WORKERS", "MMPROC_CACHE_BYTES"):  # the defaults are under test
                environment.delenv(name, raising=False)
            yield {
                (backend, norm): stack.enter_context(
                    mmproc.get_processor(folder, backend=backend, device_normalize=norm)
                )
                for backend, norm in COMBOS
            }

    @pytest.fixture(params=COMBOS, ids=COMBO_IDS)
    def combo(
        self, request: pytest.FixtureRequest, processors: Any, references: Any
    ) -> tuple[Any, Any, bool]:
        """(mmproc processor, transformers reference, device_normalize) for one combination."""
        backend, norm = request.param
        return processors[request.param], references[backend], norm

    # --- the matrix -----------------------------------------------------------------------------

    @pytest.mark.parametrize("mode", MODES)
    def test_every_size_and_mode_matches_hf(self, combo: Any, mode: str) -> None:
        processor, reference, norm = combo
        assert (processor.norm_spec is not None) is norm
        for seed, (width, height) in enumerate(self.sizes):
            image = noise_image(width, height, mode, seed=1000 + seed)
            prompt = self.one_image_prompt()
            out = processor.process(prompt, {"image": [image]})
            hf = call_hf_processor(reference, prompt, {"image": [image]})
            context = f"{width}x{height} {mode}"
            self.assert_identical(out, hf, reference.tokenizer, normalised=norm, context=context)

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_per_request_hf_kwargs_match_hf_and_are_part_of_the_cache_key(
        self, processors: Any, references: Any, backend: str
    ) -> None:
        processor, reference = processors[(backend, True)], references[backend]
        image = noise_image(*self.kwargs_image, seed=2200)
        prompt = f"{self.image} small"
        sizes = []
        smaller, smallest = (
            {"size": {"shortest_edge": self.settings["min_pixels"], "longest_edge": n * 28 * 28}}
            for n in self.kwargs_budgets
        )
        for hf_kwargs in ({}, smaller, smallest, {}):
            before = processor.cache.stats()
            out = processor.process(prompt, {"image": [image]}, hf_kwargs=hf_kwargs)
            hf = call_hf_processor(reference, prompt, {"image": [image]}, **hf_kwargs)
            self.assert_identical(
                out, hf, reference.tokenizer, normalised=True, context=str(hf_kwargs)
            )
            sizes.append(out.features[0].placeholder.length)
            hit = processor.cache.stats().hits - before.hits
            assert hit == (1 if len(sizes) == 4 else 0), hf_kwargs  # only the repeat is a hit
        assert sizes[0] == sizes[3] and len(set(sizes[:3])) == 3

    def test_a_bad_item_in_a_multi_image_request_fails_it_and_the_next_is_served(
        self, combo: Any
    ) -> None:
        processor, reference, norm = combo
        good, wide = noise_image(40, 50, seed=3000), noise_image(2010, 10, seed=3001)  # 201:1
        with pytest.raises(MmprocError, match="aspect ratio"):
            processor.process(f"{self.image}{self.image}", {"image": [good, wide]})
        prompt = f"{self.image} again"
        out = processor.process(prompt, {"image": [good]})
        hf = call_hf_processor(reference, prompt, {"image": [good]})
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm)

    @pytest.mark.parametrize("size", [(201, 1), (1, 201), (1000, 4), (3, 1000)])
    def test_beyond_200_to_1_is_a_clear_error_and_the_processor_keeps_serving(
        self, combo: Any, size: tuple[int, int]
    ) -> None:
        processor, reference, norm = combo
        width, height = size
        with pytest.raises(MmprocError, match="aspect ratio") as caught:
            processor.process(self.image, {"image": [noise_image(width, height, seed=4000)]})
        assert "200" in str(caught.value)
        with pytest.raises(ValueError, match="aspect ratio"):  # transformers refuses it too
            call_hf_processor(
                reference, self.image, {"image": [noise_image(width, height, seed=4000)]}
            )
        # 200:1 exactly still works, and matches
        ok = noise_image(*((200, 1) if width > height else (1, 200)), seed=4001)
        out = processor.process(self.image, {"image": [ok]})
        hf = call_hf_processor(reference, self.image, {"image": [ok]})
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm)

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_large_4000x3000_image_matches_hf(
        self, processors: Any, references: Any, backend: str
    ) -> None:
        processor, reference = processors[(backend, True)], references[backend]  # the defaults
        image = noise_image(4000, 3000, seed=5000).convert("RGB")
        prompt = self.one_image_prompt()
        out = processor.process(prompt, {"image": [image]})
        hf = call_hf_processor(reference, prompt, {"image": [image]})
        self.assert_identical(out, hf, reference.tokenizer, normalised=True, bf16=False)
        grid = hf["image_grid_thw"][0].tolist()
        merge = int(self.settings.get("merge_size", 1))
        assert out.features[0].placeholder.length == grid[0] * grid[1] * grid[2] // merge**2
        self.check_large_image(processor, out, hf)

    def check_large_image(self, processor: mmproc.Processor, out: Any, hf: Any) -> None:
        """More of the model's own about the 4000 x 3000 image: mmproc's result ``out`` and
        transformers' ``hf`` (nothing by default)."""

    @pytest.mark.parametrize("layout", ["hub", "save_pretrained"])
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_folder_layouts_load_the_real_settings_and_match_hf(
        self, tmp_path_factory: pytest.TempPathFactory, folder: Path, layout: str, backend: str
    ) -> None:
        if layout == "hub":
            path = folder
        else:
            path = self.write_folder(tmp_path_factory.mktemp("saved") / "model", layout=layout)
            assert (path / "processor_config.json").is_file()
            assert not (path / "preprocessor_config.json").exists()
        reference = self.build_reference(path, backend)
        messages, mm_data = self.layout_request()
        prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        with mmproc.get_processor(path, backend=backend) as processor:
            hf_processor = processor.hf_processor
            assert isinstance(hf_processor.image_processor, self.image_processor_classes[backend])
            self.check_loaded_processor(hf_processor)
            self.assert_real_settings(hf_processor)
            ours = hf_processor.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            assert ours == prompt
            out = processor.process(prompt, mm_data)
        hf = call_hf_processor(reference, prompt, mm_data)
        self.assert_identical(out, hf, reference.tokenizer, normalised=True)

    def check_loaded_processor(self, hf_processor: Any) -> None:
        """More of the model's own about the processor mmproc loads (nothing by default)."""

    def layout_request(self) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
        """The chat messages and media of the folder-layout test: two images by default."""
        images = [noise_image(70, 35, "LA", seed=9000), noise_image(500, 700, seed=9001)]
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare"}]
        return [{"role": "user", "content": content}], {"image": images}

    def test_hub_folder_loads_the_same_tokenizer_transformers_does(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        with mmproc.get_processor(folder) as processor:
            ours = processor.hf_processor.tokenizer
        theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        assert ours(self.tokenizer_text)["input_ids"] == theirs(self.tokenizer_text)["input_ids"]
        for token in self.single_tokens:
            assert len(ours.encode(token, add_special_tokens=False)) == 1, token

    def test_an_unknown_backend_is_a_configuration_error(self, folder: Path) -> None:
        with pytest.raises(ConfigurationError, match="backend"):
            mmproc.get_processor(folder, backend="opencv")
