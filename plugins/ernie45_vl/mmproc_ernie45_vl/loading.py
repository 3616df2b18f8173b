"""Build the processor of an ERNIE-4.5-VL model folder, for either layout, never running its code.

**Converted layout** (``model_type`` ``ernie4_5_vl_moe``): transformers'
``Ernie4_5_VLMoeProcessor`` assembled from its parts, the image processor of the chosen backend
(``Ernie4_5_VLMoeImageProcessor`` on torchvision, ``Ernie4_5_VLMoeImageProcessorPil`` on Pillow),
the video processor (torchvision only, as in transformers), the folder's tokenizer and chat
template. Assembled rather than built
by ``AutoProcessor`` because ``AutoProcessor(..., backend="pil")`` would ask the video processor
for a PIL backend it does not have. The sub-processors read either file layout transformers
writes (``preprocessor_config.json`` + ``video_preprocessor_config.json``, or one nested
``processor_config.json``).

**Original layout** (``model_type`` ``ernie4_5_moe_vl``): the folder's ``tokenizer_config.json``
names Baidu's remote tokenizer class and ``auto_map`` points at its Python files; neither is
followed. The tokenizer is read from ``tokenizer.json`` (or, with sentencepiece installed, from
``tokenizer.model`` the way transformers' converter reads it), the image settings from
``preprocessor_config.json``, the processor's own settings (``image_min_pixels``, ...,
``video_fps``) from ``processor_config.json`` or ``preprocessor_config.json`` where the folder
has them, else the original processor's defaults; :mod:`mmproc_ernie45_vl.original` does the
rest.

Both layouts draw timestamps on video frames with a font file of the folder
(``Roboto-Regular.ttf``); a folder without it is refused when the processor is built, naming the
file, as transformers refuses a converted folder without it: a server misses it at start-up, not
at its first video.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmproc.plugin import (
    ConfigurationError,
    ModelContext,
    ProcessorLoadError,
    read_chat_template,
    read_json_object,
)
from mmproc_qwen_vl.shared import chosen_backend

from mmproc_ernie45_vl.layout import Layout, detect_layout
from mmproc_ernie45_vl.original import (
    FONT_FILE,
    IMAGE_END,
    IMAGE_START,
    PATCH_TOKEN,
    VIDEO_END,
    VIDEO_START,
    Ernie45VLOriginalImageProcessor,
    Ernie45VLOriginalProcessor,
)

__all__ = [
    "ORIGINAL_CONFIG_TOKENS",
    "ORIGINAL_IMAGE_SETTINGS",
    "ORIGINAL_PROCESSOR_SETTINGS",
    "load_converted_processor",
    "load_ernie_processor",
    "load_original_processor",
]

#: The original processor's own settings (its keyword arguments), with their defaults.
ORIGINAL_PROCESSOR_SETTINGS: Mapping[str, float] = {
    "spatial_conv_size": 2,
    "temporal_conv_size": 2,
    "image_min_pixels": 4 * 28 * 28,
    "image_max_pixels": 6177 * 28 * 28,
    "video_min_pixels": 299 * 28 * 28,
    "video_max_pixels": 1196 * 28 * 28,
    "video_fps": 2,
    "video_min_frames": 16,
    "video_max_frames": 180,
}

#: ``preprocessor_config.json`` keys of the original image processor that decide its output.
ORIGINAL_IMAGE_SETTINGS = (
    "patch_size",
    "merge_size",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
)

#: ``config.json`` keys of an original-layout folder that state token ids, and their tokens.
ORIGINAL_CONFIG_TOKENS: Mapping[str, str] = {
    "im_patch_id": PATCH_TOKEN,
    "image_start_token_id": IMAGE_START,
    "image_end_token_id": IMAGE_END,
    "video_start_token_id": VIDEO_START,
    "video_end_token_id": VIDEO_END,
}

# Original-processor settings this plugin cannot honour: refused rather than ignored.
_UNSUPPORTED_ORIGINAL = {
    "video_target_frames": -1,  # frame counts come from mmproc's sampling of video files
}


def load_ernie_processor(ctx: ModelContext) -> Any:
    """The processor for ``ctx``'s folder, whichever layout it has."""
    layout = detect_layout(ctx.config, where=f"{ctx.require_model_path()}/config.json")
    if layout is Layout.ORIGINAL:
        return load_original_processor(ctx)
    return load_converted_processor(ctx)


def _prefix(ctx: ModelContext) -> str:
    return f"{ctx.architecture} (plugin {ctx.plugin!r})"


