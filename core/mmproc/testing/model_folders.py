"""Tiny local model folders for tests: a real tokenizer, real preprocessor settings, no weights.

No model hub is reachable where mmproc's tests run, so every test builds the folder it needs. A
folder holds what an engine reads from a hub checkout before it touches weights: ``config.json``
(architecture, model type, the placeholder token ids), ``preprocessor_config.json``, the tokenizer
files and the chat template. The tokenizer is small (a byte-level BPE trained on a few hundred
words) but holds the model's real special tokens, each a single id, so prompt expansion and
placeholder matching behave as they do with the real model.

The kit is generic: `build_tokenizer` and `write_model_folder` make a folder for any model. Each
plugin writes its own model's folders with them (its demo models), with that model's real settings;
the core names no model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BYTE_LEVEL_SPLIT_REGEX",
    "DEFAULT_WORDS",
    "build_tokenizer",
    "resave_with_processor",
    "write_model_folder",
]

BYTE_LEVEL_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""The default pre-tokenizer split of :func:`build_tokenizer`: the usual byte-level BPE split
(contractions, letter runs with one leading non-letter, single digits, punctuation runs, line
breaks, whitespace)."""

# A few hundred everyday words: enough for BPE to learn merges (so words, spaces and punctuation
# merge into multi-byte tokens the way real tokenizers do), small enough to train in milliseconds.
DEFAULT_WORDS: tuple[str, ...] = tuple(
    """
    the a an and or but if then of to in on at by for with from into over under about after before
    is are was were be been being has have had do does did can could will would should may might
    i you he she it we they me him her us them my your his its our their this that these those
    what which who whom whose where when why how all any both each few more most other some such
    no not only own same so than too very just also here there now again once out up down off
    picture image photo video frame describe look see show tell read write find count compare
    cat cats dog dogs bird fish horse cow sheep car bus train plane boat bike street road city
    house room table chair door window wall floor book page text word line letter number sign
    red green blue yellow black white gray brown orange purple pink color light dark bright
    big small large little long short tall wide high low left right top bottom middle center
    man woman child people person face hand head eye eyes hair shirt hat sky cloud sun tree
    water grass flower mountain river sea beach snow rain day night morning evening time year
    one two three four five six seven eight nine ten first second third last next many
    hello world please thank thanks yes answer question what's it's don't there's i'm you're
    """.split()
)


def _training_corpus(words: Sequence[str]) -> list[str]:
    """Sentences over ``words`` so BPE learns both in-word merges and space-prefixed tokens."""
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    # A second pass with a different stride puts each word after a space in another context.
    lines += [" ".join(words[i : i + 7]) + "." for i in range(3, len(words), 7)]
    lines += [f"{word}, {word}?" for word in words[:40]]
    return lines


