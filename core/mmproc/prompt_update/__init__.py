"""Prompt updates: expand the placeholders of media items in a prompt, and record where they went.

A model describes, per modality, how a prompt changes for each media item:
:class:`PromptReplacement` swaps an occurrence of a target for the item's content,
:class:`PromptInsertion` puts the content right after a target. A target is token ids, text, or
a zero-width position from :class:`PromptIndexTargets` (``start()``, ``end()``, ``prefix(seq)``).
A content is token ids, text, :class:`PromptUpdateDetails` (the full sequence, which positions
get embeddings, and text at its edges that merges with the prompt), or a callable of the item
index returning one of those.

:func:`resolve_prompt_updates` works out each item's content for each of its modality's updates
(:class:`ResolvedPromptUpdate`, plain values the processor-output cache keeps with the item).
:func:`apply_prompt_updates` / :func:`apply_resolved_updates` apply them (the cached /
token-prompt path); :func:`find_placeholder_ranges` / :func:`find_resolved_ranges` only locate
them in a prompt the HF processor already expanded. All return, per modality, one
:class:`PlaceholderRange` per item, in item order.

Matching rules:

* Modalities are matched in the order of ``mm_counts``, items in index order.
* An item's replacements of a sequence compete: it takes the earliest occurrence of any of their
  targets that no other item has taken (the first update, in the order given, on a tie), so
  successive items consume successive placeholders in prompt order, whichever of several forms
  each has. Only when none is left does the item take the first of its positional updates
  (insertions, zero-width targets) that matches.
* An insertion acts right after the first occurrence of its target; every item using it lands
  there, in item order (so do insertions of several modalities at one place, in modality order).
* ``start`` / ``end`` / ``prefix`` are zero-width: a replacement there replaces nothing, so it
  acts exactly as an insertion at that position, for every item, in item order (vLLM's rule).
* Matching runs on the original prompt; contents put in are never matched again. Occurrences
  left over when the items run out stay as they are.
* An item with no matching update raises :class:`~mmproc.errors.PromptUpdateError` naming the
  modality and item index; so does an insertion point that falls inside a replaced span.
* Token ids are matched as token ids; when that fails and a tokenizer is given, the decoded text
  is matched instead and the updated text is tokenized again (tokens that merged across a
  target's boundary hide it from token matching, not from text matching).
* A content may carry text at its edges that merges with the prompt next to it
  (:meth:`PromptUpdateDetails.with_merges`: Gemma 3's newlines around an image); that text is
  tokenized together with the prompt text it touches, as far as the nearest added token of the
  tokenizer or the next edit, so the result is what tokenizing the substituted text gives. The
  item's range is the content's fixed part.

Cost: one pass over the prompt per candidate update plus the output size; items sharing a target
cost O(1) each beyond their content, and tokenizer calls are cached per call.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from ._apply import (
    Placeholders,
    ResolvedUpdates,
    apply_prompt_updates,
    apply_resolved_updates,
    find_placeholder_ranges,
    find_resolved_ranges,
    resolve_prompt_updates,
)
from ._types import (
    PlaceholderRange,
    PromptContent,
    PromptIndex,
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptSeq,
    PromptTarget,
    PromptUpdate,
    PromptUpdateDetails,
    ResolvedPromptUpdate,
    Tokenizer,
)

__all__ = [
    "PlaceholderRange",
    "Placeholders",
    "PromptContent",
    "PromptIndex",
    "PromptIndexTargets",
    "PromptInsertion",
    "PromptReplacement",
    "PromptSeq",
    "PromptTarget",
    "PromptUpdate",
    "PromptUpdateDetails",
    "ResolvedPromptUpdate",
    "ResolvedUpdates",
    "Tokenizer",
    "apply_prompt_updates",
    "apply_resolved_updates",
    "find_placeholder_ranges",
    "find_resolved_ranges",
    "resolve_prompt_updates",
]
