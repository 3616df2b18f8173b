"""Resolving prompt updates per item, matching them against a prompt, applying and locating them.

Matching works on strings in both spaces: a token id prompt becomes a string with one code point
per token id, so ``str.find`` does the token-sequence search in C (linear in practice), and the
same matcher serves token ids and text.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmproc.errors import PromptUpdateError

from ._types import (
    PlaceholderRange,
    PromptIndex,
    PromptInsertion,
    PromptSeq,
    PromptUpdate,
    PromptUpdateDetails,
    ResolvedPromptUpdate,
    Tokenizer,
    normalize_content,
)

__all__ = [
    "Placeholders",
    "ResolvedUpdates",
    "apply_prompt_updates",
    "apply_resolved_updates",
    "find_placeholder_ranges",
    "find_resolved_ranges",
    "resolve_prompt_updates",
]

Placeholders = dict[str, list[PlaceholderRange]]
"""Modality -> one range per item, in item order."""

ResolvedUpdates = Mapping[str, Sequence[Sequence[ResolvedPromptUpdate]]]
"""Modality -> per item (in item order) that item's candidate updates (in the order given)."""

_MAX_TOKEN_ID = 0x10FFFF  # the largest code point; no real vocabulary comes near it


def _ids_to_str(ids: Sequence[int]) -> str:
    try:
        return "".join(map(chr, ids))
    except (ValueError, OverflowError, TypeError) as exc:
        raise PromptUpdateError(
            f"token ids must be integers in [0, {_MAX_TOKEN_ID:#x}]: {exc}"
        ) from None


def _preview(seq: object, limit: int = 60) -> str:
    text = repr(seq)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Codec:
    """Tokenizer calls, cached per call of the public functions (contents repeat per item)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._encoded: dict[str, tuple[int, ...]] = {}
        self._decoded: dict[tuple[int, ...], str] = {}
        self._standalone: frozenset[int] | None = None

    def _need(self, modality: str | None, what: str, seq: object) -> Tokenizer:
        if self.tokenizer is None:
            owner = f"{modality} update: " if modality else ""
            raise PromptUpdateError(
                f"{owner}{what} {_preview(seq)} must be converted between text and token ids, "
                "which needs a tokenizer",
                modality=modality,
            )
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """A whole prompt's token ids (not cached: prompts are large and used once)."""
        tokenizer = self._need(None, "the prompt", text)
        return list(map(operator.index, tokenizer.encode(text, add_special_tokens=False)))

    def decode(self, ids: list[int]) -> str:
        """A whole prompt's text (not cached, like :meth:`encode`)."""
        return self._need(None, "the prompt", ids).decode(ids)

    def piece(self, ids: list[int]) -> str:
        """The text of a piece of the prompt next to a merging edge (not cached)."""
        if not ids:
            return ""
        return self._need(None, "the text next to a merging content", ids).decode(ids)

    def encode_text(self, text: str, modality: str) -> list[int]:
        """A piece of prompt text next to a merging edge (not cached: each piece is new)."""
        if not text:
            return []
        tokenizer = self._need(modality, "the text next to a merging content", text)
        return list(map(operator.index, tokenizer.encode(text, add_special_tokens=False)))

    def standalone(self) -> frozenset[int]:
        """Token ids text never merges across: the tokenizer's added tokens (an HF tokenizer
        splits them out before its model runs). Empty for a tokenizer that does not list them."""
        if self._standalone is None:
            self._standalone = _added_token_ids(self.tokenizer)
        return self._standalone

    def ids(self, seq: tuple[int, ...] | str, modality: str, what: str) -> tuple[int, ...]:
        if not isinstance(seq, str):
            return seq
        cached = self._encoded.get(seq)
        if cached is None:
            tokenizer = self._need(modality, what, seq)
            cached = tuple(map(operator.index, tokenizer.encode(seq, add_special_tokens=False)))
            self._encoded[seq] = cached
        return cached

    def text(self, seq: tuple[int, ...] | str, modality: str | None, what: str) -> str:
        if isinstance(seq, str):
            return seq
        cached = self._decoded.get(seq)
        if cached is None:
            cached = self._need(modality, what, seq).decode(list(seq))
            self._decoded[seq] = cached
        return cached


