"""The messages of a chat request, checked, with their media parts taken out as request items.

A request's ``messages`` are OpenAI Chat Completions messages: mappings with a ``role`` and a
``content`` that is a string, ``None``, or a list of content parts. Other keys (``name``,
``tool_calls``, ``tool_call_id``, ``reasoning_content``, ...) go to the template as they are.
The content parts taken:

============================================  ==========================================
part                                          becomes
============================================  ==========================================
``{"type": "text", "text": str}``             text (``input_text``, ``output_text``,
                                              ``refusal`` and ``thinking`` parts too)
``{"type": "image_url", "image_url": {"url"}}``  an image item (``detail``, one of auto,
                                              low, high, original, is ignored; the
                                              Responses API's ``input_image`` too)
``{"type": "video_url", "video_url": {"url"}}``  a video item (vLLM's extension)
``{"type": "audio_url", "audio_url": {"url"}}``  an audio item (vLLM's extension)
``{"type": "input_audio", "input_audio":``    an audio item: the base64 ``data``, decoded
``{"data": base64, "format": "wav"}}``        (the format is told by the bytes themselves)
``{"type": "image", "url" | "path" |``        an image item (transformers' form; ``image``
``"image" | "base64": ...}``                  may hold a PIL image or an array)
``{"type": "video" | "audio", ...}``          likewise, with ``video`` / ``audio`` keys
============================================  ==========================================

A URL is a ``data:`` URL, an ``http(s)://`` URL (fetched only when the processor's
``remote_media`` allows it) or a ``file://`` URL, read as a local path (only inside the
processor's ``allowed_media_paths``): the processor's media rules decide, as for
:meth:`~mmproc.Processor.process`. A part without a ``type`` is what its one known key says
(``{"image_url": ...}``). A media part may carry ``"uuid"``: the caller's id of the item
(vLLM's ``multi_modal_uuids``); with an id, the part may leave its data out when the processor's
cache holds the item. Items keep message order across turns: an image in the first
message and one in the third are image items 0 and 1.

Everything wrong is a :class:`~mmproc.errors.ChatRequestError` naming the message and the part;
a message nested deeper than :data:`MAX_NESTING` levels is refused (what the template, the marking
of control tokens and copying do with a message walks it recursively, and a JSON parser hands
over up to a thousand levels).
"""

from __future__ import annotations

import binascii
import urllib.parse
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmproc.base64_text import decode_base64
from mmproc.errors import ChatRequestError

__all__ = [
    "MAX_NESTING",
    "ChatItem",
    "ChatMessage",
    "MediaPart",
    "ParsedChat",
    "nested_deeper_than",
    "parse_messages",
]

#: The deepest nesting of lists and mappings taken in one message (or one tool, document or
#: template variable): far beyond what chats use, far below Python's recursion limit.
MAX_NESTING = 64

# part type -> (modality, key of the mapping holding the URL)
_URL_PARTS = {
    "image_url": ("image", "image_url"),
    "video_url": ("video", "video_url"),
    "audio_url": ("audio", "audio_url"),
}
# transformers' forms: type -> the keys that may hold the item
_HF_PARTS = {
    "image": ("url", "path", "image", "base64"),
    "video": ("url", "path", "video", "base64"),
    "audio": ("url", "path", "audio", "base64"),
}
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")
# keys that say what a part is when it has no "type" (as vLLM reads such parts)
_TYPE_BY_KEY = ("image_url", "video_url", "audio_url", "input_audio", "text")
_DETAILS = (None, "auto", "low", "high", "original")
_KNOWN_PARTS = (*_TEXT_PARTS, *_URL_PARTS, "input_image", "input_audio", *_HF_PARTS)
_MAX_SHOWN = 64  # characters of a caller's value quoted in a message


@dataclass(frozen=True, slots=True)
class ChatItem:
    """One media part of a request: the item as the media reader takes it (a URL, a path, bytes,
    a PIL image, ...), the caller's id for it, and where it was."""

    modality: str
    value: Any
    uuid: str | None
    message_index: int
    part_index: int


