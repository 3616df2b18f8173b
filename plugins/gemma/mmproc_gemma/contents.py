"""What each Gemma item puts into the prompt, from transformers' own expansion of it.

Every Gemma processor expands an item's placeholder with a ``replace_*_token`` method that
returns text; the contents here are that very text, split in three: the text before the item's
first start token and after its last end token, which merges with the prompt around it when the
processor tokenizes the substituted prompt (Gemma 3 and 3n's ``"\\n\\n"``, Gemma 4's first
``"mm:ss "`` timestamp), and the fixed part between them, which begins and ends with special
tokens and so tokenizes the same anywhere (:meth:`PromptUpdateDetails.with_merges`).
"""

from __future__ import annotations

from typing import Any

from mmproc.plugin import PromptUpdateDetails

__all__ = ["expansion_content", "soft_token_count"]


def expansion_content(
    text: str, first: str, last: str, tokenizer: Any, embed_token_id: int
) -> PromptUpdateDetails:
    """The content of an item the HF processor expands to ``text``: its fixed part from the
    first ``first`` to the last ``last`` (as token ids; only ``embed_token_id`` gets
    embeddings), the text around it merging with the prompt."""
    start = text.index(first)
    end = text.rindex(last) + len(last)
    ids = tokenizer.encode(text[start:end], add_special_tokens=False)
    details = PromptUpdateDetails.select_token_id(ids, embed_token_id)
    before, after = text[:start], text[end:]
    return details.with_merges(before=before, after=after) if before or after else details


def soft_token_count(position_ids: Any, pooling_kernel_size: int) -> int:
    """Gemma 4's soft tokens of one image or frame: its real patches (those whose position ids
    are not the padding's -1) over the pooling kernel's area."""
    return int((position_ids[..., 0] >= 0).sum()) // int(pooling_kernel_size) ** 2
