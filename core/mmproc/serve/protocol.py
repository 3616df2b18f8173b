"""The render endpoints' request bodies and answers, in vLLM 0.33's shapes.

``POST /v1/chat/completions/render`` takes an OpenAI Chat Completions body (vLLM's extras
included: ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``,
``chat_template``, ``chat_template_kwargs``, ``documents``, ``request_id``, ``mm_payload``,
``cache_salt``, ``priority``) and ``POST /v1/completions/render`` an OpenAI Completions body
(``prompt``: a string, a list of strings, token ids, or a list of those); both answer vLLM's
``GenerateRequest``: ``request_id``, ``token_ids``, ``features`` (``mm_hashes``,
``mm_placeholders``, ``kwargs_data``, ``mm_metadata``), ``sampling_params`` (the request's
sampling fields as given, ``max_tokens`` defaulting to what the model's context leaves), and
the request's other fields passed through.

Everything wrong in a body is a :class:`BadRequest` naming the field (``param``), answered with
OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``).

What a body may not do, whoever sends it:

* name its media items: a content part's ``"uuid"`` is dropped (items are keyed by their
  content), unless the server trusts its callers' ids (``trust_request_ids``): the processor's
  cache and the answer's ``mm_hashes`` take an id for the item it names, so one client's id
  would fetch what another client sent under it;
* nest a field deeper than :data:`~mmproc.chat.messages.MAX_NESTING` levels (what is echoed
  back, serialised or walked recursively must stay far from the recursion limits);
* carry more text than the processor's ``max_prompt_chars`` (chat text is counted before the
  template renders it and the tokenizer runs on it, which is where the time would go);
* give token ids the model's vocabulary does not have (an engine indexes its embeddings
  with them).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mmproc.chat.messages import MAX_NESTING, nested_deeper_than

__all__ = [
    "SAMPLING_FIELDS",
    "BadRequest",
    "ChatRender",
    "CompletionRender",
    "error_body",
    "generate_request",
    "parse_chat",
    "parse_completion",
]

#: Request fields that are sampling parameters, passed through as given.
SAMPLING_FIELDS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "bad_words",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "structured_outputs",
    "response_format",
)
_PASSED_THROUGH = ("cache_salt", "priority", "kv_transfer_params", "ec_transfer_params")
# Fields process_chat checks itself, naming the message or the entry at fault.
_CHAT_FIELDS = ("messages", "tools", "documents", "chat_template_kwargs")
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")
# A content part's keys that hold (or name) its item's data, as chat.messages reads them.
_MEDIA_KEYS = (
    "image_url",
    "video_url",
    "audio_url",
    "input_audio",
    "url",
    "path",
    "image",
    "video",
    "audio",
    "base64",
)


class BadRequest(Exception):
    """A request the server refuses: its status, OpenAI error type and the field at fault."""

    def __init__(
        self, message: str, *, status: int = 400, kind: str = "BadRequestError", param: Any = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param


def error_body(message: str, kind: str, status: int, param: Any = None) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class ChatRender:
    """A chat render request, checked: what ``process_chat`` takes, and what goes back."""

    request_id: str
    messages: Any
    chat_kwargs: dict[str, Any]
    with_tensors: bool
    sampling: dict[str, Any]
    passed: dict[str, Any]
    stream: bool
    parse_context: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompletionRender:
    """A completions render request, checked: one prompt or several (text or token ids)."""

    request_id: str
    prompts: list[str | list[int]]
    add_special_tokens: bool
    sampling: dict[str, Any]
    passed: dict[str, Any]
    stream: bool


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r:.64}", param=name)
    return value


def _request_id(body: Mapping[str, Any], header: str | None, prefix: str) -> str:
    given = body.get("request_id") or header
    if given is not None and (not isinstance(given, str) or not 0 < len(given) <= 256):
        raise BadRequest("request_id must be a string of 1 to 256 characters", param="request_id")
    return f"{prefix}-{given or secrets.token_hex(8)}"


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    sampling = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if body.get("max_completion_tokens") is not None:
        sampling["max_tokens"] = body["max_completion_tokens"]
    tokens = sampling.get("max_tokens")
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
    ):
        raise BadRequest(
            f"max_tokens must be a positive integer, got {tokens!r:.64}", param="max_tokens"
        )
    if body.get("use_beam_search"):
        raise BadRequest("beam search is not supported by the render tier", param="use_beam_search")
    return sampling


def _check_model(body: Mapping[str, Any], served: tuple[str, ...]) -> None:
    model = body.get("model")
    if model is not None and model not in served:
        raise BadRequest(
            f"The model `{str(model)[:200]}` does not exist. Valid names: {', '.join(served)}",
            status=404,
            kind="NotFoundError",
            param="model",
        )


def parse_chat(
    body: Any,
    *,
    served: tuple[str, ...],
    header_request_id: str | None,
    trust_chat_template: bool,
    trust_request_ids: bool = False,
    max_text_chars: int | None = None,
) -> ChatRender:
    """Check a chat render body: its content parts' ``uuid`` dropped unless
    ``trust_request_ids``, its text (media data aside) at most ``max_text_chars``.

    Raises:
        BadRequest: naming the field.
    """
    body = _object(body)
    _check_nesting(body, skip=_CHAT_FIELDS)
    _check_model(body, served)
    if "messages" not in body:
        raise BadRequest("the request has no messages", param="messages")
    messages = body["messages"]
    if not trust_request_ids:
        messages = _without_item_ids(messages)
    if max_text_chars is not None:
        _check_chat_text(body, max_text_chars)
    if body.get("chat_template") is not None and not trust_chat_template:
        raise BadRequest(
            "a chat template in the request is refused: this server renders with the model's own "
            "(start it with --trust-request-chat-template to allow them)",
            param="chat_template",
        )
    for refused in ("mm_processor_kwargs", "media_io_kwargs"):
        if body.get(refused):
            raise BadRequest(f"{refused} are not taken by this server", param=refused)
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, Mapping):
        raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    payload = body.get("mm_payload", "tensors")
    if body.get("return_mm_kwargs") is False:
        payload = "none"
    if payload not in ("tensors", "none"):
        raise BadRequest("mm_payload must be 'tensors' or 'none'", param="mm_payload")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    chat_kwargs: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
        # vLLM's chat requests default to no special tokens of the tokenizer's own
        "add_special_tokens": _flag(body, "add_special_tokens", False),
        "chat_template_kwargs": dict(template_kwargs),
    }
    for name in ("chat_template", "tools", "documents"):
        if body.get(name) is not None:
            chat_kwargs[name] = body[name]
    return ChatRender(
        request_id=_request_id(body, header_request_id, "chatcmpl"),
        messages=messages,
        chat_kwargs=chat_kwargs,
        with_tensors=payload == "tensors",
        sampling=_sampling(body),
        passed={name: body.get(name) for name in _PASSED_THROUGH},
        stream=_flag(body, "stream", False),
        parse_context={
            "tools": body.get("tools"),
            "tool_choice": body.get("tool_choice", "none"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "chat_template_kwargs": {
                **template_kwargs,
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final,
            },
        },
    )


def parse_completion(
    body: Any,
    *,
    served: tuple[str, ...],
    header_request_id: str | None,
    max_text_chars: int | None = None,
    max_token_id: int | None = None,
) -> CompletionRender:
    """Check a completions render body: each text prompt at most ``max_text_chars``, each token
    id at most ``max_token_id``.

    Raises:
        BadRequest: naming the field.
    """
    body = _object(body)
    _check_nesting(body)
    _check_model(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(_is_token_id(p) for p in prompt)
    ):
        prompts: list[str | list[int]] = [prompt]
        names = ["prompt"]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        prompts = list(prompt)
        names = [f"prompt[{index}]" for index in range(len(prompts))]
    else:
        raise BadRequest(
            "prompt must be a string, a list of strings, token ids or a list of token-id lists",
            param="prompt",
        )
    for name, one in zip(names, prompts, strict=True):
        if isinstance(one, str):
            if max_text_chars is not None and len(one) > max_text_chars:
                raise BadRequest(
                    f"{name} has {len(one):,} characters, over the limit of {max_text_chars:,} "
                    "(the processor's max_prompt_chars)",
                    param=name,
                )
        elif not one or not all(_is_token_id(token) for token in one):
            raise BadRequest(f"{name} must be a non-empty list of token ids", param=name)
        elif max_token_id is not None and max(one) > max_token_id:
            raise BadRequest(
                f"{name} has token id {max(one)}, which the model's vocabulary does not have "
                f"(its largest is {max_token_id})",
                param=name,
            )
    return CompletionRender(
        request_id=_request_id(body, header_request_id, "cmpl"),
        prompts=prompts,
        add_special_tokens=_flag(body, "add_special_tokens", True),
        sampling=_sampling(body),
        passed={name: body.get(name) for name in _PASSED_THROUGH},
        stream=_flag(body, "stream", False),
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_nesting(body: Mapping[str, Any], skip: tuple[str, ...] = ()) -> None:
    for name, value in body.items():
        if name not in skip and nested_deeper_than(value, MAX_NESTING):
            raise BadRequest(
                f"{str(name)[:64]} is nested deeper than {MAX_NESTING} levels of lists and objects",
                param=str(name)[:64],
            )


def _without_item_ids(messages: Any) -> Any:
    """``messages`` with their content parts' ``uuid`` left out (a copy; what is not a list of
    messages with content parts is left for process_chat to refuse)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list) or not any(
            isinstance(part, Mapping) and "uuid" in part for part in content
        ):
            out.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if not isinstance(part, Mapping) or "uuid" not in part:
                parts.append(part)
                continue
            if not _carries_data(part):
                raise BadRequest(
                    "the part names its item by a uuid alone, without its data: this server "
                    "takes no item ids from requests (mmproc serve --trust-request-ids lets "
                    "callers that share one tenant name their items)",
                    param=f"messages[{m}].content[{p}]",
                )
            parts.append({key: value for key, value in part.items() if key != "uuid"})
        out.append({**message, "content": parts})
    return out


