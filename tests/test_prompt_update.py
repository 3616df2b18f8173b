"""Tests of mmproc.prompt_update: matching, applying, the text fallback, and locating."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mmproc.errors import PromptUpdateError
from mmproc.prompt_update import (
    PlaceholderRange,
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptUpdateDetails,
    Tokenizer,
    apply_prompt_updates,
    apply_resolved_updates,
    find_placeholder_ranges,
    find_resolved_ranges,
    resolve_prompt_updates,
)

PAD, VS, VE = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A tiny real BPE tokenizer whose merges cross the boundary of the text ``<image>``.

    ``"<image>"`` alone is one token, but in ``"a<image>"`` the merge ``a + <`` wins, so the
    prompt's token ids do not contain the target's and only text matching finds it.
    """
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for ch in "abcdefghijklmnopqrstuvwxyz <>.,!?":
        vocab[ch] = len(vocab)
    merges = [
        ("a", "<"),
        ("<", "i"),
        ("m", "a"),
        ("g", "e"),
        ("<i", "ma"),
        ("<ima", "ge"),
        ("<image", ">"),
    ]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken(t, special=True) for t in (PAD, VS, VE)])
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def enc(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def one(tok: Tokenizer, text: str) -> int:
    (token_id,) = enc(tok, text)
    return token_id


# --- replacements -------------------------------------------------------------------------------


def test_replacements_consume_successive_occurrences() -> None:
    update = PromptReplacement("image", [5], lambda i: [9] * (i + 1))
    prompt, ph = apply_prompt_updates([1, 5, 2, 5, 3], [update], {"image": 2})
    assert prompt == [1, 9, 2, 9, 9, 3]
    assert ph == {"image": [PlaceholderRange(1, 1, None), PlaceholderRange(3, 2, None)]}


def test_multi_token_target_and_leftover_occurrences_stay() -> None:
    update = PromptReplacement("image", (5, 6), [7, 7, 7])
    prompt, ph = apply_prompt_updates([5, 6, 5, 5, 6, 0, 5, 6], [update], {"image": 2})
    assert prompt == [7, 7, 7, 5, 7, 7, 7, 0, 5, 6]
    assert [(r.offset, r.length) for r in ph["image"]] == [(0, 3), (4, 3)]


def test_content_is_not_matched_again() -> None:
    # The replacement holds the target itself; item 1 must take the prompt's second occurrence.
    update = PromptReplacement("image", [5], [5, 5, 5])
    prompt, ph = apply_prompt_updates([5, 1, 5], [update], {"image": 2})
    assert prompt == [5, 5, 5, 1, 5, 5, 5]
    assert [r.offset for r in ph["image"]] == [0, 4]


def test_modalities_are_independent_and_share_no_occurrence() -> None:
    updates = [
        PromptReplacement("image", [5], [50, 50]),
        PromptReplacement("video", [5, 6], [60]),  # overlaps image's target
    ]
    prompt, ph = apply_prompt_updates([5, 6, 5, 6], updates, {"video": 1, "image": 1})
    # video comes first in mm_counts, so it takes [5, 6] at 0; image takes the next free 5.
    assert prompt == [60, 50, 50, 6]
    assert ph == {"video": [PlaceholderRange(0, 1)], "image": [PlaceholderRange(1, 2)]}


def test_items_take_placeholders_in_prompt_order_whatever_form_each_has() -> None:
    # An audio placeholder 5 alone or wrapped as 7 5 8: both become 7 9.. 8, in prompt order.
    bos, pad, eos = 7, 5, 8
    expand = lambda n: [bos, *[9] * n, eos]  # noqa: E731
    updates = [
        PromptReplacement("audio", [bos, pad, eos], lambda i: expand(i + 1)),
        PromptReplacement("audio", [pad], lambda i: expand(i + 1)),
    ]
    prompt, ph = apply_prompt_updates([pad, 0, bos, pad, eos, 0, pad], updates, {"audio": 3})
    assert prompt == [*expand(1), 0, *expand(2), 0, *expand(3)]
    assert [(r.offset, r.length) for r in ph["audio"]] == [(0, 3), (4, 4), (9, 5)]


def test_a_positional_update_serves_the_items_left_when_no_placeholder_is() -> None:
    updates = [
        PromptReplacement("image", [5], [50]),
        PromptInsertion("image", PromptIndexTargets.start(), [70]),
    ]
    # Item 0 takes the only 5; items 1 and 2 fall back to inserting at the start.
    prompt, ph = apply_prompt_updates([1, 5, 2], updates, {"image": 3})
    assert prompt == [70, 70, 1, 50, 2]
    assert [r.offset for r in ph["image"]] == [3, 0, 1]


ZERO_WIDTH_TARGETS = {
    "start": PromptIndexTargets.start,
    "end": PromptIndexTargets.end,
    "prefix": lambda: PromptIndexTargets.prefix("hi"),
}


@pytest.mark.parametrize("where", sorted(ZERO_WIDTH_TARGETS))
@pytest.mark.parametrize("count", [0, 1, 2, 3])
@pytest.mark.parametrize("as_ids", [True, False], ids=["token ids", "text"])
def test_a_zero_width_replacement_acts_for_every_item_as_an_insertion_there(
    tok: Tokenizer, where: str, count: int, as_ids: bool
) -> None:
    pad = one(tok, PAD)
    content = lambda i: [pad] * (i + 1)  # noqa: E731  (each item its own length)
    target = ZERO_WIDTH_TARGETS[where]
    text = "hi there"
    prompt = enc(tok, text) if as_ids else text
    replaced, ranges = apply_prompt_updates(
        prompt, [PromptReplacement("image", target(), content)], {"image": count}, tok
    )
    inserted, expected = apply_prompt_updates(
        prompt, [PromptInsertion("image", target(), content)], {"image": count}, tok
    )
    assert (replaced, ranges) == (inserted, expected)
    assert [r.length for r in ranges["image"]] == list(range(1, count + 1))
    # In item order, one after the other, at the one position.
    offsets = [r.offset for r in ranges["image"]]
    assert offsets == [offsets[0] + i * (i + 1) // 2 for i in range(count)]
    assert replaced.count(pad) == sum(range(1, count + 1))  # type: ignore[union-attr]


# --- insertions ---------------------------------------------------------------------------------


def test_insertions_pile_up_in_item_order_after_shared_target() -> None:
    update = PromptInsertion("audio", [3], lambda i: [100 + i] * (i + 1))
    prompt, ph = apply_prompt_updates([1, 3, 2, 3], [update], {"audio": 3})
    assert prompt == [1, 3, 100, 101, 101, 102, 102, 102, 2, 3]
    assert [(r.offset, r.length) for r in ph["audio"]] == [(2, 1), (3, 2), (5, 3)]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (PromptIndexTargets.start(), [8, 8, 1, 2, 3]),
        (PromptIndexTargets.end(), [1, 2, 3, 8, 8]),
        (PromptIndexTargets.prefix([1, 2]), [1, 2, 8, 8, 3]),
    ],
)
def test_insertion_at_index_targets(target: object, expected: list[int]) -> None:
    update = PromptInsertion("image", target, [8])  # type: ignore[arg-type]
    prompt, ph = apply_prompt_updates([1, 2, 3], [update], {"image": 2})
    assert prompt == expected
    assert ph["image"][1].offset == ph["image"][0].offset + 1