_ADDED_IDS: weakref.WeakKeyDictionary[Any, tuple[int, frozenset[int]]] = weakref.WeakKeyDictionary()
_ADDED_IDS_LOCK = threading.Lock()


def _added_token_ids(tokenizer: object) -> frozenset[int]:
    """The ids of ``tokenizer``'s added tokens (``added_tokens_decoder``), cached per tokenizer
    object and vocabulary size (an HF tokenizer builds that mapping anew on every access)."""
    if tokenizer is None:
        return frozenset()
    try:
        size = len(tokenizer)  # type: ignore[arg-type]
    except TypeError:
        size = -1
    with _ADDED_IDS_LOCK:
        try:
            cached = _ADDED_IDS.get(tokenizer)
        except TypeError:  # not weakly referenceable
            cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    ids = frozenset(map(operator.index, decoder)) if isinstance(decoder, Mapping) else frozenset()
    with _ADDED_IDS_LOCK, contextlib.suppress(TypeError):
        _ADDED_IDS[tokenizer] = (size, ids)
    return ids


# --- resolving ------------------------------------------------------------------------------------


def _checked_count(modality: str, count: Any) -> int:
    try:
        n = operator.index(count)
    except TypeError:
        n = -1
    if n < 0 or isinstance(count, bool):
        raise PromptUpdateError(
            f"the item count of {modality!r} must be a non-negative integer, got {count!r}",
            modality=modality,
        )
    return n


def _resolve_content(update: PromptUpdate, item: int) -> PromptUpdateDetails:
    content = update.content
    if isinstance(content, PromptUpdateDetails):
        return content
    value = content(item)  # type: ignore[operator]
    try:
        return normalize_content(value)
    except (TypeError, ValueError) as exc:
        raise PromptUpdateError(
            f"{update.modality} item {item}: the update's content callable returned "
            f"{type(value).__name__}, not token ids, text or PromptUpdateDetails ({exc})",
            modality=update.modality,
            item_index=item,
        ) from None


def resolve_prompt_updates(
    updates: Sequence[PromptUpdate], mm_counts: Mapping[str, int]
) -> dict[str, list[tuple[ResolvedPromptUpdate, ...]]]:
    """Work out every item's content for each of its modality's updates.

    Returns, for every modality of ``mm_counts`` (in that order), one tuple of candidates per
    item, in the order the updates were given. A content callable is called once per item and
    update, here; what it returns must depend on that item alone (the result is cached with it).
    """
    ups = list(updates)
    for update in ups:
        if not isinstance(update, PromptUpdate):
            raise TypeError(f"expected PromptReplacement or PromptInsertion, got {update!r}")
    resolved: dict[str, list[tuple[ResolvedPromptUpdate, ...]]] = {}
    for modality, count in mm_counts.items():
        n = _checked_count(modality, count)
        candidates = [u for u in ups if u.modality == modality]
        resolved[modality] = [
            tuple(
                ResolvedPromptUpdate(
                    modality,
                    "insert" if isinstance(u, PromptInsertion) else "replace",
                    u.target,  # type: ignore[arg-type]  # normalized by PromptUpdate
                    _resolve_content(u, item),
                )
                for u in candidates
            )
            for item in range(n)
        ]
    return resolved


# --- matching -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Edit:
    """One item's update as matched: the span ``[start, end)`` of the prompt it replaces."""

    start: int
    end: int
    order: int  # matching order: breaks ties between edits at one position
    modality: str
    item: int
    update: ResolvedPromptUpdate


@dataclass(frozen=True, slots=True)
class _Miss:
    """The first item that matched no update."""

    modality: str
    item: int
    candidates: tuple[ResolvedPromptUpdate, ...]


def _describe(update: ResolvedPromptUpdate) -> str:
    kind = "insertion after" if update.kind == "insert" else "replacement of"
    target = update.target
    if isinstance(target, PromptIndex):
        where = target.kind if target.prefix_seq is None else f"prefix {_preview(target)}"
        return f"{kind} the {where} of the prompt"
    return f"{kind} {_preview(target)}"