@dataclass(slots=True)
class ChatMessage:
    """One message: its other keys as given, and its content as a sequence of text (``str``)
    and media parts (a modality name, standing for the next item of that modality); ``None``
    when the message had no content."""

    fields: dict[str, Any]
    segments: list[str | MediaPart] | None
    content_was_string: bool = False


@dataclass(frozen=True, slots=True)
class MediaPart:
    """Where a media part was among a message's content: the next item of ``modality``."""

    modality: str


@dataclass(slots=True)
class ParsedChat:
    """A chat request's messages, checked, and the media items they hold in message order."""

    messages: list[ChatMessage]
    items: list[ChatItem] = field(default_factory=list)

    def mm_data(self) -> dict[str, list[Any]]:
        """The items as ``process`` takes them: modality -> items in message order."""
        data: dict[str, list[Any]] = {}
        for item in self.items:
            data.setdefault(item.modality, []).append(item.value)
        return data

    def mm_uuids(self) -> dict[str, list[str | None]] | None:
        """The parts' ``uuid`` values as ``process`` takes them, or None when no part has one."""
        if all(item.uuid is None for item in self.items):
            return None
        ids: dict[str, list[str | None]] = {}
        for item in self.items:
            ids.setdefault(item.modality, []).append(item.uuid)
        return ids

    def locate(self, modality: str, index: int) -> ChatItem | None:
        """The part that became item ``index`` of ``modality``."""
        found = [item for item in self.items if item.modality == modality]
        return found[index] if 0 <= index < len(found) else None


