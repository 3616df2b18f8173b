"""The chat check for plugin authors: ``process_chat`` against transformers' chat rendering.

:func:`assert_chat_matches_hf` renders a chat with the model's template through mmproc
(:meth:`mmproc.Processor.process_chat`) and through transformers (the HF processor's
``apply_chat_template(..., tokenize=True, return_dict=True, sanitize_control_tokens=True)``,
which loads the media of the messages and calls the processor), and asserts the two give the
same prompt ids, per-item tensors and placeholder ranges.

Give the messages in transformers' form, which both take: ``{"type": "image", "image": <PIL
image>}`` (or ``"url"`` / ``"path"``), ``{"type": "text", "text": ...}``, contents as lists of
parts. (A string content is one text part for mmproc, as for vLLM, and stays a string for
transformers: a template that walks parts only prints it for mmproc.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmproc.processor import ProcessedInputs, Processor
from mmproc.testing.conformance import assert_matches_hf, placeholder_token

__all__ = ["assert_chat_matches_hf"]


def assert_chat_matches_hf(
    processor: Processor,
    messages: Sequence[Mapping[str, Any]],
    *,
    atol: float = 1e-5,
    add_generation_prompt: bool = True,
    **chat_kwargs: Any,
) -> ProcessedInputs:
    """Process ``messages`` as a chat request and assert it equals transformers' chat rendering
    and processor call on the same messages; return mmproc's result.

    ``chat_kwargs`` go to both (``continue_final_message``, ``tools``, ``chat_template``, ...).
    transformers normalises the pixels; mmproc's raw ones under device normalisation are
    normalised with their spec to compare (within ``atol``), as :func:`assert_matches_hf` does.

    Raises:
        AssertionError: saying what differs (prompt ids, an item's tensors, its range) and which
            hook to look at.
    """
    out = processor.process_chat(
        messages, add_generation_prompt=add_generation_prompt, **chat_kwargs
    )
    call = {
        "tokenize": True,
        "return_dict": True,
        "return_tensors": "pt",
        "add_generation_prompt": add_generation_prompt,
        **chat_kwargs,
    }
    conversation = [dict(message) for message in messages]
    try:
        reference = processor.hf_processor.apply_chat_template(
            conversation, sanitize_control_tokens=True, **call
        )
    except NotImplementedError:
        # transformers sanitises only templates that write special tokens; for another, what
        # the messages' text holds is text either way.
        reference = processor.hf_processor.apply_chat_template(conversation, **call)
    outputs = {key: torch.as_tensor(value) for key, value in reference.items()}
    tokens = {f.modality: placeholder_token(out, f.modality) for f in out.features}
    assert_matches_hf(
        out,
        outputs,
        fields=processor.model.get_mm_fields(processor.ctx, outputs),
        placeholder_token_ids={m: t for m, t in tokens.items() if t is not None},
        atol=atol,
        context=(
            "a chat request against transformers' apply_chat_template [hooks: "
            "get_placeholder_text, get_prompt_updates, process_mm_data]"
        ),
    )
    return out