def _miss_error(miss: _Miss, where: str) -> PromptUpdateError:
    modality, item = miss.modality, miss.item
    if not miss.candidates:
        reason = f"no prompt update is defined for modality {modality!r}"
    else:
        tried = "; ".join(_describe(u) for u in miss.candidates)
        reason = (
            f"no prompt update matched {where} (tried: {tried}); does the prompt have a "
            f"placeholder for every {modality} item?"
        )
    message = f"{modality} item {item}: {reason}"
    return PromptUpdateError(message, modality=modality, item_index=item)


def _find_unclaimed(hay: str, claimed: bytearray, needle: str, start: int) -> int:
    """First occurrence of ``needle`` at or after ``start`` that overlaps no claimed position."""
    m = len(needle)
    while True:
        j = hay.find(needle, start)
        if j < 0 or claimed.find(1, j, j + m) < 0:
            return j
        start = j + 1


Convert = Callable[[tuple[int, ...] | str, str], str]


def _match(hay: str, resolved: ResolvedUpdates, convert: Convert) -> list[_Edit] | _Miss:
    """Match every item to one of its candidates in ``hay``; the edits, or the first miss.

    An item takes, of its replacements of a sequence, the earliest occurrence no other item has
    taken (the first candidate on a tie), so items follow the prompt's order whichever form each
    placeholder has; only when none is left does it take the first of its positional candidates
    (insertions, zero-width targets) that matches. ``convert`` turns a target sequence into
    ``hay``'s alphabet. Items share a candidate when its kind and target are equal; each shared
    candidate keeps one cursor, so the work per candidate is one left-to-right pass.
    """
    end = len(hay)
    claimed = bytearray(end)  # positions already taken by a replacement
    anchors: dict[object, str | int | None] = {}  # needle, zero-width position, or no match
    cursor: dict[object, int] = {}  # replacement candidate -> where its next search starts
    edits: list[_Edit] = []
    for modality, items in resolved.items():
        for item, candidates in enumerate(items):
            best: tuple[int, str, ResolvedPromptUpdate] | None = None
            position: tuple[int, ResolvedPromptUpdate] | None = None
            for update in candidates:
                key = update.candidate_key
                if key not in anchors:
                    anchors[key] = _resolve_target(hay, update, convert)
                target = anchors[key]
                if target is None:
                    continue
                if isinstance(target, int):
                    if position is None:
                        position = (target, update)
                    continue
                j = _find_unclaimed(hay, claimed, target, cursor.get(key, 0))
                if j < 0:
                    cursor[key] = end + 1  # exhausted: later items skip it at once
                elif best is None or j < best[0]:
                    best = (j, target, update)
            if best is not None:
                j, needle, update = best
                stop = j + len(needle)
                claimed[j:stop] = b"\x01" * len(needle)
                cursor[update.candidate_key] = stop
                edits.append(_Edit(j, stop, len(edits), modality, item, update))
            elif position is not None:
                # A position: every item of an insertion or a zero-width replacement goes
                # there, in item order.
                at, update = position
                edits.append(_Edit(at, at, len(edits), modality, item, update))
            else:
                return _Miss(modality, item, tuple(candidates))
    return edits


def _resolve_target(hay: str, update: ResolvedPromptUpdate, convert: Convert) -> str | int | None:
    """A replacement's needle, or the position an update acts at (None: no match)."""
    target = update.target
    if isinstance(target, PromptIndex):
        if target.kind == "start":
            return 0
        if target.kind == "end":
            return len(hay)
        prefix = convert(target.prefix_seq, update.modality)  # type: ignore[arg-type]
        return len(prefix) if hay.startswith(prefix) else None
    needle = convert(target, update.modality)
    if not needle:
        raise PromptUpdateError(
            f"{update.modality} update: target {_preview(target)} converts to an empty sequence",
            modality=update.modality,
        )
    if update.kind == "insert":
        # Insertions share one anchor: right after the target's first occurrence.
        j = hay.find(needle)
        return None if j < 0 else j + len(needle)
    return needle


