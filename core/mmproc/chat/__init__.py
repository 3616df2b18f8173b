"""Chat requests: OpenAI-style messages rendered with the model's own chat template.

:meth:`mmproc.Processor.process_chat` takes the ``messages`` of an OpenAI Chat Completions
request and gives the same :class:`~mmproc.ProcessedInputs` as :meth:`~mmproc.Processor.process`,
through the same pipeline. This package does the part before the pipeline, one concern a module:

``messages``
    the messages and their content parts, checked: text, and the media parts (OpenAI's
    ``image_url`` and ``input_audio``, vLLM's ``video_url`` and ``audio_url``, transformers'
    ``{"type": "image" | "video" | "audio", ...}``), each media part an item of the request, in
    message order across turns.
``template``
    the chat template (the model folder's, or the caller's), whether it walks content parts
    ("openai" format) or takes strings ("string" format), and rendering it with transformers'
    sandboxed jinja environment.
``control_tokens``
    text a user typed stays text: control tokens (special tokens, placeholders) inside the
    messages' strings are marked before rendering and tokenised as ordinary text after it, with
    transformers' own marking (``sanitize_control_tokens``).
``renderer``
    the three together: messages in, prompt token ids and the request's media out.
"""

from __future__ import annotations

from mmproc.chat.renderer import ChatOptions, ChatRenderer, RenderedChat

__all__ = ["ChatOptions", "ChatRenderer", "RenderedChat"]
