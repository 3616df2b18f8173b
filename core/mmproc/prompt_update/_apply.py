"""Matching prompt updates against a prompt, applying them, and locating applied ones.

Matching works on strings in both spaces: a token id prompt becomes a string with one code point
per token id, so ``str.find`` does the token-sequence search in C (linear in practice), and the
same matcher serves token ids and text.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mmproc.errors import PromptUpdateError

from ._types import (
    PlaceholderRange,
    PromptIndex,
    PromptInsertion,
    PromptSeq,
    PromptUpdate,
    PromptUpdateDetails,
    Tokenizer,
    normalize_content,
)

__all__ = ["Placeholders", "apply_prompt_updates", "find_placeholder_ranges"]

Placeholders = dict[str, list[PlaceholderRange]]
"""Modality -> one range per item, in item order."""

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


class _Contents:
    """Each item's content, resolved once: a content callable is called once per item."""

    def __init__(self, updates: Sequence[PromptUpdate]) -> None:
        self._updates = updates
        self._cache: dict[tuple[int, int], PromptUpdateDetails] = {}

    def is_static(self, ci: int) -> bool:
        return isinstance(self._updates[ci].content, PromptUpdateDetails)

    def get(self, ci: int, item: int) -> PromptUpdateDetails:
        content = self._updates[ci].content
        if isinstance(content, PromptUpdateDetails):
            return content
        details = self._cache.get((ci, item))
        if details is None:
            value = content(item)  # type: ignore[operator]
            try:
                details = normalize_content(value)
            except (TypeError, ValueError) as exc:
                modality = self._updates[ci].modality
                raise PromptUpdateError(
                    f"{modality} item {item}: the update's content callable returned "
                    f"{type(value).__name__}, not token ids, text or PromptUpdateDetails ({exc})",
                    modality=modality,
                    item_index=item,
                ) from None
            self._cache[(ci, item)] = details
        return details


@dataclass(frozen=True, slots=True)
class _Group:
    """One modality: its item count and candidate updates (indexes, in the order given)."""

    modality: str
    count: int
    candidates: tuple[int, ...]


def _plan(
    updates: Sequence[PromptUpdate], mm_counts: Mapping[str, int]
) -> tuple[list[PromptUpdate], list[_Group]]:
    ups = list(updates)
    for update in ups:
        if not isinstance(update, PromptUpdate):
            raise TypeError(f"expected PromptReplacement or PromptInsertion, got {update!r}")
    by_modality: dict[str, list[int]] = {}
    for ci, update in enumerate(ups):
        by_modality.setdefault(update.modality, []).append(ci)
    groups = []
    for modality, count in mm_counts.items():
        try:
            n = operator.index(count)
        except TypeError:
            n = -1
        if n < 0 or isinstance(count, bool):
            raise PromptUpdateError(
                f"the item count of {modality!r} must be a non-negative integer, got {count!r}",
                modality=modality,
            )
        groups.append(_Group(modality, n, tuple(by_modality.get(modality, ()))))
    return ups, groups


@dataclass(slots=True)
class _Edit:
    """One item's update as matched: the span ``[start, end)`` of the prompt it replaces."""

    start: int
    end: int
    order: int  # matching order: breaks ties between edits at one position
    modality: str
    item: int
    candidate: int


def _describe(update: PromptUpdate) -> str:
    kind = "insertion after" if isinstance(update, PromptInsertion) else "replacement of"
    target = update.target
    if isinstance(target, PromptIndex):
        where = target.kind if target.prefix_seq is None else f"prefix {_preview(target)}"
        return f"{kind} the {where} of the prompt"
    return f"{kind} {_preview(target)}"


def _miss(updates: Sequence[PromptUpdate], group: _Group, item: int, where: str) -> Exception:
    modality = group.modality
    if not group.candidates:
        reason = f"no prompt update is defined for modality {modality!r}"
    else:
        tried = "; ".join(_describe(updates[ci]) for ci in group.candidates)
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