def _sorted_edits(edits: list[_Edit]) -> list[_Edit]:
    """Edits in prompt order; zero-width edits at a position go before a span starting there."""
    edits = sorted(edits, key=lambda e: (e.start, e.end != e.start, e.order))
    # Replaced spans never overlap (claimed positions); only a zero-width edit can land inside one.
    last: _Edit | None = None  # the edit reaching furthest so far
    for edit in edits:
        if last is not None and edit.start < last.end:
            raise PromptUpdateError(
                f"{edit.modality} item {edit.item}: its update acts at position {edit.start}, "
                f"inside [{last.start}, {last.end}), which {last.modality} item {last.item} "
                "replaces",
                modality=edit.modality,
                item_index=edit.item,
            )
        if last is None or edit.end >= last.end:
            last = edit
    return edits


def _empty_slots(resolved: ResolvedUpdates) -> dict[str, list[PlaceholderRange | None]]:
    return {modality: [None] * len(items) for modality, items in resolved.items()}


# --- applying -------------------------------------------------------------------------------------


def _assemble_ids(
    prompt: list[int], edits: list[_Edit], resolved: ResolvedUpdates, codec: _Codec
) -> tuple[list[int], Placeholders]:
    ordered = _sorted_edits(edits)
    if any(edit.update.content.merges for edit in ordered):
        return _assemble_merging(prompt, ordered, resolved, codec)
    slots = _empty_slots(resolved)
    out: list[int] = []
    prev = 0
    for edit in ordered:
        out.extend(prompt[prev : edit.start])
        details = edit.update.content
        ids = codec.ids(details.full, edit.modality, "content")
        slots[edit.modality][edit.item] = PlaceholderRange(
            len(out), len(ids), details.embed_mask(ids)
        )
        out.extend(ids)
        prev = edit.end
    out.extend(prompt[prev:])
    return out, slots  # type: ignore[return-value]  # every slot is filled


def _assemble_merging(
    prompt: list[int], ordered: list[_Edit], resolved: ResolvedUpdates, codec: _Codec
) -> tuple[list[int], Placeholders]:
    """:func:`_assemble_ids` for edits some of which carry text that merges with the prompt
    (:meth:`PromptUpdateDetails.with_merges`): each such edge is tokenized again together with
    the prompt text next to it, as far as the nearest added token or fixed part of an edit."""
    standalone = codec.standalone()
    out: list[int] = []
    fixed: list[tuple[_Edit, int, tuple[int, ...]]] = []  # each edit, its fixed part's offset, ids
    prev = 0
    after = ""  # the previous edit's merge_after, tokenized with the text that follows it
    for edit in ordered:
        details = edit.update.content
        ids = codec.ids(details.full, edit.modality, "content")
        out += _joined(after, prompt[prev : edit.start], details.merge_before, standalone, codec)
        fixed.append((edit, len(out), ids))
        out += ids
        after, prev = details.merge_after, edit.end
    out += _joined(after, prompt[prev:], "", standalone, codec)
    slots = _empty_slots(resolved)
    for edit, offset, ids in fixed:
        details = edit.update.content
        slots[edit.modality][edit.item] = PlaceholderRange(
            offset, len(ids), details.embed_mask(ids)
        )
    return out, slots  # type: ignore[return-value]  # every slot is filled


def _joined(
    after: str, gap: list[int], before: str, standalone: frozenset[int], codec: _Codec
) -> list[int]:
    """The prompt tokens ``gap`` between two edits, with the previous edit's ``after`` text and
    the next one's ``before`` text tokenized together with the text they touch.

    Text never merges across an added token (the tokenizer splits them out first), so only the
    gap's text up to its first added token is tokenized with ``after``, and only its text from
    its last added token on with ``before``; the tokens between stay as they are.
    """
    if not after and not before:
        return gap
    first = next((i for i, token in enumerate(gap) if token in standalone), None)
    if first is None:
        return codec.encode_text(after + codec.piece(gap) + before, "merging")
    last = len(gap) - 1 - next(i for i, token in enumerate(reversed(gap)) if token in standalone)
    head, middle, tail = gap[:first], gap[first : last + 1], gap[last + 1 :]
    out = codec.encode_text(after + codec.piece(head), "merging") if after else head
    out += middle
    out += codec.encode_text(codec.piece(tail) + before, "merging") if before else tail
    return out