def _check_font(ctx: ModelContext, folder: Path, name: str) -> Path:
    """The folder's font file ``name``, checked to be a font Pillow can load."""
    from PIL import ImageFont

    path = folder / Path(name).name
    if not path.is_file():
        raise ProcessorLoadError(
            f"{_prefix(ctx)}: {folder} has no {path.name}, the font ERNIE-4.5-VL draws each video "
            f"frame's time with. Put the model's {path.name} next to its config.json (Baidu's "
            "repositories and transformers' converted folders ship it)"
        )
    try:
        ImageFont.truetype(str(path), 12)
    except OSError as exc:
        raise ProcessorLoadError(
            f"{_prefix(ctx)}: {path} is not a font Pillow can load: {exc}"
        ) from exc
    return path


def _check_ids(ctx: ModelContext, found: Mapping[str, tuple[str, int]]) -> None:
    """Each token id ``config.json`` states (``found``: its key -> the token and the tokenizer's
    id of it) is the tokenizer's; keys the config leaves out are not checked."""
    for key, (token, token_id) in found.items():
        value = ctx.config.get(key)
        if value is not None and value != token_id:
            raise ProcessorLoadError(
                f"{_prefix(ctx)}: config.json's {key} is {value!r}, but the folder's tokenizer "
                f"gives {token} the id {token_id}"
            )


# --- converted layout ------------------------------------------------------------------------


def _video_processor_settings(folder: Path, ctx: ModelContext) -> dict[str, Any]:
    """The video processor's settings, from the file transformers would read them from."""
    nested = read_json_object(ctx, "processor_config.json", required=False)
    if nested is not None and isinstance(nested.get("video_processor"), dict):
        return dict(nested["video_processor"])
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        found = read_json_object(ctx, name, required=False)
        if found is not None:
            return found
    return {}


def load_converted_processor(ctx: ModelContext) -> Any:
    """transformers' ``Ernie4_5_VLMoeProcessor`` for ``ctx``'s folder, with the image backend of
    option ``backend``."""
    backend = chosen_backend(ctx)
    folder = ctx.require_model_path()
    from transformers import AutoTokenizer
    from transformers.models.ernie4_5_vl_moe.processing_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeProcessor,
    )
    from transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeVideoProcessor,
    )

    image_processor_class: Any
    if backend == "pil":
        from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
            Ernie4_5_VLMoeImageProcessorPil,
        )

        image_processor_class = Ernie4_5_VLMoeImageProcessorPil
    else:
        from transformers.models.ernie4_5_vl_moe.image_processing_ernie4_5_vl_moe import (
            Ernie4_5_VLMoeImageProcessor,
        )

        image_processor_class = Ernie4_5_VLMoeImageProcessor
    video_settings = _video_processor_settings(folder, ctx)
    # transformers draws unless told not to, but finds the font in the folder only when the
    # file says it draws; otherwise it looks for a bare "Roboto-Regular.ttf" wherever the server
    # runs. The folder's font is checked here and given to the video processor by its path.
    draws = video_settings.get("draw_on_frames", Ernie4_5_VLMoeVideoProcessor.draw_on_frames)
    font_kwargs = (
        {"font": str(_check_font(ctx, folder, str(video_settings.get("font") or FONT_FILE)))}
        if draws
        else {}
    )
    extra = dict(ctx.processor_options.hf_processor_kwargs)
    image_processor = image_processor_class.from_pretrained(
        str(folder), local_files_only=True, **extra
    )
    video_processor = Ernie4_5_VLMoeVideoProcessor.from_pretrained(
        str(folder), local_files_only=True, **{**font_kwargs, **extra}
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    processor = Ernie4_5_VLMoeProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=read_chat_template(folder),
    )
    _check_ids(
        ctx,
        {
            f"{name}_token_id": (
                getattr(processor, f"{name}_token"),
                getattr(processor, f"{name}_token_id"),
            )
            for name in ("image", "image_start", "image_end", "video", "video_start", "video_end")
        },
    )
    return processor


# --- original layout -------------------------------------------------------------------------