def _match(
    hay: str,
    updates: Sequence[PromptUpdate],
    groups: Sequence[_Group],
    convert: Callable[[tuple[int, ...] | str, str], str],
) -> list[_Edit] | tuple[_Group, int]:
    """Match every item to an update in ``hay``; the edits, or the first item that matched none.

    ``convert`` turns a target sequence into ``hay``'s alphabet. Each candidate keeps its own
    cursor, so the work per candidate is one left-to-right pass over the prompt.
    """
    end = len(hay)
    claimed = bytearray(end)  # positions already taken by a replacement
    resolved: dict[int, str | int | None] = {}  # needle, zero-width position, or no match
    cursor: dict[int, int] = {}  # replacement candidate -> where its next search starts
    used: set[int] = set()  # zero-width replacements, which match once
    edits: list[_Edit] = []
    for group in groups:
        for item in range(group.count):
            for ci in group.candidates:
                update = updates[ci]
                if ci not in resolved:
                    resolved[ci] = _resolve_target(hay, update, convert)
                target = resolved[ci]
                if target is None:
                    continue
                if isinstance(target, int):
                    if not isinstance(update, PromptInsertion):
                        if ci in used:
                            continue
                        used.add(ci)
                    edits.append(_Edit(target, target, len(edits), group.modality, item, ci))
                    break
                j = _find_unclaimed(hay, claimed, target, cursor.get(ci, 0))
                if j < 0:
                    cursor[ci] = end + 1  # exhausted: later items skip it at once
                    continue
                stop = j + len(target)
                claimed[j:stop] = b"\x01" * len(target)
                cursor[ci] = stop
                edits.append(_Edit(j, stop, len(edits), group.modality, item, ci))
                break
            else:
                return group, item
    return edits


def _resolve_target(
    hay: str, update: PromptUpdate, convert: Callable[[tuple[int, ...] | str, str], str]
) -> str | int | None:
    """A replacement's needle, or the zero-width position an update acts at (None: no match)."""
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
    if isinstance(update, PromptInsertion):
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


def _assemble_ids(
    prompt: list[int],
    edits: list[_Edit],
    groups: Sequence[_Group],
    contents: _Contents,
    codec: _Codec,
) -> tuple[list[int], Placeholders]:
    slots: dict[str, list[PlaceholderRange | None]] = {g.modality: [None] * g.count for g in groups}
    out: list[int] = []
    prev = 0
    for edit in _sorted_edits(edits):
        out.extend(prompt[prev : edit.start])
        details = contents.get(edit.candidate, edit.item)
        ids = codec.ids(details.full, edit.modality, "content")
        slots[edit.modality][edit.item] = PlaceholderRange(
            len(out), len(ids), details.embed_mask(ids)
        )
        out.extend(ids)
        prev = edit.end
    out.extend(prompt[prev:])
    return out, slots  # type: ignore[return-value]  # every slot is filled


def _assemble_text(
    text: str, edits: list[_Edit], contents: _Contents, codec: _Codec
) -> tuple[str, list[tuple[_Edit, int, str]]]:
    """The updated text, and per edit (in prompt order) its character offset and inserted text."""
    pieces: list[str] = []
    placed: list[tuple[_Edit, int, str]] = []
    size = prev = 0
    for edit in _sorted_edits(edits):
        kept = text[prev : edit.start]
        details = contents.get(edit.candidate, edit.item)
        new = codec.text(details.full, edit.modality, "content")
        pieces += (kept, new)
        size += len(kept)
        placed.append((edit, size, new))
        size += len(new)
        prev = edit.end
    pieces.append(text[prev:])
    return "".join(pieces), placed


def _apply_text(
    text: str,
    updates: list[PromptUpdate],
    groups: list[_Group],
    contents: _Contents,
    codec: _Codec,
) -> tuple[str, Placeholders]:
    matched = _match(text, updates, groups, lambda seq, m: codec.text(seq, m, "target"))
    if not isinstance(matched, list):
        raise _miss(updates, *matched, "the text")
    new_text, placed = _assemble_text(text, matched, contents, codec)
    slots: dict[str, list[PlaceholderRange | None]] = {g.modality: [None] * g.count for g in groups}
    for edit, offset, new in placed:
        if contents.get(edit.candidate, edit.item).embed_token_id is not None:
            raise PromptUpdateError(
                f"{edit.modality} item {edit.item}: select_token_id needs a tokenizer to tell "
                "which positions get embeddings",
                modality=edit.modality,
                item_index=edit.item,
            )
        slots[edit.modality][edit.item] = PlaceholderRange(offset, len(new))
    return new_text, slots  # type: ignore[return-value]