def _assemble_text(
    text: str, edits: list[_Edit], codec: _Codec
) -> tuple[str, list[tuple[_Edit, int, str]]]:
    """The updated text, and per edit (in prompt order) its character offset and inserted text
    (merging edges included)."""
    pieces: list[str] = []
    placed: list[tuple[_Edit, int, str]] = []
    size = prev = 0
    for edit in _sorted_edits(edits):
        kept = text[prev : edit.start]
        details = edit.update.content
        core = codec.text(details.full, edit.modality, "content")
        new = details.merge_before + core + details.merge_after
        pieces += (kept, new)
        size += len(kept)
        placed.append((edit, size, new))
        size += len(new)
        prev = edit.end
    pieces.append(text[prev:])
    return "".join(pieces), placed


def _apply_text(text: str, resolved: ResolvedUpdates, codec: _Codec) -> tuple[str, Placeholders]:
    matched = _match(text, resolved, lambda seq, m: codec.text(seq, m, "target"))
    if isinstance(matched, _Miss):
        raise _miss_error(matched, "the text")
    new_text, placed = _assemble_text(text, matched, codec)
    slots = _empty_slots(resolved)
    for edit, offset, new in placed:
        if edit.update.content.embed_token_id is not None:
            raise PromptUpdateError(
                f"{edit.modality} item {edit.item}: select_token_id needs a tokenizer to tell "
                "which positions get embeddings",
                modality=edit.modality,
                item_index=edit.item,
            )
        details = edit.update.content  # the range is the fixed part, between merging edges
        fixed = len(new) - len(details.merge_before) - len(details.merge_after)
        slots[edit.modality][edit.item] = PlaceholderRange(
            offset + len(details.merge_before), fixed
        )
    return new_text, slots  # type: ignore[return-value]


def _apply_ids(
    prompt: list[int], resolved: ResolvedUpdates, codec: _Codec, source_text: str | None
) -> tuple[list[int], Placeholders]:
    hay = _ids_to_str(prompt)
    matched = _match(hay, resolved, lambda seq, m: _ids_to_str(codec.ids(seq, m, "target")))
    if not isinstance(matched, _Miss):
        return _assemble_ids(prompt, matched, resolved, codec)
    if codec.tokenizer is None:
        raise _miss_error(matched, "the token ids (pass a tokenizer to also match on text)")

    # Tokens merged across a target's boundary: match on the text, then tokenize the result.
    text = codec.decode(prompt) if source_text is None else source_text
    matched = _match(text, resolved, lambda seq, m: codec.text(seq, m, "target"))
    if isinstance(matched, _Miss):
        raise _miss_error(matched, "the token ids nor the decoded text")
    new_text, placed = _assemble_text(text, matched, codec)
    new_ids = codec.encode(new_text)
    new_hay = _ids_to_str(new_ids)
    slots = _empty_slots(resolved)
    pos = 0
    for edit, _offset, _new in placed:  # in prompt order, so one left-to-right pass finds them
        details = edit.update.content
        ids = codec.ids(details.full, edit.modality, "content")
        j = new_hay.find(_ids_to_str(ids), pos)
        if j < 0:
            raise PromptUpdateError(
                f"{edit.modality} item {edit.item}: after matching on text, its content "
                f"{_preview(details.full)} does not come out of tokenizing the updated prompt as "
                "the same token ids (it merges with the text around it: declare the text at its "
                "edges with PromptUpdateDetails.with_merges)",
                modality=edit.modality,
                item_index=edit.item,
            )
        slots[edit.modality][edit.item] = PlaceholderRange(j, len(ids), details.embed_mask(ids))
        pos = j + len(ids)
    return new_ids, slots  # type: ignore[return-value]


def apply_resolved_updates(
    prompt: PromptSeq, resolved: ResolvedUpdates, tokenizer: Tokenizer | None = None
) -> tuple[list[int] | str, Placeholders]:
    """Apply per-item resolved updates (see :func:`resolve_prompt_updates`) to ``prompt``.

    The same rules as :func:`apply_prompt_updates`, for updates already resolved per item: the
    form the processor-output cache keeps them in.
    """
    codec = _Codec(tokenizer)
    if isinstance(prompt, str):
        if tokenizer is None:
            return _apply_text(prompt, resolved, codec)
        return _apply_ids(codec.encode(prompt), resolved, codec, prompt)
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be token ids or text, not bytes")
    return _apply_ids(list(map(operator.index, prompt)), resolved, codec, None)


