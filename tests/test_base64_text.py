"""Strict base64 decoding: the standard library's rule and errors, pybase64's speed."""

from __future__ import annotations

import base64
import binascii
import random

import pytest
from mmproc.base64_text import decode_base64

# Seeded, so every collection (each xdist worker's too) names the same cases.
_bytes = random.Random(0).randbytes
VALID = [base64.b64encode(_bytes(n)).decode() for n in (0, 1, 2, 3, 4, 5, 64, 1000, 100_001)]
INVALID = ["aGVsbG8", "aGVs\nbG8=", "aGVsbG8 ", "aGVsbG8==", "a", "aGVs$G8=", "aGVsbG8\u00e9"]


@pytest.mark.parametrize("text", VALID)
def test_valid_base64_decodes_as_the_standard_library_decodes_it(text: str) -> None:
    assert decode_base64(text) == base64.b64decode(text, validate=True)
    assert decode_base64(text.encode()) == base64.b64decode(text, validate=True)


@pytest.mark.parametrize("text", INVALID)
def test_invalid_base64_is_refused_with_the_standard_librarys_error(text: str) -> None:
    with pytest.raises((binascii.Error, ValueError)) as expected:
        base64.b64decode(text, validate=True)
    with pytest.raises(type(expected.value)) as refused:
        decode_base64(text)
    assert str(refused.value) == str(expected.value)
