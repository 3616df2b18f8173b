"""Chat messages in, the prompt's token ids and the request's media out.

:class:`ChatRenderer` is built once per processor (its model's placeholders and modalities, its
chat template); :meth:`ChatRenderer.render` then does, for one request:

1. check the messages and take out their media parts as items (:mod:`mmproc.chat.messages`);
2. build the conversation the template gets: content parts for an "openai" template (each media
   part ``{"type": "image"}`` and the like, as transformers' templates expect; a string content
   one text part), strings with the model's placeholder text where each media part was for a
   "string" one; the control tokens in the request's own strings marked
   (:mod:`mmproc.chat.control_tokens`);
3. render it (:mod:`mmproc.chat.template`) and tokenise it, marked tokens as plain text.

The processor then runs the token ids and the items through its pipeline, as for ``process``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmproc.chat.control_tokens import control_token_pattern, encode_chat, mark_control_tokens
from mmproc.chat.messages import (
    MAX_NESTING,
    ChatMessage,
    MediaPart,
    ParsedChat,
    nested_deeper_than,
    parse_messages,
)
from mmproc.chat.template import content_format, find_chat_template, render_chat
from mmproc.errors import ChatRequestError

__all__ = ["ChatOptions", "ChatRenderer", "RenderedChat"]


@dataclass(frozen=True)
class ChatOptions:
    """How one chat request is rendered (the keyword arguments of ``process_chat``).

    ``add_generation_prompt``
        end with the opening of the assistant's reply (default True).
    ``continue_final_message``
        leave the last message open, for the model to continue it.
    ``chat_template``
        a template (or the name of one of the folder's named templates) instead of the
        folder's.
    ``chat_template_kwargs``
        further variables for the template (``enable_thinking``, ...).
    ``tools`` / ``documents``
        OpenAI-style tool definitions, and documents, for templates that take them.
    ``keep_control_tokens``
        let control tokens typed in the messages act as control tokens: for trusted callers
        that write placeholders or special tokens into their text on purpose.
    ``add_special_tokens``
        whether the tokenizer adds its special tokens (a BOS) around the rendered chat; ``None``
        (default): as transformers' processors decide, unless the template wrote the BOS itself
        (vLLM's chat requests say False).
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tools: Sequence[Mapping[str, Any]] | None = None
    documents: Sequence[Mapping[str, Any]] | None = None
    keep_control_tokens: bool = False
    add_special_tokens: bool | None = None

    def __post_init__(self) -> None:
        # Each error names the option (``field``) as a request body spells it.
        if self.add_special_tokens not in (None, True, False):
            raise ChatRequestError(
                f"add_special_tokens must be True, False or None, got {self.add_special_tokens!r}",
                field="add_special_tokens",
            )
        for name in ("add_generation_prompt", "continue_final_message", "keep_control_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ChatRequestError(
                    f"{name} must be True or False, got {type(getattr(self, name)).__name__}",
                    field=name,
                )
        if self.add_generation_prompt and self.continue_final_message:
            raise ChatRequestError(
                "add_generation_prompt and continue_final_message cannot both be set: one opens a "
                "new assistant message, the other continues the last one",
                field="continue_final_message",
            )
        if not isinstance(self.chat_template_kwargs, Mapping):
            raise ChatRequestError(
                f"chat_template_kwargs must be a mapping, got {type(self.chat_template_kwargs)}",
                field="chat_template_kwargs",
            )
        _check_nesting(self.chat_template_kwargs, "chat_template_kwargs")
        for name in ("tools", "documents"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str | bytes) or not isinstance(value, Sequence):
                raise ChatRequestError(
                    f"{name} must be a list of mappings, got {type(value).__name__}", field=name
                )
            for index, entry in enumerate(value):
                if not isinstance(entry, Mapping):
                    raise ChatRequestError(
                        f"{name} must be a list of mappings; entry {index} is "
                        f"{type(entry).__name__}",
                        field=f"{name}[{index}]",
                    )
                _check_nesting(entry, f"{name}[{index}]")


def _check_nesting(value: Any, field: str) -> None:
    # Marking control tokens and rendering walk these recursively.
    if nested_deeper_than(value, MAX_NESTING):
        raise ChatRequestError(
            f"{field} is nested deeper than {MAX_NESTING} levels of lists and mappings",
            field=field,
        )


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A rendered chat request: the prompt's token ids, and its media as ``process`` takes
    them."""

    prompt_token_ids: list[int]
    chat: ParsedChat

    @property
    def mm_data(self) -> dict[str, list[Any]]:
        """The media parts' items, per modality in the order of the messages and parts."""
        return self.chat.mm_data()

    @property
    def mm_uuids(self) -> dict[str, list[str | None]] | None:
        """The parts' ``uuid``s in the same layout (None where a part has none); None when no
        part has one."""
        return self.chat.mm_uuids()


class ChatRenderer:
    """Renders chat requests for one model.

    Args:
        processor: The HF processor (its chat template, its tokenizer's special tokens).
        tokenizer: The processor's tokenizer, whose control tokens are read here (rendering
            tokenises with the copy :meth:`render` is given).
        placeholders: Modality -> the text standing for one item (the model's
            ``get_placeholder_text``), for the modalities the model takes.
        model: How to name the model in messages.
        max_items: The most items of a modality one request may have.
        max_chars: The most characters a rendered chat may have before it is tokenised.
    """

    def __init__(
        self,
        processor: Any,
        tokenizer: Any,
        placeholders: Mapping[str, str],
        *,
        model: str,
        max_items: Mapping[str, int] | None = None,
        max_chars: int | None = None,
    ) -> None:
        self._processor = processor
        self._max_chars = max_chars
        self._tokenizer = tokenizer
        self._placeholders = dict(placeholders)
        self._model = model
        self._max_items = dict(max_items or {})
        self._special_tokens = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
        self._pattern = functools.lru_cache(maxsize=16)(self._control_tokens)

    def _control_tokens(self, template: str) -> re.Pattern[str]:
        return control_token_pattern(self._tokenizer, template, tuple(self._placeholders.values()))

    def render(self, messages: Any, options: ChatOptions, tokenizer: Any) -> RenderedChat:
        """Check, render and tokenise ``messages`` with ``tokenizer`` (a copy no other thread
        uses meanwhile).

        Raises:
            ChatRequestError: naming the message and the part at fault (a
                :class:`~mmproc.errors.ChatTemplateError` when the template fails).
        """
        chat = parse_messages(
            messages, modalities=self._placeholders, model=self._model, max_items=self._max_items
        )
        try:
            template = find_chat_template(
                self._processor,
                self._tokenizer,
                options.chat_template,
                with_tools=bool(options.tools),
            )
            as_parts = content_format(template) == "openai"  # (parses it: a bad one fails here)
        except ChatRequestError as exc:
            if options.chat_template is None:
                raise  # the model folder's own templates
            raise type(exc)(str(exc), field="chat_template") from exc
        messages_in = _developer_as_system(chat.messages, template)
        mark = not options.keep_control_tokens
        pattern = self._pattern(template) if mark else None

        def user(obj: Any) -> Any:
            return mark_control_tokens(obj, pattern) if pattern is not None else obj

        conversation = [self._message(message, as_parts, user) for message in messages_in]
        rendered = render_chat(
            template,
            conversation,
            special_tokens=self._special_tokens,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tools=user(options.tools),
            documents=user(options.documents),
            template_kwargs=user(dict(options.chat_template_kwargs)),
        )
        if self._max_chars is not None and len(rendered) > self._max_chars:
            raise ChatRequestError(
                f"the rendered chat has {len(rendered):,} characters, over the limit of "
                f"{self._max_chars:,} (the max_prompt_chars option)"
            )
        try:
            ids = encode_chat(
                tokenizer, rendered, marked=mark, add_special_tokens=options.add_special_tokens
            )
        except ValueError as exc:  # a control token the tokenizer makes from its own text
            raise ChatRequestError(f"the messages' text cannot be kept as text: {exc}") from exc
        return RenderedChat(ids, chat)

    def _message(self, message: ChatMessage, as_parts: bool, user: Any) -> dict[str, Any]:
        """The message as the template gets it."""
        out: dict[str, Any] = user(message.fields)
        if message.segments is None:
            return out
        if message.content_was_string and not as_parts:
            out["content"] = user(message.segments[0])
        elif as_parts:
            # A string content is one text part for a template that walks parts (as vLLM
            # gives it): such a template may print only the parts it finds.
            out["content"] = [
                {"type": seg.modality}
                if isinstance(seg, MediaPart)
                else {"type": "text", "text": user(seg)}
                for seg in message.segments
            ]
        else:
            # A "string" template: each media part's placeholder text where the part was, the
            # parts joined by newlines (the placeholders are the model's, so never marked).
            out["content"] = "\n".join(
                self._placeholders[seg.modality] if isinstance(seg, MediaPart) else user(seg)
                for seg in message.segments
            )
        return out


def _developer_as_system(messages: list[ChatMessage], template: str) -> list[ChatMessage]:
    """OpenAI's ``developer`` role as ``system`` for a template that does not know it, the system
    messages then merged into one at the start (templates that know only one system message want
    it first), as vLLM does. Media in such a message cannot be merged: refused."""
    if '"developer"' in template or "'developer'" in template:
        return messages
    if not any(message.fields.get("role") == "developer" for message in messages):
        return messages
    texts: list[str] = []
    rest: list[ChatMessage] = []
    for index, message in enumerate(messages):
        if message.fields.get("role") not in ("system", "developer"):
            rest.append(message)
            continue
        segments = message.segments or []
        if any(isinstance(seg, MediaPart) for seg in segments):
            raise ChatRequestError(
                "a system or developer message with media, in a chat whose template takes no "
                "developer role (its messages are merged into one system message, as text)",
                message_index=index,
            )
        text = "\n".join(seg for seg in segments if isinstance(seg, str))
        if text:
            texts.append(text)
    merged = ChatMessage({"role": "system"}, ["\n\n".join(texts)], content_was_string=True)
    return [merged, *rest]