def _carries_data(part: Mapping[str, Any]) -> bool:
    for key in _MEDIA_KEYS:
        value = part.get(key)
        if isinstance(value, Mapping):
            value = value.get("url", value.get("data"))
        if value is not None:
            return True
    return False


def _check_chat_text(body: Mapping[str, Any], limit: int) -> None:
    """Refuse a chat whose text is over ``limit`` characters: its strings, keys included (a
    rendered chat prints about that much), media parts not counted (they become placeholders),
    each list and object counted as one (the template and the marking of control tokens visit
    each)."""
    total = 0
    pending: list[Any] = [body.get(name) for name in _CHAT_FIELDS[1:]]
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else [messages]:
        if isinstance(message, Mapping) and isinstance(message.get("content"), list):
            pending.extend(value for key, value in message.items() if key != "content")
            for part in message["content"]:
                if isinstance(part, Mapping) and not _is_text_part(part):
                    total += 1  # a media part (or a bad one, left for process_chat to refuse)
                else:
                    pending.append(part)
        else:
            pending.append(message)
    while pending and total <= limit:
        node = pending.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, Mapping):
            total += 1 + sum(len(key) for key in node if isinstance(key, str))
            pending.extend(node.values())
        elif isinstance(node, list):
            total += 1
            pending.extend(node)
    if total > limit:
        raise BadRequest(
            f"the chat's text is over {limit:,} characters (the processor's max_prompt_chars)",
            param="messages",
        )