def _apply_ids(
    prompt: list[int],
    updates: list[PromptUpdate],
    groups: list[_Group],
    contents: _Contents,
    codec: _Codec,
    source_text: str | None,
) -> tuple[list[int], Placeholders]:
    hay = _ids_to_str(prompt)
    matched = _match(hay, updates, groups, lambda seq, m: _ids_to_str(codec.ids(seq, m, "target")))
    if isinstance(matched, list):
        return _assemble_ids(prompt, matched, groups, contents, codec)
    if codec.tokenizer is None:
        raise _miss(updates, *matched, "the token ids (pass a tokenizer to also match on text)")

    # Tokens merged across a target's boundary: match on the text, then tokenize the result.
    text = codec.decode(prompt) if source_text is None else source_text
    matched = _match(text, updates, groups, lambda seq, m: codec.text(seq, m, "target"))
    if not isinstance(matched, list):
        raise _miss(updates, *matched, "the token ids nor the decoded text")
    new_text, placed = _assemble_text(text, matched, contents, codec)
    new_ids = codec.encode(new_text)
    new_hay = _ids_to_str(new_ids)
    slots: dict[str, list[PlaceholderRange | None]] = {g.modality: [None] * g.count for g in groups}
    pos = 0
    for edit, _offset, _new in placed:  # in prompt order, so one left-to-right pass finds them
        details = contents.get(edit.candidate, edit.item)
        ids = codec.ids(details.full, edit.modality, "content")
        j = new_hay.find(_ids_to_str(ids), pos)
        if j < 0:
            raise PromptUpdateError(
                f"{edit.modality} item {edit.item}: after matching on text, its content "
                f"{_preview(details.full)} does not come out of tokenizing the updated prompt as "
                "the same token ids (it merges with the text around it)",
                modality=edit.modality,
                item_index=edit.item,
            )
        slots[edit.modality][edit.item] = PlaceholderRange(j, len(ids), details.embed_mask(ids))
        pos = j + len(ids)
    return new_ids, slots  # type: ignore[return-value]


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
    ups, groups = _plan(updates, mm_counts)
    codec = _Codec(tokenizer)
    contents = _Contents(ups)
    if isinstance(prompt, str):
        if tokenizer is None:
            return _apply_text(prompt, ups, groups, contents, codec)
        return _apply_ids(codec.encode(prompt), ups, groups, contents, codec, prompt)
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be token ids or text, not bytes")
    return _apply_ids(list(map(operator.index, prompt)), ups, groups, contents, codec, None)


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
    ups, groups = _plan(updates, mm_counts)
    codec = _Codec(tokenizer)
    contents = _Contents(ups)
    hay = _ids_to_str(list(map(operator.index, token_ids)))
    claimed = bytearray(len(hay))
    needles: dict[int, tuple[tuple[int, ...], str]] = {}  # static contents, converted once
    placeholders: Placeholders = {}
    for group in groups:
        ranges: list[PlaceholderRange] = []
        pos = 0
        missed: dict[int, int] = {}  # static candidate -> absent at or after this position
        for item in range(group.count):
            best: tuple[int, PromptUpdateDetails, tuple[int, ...]] | None = None
            for ci in group.candidates:
                static = contents.is_static(ci)
                if static and missed.get(ci, len(hay) + 1) <= pos:
                    continue
                details = contents.get(ci, item)
                if static and ci in needles:
                    ids, needle = needles[ci]
                else:
                    ids = codec.ids(details.full, group.modality, "content")
                    needle = _ids_to_str(ids)
                    if static:
                        needles[ci] = (ids, needle)
                j = _find_unclaimed(hay, claimed, needle, pos)
                if j < 0:
                    if static:
                        missed[ci] = pos
                    continue
                # An empty content matches anywhere; it loses to any real occurrence.
                if best is None or (j < best[0] and ids) or not best[2]:
                    best = (j, details, ids)
            if best is None:
                raise PromptUpdateError(
                    f"{group.modality} item {item}: its placeholder sequence is not in the "
                    f"prompt (searched from token {pos})",
                    modality=group.modality,
                    item_index=item,
                )
            j, details, ids = best
            claimed[j : j + len(ids)] = b"\x01" * len(ids)
            ranges.append(PlaceholderRange(j, len(ids), details.embed_mask(ids)))
            pos = j + len(ids)
        placeholders[group.modality] = ranges
    return placeholders
