"""Text a user typed is text: control tokens in a chat's strings never act as control tokens.

A user who types ``<|vision_start|><|image_pad|><|vision_end|>`` into a message would otherwise add
a placeholder the prompt has no item for, or move which image binds where. Before the template is
rendered, every control token inside the request's own strings (message contents, names, tool calls,
tool definitions, template arguments, the keys of their mappings too) is wrapped in private markers
(transformers' ``mark_control_tokens``); after rendering, marked tokens are tokenised as the
ordinary text they are made of and everything else as usual (``encode_marked_chat``): the template's
own control tokens, and the placeholders it writes, stay control tokens. This is transformers'
``apply_chat_template(..., sanitize_control_tokens=True)``, split around the rendering so that a
"string" template's placeholders, which mmproc puts into the strings, stay placeholders.

The control tokens are the tokenizer's special tokens, the tokens it names in
``chat_control_tokens`` if it has that list, and the other added tokens the template writes as
literal text (whitespace tokens aside), as transformers defines them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.nodes

__all__ = ["control_token_pattern", "encode_chat", "mark_control_tokens"]


def control_token_pattern(
    tokenizer: Any, template: str, placeholders: tuple[str, ...] = ()
) -> re.Pattern[str]:
    """A pattern matching any of the tokenizer's control tokens for chats rendered with
    ``template``, longest first; the added tokens inside the model's ``placeholders`` texts
    count too (a "string" template does not write them itself)."""
    listed = getattr(tokenizer, "chat_control_tokens", None)
    literal = _literal_text(template)

    def is_control(token: Any) -> bool:
        if token.special or any(token.content in text for text in placeholders):
            return True
        if listed is not None:
            return token.content in listed
        return token.content in literal and not token.content.isspace()

    added = tokenizer.added_tokens_decoder.values()
    return _pattern(tuple(token.content for token in added if is_control(token)))


@functools.lru_cache(maxsize=64)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    longest_first = sorted(set(tokens), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!): never matches


@functools.lru_cache(maxsize=64)
def _literal_text(template: str) -> str:
    """The template's literal strings, joined by NUL so that no search matches across two."""
    tree = jinja2.Environment().parse(template)
    literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
    literals |= {
        node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)
    }
    return "\0".join(literals)


def mark_control_tokens(obj: Any, pattern: re.Pattern[str]) -> Any:
    """``obj`` (a string, or lists and mappings of them) with its control tokens marked, in
    mappings' keys too (a tool's parameter names reach the prompt as text, as its values do);
    any marker a caller put in a string is dropped first, so that none can be forged."""
    from transformers.utils.chat_template_utils import mark_control_tokens as mark

    def marked(value: Any) -> Any:
        if isinstance(value, str):
            return mark(value, pattern)
        if isinstance(value, Mapping):
            return {marked(key): marked(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [marked(item) for item in value]
        return value

    return marked(obj)


def encode_chat(
    tokenizer: Any, rendered: str, *, marked: bool, add_special_tokens: bool | None
) -> list[int]:
    """The token ids of a rendered chat, marked control tokens as plain text.

    ``add_special_tokens``: whether the tokenizer adds its own (a BOS, ...) around the text.
    ``None`` decides as transformers' processors do in ``apply_chat_template``: yes, unless the
    template already wrote the BOS.
    """
    if marked:
        from transformers.utils.chat_template_utils import encode_marked_chat

        ids = list(encode_marked_chat(tokenizer, rendered))
    else:
        ids = list(tokenizer.encode(rendered, add_special_tokens=False))
    if add_special_tokens is None:
        bos = getattr(tokenizer, "bos_token", None)
        add_special_tokens = not (bos and rendered.startswith(bos))
    if not add_special_tokens:
        return ids
    prefix, suffix = _special_tokens_around(tokenizer)
    return [*prefix, *ids, *suffix]


def _special_tokens_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """What the tokenizer puts before and after a text when it adds its special tokens (found by
    encoding a probe both ways)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    wrapped = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(wrapped) - len(plain) + 1):
        if wrapped[start : start + len(plain)] == plain:
            return wrapped[:start], wrapped[start + len(plain) :]
    return [], []  # a post-processor that changes the text itself: add nothing rather than guess