def _is_text_part(part: Mapping[str, Any]) -> bool:
    kind = part.get("type")
    if kind is None:
        return "text" in part and not any(key in part for key in _MEDIA_KEYS)
    return kind in _TEXT_PARTS


def generate_request(
    *,
    request_id: str,
    token_ids: list[int],
    features: dict[str, Any] | None,
    sampling: Mapping[str, Any],
    max_model_len: int | None,
    model: str,
    passed: Mapping[str, Any],
    stream: bool,
    parse_context: Mapping[str, Any] | None,
    engine_request_id: str | None = None,
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for one rendered prompt (``engine_request_id``: the id it was
    sent to the engine under, on the native path)."""
    params = dict(sampling)
    if "max_tokens" not in params and max_model_len is not None:
        params["max_tokens"] = max(1, max_model_len - len(token_ids))
    params.setdefault("output_kind", 1 if stream else 2)
    answer: dict[str, Any] = {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": features,
        "content_parts": None,
        "sampling_params": params,
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "parse_context": dict(parse_context) if parse_context is not None else None,
        "stream": stream,
        "stream_options": None,
        "cache_salt": passed.get("cache_salt"),
        "priority": passed.get("priority") or 0,
        "kv_transfer_params": passed.get("kv_transfer_params"),
        "ec_transfer_params": passed.get("ec_transfer_params"),
    }
    if engine_request_id is not None:
        answer["engine_request_id"] = engine_request_id
    return answer