def _load_original_tokenizer(ctx: ModelContext, folder: Path) -> Any:
    """The folder's tokenizer, without the remote class its ``tokenizer_config.json`` names."""
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        try:
            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:
            raise ProcessorLoadError(
                f"{_prefix(ctx)}: cannot read {folder}/tokenizer.json: {type(exc).__name__}: {exc}"
            ) from exc
    if (folder / "tokenizer.model").is_file():
        from transformers import LlamaTokenizer

        try:
            # How transformers' converter reads Baidu's SentencePiece model: no BOS of its own
            # (the chat template writes <|begin_of_sentence|>), no prefix space.
            return LlamaTokenizer.from_pretrained(
                str(folder), local_files_only=True, add_bos_token=False, add_prefix_space=False
            )
        except Exception as exc:
            raise ProcessorLoadError(
                f"{_prefix(ctx)}: cannot read the SentencePiece model {folder}/tokenizer.model "
                f"({type(exc).__name__}: {exc}); reading it needs sentencepiece and protobuf: "
                "pip install 'mmproc-ernie45-vl[sentencepiece]'"
            ) from exc
    raise ProcessorLoadError(f"{_prefix(ctx)}: {folder} has no tokenizer.json or tokenizer.model")


def _original_settings(
    ctx: ModelContext, preprocessor: Mapping[str, Any], processor_file: Mapping[str, Any]
) -> dict[str, Any]:
    """The original processor's settings: ``processor_config.json``, else the same keys in
    ``preprocessor_config.json``, else ``config.json``'s conv sizes, else the defaults."""
    settings: dict[str, Any] = {}
    for key, default in ORIGINAL_PROCESSOR_SETTINGS.items():
        sources = [processor_file, preprocessor]
        if key in ("spatial_conv_size", "temporal_conv_size"):
            sources.append(ctx.config)  # the model's own config states these two
        settings[key] = next((s[key] for s in sources if s.get(key) is not None), default)
    for key, default in _UNSUPPORTED_ORIGINAL.items():
        value = processor_file.get(key, preprocessor.get(key, default))
        if value != default:
            raise ProcessorLoadError(
                f"{_prefix(ctx)}: the folder sets {key}={value!r}; this plugin samples video "
                f"files with mmproc's sampling (fps, min and max frames) and serves only "
                f"{key}={default!r}"
            )
    return settings


def load_original_processor(ctx: ModelContext) -> Ernie45VLOriginalProcessor:
    """The reimplemented original processor for ``ctx``'s folder (see the module docs)."""
    backend = ctx.option("backend")
    if backend not in (None, "pil"):
        raise ConfigurationError(
            f"{_prefix(ctx)}: an original-layout folder resizes with Pillow, as Baidu's processor "
            f"does; backend={backend!r} applies to converted folders only"
        )
    folder = ctx.require_model_path()
    preprocessor = read_json_object(ctx, "preprocessor_config.json", required=False) or {}
    processor_file = read_json_object(ctx, "processor_config.json", required=False) or {}
    settings = _original_settings(ctx, preprocessor, processor_file)
    image_settings = {k: preprocessor[k] for k in ORIGINAL_IMAGE_SETTINGS if k in preprocessor}
    vision = ctx.config.get("vision_config")
    if "patch_size" not in image_settings and isinstance(vision, Mapping):
        image_settings["patch_size"] = vision.get("patch_size", 14)
    image_settings.setdefault("merge_size", settings["spatial_conv_size"])
    overrides = dict(ctx.processor_options.hf_processor_kwargs)
    known = (*ORIGINAL_PROCESSOR_SETTINGS, *ORIGINAL_IMAGE_SETTINGS)
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ConfigurationError(
            f"{_prefix(ctx)}: hf_processor_kwargs {unknown} are not settings of the original "
            f"processor; it takes {', '.join(known)}"
        )
    for key, value in overrides.items():
        (settings if key in ORIGINAL_PROCESSOR_SETTINGS else image_settings)[key] = value
    if int(image_settings["merge_size"]) != int(settings["spatial_conv_size"]):
        raise ProcessorLoadError(
            f"{_prefix(ctx)}: the image processor merges {image_settings['merge_size']} x "
            f"{image_settings['merge_size']} patches but spatial_conv_size is "
            f"{settings['spatial_conv_size']}"
        )
    font = _check_font(ctx, folder, FONT_FILE)
    tokenizer = _load_original_tokenizer(ctx, folder)
    try:
        processor = Ernie45VLOriginalProcessor(
            tokenizer=tokenizer,
            image_processor=Ernie45VLOriginalImageProcessor(**image_settings),
            font_bytes=font.read_bytes(),
            chat_template=read_chat_template(folder) or getattr(tokenizer, "chat_template", None),
            **settings,
        )
    except (TypeError, ValueError) as exc:
        raise ProcessorLoadError(
            f"{_prefix(ctx)}: cannot build the original-layout processor from {folder}: {exc}"
        ) from exc
    _check_ids(
        ctx,
        {
            key: (token, processor.tokenizer.convert_tokens_to_ids(token))
            for key, token in ORIGINAL_CONFIG_TOKENS.items()
        },
    )
    return processor
