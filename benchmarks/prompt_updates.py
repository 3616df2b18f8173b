"""Benchmark of mmproc.prompt_update: cost against item count and prompt length.

Run: ``.venv/bin/python benchmarks/prompt_updates.py``. Prints one table: 1,000 vs 4,000 items
sharing one target (replacements and insertions; linear means a ratio near 4, the bar is < 6),
a 10,000-token prompt with nothing to match, and the text fallback (tokens merged across the
target's boundary). Times are CPU milliseconds, the best of several runs.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from mmproc.errors import PromptUpdateError
from mmproc.prompt_update import (
    PromptInsertion,
    PromptReplacement,
    Tokenizer,
    apply_prompt_updates,
    find_placeholder_ranges,
)

PAD, VS, VE = 151655, 151652, 151653  # Qwen2-VL's ids for <|image_pad|>, vision start / end
CONTENT_TOKENS = 16


def best_ms(fn: Callable[[], object], repeat: int = 9) -> float:
    """The fastest of ``repeat`` runs, in CPU milliseconds of this process.

    CPU time rather than wall time, so other work on a shared machine skews the ratios less.
    """
    fn()  # warm-up: first-call costs (imports, caches) are not what is measured
    gc.collect()
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def replacements(n: int) -> Callable[[], object]:
    prompt = [1, 2, 3, VS, PAD, VE] * n
    update = PromptReplacement("image", [PAD], lambda i: [PAD] * CONTENT_TOKENS)
    return lambda: apply_prompt_updates(prompt, [update], {"image": n})


def insertions(n: int) -> Callable[[], object]:
    prompt = [1, 2, 3] * 100 + [VS]
    update = PromptInsertion("image", [VS], lambda i: [PAD] * CONTENT_TOKENS)
    return lambda: apply_prompt_updates(prompt, [update], {"image": n})


def locate(n: int) -> Callable[[], object]:
    sizes = [CONTENT_TOKENS + i % 3 for i in range(n)]
    update = PromptReplacement("image", [PAD], lambda i: [VS, *([PAD] * sizes[i]), VE])
    prompt, _ = apply_prompt_updates([1, 2, PAD] * n, [update], {"image": n})
    return lambda: find_placeholder_ranges(prompt, [update], {"image": n})


def no_match(tokenizer: Tokenizer | None) -> Callable[[], object]:
    prompt = [(i * 7919) % 1000 + 2000 for i in range(10_000)]  # no PAD anywhere
    update = PromptReplacement("image", [PAD], [PAD] * CONTENT_TOKENS)

    def run() -> None:
        try:
            apply_prompt_updates(prompt, [update], {"image": 1}, tokenizer)
        except PromptUpdateError:
            return
        raise AssertionError("expected no match")

    return run


def adversarial() -> Callable[[], object]:
    # Every position starts a near-match: naive first-token scanning would be O(n * m).
    prompt = [5] * 10_000 + [6]
    update = PromptReplacement("image", [5] * 200 + [6], [PAD])
    return lambda: apply_prompt_updates(prompt, [update], {"image": 1})


def tiny_tokenizer() -> Tokenizer:
    """A BPE tokenizer where ``a<image>`` merges into ``a<`` ... and hides the target."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for ch in "abcdefghijklmnopqrstuvwxyz <>.,!?#":
        vocab[ch] = len(vocab)
    merges = [("a", "<"), ("<", "i"), ("m", "a"), ("g", "e"), ("<i", "ma")]
    merges += [("<ima", "ge"), ("<image", ">")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    raw.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def fallback(n: int, tokenizer: Tokenizer) -> Callable[[], object]:
    prompt = tokenizer.encode("xa<image>y " * n, add_special_tokens=False)
    update = PromptReplacement("image", "<image>", "#" * CONTENT_TOKENS)
    return lambda: apply_prompt_updates(prompt, [update], {"image": n}, tokenizer)


def main() -> None:
    """Run every case and print the table."""
    tokenizer = tiny_tokenizer()
    rows: list[tuple[str, float, float | None]] = []
    for name, case in (
        ("replacements, one shared target", replacements),
        ("insertions, one shared target", insertions),
        ("find_placeholder_ranges", locate),
    ):
        small, large = best_ms(case(1000)), best_ms(case(4000))
        rows.append((f"{name}: 1,000 items", small, None))
        rows.append((f"{name}: 4,000 items", large, large / small))
    rows.append(("10,000 tokens, nothing to match", best_ms(no_match(None)), None))
    rows.append(
        ("10,000 tokens, nothing to match, + text retry", best_ms(no_match(tokenizer)), None)
    )
    rows.append(("10,000 tokens, adversarial near-matches", best_ms(adversarial()), None))
    small, large = best_ms(fallback(250, tokenizer)), best_ms(fallback(1000, tokenizer))
    rows.append(("text fallback (merged tokens): 250 items", small, None))
    rows.append(("text fallback (merged tokens): 1,000 items", large, large / small))

    width = max(len(name) for name, _, _ in rows)
    print(f"{'case':<{width}}  {'CPU ms':>9}  {'ratio':>6}")
    print("-" * (width + 19))
    for name, ms, ratio in rows:
        shown = f"{ratio:6.2f}" if ratio is not None else ""
        print(f"{name:<{width}}  {ms:9.3f}  {shown:>6}")


if __name__ == "__main__":
    main()