def test_prefix_absent_is_no_match() -> None:
    update = PromptInsertion("image", PromptIndexTargets.prefix([9]), [8])
    with pytest.raises(PromptUpdateError, match=r"image item 0: .*prefix"):
        apply_prompt_updates([1, 2], [update], {"image": 1})


def test_insertion_into_empty_prompt() -> None:
    update = PromptInsertion("image", PromptIndexTargets.start(), "<i>")
    assert apply_prompt_updates("", [update], {"image": 1}) == (
        "<i>",
        {"image": [PlaceholderRange(0, 3)]},
    )


def test_insertion_before_a_replacement_at_the_same_position() -> None:
    updates = [
        PromptInsertion("audio", PromptIndexTargets.prefix([1]), [40]),
        PromptReplacement("image", [2], [50, 50]),
    ]
    prompt, ph = apply_prompt_updates([1, 2, 3], updates, {"image": 1, "audio": 1})
    assert prompt == [1, 40, 50, 50, 3]
    assert ph == {"image": [PlaceholderRange(2, 2)], "audio": [PlaceholderRange(1, 1)]}


def test_insertion_inside_a_replaced_span_is_an_error() -> None:
    updates = [
        PromptReplacement("image", [1, 2, 3], [50]),
        PromptInsertion("audio", [1], [40]),  # would land between 1 and 2
    ]
    with pytest.raises(PromptUpdateError, match=r"audio item 0.*image item 0") as info:
        apply_prompt_updates([1, 2, 3], updates, {"image": 1, "audio": 1})
    assert (info.value.modality, info.value.item_index) == ("audio", 0)


