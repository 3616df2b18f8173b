"""mmproc's test kit for plugin authors: tiny local model folders to test against, offline.

``write_qwen2_vl_folder`` and ``write_paddleocr_vl_folder`` write ready-made folders with each
model's real special tokens and preprocessor settings; ``build_tokenizer`` and
``write_model_folder`` build a folder for any other model. Every folder loads with transformers'
Auto classes and ``local_files_only=True``. ``assert_matches_hf`` (in ``conformance``) checks a
processed request against the HF processor called directly on the same inputs.

Importing this package imports transformers and tokenizers (it is a test kit); ``import mmproc``
does not import it.
"""

from __future__ import annotations

from mmproc.testing.conformance import assert_matches_hf
from mmproc.testing.model_folders import (
    DEFAULT_WORDS,
    PADDLEOCR_VL_CHAT_TEMPLATE,
    PADDLEOCR_VL_SPECIAL_TOKENS,
    QWEN2_5_VL_ADDED_TOKENS,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN2_VL_SPECIAL_TOKENS,
    build_tokenizer,
    write_model_folder,
    write_paddleocr_vl_folder,
    write_qwen2_vl_folder,
)

__all__ = [
    "DEFAULT_WORDS",
    "PADDLEOCR_VL_CHAT_TEMPLATE",
    "PADDLEOCR_VL_SPECIAL_TOKENS",
    "QWEN2_5_VL_ADDED_TOKENS",
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN2_VL_SPECIAL_TOKENS",
    "assert_matches_hf",
    "build_tokenizer",
    "write_model_folder",
    "write_paddleocr_vl_folder",
    "write_qwen2_vl_folder",
]