def parse_messages(
    messages: Any,
    *,
    modalities: Collection[str],
    model: str,
    max_items: Mapping[str, int] | None = None,
) -> ParsedChat:
    """Check ``messages`` and take out their media parts.

    Args:
        messages: The request's messages.
        modalities: The modalities the model takes (a media part of another is refused).
        model: How to name the model in messages (``"Qwen2VL... (plugin 'qwen_vl')"``).
        max_items: The most items of a modality one request may have.

    Raises:
        ChatRequestError: naming the message and the part at fault.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatRequestError(
            f"messages must be a list of messages, not {type(messages).__name__}", field="messages"
        )
    if not messages:
        raise ChatRequestError(
            "messages is empty: a chat request needs at least one message", field="messages"
        )
    parsed = ParsedChat([])
    for m, message in enumerate(messages):
        parsed.messages.append(_parse_message(m, message, parsed, modalities, model, max_items))
    return parsed


def _parse_message(
    m: int,
    message: Any,
    parsed: ParsedChat,
    modalities: Collection[str],
    model: str,
    max_items: Mapping[str, int] | None,
) -> ChatMessage:
    if not isinstance(message, Mapping):
        raise ChatRequestError(
            f"a message must be a mapping with 'role' and 'content', not {type(message).__name__}",
            message_index=m,
        )
    if nested_deeper_than(message, MAX_NESTING):
        raise ChatRequestError(
            f"it is nested deeper than {MAX_NESTING} levels of lists and mappings",
            message_index=m,
        )
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ChatRequestError(
            "it has no role" if role is None else f"its role must be a string, got {_show(role)}",
            message_index=m,
        )
    fields = {key: value for key, value in message.items() if key != "content"}
    content = message.get("content")
    if content is None:
        return ChatMessage(fields, None)
    if isinstance(content, str):
        return ChatMessage(fields, [content], content_was_string=True)
    if isinstance(content, bytes | bytearray) or not isinstance(content, Sequence):
        raise ChatRequestError(
            f"content must be a string or a list of content parts, not {type(content).__name__}",
            message_index=m,
        )
    segments: list[str | MediaPart] = []
    for p, part in enumerate(content):
        text, item = _parse_part(m, p, part)
        if item is None:
            segments.append(text)
            continue
        if item.modality not in modalities:
            takes = ", ".join(modalities) or "no media"
            raise ChatRequestError(
                f"a {item.modality} part, but {model} takes no {item.modality} items; it takes "
                f"{takes}",
                message_index=m,
                part_index=p,
            )
        count = sum(1 for other in parsed.items if other.modality == item.modality)
        limit = (max_items or {}).get(item.modality)
        if limit is not None and count >= limit:
            raise ChatRequestError(
                f"more than {limit} {item.modality} items in one request "
                "(the max_items_per_request option)",
                message_index=m,
                part_index=p,
                modality=item.modality,
                item_index=count,
            )
        parsed.items.append(item)
        segments.append(MediaPart(item.modality))
    return ChatMessage(fields, segments)


def _parse_part(m: int, p: int, part: Any) -> tuple[str, ChatItem | None]:
    """A part's text, or the item it is."""

    def refuse(reason: str) -> ChatRequestError:
        return ChatRequestError(reason, message_index=m, part_index=p)

    if isinstance(part, str):
        return part, None  # some clients send bare strings among the parts
    if not isinstance(part, Mapping):
        raise refuse(f"a content part must be a mapping with a 'type', not {type(part).__name__}")
    kind = part.get("type")
    if kind is None:
        present = [key for key in _TYPE_BY_KEY if key in part]
        if len(present) != 1:
            raise refuse("the part has no 'type'")
        kind = present[0]
    if not isinstance(kind, str):
        raise refuse(f"its type must be a string, got {_show(kind)}")
    uuid = part.get("uuid")
    if uuid is not None and not isinstance(uuid, str):
        raise refuse(f"its uuid must be a string, got {_show(uuid)}")
    if kind in _TEXT_PARTS:
        key = "text" if kind in ("input_text", "output_text") else kind
        text = part.get(key)
        if not isinstance(text, str):
            raise refuse(f"a {kind} part needs a string {key!r}, got {_show(text)}")
        return text, None
    if kind in _URL_PARTS or kind == "input_image":
        modality, key = _URL_PARTS.get(kind, ("image", "image_url"))
        holder = part.get(key)
        url = holder.get("url") if isinstance(holder, Mapping) else holder
        if url is None and uuid is not None:
            return "", ChatItem(modality, None, uuid, m, p)  # by its id alone
        if not isinstance(url, str) or not url:
            raise refuse(f"a {kind} part needs {key}: {{'url': '...'}}")
        detail = holder.get("detail") if isinstance(holder, Mapping) else part.get("detail")
        if detail not in _DETAILS:
            allowed = ", ".join(d for d in _DETAILS if d)
            raise refuse(f"its detail must be one of {allowed}, got {_show(detail)}")
        return "", ChatItem(modality, _url_item(url), uuid, m, p)
    if kind == "input_audio":
        holder = part.get("input_audio")
        data = holder.get("data") if isinstance(holder, Mapping) else None
        if data is None and uuid is not None:
            return "", ChatItem("audio", None, uuid, m, p)
        if not isinstance(data, str):
            raise refuse("an input_audio part needs input_audio: {'data': base64, 'format': ...}")
        return "", ChatItem("audio", _base64(data, refuse), uuid, m, p)
    if kind in _HF_PARTS:
        keys = [key for key in _HF_PARTS[kind] if part.get(key) is not None]
        if not keys and uuid is not None:
            return "", ChatItem(kind, None, uuid, m, p)
        if len(keys) != 1:
            shown = " or ".join(repr(k) for k in _HF_PARTS[kind])
            raise refuse(f"an {kind} part needs exactly one of {shown}")
        value = part[keys[0]]
        if keys[0] == "base64":
            if not isinstance(value, str):
                raise refuse(f"its base64 must be a string, got {_show(value)}")
            value = _base64(value, refuse)
        elif keys[0] == "url":
            if not isinstance(value, str):
                raise refuse(f"its url must be a string, got {_show(value)}")
            value = _url_item(value)
        return "", ChatItem(kind, value, uuid, m, p)
    raise refuse(f"unknown content part type {_show(kind)}; known: {', '.join(_KNOWN_PARTS)}")


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` holds lists or mappings (tuples too) more than ``limit`` levels deep;
    walked without recursion, so any depth can be asked about."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _url_item(url: str) -> str:
    """A part's URL as the media reader takes it: ``file://`` URLs as the path they name."""
    if url[:7].lower() == "file://":
        return urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    return url


def _base64(data: str, refuse: Any) -> bytes:
    try:
        return decode_base64(data)
    except (binascii.Error, ValueError) as exc:
        raise refuse(f"its base64 data is not valid base64: {exc}") from None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
