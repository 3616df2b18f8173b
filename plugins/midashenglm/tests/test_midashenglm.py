"""The midashenglm plugin: token counts, the feature extractor's values, resampling and
downmixing, the prompt forms, bad audio named, the folder's rules, and audio through the whole
system: from a file, through the pool, the wire and the engine."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import mmproc
import numpy as np
import pytest
import soxr
import torch
from mmproc.engine import prepare_request
from mmproc.plugin import MediaItemError, ProcessorLoadError
from mmproc.testing.samples import encode_audio, tone
from mmproc.wire import RequestReceiver, RequestSender
from mmproc_midashenglm.demo import write_demo_folder
from mmproc_midashenglm.model import AUDIO_PLACEHOLDER
from transformers import Wav2Vec2FeatureExtractor

RATE = 16000


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_folder(tmp_path_factory.mktemp("midashenglm") / "demo")


@pytest.fixture(scope="module")
def processor(folder: Path) -> Iterator[mmproc.Processor]:
    with mmproc.get_processor(folder) as processor:
        yield processor


def clip(seconds: float, rate: int = RATE, channels: int = 1) -> np.ndarray:
    return tone(seconds, rate, channels=channels, hz=330.0)


@pytest.mark.parametrize(
    ("seconds", "tokens"),
    [(0.05, 1), (0.2, 1), (1.0, 5), (2.5, 12), (10.0, 50), (30.0, 150)],
)
def test_each_clip_gets_one_token_per_fifth_of_a_second_and_at_least_one(
    processor: mmproc.Processor, seconds: float, tokens: int
) -> None:
    out = processor.process(AUDIO_PLACEHOLDER, {"audio": [(clip(seconds), RATE)]})
    (feature,) = out.features
    assert feature.placeholder.embed_count == tokens
    # int(1 + L / 160) // 4 // 5 for L samples, clips under 0.2 s padded to 3200 samples first
    samples = max(int(seconds * RATE), 3200)
    assert int(feature.data["audio_length"]) == samples
    assert tokens == max(1, int(1 + samples / 160) // 4 // 5)


def test_input_values_equal_the_feature_extractor_called_directly(
    processor: mmproc.Processor,
) -> None:
    clips = [clip(1.3), clip(0.4), clip(2.0)]
    out = processor.process(AUDIO_PLACEHOLDER * 3, {"audio": [(c, RATE) for c in clips]})
    extractor = Wav2Vec2FeatureExtractor(do_normalize=False)
    want = extractor(clips, sampling_rate=RATE, padding=True, return_tensors="pt")
    values = [f.data["input_values"] for f in out.features]
    assert [v.dtype for v in values] == [torch.float32] * 3
    for got, clip_values in zip(values, clips, strict=True):
        assert torch.equal(got, torch.from_numpy(clip_values))  # each clip's own, unpadded
    joined = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
    assert torch.equal(joined, want["input_values"])  # a batch pads as the extractor pads


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_other_rates_are_resampled_to_16_khz(processor: mmproc.Processor, rate: int) -> None:
    source = clip(2.5, rate)
    out = processor.process(AUDIO_PLACEHOLDER, {"audio": [(source, rate)]})
    (feature,) = out.features
    expected = soxr.resample(source, rate, RATE, quality="HQ").astype(np.float32)
    assert int(feature.data["audio_length"]) == len(expected) == 40000
    assert np.array_equal(feature.data["input_values"].numpy(), expected)
    assert feature.placeholder.embed_count == 12


def test_stereo_is_downmixed_by_the_channel_mean(processor: mmproc.Processor) -> None:
    stereo = np.stack([clip(1.0), -0.5 * clip(1.0)])
    out = processor.process(AUDIO_PLACEHOLDER, {"audio": [(stereo, RATE)]})
    mono = stereo.mean(axis=0).astype(np.float32)
    assert np.allclose(out.features[0].data["input_values"].numpy(), mono, atol=1e-7)


def test_a_bare_audio_token_is_wrapped_and_a_half_wrapped_one_kept_as_the_model_does(
    processor: mmproc.Processor,
) -> None:
    tokenizer = processor.hf_processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids(["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"])
    bos, audio, eos = ids
    prompt = "first <|AUDIO|> then <|audio_bos|><|AUDIO|> and <|audio_bos|><|AUDIO|><|audio_eos|>"
    clips = [(clip(1.0), RATE), (clip(0.6), RATE), (clip(0.4), RATE)]
    out = processor.process(prompt, {"audio": clips})
    reference = processor.hf_processor(
        text=[prompt], audio=[c for c, _ in clips], sampling_rate=RATE
    )
    assert out.prompt_token_ids == reference["input_ids"][0].tolist()
    shapes = []
    for feature in out.features:
        r = feature.placeholder
        span = out.prompt_token_ids[r.offset : r.offset + r.length]
        shapes.append((span[0] == bos, span[-1] == eos, span.count(audio) == r.embed_count))
    # item 0 was bare: wrapped now; item 1 had its bos only; item 2 both
    assert shapes == [(True, True, True), (True, False, True), (True, True, True)]
    assert [f.placeholder.embed_count for f in out.features] == [5, 3, 2]


@pytest.mark.parametrize(
    ("audio", "message"),
    [
        ((np.zeros(0, np.float32), RATE), "empty audio"),
        ((np.array([0.1, np.nan, 0.2], np.float32), RATE), "NaN or infinite"),
        ((np.array([0.1, np.inf] * 2000, np.float32), RATE), "NaN or infinite"),
        ((np.zeros(4000, np.int16), RATE), "integer PCM"),
        ((np.zeros((2, 2, 4000), np.float32), RATE), "is not \\(samples,\\) or \\(channels"),
        ((np.zeros(4000, np.float32), 0), "sample rate must be a positive integer"),
        ((np.zeros(4000, np.float32), "16000"), "sample rate must be a number"),
    ],
    ids=["empty", "nan", "inf", "int16", "3d", "rate_0", "rate_str"],
)
def test_bad_audio_is_named_and_the_processor_keeps_serving(
    processor: mmproc.Processor, audio: tuple, message: str
) -> None:
    good = (clip(0.5), RATE)
    with pytest.raises(MediaItemError, match=rf"audio item 1: .*{message}"):
        processor.process(AUDIO_PLACEHOLDER * 2, {"audio": [good, audio]})
    assert processor.process(AUDIO_PLACEHOLDER, {"audio": [good]}).features


# --- the folder ------------------------------------------------------------------------------


def edited(folder: Path, target: Path, name: str, **changes: object) -> Path:
    shutil.copytree(folder, target)
    path = target / name
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return target


def test_a_folder_whose_extractor_normalises_is_refused(folder: Path, tmp_path: Path) -> None:
    bad = edited(folder, tmp_path / "bad", "preprocessor_config.json", do_normalize=True)
    with pytest.raises(ProcessorLoadError, match=r"do_normalize.*as the model's processor"):
        mmproc.get_processor(bad)


def test_early_uploads_model_type_is_accepted_and_an_unknown_one_named(
    folder: Path, tmp_path: Path
) -> None:
    early = edited(folder, tmp_path / "early", "config.json", model_type="miaudiollm")
    with mmproc.get_processor(early) as processor:
        assert processor.process(AUDIO_PLACEHOLDER, {"audio": [(clip(1.0), RATE)]}).features
    other = edited(folder, tmp_path / "other", "config.json", model_type="qwen2_audio")
    with pytest.raises(ProcessorLoadError, match="model_type 'qwen2_audio'"):
        mmproc.get_processor(other)


def test_config_audio_token_id_must_be_the_tokenizers(folder: Path, tmp_path: Path) -> None:
    bad = edited(folder, tmp_path / "bad", "config.json", audio_token_id=3)
    with pytest.raises(ProcessorLoadError, match="audio_token_id is 3, but the tokenizer"):
        mmproc.get_processor(bad)


# --- the whole system ------------------------------------------------------------------------


def test_an_mp3_file_runs_end_to_end(processor: mmproc.Processor, tmp_path: Path) -> None:
    path = tmp_path / "speech.mp3"
    path.write_bytes(encode_audio(clip(2.0, 44100, channels=2), 44100, format="mp3"))
    out = processor.process(AUDIO_PLACEHOLDER, {"audio": [str(path)]})
    (feature,) = out.features
    samples = int(feature.data["audio_length"])  # 16 kHz mono, about 2 s (mp3 adds padding)
    assert 32000 <= samples <= 34000
    assert feature.placeholder.embed_count == (1 + samples // 160) // 20


def test_audio_goes_from_process_over_the_wire_to_the_engine(
    processor: mmproc.Processor, tmp_path: Path
) -> None:
    clips = [(clip(1.5), RATE), (clip(0.3, 48000), 48000)]
    out = processor.process("<|im_start|>user\n" + AUDIO_PLACEHOLDER * 2, {"audio": clips})
    address = f"ipc://{tmp_path}/engine.sock"
    received: list = []
    with RequestReceiver(address) as receiver:
        ready = threading.Event()

        def engine() -> None:
            ready.set()
            received.append(receiver.recv(timeout=30))

        thread = threading.Thread(target=engine)
        thread.start()
        ready.wait(10)
        with RequestSender(address) as sender:
            sender.send(out.to_engine_request("audio-1"))
            sender.flush(timeout=30)
        thread.join(30)
    (request,) = received
    assert request.prompt_token_ids == out.prompt_token_ids
    inputs = prepare_request(request, device="cpu")
    for sent, prepared in zip(out.features, inputs, strict=True):
        assert prepared["input_values"].dtype == torch.float32  # waveforms are not pixels
        assert torch.equal(prepared["input_values"], sent.data["input_values"])
        assert torch.equal(prepared["audio_length"], sent.data["audio_length"])
    assert [f.hash for f in request.features] == [f.hash for f in out.features]
