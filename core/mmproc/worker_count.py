"""How many preprocessing workers a model gets: the preprocessing path and the count rules.

Why the path decides the default: preprocessing costs CPU time on the serving process, so with one
worker throughput is capped at ``1 / preprocess_time`` however idle the accelerator is. A second
worker lifts that cap when preprocessing runs on the CPU, but when a torchvision ("fast") image
processor runs on the serving GPU a second worker competes with the model for the device and
lowers throughput. So the CPU path defaults to two workers (or the model's own hint) and the
device path to one, which caps any hint; an explicit count from the user wins over both; a model
that cannot run on per-thread clones gets one.

Everything here is pure (no torch import, no threads); the only side effects are log records on
this module's logger.
"""

from __future__ import annotations

import enum
import logging
import os
from typing import Any

from mmproc.errors import ConfigurationError

__all__ = [
    "DEFAULT_CPU_WORKERS",
    "DEFAULT_IO_WORKERS",
    "IO_WORKERS_ENV",
    "WORKERS_ENV",
    "PreprocessingPath",
    "fast_processor_kwargs",
    "preprocessing_path",
    "requested_worker_count",
    "resolve_io_worker_count",
    "resolve_worker_count",
]

logger = logging.getLogger(__name__)

WORKERS_ENV = "MMPROC_WORKERS"
IO_WORKERS_ENV = "MMPROC_IO_WORKERS"
DEFAULT_CPU_WORKERS = 2
DEFAULT_IO_WORKERS = 4

# Classes of transformers' torch-based processors, by name, so that telling the path needs no
# transformers import: TorchvisionBackend (5.x image and video processors), BaseImageProcessorFast
# and BaseVideoProcessor (4.x).
_TORCH_BACKEND_CLASSES = frozenset(
    {"TorchvisionBackend", "BaseImageProcessorFast", "BaseVideoProcessor"}
)


class PreprocessingPath(enum.StrEnum):
    """Where a model's preprocessing runs, which decides its default worker count."""

    CPU = "cpu"
    """PIL / NumPy image processors, torchvision on the CPU, audio feature extractors."""

    DEVICE = "device"
    """A torchvision ("fast") image processor running on the serving accelerator."""


def _device_type(device: Any) -> str:
    """``"cuda"`` for ``"cuda:1"`` or ``torch.device("cuda", 1)``; no torch import needed."""
    text = str(getattr(device, "type", device)).strip().lower()
    kind = text.split(":", 1)[0]
    if not kind:
        raise ConfigurationError(f"device {device!r} is not a device name (e.g. 'cpu', 'cuda:0')")
    return kind


def _is_torch_backend(component: Any) -> bool:
    """Whether an image / video processor runs on torch (and so honours ``device``)."""
    backend = getattr(component, "backend", None)
    if isinstance(backend, str):
        return backend == "torchvision"
    return any(cls.__name__ in _TORCH_BACKEND_CLASSES for cls in type(component).__mro__)


def _vision_component(processor: Any) -> Any | None:
    """The component whose backend decides the path: the image processor, else the video one.

    A bare image processor (some models load one instead of a ``ProcessorMixin``) is its own
    component; a tokenizer or an audio feature extractor has none.
    """
    for name in ("image_processor", "video_processor"):
        component = getattr(processor, name, None)
        if component is not None:
            return component
    if _is_torch_backend(processor) or hasattr(processor, "resample"):
        return processor
    return None


def preprocessing_path(processor: Any, *, device: Any = "cpu") -> PreprocessingPath:
    """Tell where ``processor`` preprocesses when called with the processor option ``device``.

    ``DEVICE`` only for a torchvision ("fast") image processor with a non-CPU ``device``; the PIL
    backend, ``device="cpu"`` and models without an image (or video) processor, audio-only ones
    included, are ``CPU``. The image processor decides when a model has both image and video
    processors. ``device=None`` reads the image processor's own ``device`` attribute (CPU when it
    has none).

    Raises:
        ConfigurationError: ``device`` is not a device name.
    """
    component = _vision_component(processor)
    if component is None or not _is_torch_backend(component):
        return PreprocessingPath.CPU
    if device is None:
        device = getattr(component, "device", None) or "cpu"
    return PreprocessingPath.CPU if _device_type(device) == "cpu" else PreprocessingPath.DEVICE


