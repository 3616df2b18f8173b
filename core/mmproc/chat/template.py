"""The chat template: which one, what content it expects, and rendering it.

The template is the caller's (``chat_template=``: a template, or the name of one of the folder's
named templates) or the model folder's, as transformers loaded it with the processor
(``chat_template.jinja``, ``chat_template.json``, or ``tokenizer_config.json``'s
``chat_template``); a folder's named templates give ``"tool_use"`` to requests with tools when
there is one, ``"default"`` otherwise.

Templates come in two content formats, told apart from the template's own syntax tree
(:func:`content_format`): an **"openai"** template walks a message's content parts (``{% for part
in message['content'] %}``) and writes each media part's placeholder itself; a **"string"**
template prints ``message['content']`` as text, so the placeholder text of each media part is
put into the string where the part was, between the text parts (never gathered at the front).

Rendering is transformers' own (``render_jinja_template`` of
``transformers.utils.chat_template_utils``: its sandboxed jinja environment, its
``raise_exception``, ``tojson`` and ``strftime_now``), with the tokenizer's special tokens
(``bos_token``, ...) as variables, as ``apply_chat_template`` renders. A template that fails is
a :class:`~mmproc.errors.ChatTemplateError`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jinja2
import jinja2.nodes

from mmproc.errors import ChatRequestError, ChatTemplateError

__all__ = ["ContentFormat", "content_format", "find_chat_template", "render_chat"]

ContentFormat = Literal["string", "openai"]

# Variables a request's chat_template_kwargs may not set: the renderer sets them itself.
_RESERVED = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


def find_chat_template(
    processor: Any, tokenizer: Any, override: str | None, *, with_tools: bool
) -> str:
    """The template to render with: ``override`` (a template, or a named template's name), else
    the processor's, else the tokenizer's.

    Raises:
        ChatTemplateError: there is none, or ``override`` names no template of the folder.
    """
    stored = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    named = stored if isinstance(stored, Mapping) else None
    if override is not None:
        if not isinstance(override, str) or not override:
            raise ChatRequestError(f"chat_template must be a non-empty string, got {override!r}")
        if named is not None and override in named:
            return str(named[override])
        if "{" not in override:  # a name, not a template
            known = ", ".join(sorted(named)) if named else "none"
            raise ChatTemplateError(
                f"the model folder has no chat template named {override!r} (named templates: "
                f"{known})"
            )
        return override
    if named is not None:
        choice = "tool_use" if with_tools and "tool_use" in named else "default"
        if choice not in named:
            raise ChatTemplateError(
                f"the model folder's chat templates are named {', '.join(sorted(named))}, none "
                "'default': pass chat_template= with a name"
            )
        return str(named[choice])
    if not isinstance(stored, str) or not stored:
        raise ChatTemplateError(
            "the model folder has no chat template (chat_template.jinja, chat_template.json or "
            "tokenizer_config.json's chat_template): pass chat_template="
        )
    return stored


@functools.lru_cache(maxsize=64)
def content_format(template: str) -> ContentFormat:
    """``"openai"`` when the template iterates over a message's ``content``: directly, through a
    variable set from it, or through a macro's parameter it is passed as (as in
    ``render_content(message.content)``); else ``"string"``.

    Raises:
        ChatTemplateError: the template is not valid jinja.
    """
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is not valid jinja: {exc}") from exc
    content_vars = _content_names(tree)
    for loop in tree.find_all(jinja2.nodes.For):
        if _is_content(loop.iter, content_vars):
            return "openai"
    return "string"


def _content_names(tree: jinja2.nodes.Template) -> set[str]:
    """Names that hold a message's content: variables set from it, and macro parameters some
    call passes it to (to a fixed point, for macros that hand it on to other macros)."""
    macros = {macro.name: macro for macro in tree.find_all(jinja2.nodes.Macro)}
    calls = [
        (call, [arg.name for arg in macros[call.node.name].args])
        for call in tree.find_all(jinja2.nodes.Call)
        if isinstance(call.node, jinja2.nodes.Name) and call.node.name in macros
    ]
    names: set[str] = set()
    while True:
        found = {
            node.target.name
            for node in tree.find_all(jinja2.nodes.Assign)
            if isinstance(node.target, jinja2.nodes.Name) and _is_content(node.node, names)
        }
        for call, parameters in calls:
            passed = list(zip(parameters, call.args, strict=False))
            passed += [(keyword.key, keyword.value) for keyword in call.kwargs]
            found.update(name for name, value in passed if _is_content(value, names))
        if found <= names:
            return names
        names |= found


def _is_content(node: jinja2.nodes.Node, content_vars: set[str]) -> bool:
    """Whether ``node`` is ``x['content']`` / ``x.content`` (optionally filtered, as in
    ``message['content'] | selectattr(...)``), or a variable set from one."""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in content_vars


def render_chat(
    template: str,
    conversation: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    documents: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any],
) -> str:
    """The template rendered on ``conversation`` with transformers' sandboxed environment.

    Raises:
        ChatRequestError: options that contradict each other.
        ChatTemplateError: the template failed (its own ``raise_exception`` included).
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    if add_generation_prompt and continue_final_message:
        raise ChatRequestError(
            "add_generation_prompt and continue_final_message cannot both be set: one opens a "
            "new assistant message, the other continues the last one"
        )
    reserved = _RESERVED & set(template_kwargs)
    if reserved:
        raise ChatRequestError(
            f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: they are "
            "arguments of the request itself",
            field="chat_template_kwargs",
        )
    try:
        result: Any = render_jinja_template(
            conversations=[[dict(message) for message in conversation]],
            tools=[dict(tool) for tool in tools] if tools is not None else None,
            documents=[dict(doc) for doc in documents] if documents is not None else None,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**special_tokens, **template_kwargs},
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        # transformers' own checks (e.g. continue_final_message on a message the template does
        # not end with), or a template's Python-level error.
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
    rendered, _generation_indices = result
    return str(rendered[0])  # one conversation in, one rendering out