def build_tokenizer(
    special_tokens: Sequence[str],
    *,
    words: Sequence[str] = DEFAULT_WORDS,
    vocab_size: int = 600,
    named_tokens: Mapping[str, str] | None = None,
    added_tokens: Sequence[str] = (),
    model_max_length: int = 32768,
    pretokenize_regex: str = BYTE_LEVEL_SPLIT_REGEX,
    add_bos_token: bool = False,
) -> PreTrainedTokenizerFast:
    """Build a small real byte-level BPE tokenizer holding ``special_tokens``, each a single id.

    The BPE is trained (with `tokenizers`' `BpeTrainer`) on sentences made of ``words``; being
    byte-level it tokenises any text, and its merges cross the boundary between a word and the
    space before it, as real byte-level BPEs do. Normalisation is NFC, pre-tokenisation
    ``pretokenize_regex`` then byte-level. A tokenizer class that rebuilds its pipeline on load
    (transformers does for some models) must get the split it rebuilds with, so that the folder
    tokenises exactly like the returned object: pass the model's own regex then.

    Args:
        special_tokens: Added as special tokens after the learned vocabulary, in this order, so
            their ids are consecutive and each matches only as a whole.
        words: The training vocabulary.
        vocab_size: Target size of the learned vocabulary (256 byte tokens plus merges).
        named_tokens: Attribute name -> token, e.g. ``{"eos_token": "<|im_end|>",
            "image_token": "<|image_pad|>"}``; each becomes ``tokenizer.<name>`` (and
            ``<name>_id``) and is saved in ``tokenizer_config.json``. Tokens named here that are
            not in ``special_tokens`` are added as special tokens too.
        added_tokens: Tokens added after the special ones as whole, non-special tokens.
        model_max_length: Saved as the tokenizer's maximum length.
        pretokenize_regex: How text is split before the byte-level step.
        add_bos_token: Start every encoding made with ``add_special_tokens=True`` (the default of
            a tokenizer call, and what HF processors use) with the ``bos_token`` of
            ``named_tokens``, as Llama-style tokenizers do. The folder keeps it: the tokenizer
            loads as transformers' generic ``TokenizersBackend`` with this post-processor.

    Returns:
        A transformers fast tokenizer (``PreTrainedTokenizerFast``).
    """
    named = dict(named_tokens or {})
    bad_names = [name for name in named if not name.endswith("_token")]
    if bad_names:
        raise ValueError(f"named token attributes must end in '_token': {bad_names}")
    specials = list(dict.fromkeys([*special_tokens, *named.values()]))
    overlap = set(specials) & set(added_tokens)
    if overlap:
        raise ValueError(f"tokens both special and non-special: {sorted(overlap)}")

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if add_bos_token and "bos_token" not in named:
        raise ValueError("add_bos_token needs a bos_token in named_tokens")
    backend.train_from_iterator(_training_corpus(words), trainer=trainer)
    # normalized=False: a special token must match its exact text, before NFC touches it.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if added_tokens:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    if add_bos_token:
        bos = named["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, backend.token_to_id(bos))],
        )

    extra = [t for t in specials if t not in named.values()]
    # transformers treats any `<name>_token` keyword as a named (model-specific) special token,
    # which is how hub tokenizer configs declare `image_token` and friends.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        extra_special_tokens=extra,
        clean_up_tokenization_spaces=False,
        **named,
    )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_folder(
    path: str | Path,
    *,
    architecture: str,
    model_type: str,
    tokenizer: PreTrainedTokenizerFast,
    preprocessor_config: Mapping[str, Any],
    processor_config: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
    chat_template_file: Literal["json", "jinja"] = "json",
    extra_config: Mapping[str, Any] | None = None,
    video_preprocessor_config: Mapping[str, Any] | None = None,
    tokenizer_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a model folder in the hub's layout and return its path (created if missing).

    ``config.json`` must be a config transformers can load when the plugin relies on its Auto
    classes (the default ``load_hf_processor``): ``model_type`` one transformers knows, whose
    processor reads the files written here. A model transformers does not know (remote code) gets
    the model type its hub folder has, and its plugin reads the folder's JSON files itself.

    Files: ``config.json`` (``architectures``, ``model_type`` and ``extra_config``, which is where
    token ids such as ``image_token_id`` go), ``preprocessor_config.json``, ``tokenizer.json`` and
    ``tokenizer_config.json`` (from ``tokenizer.save_pretrained``, then updated with
    ``tokenizer_config``, e.g. ``{"tokenizer_class": "Qwen2Tokenizer"}``), the chat template as
    ``chat_template.json`` (``{"chat_template": ...}``, the older hub form) or
    ``chat_template.jinja``, and, when given, ``processor_config.json`` and
    ``video_preprocessor_config.json``.
    """
    if chat_template_file not in ("json", "jinja"):
        raise ValueError(
            f"chat_template_file must be 'json' or 'jinja', not {chat_template_file!r}"
        )
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)

    config = {"architectures": [architecture], "model_type": model_type, **(extra_config or {})}
    _write_json(folder / "config.json", config)
    _write_json(folder / "preprocessor_config.json", preprocessor_config)
    if processor_config is not None:
        _write_json(folder / "processor_config.json", processor_config)
    if video_preprocessor_config is not None:
        _write_json(folder / "video_preprocessor_config.json", video_preprocessor_config)

    tokenizer.save_pretrained(folder)
    if tokenizer_config:
        config_path = folder / "tokenizer_config.json"
        saved = json.loads(config_path.read_text(encoding="utf-8"))
        saved.update(tokenizer_config)
        _write_json(config_path, saved)

    if chat_template is not None:
        if chat_template_file == "json":
            _write_json(folder / "chat_template.json", {"chat_template": chat_template})
        else:
            (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return folder


def resave_with_processor(folder: str | Path, path: str | Path) -> Path:
    """Load ``folder``'s processor with ``AutoProcessor``, ``save_pretrained`` it to ``path`` and
    copy ``config.json``: the layout a folder has after a round trip through transformers (e.g.
    ``processor_config.json`` instead of ``preprocessor_config.json``)."""
    from transformers import AutoProcessor

    source, target = Path(folder), Path(path)
    processor = AutoProcessor.from_pretrained(source, local_files_only=True)
    target.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(target)
    # save_pretrained writes the processor only; a model folder also has the model's config.
    (target / "config.json").write_bytes((source / "config.json").read_bytes())
    return target