def fast_processor_kwargs(processor: Any, device: Any = "cpu") -> dict[str, Any]:
    """The call kwargs that put ``processor``'s fast image processor on ``device``.

    ``{"device": device}`` when the processor has a torchvision image or video processor, else
    ``{}``: PIL-backend and audio processors are not given a device they would not use.
    """
    component = _vision_component(processor)
    if component is None or not _is_torch_backend(component):
        return {}
    return {"device": device}


def _positive_count(value: Any, what: str) -> int:
    """``value`` as a worker count >= 1, or a ``ConfigurationError`` naming ``what``."""
    # bool is an int: `workers=True` is a mistake, not one worker.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{what} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ConfigurationError(f"{what} must be >= 1, got {value}")
    return value


def requested_worker_count(
    option: int | str | None = None, *, env: str = WORKERS_ENV
) -> int | None:
    """The worker count the user asked for, or ``None`` to follow the defaults.

    The option (``workers=``) wins over the environment variable ``env`` (``MMPROC_WORKERS``, or
    ``MMPROC_IO_WORKERS`` for the IO pool); an empty value or ``"auto"`` means no request.

    Raises:
        ConfigurationError: the value is not an integer >= 1; the message names its source.
    """
    source = "io_workers option" if env == IO_WORKERS_ENV else "workers option"
    if option is None:
        option = os.environ.get(env)
        source = f"environment variable {env}"
    if option is None:
        return None
    if isinstance(option, str):
        text = option.strip().lower()
        if text in ("", "auto"):
            return None
        try:
            option = int(text)
        except ValueError:
            raise ConfigurationError(
                f"{source} must be an integer >= 1 or 'auto', got {option!r}"
            ) from None
    return _positive_count(option, source)


def resolve_worker_count(
    *,
    requested: int | None,
    hint: int | None,
    supports_concurrency: bool,
    path: PreprocessingPath,
    model: str | None = None,
) -> int:
    """Decide how many preprocessing workers a model gets.

    In order:

    1. A model that does not support concurrency gets 1 whatever was asked, with a warning naming
       the model whenever that takes workers away (a request above 1, or a CPU-path default).
    2. An explicit request (``requested``, from the ``workers=`` option or ``MMPROC_WORKERS``;
       see :func:`requested_worker_count`) wins over the path and the hint. More than one on the
       ``DEVICE`` path is honoured with a warning, since it was measured to lower throughput.
    3. ``DEVICE`` path: 1, even when the model hints more (logged at info level).
    4. ``CPU`` path: the model's hint, else 2.

    ``model`` names the model in the messages.

    Raises:
        ConfigurationError: ``requested`` or ``hint`` is not an integer >= 1.
    """
    name = model or "this model"
    if requested is not None:
        requested = _positive_count(requested, "requested worker count")
    if hint is not None:
        hint = _positive_count(hint, f"worker_count_hint of {name}")
    path = PreprocessingPath(path)

    if requested is not None:
        count = requested
    elif path is PreprocessingPath.DEVICE:
        count = 1
        if hint is not None and hint > 1:
            logger.info(
                "%s hints %d preprocessing workers, capped to 1: preprocessing runs on the "
                "serving device, where extra workers compete with the model for it",
                name,
                hint,
            )
    else:
        count = hint if hint is not None else DEFAULT_CPU_WORKERS

    if not supports_concurrency:
        if count > 1:
            logger.warning(
                "%s does not support concurrent preprocessing: using 1 preprocessing worker "
                "instead of %d%s",
                name,
                count,
                " (as requested)" if requested is not None else "",
            )
        return 1

    if requested is not None and requested > 1 and path is PreprocessingPath.DEVICE:
        logger.warning(
            "%d preprocessing workers requested for %s while its preprocessing runs on the "
            "serving device: extra workers there compete with the model (one engine measured "
            "9.30 -> 4.02 req/s with a second worker); leave the count unset to get 1",
            requested,
            name,
        )
    return count


def resolve_io_worker_count(*, requested: int | None = None, hint: int | None = None) -> int:
    """Threads of the media-loading IO pool: the request, else the model's hint, else 4.

    ``requested`` comes from the ``io_workers=`` option or ``MMPROC_IO_WORKERS`` (see
    :func:`requested_worker_count` with ``env=IO_WORKERS_ENV``). Loading is IO and
    GIL-releasing decoding, so this count is independent of the preprocessing path.

    Raises:
        ConfigurationError: ``requested`` or ``hint`` is not an integer >= 1.
    """
    if requested is not None:
        return _positive_count(requested, "requested IO worker count")
    if hint is not None:
        return _positive_count(hint, "IO worker count hint")
    return DEFAULT_IO_WORKERS
