"""Helpers for plugins that read a model folder or call an HF processor themselves.

:func:`read_json_object` reads a folder's JSON settings with errors that name the model, the
plugin and the file; :func:`read_chat_template` finds the chat template a folder stores;
:func:`hf_video_kwargs` gives the HF keywords for video items (their frames and, when they came
from a file, their metadata). Plugins reach them through :mod:`mmproc.plugin`; the core's default
hooks (:mod:`mmproc.defaults`) use them too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from mmproc.context import ModelContext
from mmproc.errors import ProcessorLoadError

__all__ = [
    "HF_MODALITY_KWARGS",
    "hf_video_kwargs",
    "read_chat_template",
    "read_json_object",
]

#: The keyword an HF processor takes each modality's items under.
HF_MODALITY_KWARGS: Mapping[str, str] = {"image": "images", "video": "videos", "audio": "audio"}


@overload
def read_json_object(
    ctx: ModelContext, name: str, *, required: Literal[True] = True
) -> dict[str, Any]: ...
@overload
def read_json_object(ctx: ModelContext, name: str, *, required: bool) -> dict[str, Any] | None: ...
def read_json_object(
    ctx: ModelContext, name: str, *, required: bool = True
) -> dict[str, Any] | None:
    """The JSON object in the model folder's file ``name`` (``preprocessor_config.json``, ...).

    For plugins that read a folder's settings themselves. A file that is missing (when
    ``required``; else ``None`` comes back), unreadable, not JSON or not an object is a
    :class:`~mmproc.errors.ProcessorLoadError` naming the model, the plugin and the file.
    """
    folder = ctx.require_model_path()
    path = folder / name
    where = ctx.model_name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if not required:
            return None
        raise ProcessorLoadError(f"{where}: {folder} has no {name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProcessorLoadError(f"{where}: cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ProcessorLoadError(f"{where}: {path} must hold a JSON object")
    return data


def read_chat_template(folder: Path) -> str | None:
    """The chat template a model folder stores (``chat_template.jinja`` or ``.json``), if any.

    For plugins that assemble a processor from its parts: transformers' tokenizer does not read
    ``chat_template.json``, only its processor classes do.
    """
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = folder / "chat_template.json"
    if as_json.is_file():
        try:
            template = json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ProcessorLoadError(f"{as_json} is not a JSON object: {exc}") from exc
        return template if isinstance(template, str) else None
    return None


def hf_video_kwargs(videos: Sequence[Any]) -> dict[str, Any]:
    """The HF processor keywords for video items (:class:`mmproc.media.items.VideoItem`).

    ``videos``: the frames. When some video came from a file, also ``video_metadata`` (what
    transformers' video processors read: source fps, frame count, the sampled frames' indices,
    from which e.g. Qwen2.5-VL's ``second_per_grid_ts`` comes) and ``do_sample_frames=False``:
    mmproc sampled the frames already. Frames given decoded get the metadata transformers itself
    assumes for them.
    """
    kwargs: dict[str, Any] = {"videos": [video.frames for video in videos]}
    if any(video.metadata is not None for video in videos):
        kwargs["video_metadata"] = [
            video.metadata.to_transformers()
            if video.metadata is not None
            else {
                "total_num_frames": len(video.frames),
                "fps": None,
                "duration": None,
                "frames_indices": list(range(len(video.frames))),
                "height": video.frames.shape[1],
                "width": video.frames.shape[2],
            }
            for video in videos
        ]
        kwargs["do_sample_frames"] = False
    return kwargs