# --- errors and validation ----------------------------------------------------------------------


def test_missing_placeholder_names_modality_and_item() -> None:
    update = PromptReplacement("image", [5], [9])
    with pytest.raises(PromptUpdateError, match=r"image item 2: no prompt update matched") as info:
        apply_prompt_updates([5, 5], [update], {"image": 3})
    assert (info.value.modality, info.value.item_index) == ("image", 2)


def test_modality_without_updates() -> None:
    with pytest.raises(PromptUpdateError, match="no prompt update is defined for modality 'video'"):
        apply_prompt_updates([1], [PromptReplacement("image", [1], [2])], {"video": 1})


def test_zero_items_and_unused_updates() -> None:
    update = PromptReplacement("image", [5], [9])
    assert apply_prompt_updates([5], [update], {"image": 0}) == ([5], {"image": []})
    assert apply_prompt_updates([5], [update], {}) == ([5], {})


@pytest.mark.parametrize("count", [-1, 1.5, "2", True])
def test_bad_item_count(count: object) -> None:
    with pytest.raises(PromptUpdateError, match="item count of 'image'"):
        apply_prompt_updates([1], [], {"image": count})  # type: ignore[dict-item]


def test_construction_validates() -> None:
    with pytest.raises(ValueError, match="empty"):
        PromptReplacement("image", [], [1])
    with pytest.raises(ValueError, match="empty"):
        PromptInsertion("image", "", [1])
    with pytest.raises(TypeError):
        PromptReplacement("image", [1.5], [1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="negative"):
        PromptReplacement("image", [1], [-3])
    with pytest.raises(TypeError):
        PromptReplacement("", [1], [1])
    with pytest.raises(TypeError):
        PromptReplacement("image", b"x", [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PromptReplacement or PromptInsertion"):
        apply_prompt_updates([1], [([1], [2])], {"image": 1})  # type: ignore[list-item]


def test_bad_callable_result_names_the_item() -> None:
    update = PromptReplacement("image", [1], lambda i: 3.5)  # type: ignore[arg-type,return-value]
    with pytest.raises(PromptUpdateError, match=r"image item 0: .*returned float") as info:
        apply_prompt_updates([1], [update], {"image": 1})
    assert info.value.item_index == 0


def test_bad_prompt_token_ids() -> None:
    update = PromptReplacement("image", [1], [2])
    with pytest.raises(PromptUpdateError, match="token ids"):
        apply_prompt_updates([1, -4], [update], {"image": 1})
    with pytest.raises(TypeError):
        apply_prompt_updates([1, 2.0], [update], {"image": 1})  # type: ignore[list-item]


def test_text_needs_tokenizer_on_token_prompt() -> None:
    update = PromptReplacement("image", "<image>", [9])
    with pytest.raises(PromptUpdateError, match="needs a tokenizer") as info:
        apply_prompt_updates([1, 2], [update], {"image": 1})
    assert info.value.modality == "image"


def test_content_callables_are_resolved_once_per_item_and_update() -> None:
    calls: list[tuple[str, int]] = []

    def content(name: str) -> object:
        return lambda i: calls.append((name, i)) or [9]

    updates = [
        PromptReplacement("image", [5], content("first")),
        PromptReplacement("image", [6], content("second")),
    ]
    prompt, _ = apply_prompt_updates([5, 6, 5], updates, {"image": 3})
    assert prompt == [9, 9, 9]
    # Every candidate of every item is resolved up front: the resolved updates are what the
    # processor-output cache keeps with each item, before any prompt decides which one wins.
    assert sorted(calls) == sorted((n, i) for n in ("first", "second") for i in range(3))


def test_resolved_updates_apply_like_the_updates_they_come_from(tok: Tokenizer) -> None:
    pad = one(tok, PAD)
    updates = [PromptReplacement("image", [pad], lambda i: [pad] * (2 + i))]
    prompt = enc(tok, f"a {PAD} b {PAD}")
    resolved = resolve_prompt_updates(updates, {"image": 2})
    assert [len(u.content.full) for (u,) in resolved["image"]] == [2, 3]
    assert apply_resolved_updates(prompt, resolved, tok) == apply_prompt_updates(
        prompt, updates, {"image": 2}, tok
    )
    out, ranges = apply_resolved_updates(prompt, resolved, tok)
    assert find_resolved_ranges(out, resolved) == ranges  # type: ignore[arg-type]


def test_items_resolved_in_different_requests_share_one_target() -> None:
    # A cached item (resolved when an earlier request computed it) and a new one: each takes
    # its own occurrence of the shared target, in item order.
    update = lambda n: PromptReplacement("image", [5], [7] * n)  # noqa: E731
    first = resolve_prompt_updates([update(1)], {"image": 1})["image"]
    second = resolve_prompt_updates([update(2)], {"image": 1})["image"]
    prompt, ranges = apply_resolved_updates([5, 0, 5], {"image": [*second, *first]})
    assert prompt == [7, 7, 0, 7]
    assert ranges == {"image": [PlaceholderRange(0, 2), PlaceholderRange(3, 1)]}


# --- embeddings ---------------------------------------------------------------------------------


def test_select_token_id_marks_embed_positions() -> None:
    details = PromptUpdateDetails.select_token_id([10, 11, 11, 12], 11)
    update = PromptReplacement("image", [5], details)
    prompt, ph = apply_prompt_updates([0, 5], [update], {"image": 1})
    assert prompt == [0, 10, 11, 11, 12]
    (rng,) = ph["image"]
    assert rng == PlaceholderRange(1, 4, (False, True, True, False))
    assert (rng.end, rng.embed_count, rng.embed_mask()) == (5, 2, (False, True, True, False))


def test_all_true_mask_is_normalised_to_none() -> None:
    a = PromptReplacement("image", [5], PromptUpdateDetails.select_token_id([11, 11], 11))
    b = PromptReplacement("image", [5], PromptUpdateDetails.from_seq([11, 11]))
    assert apply_prompt_updates([5], [a], {"image": 1}) == apply_prompt_updates(
        [5], [b], {"image": 1}
    )
    rng = PlaceholderRange(0, 2)
    assert (rng.embed_count, rng.embed_mask()) == (2, (True, True))


def test_placeholder_range_validates() -> None:
    with pytest.raises(ValueError):
        PlaceholderRange(-1, 2)
    with pytest.raises(ValueError, match="entries"):
        PlaceholderRange(0, 2, (True,))
    with pytest.raises(AttributeError):
        PlaceholderRange(0, 1).offset = 3  # type: ignore[misc]


# --- text prompts -------------------------------------------------------------------------------


def test_text_prompt_without_tokenizer_counts_characters() -> None:
    update = PromptReplacement("image", "<img>", lambda i: "#" * (i + 2))
    prompt, ph = apply_prompt_updates("a<img>b<img>", [update], {"image": 2})
    assert prompt == "a##b###"
    assert ph == {"image": [PlaceholderRange(1, 2), PlaceholderRange(4, 3)]}


def test_text_prompt_without_tokenizer_rejects_token_ids_and_selection() -> None:
    with pytest.raises(PromptUpdateError, match="needs a tokenizer"):
        apply_prompt_updates("a", [PromptReplacement("image", [1], "x")], {"image": 1})
    update = PromptReplacement("image", "a", PromptUpdateDetails.select_token_id("xx", 3))
    with pytest.raises(PromptUpdateError, match="select_token_id needs a tokenizer"):
        apply_prompt_updates("a", [update], {"image": 1})


def test_text_prompt_with_tokenizer_returns_token_ids(tok: Tokenizer) -> None:
    pad = one(tok, PAD)
    details = PromptUpdateDetails.select_token_id(VS + PAD * 3 + VE, pad)
    update = PromptReplacement("image", PAD, details)
    prompt, ph = apply_prompt_updates(f"hi {PAD} yo", [update], {"image": 1}, tok)
    assert prompt == enc(tok, f"hi {VS}{PAD * 3}{VE} yo")
    assert ph == {"image": [PlaceholderRange(3, 5, (False, True, True, True, False))]}


def test_qwen_style_pad_expansion_on_token_ids(tok: Tokenizer) -> None:
    pad, vs, ve = one(tok, PAD), one(tok, VS), one(tok, VE)
    sizes = [2, 4]
    update = PromptReplacement("image", [pad], lambda i: [pad] * sizes[i])
    ids = enc(tok, f"a {VS}{PAD}{VE} and {VS}{PAD}{VE}.")
    prompt, ph = apply_prompt_updates(ids, [update], {"image": 2}, tok)
    assert prompt == enc(tok, f"a {VS}{PAD * 2}{VE} and {VS}{PAD * 4}{VE}.")
    for rng, size in zip(ph["image"], sizes, strict=True):
        assert prompt[rng.offset - 1] == vs and prompt[rng.end] == ve and rng.length == size


def test_text_prefix_target_on_token_prompt(tok: Tokenizer) -> None:
    update = PromptInsertion("image", PromptIndexTargets.prefix("hi "), [one(tok, PAD)])
    prompt, ph = apply_prompt_updates(enc(tok, "hi there"), [update], {"image": 1}, tok)
    assert prompt == enc(tok, f"hi {PAD}there")
    assert ph == {"image": [PlaceholderRange(3, 1)]}


# --- the text fallback --------------------------------------------------------------------------


def test_fallback_when_tokens_merge_across_the_boundary(tok: Tokenizer) -> None:
    ids = enc(tok, "a<image>b<image>")
    target = enc(tok, "<image>")
    assert len(target) == 1 and target[0] in ids  # the second one tokenizes cleanly ...
    assert ids.count(target[0]) == 1  # ... the first merged with the "a" before it
    pad = one(tok, PAD)
    update = PromptReplacement("image", target, lambda i: PAD * (i + 1))
    with pytest.raises(PromptUpdateError, match="pass a tokenizer"):
        apply_prompt_updates(ids, [update], {"image": 2})
    prompt, ph = apply_prompt_updates(ids, [update], {"image": 2}, tok)
    assert prompt == enc(tok, f"a{PAD}b{PAD}{PAD}")
    assert ph == {"image": [PlaceholderRange(1, 1), PlaceholderRange(3, 2)]}
    assert all(prompt[r.offset] == pad for r in ph["image"])


def test_fallback_from_text_prompt_uses_the_original_text(tok: Tokenizer) -> None:
    update = PromptInsertion("image", "<image>", PromptUpdateDetails.from_seq(VS + VE))
    prompt, ph = apply_prompt_updates("ca<image>!", [update], {"image": 2}, tok)
    assert prompt == enc(tok, f"ca<image>{VS}{VE}{VS}{VE}!")
    assert [(r.offset, r.length) for r in ph["image"]] == [(6, 2), (8, 2)]


def test_fallback_fails_cleanly_when_text_does_not_match_either(tok: Tokenizer) -> None:
    update = PromptReplacement("image", "<image>", PAD)
    with pytest.raises(PromptUpdateError, match="token ids nor the decoded text") as info:
        apply_prompt_updates(enc(tok, "a<image>"), [update], {"image": 2}, tok)
    assert (info.value.modality, info.value.item_index) == ("image", 1)


def test_fallback_content_that_merges_after_retokenizing(tok: Tokenizer) -> None:
    # "<" as content after an "a" becomes part of the token "a<": no such token run survives.
    update = PromptReplacement("image", "<image>", "<")
    with pytest.raises(PromptUpdateError, match="merges with the text") as info:
        apply_prompt_updates(enc(tok, "a<image>"), [update], {"image": 1}, tok)
    assert info.value.item_index == 0


class CountingTokenizer:
    """Wraps a tokenizer and counts calls, to check contents are encoded once per call."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.encodes = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encodes += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.inner.decode(token_ids)


def test_text_contents_are_encoded_once_per_call(tok: Tokenizer) -> None:
    counting = CountingTokenizer(tok)
    assert isinstance(counting, Tokenizer)
    pad = one(tok, PAD)
    update = PromptReplacement("image", PAD, lambda i: VS + PAD * 4 + VE)
    prompt, ph = apply_prompt_updates([pad] * 1000, [update], {"image": 1000}, counting)
    assert counting.encodes == 2  # the target and the (same) content text
    assert len(prompt) == 6000 and ph["image"][-1] == PlaceholderRange(5994, 6)


def test_many_items_sharing_one_target() -> None:
    n = 4000
    rep = PromptReplacement("image", [5], [7, 7])
    prompt, ph = apply_prompt_updates([1, 5] * n, [rep], {"image": n})
    assert len(prompt) == 3 * n and ph["image"][-1] == PlaceholderRange(3 * n - 2, 2)
    ins = PromptInsertion("image", [1], [7])
    prompt, ph = apply_prompt_updates([1, 5], [ins], {"image": n})
    assert prompt == [1, *([7] * n), 5] and ph["image"][-1] == PlaceholderRange(n, 1)


# --- locating applied updates -------------------------------------------------------------------


def test_find_placeholder_ranges_matches_apply() -> None:
    sizes = [3, 1, 2]
    updates = [
        PromptReplacement("image", [5], lambda i: [90, *([91] * sizes[i]), 92]),
        PromptInsertion("audio", PromptIndexTargets.start(), [80, 81]),
    ]
    counts = {"image": 3, "audio": 2}
    prompt, ph = apply_prompt_updates([0, 5, 1, 5, 5, 2], updates, counts)
    assert find_placeholder_ranges(prompt, updates, counts) == ph


def test_find_placeholder_ranges_is_ordered_and_exclusive() -> None:
    # Two items with identical content must get the two distinct occurrences, in order.
    update = PromptReplacement("image", [5], [9, 9])
    found = find_placeholder_ranges([1, 9, 9, 2, 9, 9, 9], [update], {"image": 2})
    assert found == {"image": [PlaceholderRange(1, 2), PlaceholderRange(4, 2)]}


def test_find_placeholder_ranges_reports_missing_item() -> None:
    update = PromptReplacement("image", [5], lambda i: [9] * (i + 2))
    with pytest.raises(PromptUpdateError, match=r"image item 1: .*not in the prompt") as info:
        find_placeholder_ranges([9, 9, 0, 9, 9], [update], {"image": 2})
    assert (info.value.modality, info.value.item_index) == ("image", 1)


def test_find_placeholder_ranges_earliest_candidate_and_text_content(tok: Tokenizer) -> None:
    pad = one(tok, PAD)
    updates = [
        PromptReplacement("image", PAD, PromptUpdateDetails.select_token_id(VS + PAD + VE, pad)),
        PromptInsertion("image", PromptIndexTargets.start(), PAD + PAD),
    ]
    ids = enc(tok, f"{PAD}{PAD}x{VS}{PAD}{VE}")
    found = find_placeholder_ranges(ids, updates, {"image": 2}, tok)
    assert found == {
        "image": [PlaceholderRange(0, 2), PlaceholderRange(3, 3, (False, True, False))]
    }
    with pytest.raises(PromptUpdateError, match="needs a tokenizer"):
        find_placeholder_ranges(ids, updates, {"image": 1})


# --- properties ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    filler=st.lists(st.lists(st.integers(0, 4), max_size=4), min_size=1, max_size=8),
    sizes=st.lists(st.integers(0, 5), max_size=7),
)
def test_apply_then_find_round_trip(filler: list[list[int]], sizes: Sequence[int]) -> None:
    """Replacing marker 5 (one per item) keeps the filler and puts each item where recorded."""
    n = min(len(sizes), len(filler) - 1)
    prompt: list[int] = []
    for i, chunk in enumerate(filler):
        prompt += chunk
        if i < n:
            prompt.append(5)
    update = PromptReplacement("image", [5], lambda i: [8, *([9] * sizes[i]), 8])
    out, ph = apply_prompt_updates(prompt, [update], {"image": n})
    assert [t for t in out if t < 5] == [t for t in prompt if t < 5]
    ranges = ph["image"]
    assert [r.length for r in ranges] == [s + 2 for s in sizes[:n]]
    assert all(out[r.offset : r.end] == [8, *([9] * (r.length - 2)), 8] for r in ranges)
    assert all(a.end <= b.offset for a, b in itertools.pairwise(ranges))
    assert find_placeholder_ranges(out, [update], {"image": n}) == ph


# --- contents whose edges merge with the prompt ------------------------------------------------

BOI, SOFT, EOI = "<boi>", "<soft>", "<eoi>"


@pytest.fixture(scope="module")
def nl_tok() -> Tokenizer:
    """A tiny real BPE tokenizer that tokenizes as Gemma's does at an image's edges: one token for
    every run of up to four newlines (``"\n\n\n"`` is one token), a ``":\n\n"`` that fuses the
    newlines with the text before them, and ``<boi>``, ``<soft>``, ``<eoi>`` as added tokens."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for ch in "abcdefghijklmnopqrstuvwxyz :.\n":
        vocab[ch] = len(vocab)
    merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n"), (":", "\n\n"), ("h", "i")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken(t, special=True) for t in (BOI, SOFT, EOI, "<bos>")])
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def gemma_image(tok: Tokenizer, soft: int = 3) -> PromptReplacement:
    """Gemma 3's update: ``<boi>`` becomes ``"\n\n" <boi> <soft>*n <eoi> "\n\n"``, the newlines
    merging with the prompt around it."""
    boi, s, eoi = one(tok, BOI), one(tok, SOFT), one(tok, EOI)
    details = PromptUpdateDetails.select_token_id([boi, *[s] * soft, eoi], s)
    return PromptReplacement("image", [boi], details.with_merges(before="\n\n", after="\n\n"))


def substituted(text: str, soft: int = 3) -> str:
    """What an HF processor tokenizes: every ``<boi>`` of ``text`` substituted as text."""
    return text.replace(BOI, f"\n\n{BOI}{SOFT * soft}{EOI}\n\n")


def test_the_with_merges_docstring_example_holds(nl_tok: Tokenizer) -> None:
    boi, s, eoi = one(nl_tok, BOI), one(nl_tok, SOFT), one(nl_tok, EOI)
    image = PromptUpdateDetails.select_token_id([boi, *[s] * 3, eoi], s)
    merging = image.with_merges(before="\n\n", after="\n\n")
    update = PromptReplacement("image", [boi], merging)
    ids = nl_tok.encode("user\n<boi>hi", add_special_tokens=False)
    new, ranges = apply_prompt_updates(ids, [update], {"image": 1}, nl_tok)
    words = [nl_tok.decode([t]) for t in new]
    assert words == ["u", "s", "e", "r", "\n\n\n", BOI, SOFT, SOFT, SOFT, EOI, "\n\n", "hi"]
    assert ranges["image"] == [PlaceholderRange(5, 5, (False, True, True, True, False))]


MERGING_PROMPTS = [
    "user\n<boi>describe",  # "\n" + "\n\n": one "\n\n\n"
    "<boi><boi>",  # "\n\n" + "\n\n" between two images: one "\n\n\n\n"
    "<boi> <boi>",  # a space between: "\n\n", " ", "\n\n"
    "look:<boi>\nhi",  # ":" + "\n\n" fuse; "\n\n" + "\n" fuse
    "<bos>a<boi>b<boi>c<bos>d<boi>",  # added tokens bound the text tokenized again
    "<boi>",
    "\n\n\n\n<boi>\n\n\n\n",  # runs longer than any token
    "hi<eoi><boi><eoi>hi",  # added tokens right next to the placeholder
]


@pytest.mark.parametrize("text", MERGING_PROMPTS)
def test_merging_edges_give_the_ids_of_the_substituted_text(nl_tok: Tokenizer, text: str) -> None:
    update, count = gemma_image(nl_tok), text.count(BOI)
    want = enc(nl_tok, substituted(text))
    for prompt in (text, enc(nl_tok, text)):  # a text prompt and a token-id prompt
        new, ranges = apply_prompt_updates(prompt, [update], {"image": count}, nl_tok)
        assert new == want, [nl_tok.decode([t]) for t in new]
        # What an HF processor's own expansion gives is located with the same ranges.
        assert find_placeholder_ranges(want, [update], {"image": count}, nl_tok) == ranges
        soft = one(nl_tok, SOFT)
        embedded = [i for r in ranges["image"] for i, e in enumerate(r.embed_mask(), r.offset) if e]
        assert embedded == [i for i, t in enumerate(want) if t == soft]


def test_a_range_is_the_fixed_part_whatever_the_edges_fused_with(nl_tok: Tokenizer) -> None:
    update = gemma_image(nl_tok, soft=1)
    new, ranges = apply_prompt_updates("hi<boi> <boi>\n", [update], {"image": 2}, nl_tok)
    words = [nl_tok.decode([t]) for t in new]
    assert words == ["hi", "\n\n", BOI, SOFT, EOI, "\n\n", " ", "\n\n", BOI, SOFT, EOI, "\n\n\n"]
    # Both ranges are <boi> <soft> <eoi>, though the second's trailing newlines fused with the
    # prompt's "\n" and the first's did not: an item's length never depends on its neighbours.
    assert ranges["image"] == [
        PlaceholderRange(2, 3, (False, True, False)),
        PlaceholderRange(8, 3, (False, True, False)),
    ]


def test_text_is_tokenized_again_only_as_far_as_the_nearest_added_token(
    nl_tok: Tokenizer,
) -> None:
    # Ids no tokenizer would give ("h", "i" rather than "hi") stay as they were beyond <bos>.
    bos, h, i = one(nl_tok, "<bos>"), enc(nl_tok, "h"), enc(nl_tok, "i")
    boi = one(nl_tok, BOI)
    prompt = [*h, *i, bos, *h, *i, boi, bos, *h, *i]
    new, _ = apply_prompt_updates(prompt, [gemma_image(nl_tok)], {"image": 1}, nl_tok)
    assert new[:3] == [*h, *i, bos] and new[-3:] == [bos, *h, *i]
    assert new[3] == one(nl_tok, "hi")  # next to the edge: tokenized again with it


def test_insertions_with_merging_edges_pile_up_and_fuse(nl_tok: Tokenizer) -> None:
    boi, eoi = one(nl_tok, BOI), one(nl_tok, EOI)
    details = PromptUpdateDetails.from_seq([boi, eoi]).with_merges(before="\n", after="\n")
    update = PromptInsertion("image", PromptIndexTargets.end(), details)
    new, ranges = apply_prompt_updates("hi", [update], {"image": 2}, nl_tok)
    # In item order at the end; the first's trailing "\n" and the second's leading one fuse.
    assert new == enc(nl_tok, f"hi\n{BOI}{EOI}\n\n{BOI}{EOI}\n")
    assert [(r.offset, r.length) for r in ranges["image"]] == [(2, 2), (5, 2)]


def test_the_text_fallback_keeps_merging_edges(nl_tok: Tokenizer) -> None:
    # The target is text whose tokens merged into the prompt ("hi" hides "h" + "i"): matching
    # falls back to the text, and the edges still merge.
    boi, s, eoi = one(nl_tok, BOI), one(nl_tok, SOFT), one(nl_tok, EOI)
    details = PromptUpdateDetails.select_token_id([boi, s, eoi], s).with_merges(after="\n\n")
    update = PromptReplacement("image", "i", details)
    new, ranges = apply_prompt_updates(enc(nl_tok, "hi\n"), [update], {"image": 1}, nl_tok)
    assert new == enc(nl_tok, f"h{BOI}{SOFT}{EOI}\n\n\n")
    assert ranges["image"] == [PlaceholderRange(1, 3, (False, True, False))]


def test_merging_edges_without_a_tokenizer_are_text() -> None:
    details = PromptUpdateDetails.from_seq("[img]").with_merges(before="\n", after="\n")
    new, ranges = apply_prompt_updates(
        "a<i>b", [PromptReplacement("image", "<i>", details)], {"image": 1}
    )
    # Without a tokenizer text is text: the edges go in as they are, and the range counts the
    # fixed part's characters.
    assert new == "a\n[img]\nb"
    assert ranges["image"] == [PlaceholderRange(2, 5)]


def test_a_merging_content_needs_a_fixed_part() -> None:
    with pytest.raises(ValueError, match="fixed part"):
        PromptUpdateDetails.from_seq([]).with_merges(before="\n\n")
    with pytest.raises(TypeError, match="merge_after must be text"):
        PromptUpdateDetails([1], merge_after=[2])  # type: ignore[arg-type]
    plain = PromptUpdateDetails.select_token_id([1, 2], 2)
    assert not plain.merges and plain.with_merges(after="\n").merges
    assert plain.with_merges(after="\n").embed_token_id == 2


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(["a", "hi", " ", "\n", ":", "<bos>", BOI, "."]), max_size=12))
def test_any_prompt_gets_the_ids_of_its_substituted_text(
    nl_tok: Tokenizer, parts: list[str]
) -> None:
    text = "".join(parts)
    count = text.count(BOI)
    update = gemma_image(nl_tok, soft=2)
    want = enc(nl_tok, substituted(text, soft=2))
    new, ranges = apply_prompt_updates(enc(nl_tok, text), [update], {"image": count}, nl_tok)
    assert new == want
    assert find_placeholder_ranges(want, [update], {"image": count}, nl_tok) == ranges


def test_the_docstring_examples_hold() -> None:
    import doctest

    from mmproc.prompt_update import _types

    results = doctest.testmod(_types)
    assert results.attempted >= 10 and results.failed == 0


# --- packaging ----------------------------------------------------------------------------------


def test_import_is_light() -> None:
    code = (
        "import sys, mmproc.prompt_update; "
        "bad = {'torch', 'transformers', 'tokenizers'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
