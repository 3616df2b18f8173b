"""The value types of prompt updates: targets, contents, updates and placeholder ranges."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias, runtime_checkable

__all__ = [
    "PlaceholderRange",
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
    "Tokenizer",
]

PromptSeq: TypeAlias = Sequence[int] | str
"""A token id sequence or a text."""


@runtime_checkable
class Tokenizer(Protocol):
    """What prompt updating needs from a tokenizer (a transformers tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of ``text``; called with ``add_special_tokens=False``."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included."""
        ...


def _normalize_seq(seq: object, what: str) -> tuple[int, ...] | str:
    """``seq`` as an immutable token id tuple or a text; raises TypeError on anything else."""
    if isinstance(seq, str):
        return seq
    # The exact-type check first: the Sequence ABC check is slow, and contents come per item.
    if type(seq) not in (list, tuple) and (
        isinstance(seq, bytes | bytearray) or not isinstance(seq, Sequence)
    ):
        raise TypeError(f"{what} must be token ids or text, not {type(seq).__name__}")
    try:
        # operator.index runs in C, rejects floats and turns numpy integers into plain ints.
        ids = tuple(map(operator.index, seq))  # type: ignore[call-overload]
    except TypeError as exc:
        raise TypeError(f"{what} must hold integer token ids: {exc}") from None
    if ids and min(ids) < 0:
        raise ValueError(f"{what} holds a negative token id: {min(ids)}")
    return ids


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where one media item's placeholder sequence lies in the final prompt.

    ``offset`` and ``length`` count token ids of the final prompt (characters only when a text
    prompt was updated without a tokenizer). ``is_embed`` marks, per position, which positions
    receive an embedding from the item; ``None`` means all of them do.
    """

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"offset and length must be >= 0, got {self.offset}, {self.length}")
        if self.is_embed is not None:
            mask = tuple(map(bool, self.is_embed))
            if len(mask) != self.length:
                raise ValueError(f"is_embed has {len(mask)} entries for length {self.length}")
            object.__setattr__(self, "is_embed", mask)

    @property
    def end(self) -> int:
        """One past the last position of the range."""
        return self.offset + self.length

    @property
    def embed_count(self) -> int:
        """How many positions of the range receive an embedding."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embed_mask(self) -> tuple[bool, ...]:
        """``is_embed`` spelled out: one flag per position, also when every position embeds."""
        return (True,) * self.length if self.is_embed is None else self.is_embed


@dataclass(frozen=True, slots=True)
class PromptIndex:
    """A zero-width target: a position in the prompt rather than a sequence in it.

    Build one with :class:`PromptIndexTargets`. ``start`` is position 0, ``end`` the end of the
    prompt, ``prefix`` the position right after ``prefix_seq`` when the prompt starts with it (no
    match otherwise). Replacements and insertions at an index act alike (as vLLM applies them):
    there is nothing to replace, so every item of the modality puts its content there, in item
    order.
    """

    kind: Literal["start", "end", "prefix"]
    prefix_seq: tuple[int, ...] | str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("start", "end", "prefix"):
            raise ValueError(f"unknown index kind {self.kind!r}")
        if (self.kind == "prefix") != (self.prefix_seq is not None):
            raise ValueError("prefix_seq is given exactly when kind is 'prefix'")
        if self.prefix_seq is not None:
            object.__setattr__(self, "prefix_seq", _normalize_seq(self.prefix_seq, "prefix"))


class PromptIndexTargets:
    """Constructors of the zero-width targets (:class:`PromptIndex`)."""

    @staticmethod
    def start() -> PromptIndex:
        """The start of the prompt."""
        return PromptIndex("start")

    @staticmethod
    def end() -> PromptIndex:
        """The end of the prompt."""
        return PromptIndex("end")

    @staticmethod
    def prefix(seq: PromptSeq) -> PromptIndex:
        """Right after ``seq`` (token ids or text), if the prompt starts with it."""
        return PromptIndex("prefix", _normalize_seq(seq, "prefix"))


PromptTarget: TypeAlias = Sequence[int] | str | PromptIndex
"""What an update looks for: token ids, text, or a zero-width :class:`PromptIndex`."""


@dataclass(frozen=True, slots=True)
class PromptUpdateDetails:
    """The full sequence an update puts into the prompt, and which positions get embeddings.

    ``full`` is token ids or text. With ``embed_token_id`` unset every position of ``full`` gets
    an embedding; with it set only the positions holding that token id do (for a text ``full``
    this is decided after tokenizing it, so it needs a tokenizer).

    ``merge_before`` and ``merge_after`` (see :meth:`with_merges`) are text the content carries
    at its edges that merges with the prompt next to it, as it does when an HF processor
    substitutes its placeholders in the text and tokenizes the result: the text before the edit
    and ``merge_before`` are tokenized together, so are ``merge_after`` and the text after the
    edit. ``full`` is then the content's fixed part between them, put in as its own tokens: it
    must begin and end with tokens that never merge with text (special tokens). The item's
    placeholder range is that fixed part.
    """

    full: tuple[int, ...] | str
    embed_token_id: int | None = None
    merge_before: str = ""
    merge_after: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "full", _normalize_seq(self.full, "update content"))
        if self.embed_token_id is not None:
            object.__setattr__(self, "embed_token_id", operator.index(self.embed_token_id))
        for name in ("merge_before", "merge_after"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be text, not {type(getattr(self, name)).__name__}")
        if self.merges and len(self.full) == 0:
            raise ValueError(
                "a content that merges with its neighbours needs a fixed part (full) between "
                "its merging edges"
            )

    @staticmethod
    def from_seq(seq: PromptSeq) -> PromptUpdateDetails:
        """Every position of ``seq`` gets an embedding."""
        return PromptUpdateDetails(seq)  # type: ignore[arg-type]  # normalized by __post_init__

    @staticmethod
    def select_token_id(seq: PromptSeq, token_id: int) -> PromptUpdateDetails:
        """Only the positions of ``seq`` holding ``token_id`` get an embedding."""
        return PromptUpdateDetails(seq, token_id)  # type: ignore[arg-type]

    def with_merges(self, *, before: str = "", after: str = "") -> PromptUpdateDetails:
        r"""This content, with text at its edges that merges with the prompt next to it.

        The content put into the prompt is ``before``, then ``full`` as its own tokens, then
        ``after``. ``before`` is tokenized together with the prompt text before the edit (back
        to the previous added token of the tokenizer, or the previous edit), ``after`` with the
        text after it: the result is what tokenizing the substituted text gives, on the cached
        path and for token-id prompts alike.

        Gemma 3 puts an image in as ``"\n\n<start_of_image>"``, 256 soft tokens, then
        ``"<end_of_image>\n\n"``, and its tokenizer has one token for each run of newlines: after
        ``"user\n"`` the newlines fuse into one ``"\n\n\n"``. With ``BOI``, ``SOFT``, ``EOI`` its
        special tokens and ``tok`` its tokenizer (the test suite runs this example)::

            image = PromptUpdateDetails.select_token_id([BOI, *[SOFT] * 3, EOI], SOFT)
            merging = image.with_merges(before="\n\n", after="\n\n")
            update = PromptReplacement("image", [BOI], merging)
            ids = tok.encode("user\n<start_of_image>Hi", add_special_tokens=False)
            new, ranges = apply_prompt_updates(ids, [update], {"image": 1}, tok)
            # new: "user", "\n\n\n", BOI, SOFT, SOFT, SOFT, EOI, "\n\n", "Hi"
            # ranges["image"][0]: offset 2, length 5 (BOI ... EOI),
            #                     is_embed (False, True, True, True, False)

        An item's placeholder range is its fixed part, wherever the edges' tokens fell: a
        token an edge shares with the prompt (``"\n\n\n"`` above) is the prompt's, and the
        range's length is the item's own whatever its neighbours, on both prompt paths.
        """
        return PromptUpdateDetails(self.full, self.embed_token_id, before, after)

    @property
    def merges(self) -> bool:
        """Whether the content has text at an edge that merges with the prompt next to it."""
        return bool(self.merge_before or self.merge_after)

    def embed_mask(self, token_ids: Sequence[int]) -> tuple[bool, ...] | None:
        """The ``is_embed`` of ``token_ids`` (this update's ``full``, tokenized).

        ``None`` when every position embeds, so equal ranges compare equal however they were
        specified.
        """
        if self.embed_token_id is None:
            return None
        mask = tuple(map(self.embed_token_id.__eq__, token_ids))
        return None if all(mask) else mask


PromptContent: TypeAlias = (
    Sequence[int]
    | str
    | PromptUpdateDetails
    | Callable[[int], "Sequence[int] | str | PromptUpdateDetails"]
)
"""What an update puts in: token ids, text, details, or a callable of the item index."""


def _normalize_target(target: object) -> tuple[int, ...] | str | PromptIndex:
    if isinstance(target, PromptIndex):
        return target
    seq = _normalize_seq(target, "target")
    if len(seq) == 0:
        raise ValueError("a target must not be empty (use PromptIndexTargets for positions)")
    return seq


def normalize_content(content: object) -> PromptUpdateDetails:
    """A non-callable content as :class:`PromptUpdateDetails` (internal helper)."""
    if isinstance(content, PromptUpdateDetails):
        return content
    return PromptUpdateDetails.from_seq(content)  # type: ignore[arg-type]


def _normalize_update_content(content: object) -> object:
    # Callables stay lazy: they are called per item, and only for the update that wins.
    if callable(content) and not isinstance(content, PromptUpdateDetails):
        return content
    return normalize_content(content)


class PromptUpdate:
    """Base of :class:`PromptReplacement` and :class:`PromptInsertion`.

    ``content`` is what the update puts into the prompt for an item: token ids, text, a
    :class:`PromptUpdateDetails`, or a callable of the item index (within its modality) returning
    one of those. Non-callable contents are stored as :class:`PromptUpdateDetails`.
    """

    __slots__ = ()

    modality: str
    target: PromptTarget

    @property
    def content(self) -> PromptContent:
        """The content, whatever the subclass calls it."""
        raise NotImplementedError

    def _check(self, field: str) -> None:
        if not isinstance(self.modality, str) or not self.modality:
            raise TypeError(f"modality must be a non-empty string, got {self.modality!r}")
        object.__setattr__(self, "target", _normalize_target(self.target))
        object.__setattr__(self, field, _normalize_update_content(getattr(self, field)))


@dataclass(frozen=True, slots=True)
class PromptReplacement(PromptUpdate):
    """Replace occurrences of ``target`` with ``replacement``, one occurrence per item.

    Items of the modality consume successive, non-overlapping occurrences, left to right. Each
    pad token 9 below becomes its item's run of 9s, wrapped in start and end tokens 7 and 8 of
    which only the 9s receive embeddings:

    >>> from mmproc.prompt_update import apply_prompt_updates
    >>> sizes = [3, 2]
    >>> wrapped = lambda i: PromptUpdateDetails.select_token_id([7, *[9] * sizes[i], 8], 9)
    >>> update = PromptReplacement("image", [9], wrapped)
    >>> ids, ranges = apply_prompt_updates([1, 9, 5, 9], [update], {"image": 2})
    >>> ids
    [1, 7, 9, 9, 9, 8, 5, 7, 9, 9, 8]
    >>> [(r.offset, r.length, r.embed_count) for r in ranges["image"]]
    [(1, 5, 3), (7, 4, 2)]

    A content whose edges are text that merges with the prompt around it (Gemma 3's newlines
    around each image) says so with :meth:`PromptUpdateDetails.with_merges`.
    """

    modality: str
    target: PromptTarget
    replacement: PromptContent

    def __post_init__(self) -> None:
        self._check("replacement")

    @property
    def content(self) -> PromptContent:
        """The replacement."""
        return self.replacement


@dataclass(frozen=True, slots=True)
class PromptInsertion(PromptUpdate):
    """Insert ``insertion`` right after the first occurrence of ``target``.

    Every item that uses the insertion goes to that same place, piled up in item order. Two
    images go right after the BOS token 1, wherever the text puts them:

    >>> from mmproc.prompt_update import PromptIndexTargets, apply_prompt_updates
    >>> update = PromptInsertion("image", PromptIndexTargets.prefix([1]), lambda i: [9] * (i + 1))
    >>> ids, ranges = apply_prompt_updates([1, 5, 6], [update], {"image": 2})
    >>> ids
    [1, 9, 9, 9, 5, 6]
    >>> [(r.offset, r.length) for r in ranges["image"]]
    [(1, 1), (2, 2)]
    """

    modality: str
    target: PromptTarget
    insertion: PromptContent

    def __post_init__(self) -> None:
        self._check("insertion")

    @property
    def content(self) -> PromptContent:
        """The insertion."""
        return self.insertion


UpdateKind: TypeAlias = Literal["replace", "insert"]
"""How a resolved update acts on its target."""


@dataclass(frozen=True, slots=True)
class ResolvedPromptUpdate:
    """One candidate update of one item, with the item's content already worked out.

    :func:`mmproc.prompt_update.resolve_prompt_updates` turns a model's updates (whose content may
    be a callable of the item index) into these, one tuple of candidates per item. They are plain
    values that depend on the item alone, so the processor-output cache keeps them with the
    item's outputs: a request whose items all hit applies them without calling the model again.
    """

    modality: str
    kind: UpdateKind
    target: tuple[int, ...] | str | PromptIndex
    content: PromptUpdateDetails

    @property
    def candidate_key(self) -> tuple[UpdateKind, tuple[int, ...] | str | PromptIndex]:
        """What makes two items' candidates the same update: its kind and target."""
        return (self.kind, self.target)
