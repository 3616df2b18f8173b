"""Gemma 3n through mmproc equals transformers' ``Gemma3nProcessor`` called directly.

The demo folder carries ``google/gemma-3n-E4B-it``'s settings: SigLIP images of 768 x 768 (no
normalisation, ``do_convert_rgb`` null), 256 soft tokens an image, 188 an audio clip, 128 mel bins
at 16 kHz. The reference is built without the plugin; two of mmproc's choices are stated where
they differ from transformers' defaults: images in other modes than RGB are converted (the
reference is called with ``do_convert_rgb=True``), and each audio clip's features are the ones
transformers gives that clip alone (in a batch of clips it gives a shorter one frames that run
past its end into the padding, so they would depend on the batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
import torch
from mmproc.inputs import parse_mm_data
from mmproc.testing import call_hf_processor, noise_image

IMAGE, AUDIO = "<image_soft_token>", "<audio_soft_token>"
FAMILY = "gemma3n"
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


def test_images_of_odd_sizes_and_any_mode_match_transformers_converting_to_rgb(
    gemma: Any, combo: Any
) -> None:
    processor, reference, norm = combo
    shapes = [(1, 1, "L"), (3, 900, "RGBA"), (1000, 7, "LA"), (768, 768, "RGB"), (333, 17, "P")]
    prompt = TURN.format(f"{IMAGE}What is it?")
    for seed, (width, height, mode) in enumerate(shapes):
        image = noise_image(width, height, mode, seed=500 + seed)
        out = processor.process(prompt, {"image": [image]})
        hf = call_hf_processor(reference, prompt, {"image": [image]}, do_convert_rgb=True)
        context = f"{width}x{height} {mode}"
        gemma.assert_like_hf(
            out, hf, "gemma3n", reference.tokenizer, normalised=norm, context=context
        )
        assert out.features[0].data["pixel_values"].shape == (3, 768, 768)


def test_transformers_alone_passes_grayscale_on_with_one_channel(references: Any) -> None:
    # The released config's do_convert_rgb is null: the model would get 1 (or 4) channels.
    for reference in references.values():
        assert reference.image_processor.do_convert_rgb is None
        gray = call_hf_processor(reference, IMAGE, {"image": [noise_image(40, 30, "L")]})
        assert gray["pixel_values"].shape == (1, 1, 768, 768)


@pytest.mark.parametrize("seconds", [0.02, 0.04, 0.3, 1.0, 7.37, 29.99, 30.0])
def test_an_audio_clip_is_188_tokens_and_its_features_are_transformers(
    gemma: Any, processors: Any, references: Any, seconds: float
) -> None:
    prompt = TURN.format(f"{AUDIO}Transcribe.")
    out = gemma.one_clip(processors, references, FAMILY, prompt, seconds, int(seconds * 100))
    (feature,) = out.features
    assert feature.placeholder.embed_count == 188 and feature.placeholder.length == 190


def test_a_clip_over_30_seconds_is_cut_as_transformers_cuts_it_and_the_log_says_so(
    gemma: Any, processors: Any, references: Any, caplog: pytest.LogCaptureFixture
) -> None:
    processor, reference = processors[("pil", False)], references["pil"]
    out = gemma.long_clip(processor, reference, FAMILY, AUDIO, 31.5, caplog)
    first = gemma.tone(31.5, seed=3)[:480000]  # the same clip's first 30 s
    same = processor.process(AUDIO, {"audio": [(first, 16000)]})
    assert torch.equal(
        same.features[0].data["input_features"], out.features[0].data["input_features"]
    )


def test_each_clip_of_several_gets_what_transformers_gives_it_alone(
    gemma: Any, processors: Any, references: Any
) -> None:
    processor, reference = processors[("torchvision", False)], references["torchvision"]
    clips = [(gemma.tone(s, seed=i), 16000) for i, s in enumerate((1.5, 0.25, 3.1))]
    prompt = TURN.format(f"{AUDIO} then {AUDIO}{AUDIO}")
    out = processor.process(prompt, {"audio": clips})
    hf = gemma.hf_with_clips_alone(reference, prompt, {"audio": clips})
    gemma.assert_like_hf(out, hf, "gemma3n", reference.tokenizer)
    # In one batch, transformers gives the 0.25 s clip valid frames past its own end.
    batch = call_hf_processor(reference, prompt, {"audio": clips})
    alone = call_hf_processor(reference, AUDIO, {"audio": [clips[1]]})
    assert int(batch["input_features_mask"][1].sum()) > int(alone["input_features_mask"][0].sum())
    assert out.features[1].data["input_features_mask"].tolist() == (
        alone["input_features_mask"][0].tolist()
    )


def test_images_and_clips_together_match_on_every_path(
    gemma: Any, folder: Path, combo: Any, combo_key: tuple[str, bool]
) -> None:
    processor, reference, norm = combo
    images = [noise_image(640, 480, seed=600), noise_image(30, 90, "L", seed=601)]
    clips = [(gemma.tone(0.8, seed=602), 16000), (gemma.tone(2.2, hz=500, seed=603), 16000)]
    prompt = TURN.format(f"{IMAGE}{AUDIO}\n{AUDIO}and {IMAGE}?")
    mm_data = {"image": images, "audio": clips}
    out = processor.process(prompt, mm_data)
    hf = gemma.hf_with_clips_alone(reference, prompt, mm_data, do_convert_rgb=True)
    gemma.assert_like_hf(out, hf, "gemma3n", reference.tokenizer, normalised=None)
    types = out.prompt_outputs["token_type_ids"].tolist()
    assert types == hf["token_type_ids"][0].tolist()
    assert (types.count(1), types.count(3)) == (512, 376)
    ids = processor.process(reference.tokenizer(prompt)["input_ids"], mm_data)
    assert ids.prompt_token_ids == out.prompt_token_ids
    with mmproc.get_processor(
        folder, backend=combo_key[0], device_normalize=norm, hf_prompt_expansion=True
    ) as expanding:
        expanded = expanding.process(prompt, mm_data)
    assert expanded.prompt_token_ids == out.prompt_token_ids
    assert [f.placeholder for f in expanded.features] == [f.placeholder for f in out.features]
    for a, b in zip(expanded.features, out.features, strict=True):
        assert all(torch.equal(a.data[k], b.data[k]) for k in a.data)


def test_audio_of_another_rate_and_stereo_reaches_the_model_at_16_khz_mono(
    gemma: Any, processors: Any, references: Any
) -> None:
    processor, reference = processors[("torchvision", True)], references["torchvision"]
    stereo = np.stack([gemma.tone(1.3, 44100, seed=8), gemma.tone(1.3, 44100, 660, seed=9)])
    for given in ((stereo, 44100), gemma.wav_url(stereo, 44100)):
        (item,) = parse_mm_data({"audio": [given]}, media=processor.media)["audio"]
        assert (item.sample_rate, item.waveform.ndim) == (16000, 1)
        out = processor.process(AUDIO, {"audio": [given]})
        hf = call_hf_processor(reference, AUDIO, {"audio": [(item.waveform, 16000)]})
        gemma.assert_like_hf(out, hf, "gemma3n", reference.tokenizer)


def test_the_chat_path_gives_what_apply_chat_template_gives(gemma: Any, processors: Any) -> None:
    processor = processors[("pil", False)]
    image = noise_image(120, 80, seed=610)
    clip = gemma.tone(0.9, seed=611)
    url = gemma.wav_url(clip, 16000)
    wav = url.partition(",")[2]
    ours = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": gemma.png_url(image)}},
                {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                {"type": "text", "text": "What do you see and hear?"},
            ],
        }
    ]
    out = gemma.chat_like_hf(processor, FAMILY, ours)
    assert [f.modality for f in out.features] == ["image", "audio"]