def apply_prompt_updates(
    prompt: PromptSeq,
    updates: Sequence[PromptUpdate],
    mm_counts: Mapping[str, int],
    tokenizer: Tokenizer | None = None,
) -> tuple[list[int] | str, Placeholders]:
    """Apply ``updates`` for ``mm_counts`` items per modality; the new prompt and its placeholders.

    * Token ids in: token ids out. Matching runs on the token ids; when some item finds no match
      there (typically a target whose tokens merged with a neighbour) and a tokenizer is given,
      the whole prompt is matched again on its decoded text, updated as text, and tokenized.
    * Text and a tokenizer in: the text is tokenized first (``add_special_tokens=False``, as
      every text this module tokenizes), then as above, the text fallback matching the original
      text; token ids out.
    * Text and no tokenizer in: matched and updated as text; text out, and the placeholder
      offsets and lengths count characters.

    ``placeholders`` maps every modality of ``mm_counts`` to one :class:`PlaceholderRange` per
    item, in item order. Raises :class:`~mmproc.errors.PromptUpdateError` naming the modality and
    item index when an item matches no update, or when text must be converted to token ids (or
    back) and no tokenizer is given.
    """
    return apply_resolved_updates(prompt, resolve_prompt_updates(updates, mm_counts), tokenizer)


# --- locating -------------------------------------------------------------------------------------


def find_resolved_ranges(
    token_ids: Sequence[int], resolved: ResolvedUpdates, tokenizer: Tokenizer | None = None
) -> Placeholders:
    """Locate per-item resolved updates that were already applied; see
    :func:`find_placeholder_ranges`."""
    codec = _Codec(tokenizer)
    hay = _ids_to_str(list(map(operator.index, token_ids)))
    claimed = bytearray(len(hay))
    needles: dict[tuple[int, ...] | str, tuple[tuple[int, ...], str]] = {}
    placeholders: Placeholders = {}
    for modality, items in resolved.items():
        ranges: list[PlaceholderRange] = []
        pos = 0
        missed: dict[tuple[int, ...] | str, int] = {}  # content -> absent at or after this position
        for item, candidates in enumerate(items):
            best: tuple[int, PromptUpdateDetails, tuple[int, ...]] | None = None
            for update in candidates:
                details = update.content
                full = details.full
                if missed.get(full, len(hay) + 1) <= pos:
                    continue
                if full not in needles:
                    ids = codec.ids(full, modality, "content")
                    needles[full] = (ids, _ids_to_str(ids))
                ids, needle = needles[full]
                j = _find_unclaimed(hay, claimed, needle, pos)
                if j < 0:
                    missed[full] = pos
                    continue
                # An empty content matches anywhere; it loses to any real occurrence.
                if best is None or (j < best[0] and ids) or not best[2]:
                    best = (j, details, ids)
            if best is None:
                raise PromptUpdateError(
                    f"{modality} item {item}: its placeholder sequence is not in the "
                    f"prompt (searched from token {pos})",
                    modality=modality,
                    item_index=item,
                )
            j, details, ids = best
            found = PlaceholderRange(j, len(ids), details.embed_mask(ids))
            claimed[j : j + len(ids)] = b"\x01" * len(ids)
            ranges.append(found)
            pos = j + len(ids)
        placeholders[modality] = ranges
    return placeholders


def find_placeholder_ranges(
    token_ids: Sequence[int],
    updates: Sequence[PromptUpdate],
    mm_counts: Mapping[str, int],
    tokenizer: Tokenizer | None = None,
) -> Placeholders:
    """Locate updates that were already applied (e.g. by the HF processor) in ``token_ids``.

    Nothing is applied: per modality, in item order, each item's full content (as resolved for
    its index) is searched after the previous item's; when a modality has several candidate
    updates the earliest occurrence wins (the first candidate on a tie). Occurrences taken by one
    item are not given to another. ``tokenizer`` is needed only for contents given as text.

    Raises :class:`~mmproc.errors.PromptUpdateError` naming the modality and item index when an
    item's sequence is not found.
    """
    return find_resolved_ranges(token_ids, resolve_prompt_updates(updates, mm_counts), tokenizer)
