"""mmproc's test kit for plugin authors: tiny local model folders to test against, offline.

``build_tokenizer`` and ``write_model_folder`` build a folder for any model: a small real
tokenizer holding the model's special tokens, and its real preprocessor settings. Every folder
loads with transformers' Auto classes and ``local_files_only=True``. ``assert_matches_hf`` (in
``conformance``) checks a processed request against the HF processor called directly on the same
inputs (``call_hf_processor``), on synthetic media (``noise_image``, ``media_items``). The kit
names no model: each plugin writes its own model's folders with it.

The conformance suite is :class:`mmproc.testing.suite.PluginConformance` (a pytest base class);
mmproc's pytest plugin (:mod:`mmproc.testing.pytest_plugin`) adds fixtures for plugin tests.

Importing this package imports transformers and tokenizers (it is a test kit); ``import mmproc``
does not import it.
"""

from __future__ import annotations

from mmproc.testing.conformance import assert_matches_hf
from mmproc.testing.media import call_hf_processor, media_items, noise_image, noise_video
from mmproc.testing.model_folders import (
    BYTE_LEVEL_SPLIT_REGEX,
    DEFAULT_WORDS,
    build_tokenizer,
    resave_with_processor,
    write_model_folder,
)

__all__ = [
    "BYTE_LEVEL_SPLIT_REGEX",
    "DEFAULT_WORDS",
    "assert_matches_hf",
    "build_tokenizer",
    "call_hf_processor",
    "media_items",
    "noise_image",
    "noise_video",
    "resave_with_processor",
    "write_model_folder",
]
