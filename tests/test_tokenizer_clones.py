"""TokenizerClones: tokenizer copies lent one caller at a time, for cached requests."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from mmproc.tokenizer_clones import TokenizerClones
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(qwen_folder: Path):
    return AutoTokenizer.from_pretrained(str(qwen_folder), local_files_only=True)


def test_the_original_is_lent_first_and_copies_only_when_it_is_busy(tokenizer) -> None:
    clones = TokenizerClones(tokenizer, max_copies=3)
    with clones.borrow() as first:
        assert first is tokenizer
        with clones.borrow() as second:
            assert second is not tokenizer
            assert second("a picture")["input_ids"] == tokenizer("a picture")["input_ids"]
    assert clones.copies == 2
    with clones.borrow() as again:
        assert again in (tokenizer, second)  # returned copies are lent again
    assert clones.copies == 2


def test_a_borrower_beyond_the_bound_waits_for_a_copy_to_come_back(tokenizer) -> None:
    clones = TokenizerClones(tokenizer, max_copies=1)
    got: list[object] = []

    def second_borrower() -> None:
        with clones.borrow() as tok:
            got.append(tok)

    with clones.borrow():
        waiter = threading.Thread(target=second_borrower)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not got  # waiting: the one copy is lent
    waiter.join(30)
    assert got == [tokenizer] and clones.copies == 1


def test_a_bound_below_one_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="max_copies"):
        TokenizerClones(tokenizer, max_copies=0)


def test_while_others_use_the_original_under_their_lock_only_copies_made_under_it_are_lent(
    tokenizer,
) -> None:
    # The other user: a worker pool's synchronous fallback, calling the original processor
    # under its lock (and free to set truncation on its tokenizer meanwhile).
    lock = threading.RLock()
    shared = threading.Event()
    clones = TokenizerClones(tokenizer, max_copies=1, original_lock=lock, shared=shared.is_set)
    with clones.borrow() as alone:
        assert alone is tokenizer  # nobody else uses it yet
    shared.set()
    lent: list[object] = []
    entered = threading.Event()

    def borrower() -> None:
        with clones.borrow() as borrowed:
            lent.append(borrowed)
            entered.set()

    with lock:
        thread = threading.Thread(target=borrower)
        thread.start()
        assert not entered.wait(0.3)  # not lent the original, and not copying it meanwhile
    thread.join(10)
    assert len(lent) == 1 and lent[0] is not tokenizer
    assert clones.copies == 2  # beyond max_copies: the original is not lendable
