"""mmproc.media.audio: audio files decoded (soundfile, PyAV), every audio item converted to the
model's rate and channels (soxr), limits; every bad file a MediaItemError, after which a good one
still parses."""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from mmproc.errors import MediaItemError
from mmproc.hashing import hash_item
from mmproc.inputs import parse_mm_data
from mmproc.media import AudioFormat, MediaLimits, MediaOptions
from mmproc.media.items import AudioItem
from mmproc.testing.samples import encode_audio, encode_video, numbered_frames, tone

LOSSLESS = ["wav", "flac"]
LOSSY = ["ogg", "mp3", "m4a", "aac", "webm"]
TO_16K_MONO = MediaOptions(audio=AudioFormat(sample_rate=16000, mono=True))


def _audio(item: Any, options: MediaOptions | None = None) -> AudioItem:
    parsed = parse_mm_data({"audio": item}, media=options)["audio"]
    assert len(parsed) == 1
    return parsed[0]


def _refused(item: Any, options: MediaOptions | None = None) -> MediaItemError:
    """Parse ``item`` as audio, return the error — once a good file has been seen to parse with
    the same options after it."""
    with pytest.raises(MediaItemError) as info:
        parse_mm_data({"audio": [item]}, media=options)
    assert (info.value.modality, info.value.index) == ("audio", 0)
    assert _audio(encode_audio(tone(0.1, 8000), 8000), options).num_samples > 0
    return info.value


def _similar(a: np.ndarray, b: np.ndarray) -> float:
    """Correlation of two equally long signals (lossy codecs shift and colour them a little)."""
    n = min(a.shape[-1], b.shape[-1])
    return float(np.corrcoef(a[..., :n].ravel(), b[..., :n].ravel())[0, 1])


@pytest.mark.parametrize("fmt", LOSSLESS)
@pytest.mark.parametrize("rate", [8000, 22050, 44100])
@pytest.mark.parametrize("channels", [1, 2])
def test_lossless_files_decode_to_their_samples(fmt: str, rate: int, channels: int) -> None:
    wave = tone(0.5, rate, channels)
    audio = _audio(encode_audio(wave, rate, fmt))
    assert audio.sample_rate == rate
    assert audio.waveform.dtype == np.float32
    assert audio.waveform.shape == wave.shape  # 1-D when mono, channels-first otherwise
    np.testing.assert_allclose(audio.waveform, wave, atol=1e-4)  # 16-bit PCM


@pytest.mark.parametrize("fmt", LOSSY)
@pytest.mark.parametrize("channels", [1, 2])
def test_compressed_files_decode_close_to_their_signal(fmt: str, channels: int) -> None:
    rate = 48000 if fmt == "webm" else 44100  # Opus runs at 48 kHz
    wave = tone(0.5, rate, channels)
    audio = _audio(encode_audio(wave, rate, fmt))
    assert audio.sample_rate == rate
    assert audio.waveform.ndim == wave.ndim
    assert audio.waveform.shape[-1] >= wave.shape[-1] * 0.95
    if fmt in ("ogg", "mp3"):  # no encoder delay left in: the samples line up
        assert _similar(audio.waveform, wave) > 0.95


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3", "m4a", "webm"])
def test_any_file_is_converted_to_the_models_rate_and_channels(fmt: str) -> None:
    rate = 48000 if fmt == "webm" else 44100
    audio = _audio(encode_audio(tone(1.0, rate, 2), rate, fmt), TO_16K_MONO)
    assert audio.sample_rate == 16000
    assert audio.waveform.ndim == 1
    assert audio.waveform.dtype == np.float32
    assert audio.waveform.flags.c_contiguous
    assert audio.duration_s == pytest.approx(1.0, abs=0.05)


def test_downmixing_is_the_mean_of_the_channels() -> None:
    stereo = np.stack([np.full(800, 0.5, np.float32), np.full(800, -0.25, np.float32)])
    audio = _audio((stereo, 8000), MediaOptions(audio=AudioFormat(mono=True)))
    assert audio.sample_rate == 8000
    np.testing.assert_array_equal(audio.waveform, np.full(800, 0.125, np.float32))


def test_resampling_keeps_channels_unless_told_to_downmix() -> None:
    audio = _audio((tone(1.0, 44100, 2), 44100), MediaOptions(audio=AudioFormat(16000)))
    assert audio.waveform.shape == (2, 16000)
    reference = tone(1.0, 16000, 2)
    assert _similar(audio.waveform[0], reference[0]) > 0.99
    assert _similar(audio.waveform[1], reference[1]) > 0.99


def test_a_waveform_already_in_the_models_format_is_not_copied() -> None:
    item = AudioItem(tone(0.1, 16000), 16000)
    assert _audio(item, TO_16K_MONO) is item
    assert _audio(item).waveform is item.waveform


def test_the_same_sound_as_a_file_and_as_a_waveform_hashes_alike() -> None:
    # A float WAV holds the samples exactly: the model receives the same thing either way.
    wave = tone(0.5, 44100, 2)
    buf = io.BytesIO()
    soundfile.write(buf, wave.T, 44100, format="WAV", subtype="FLOAT")
    from_file = _audio(buf.getvalue(), TO_16K_MONO)
    given = _audio((wave, 44100), TO_16K_MONO)
    assert hash_item("audio", from_file) == hash_item("audio", given)
    assert hash_item("audio", from_file) != hash_item("audio", _audio((wave, 44100)))


def test_the_audio_track_of_a_video_file_is_decoded() -> None:
    video = encode_video(numbered_frames(20), audio=(tone(2.0, 22050, 2), 22050))
    audio = _audio(video, TO_16K_MONO)
    assert audio.sample_rate == 16000
    assert audio.duration_s == pytest.approx(2.0, abs=0.1)


def test_a_file_with_the_wrong_extension_is_read_by_its_content(tmp_path: Path) -> None:
    path = tmp_path / "speech.wav"
    path.write_bytes(encode_audio(tone(0.5, 22050), 22050, "mp3"))
    assert _audio(path).sample_rate == 22050


def test_every_encoded_form_gives_the_same_item(tmp_path: Path) -> None:
    import base64

    flac = encode_audio(tone(0.2, 16000), 16000, "flac")
    (tmp_path / "a.flac").write_bytes(flac)
    forms = [
        flac,
        memoryview(flac),
        tmp_path / "a.flac",
        str(tmp_path / "a.flac"),
        "data:audio/flac;base64," + base64.b64encode(flac).decode(),
    ]
    assert len({hash_item("audio", _audio(form)) for form in forms}) == 1


def test_several_audio_files_in_one_request() -> None:
    files = [encode_audio(tone(0.2, rate), rate, "wav") for rate in (8000, 16000, 44100)]
    parsed = parse_mm_data({"audio": files}, media=TO_16K_MONO)["audio"]
    assert [a.sample_rate for a in parsed] == [16000] * 3
    assert [a.num_samples for a in parsed] == [3200] * 3


# --- bad files and limits ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "needle"),
    [
        ("wav", "truncated: the data chunk runs past the end of the file"),
        ("flac", "cannot decode the audio: LibsndfileError"),
        ("ogg", "cannot open the audio: soundfile: LibsndfileError"),
        ("m4a", "cannot open it"),
    ],
)
def test_a_truncated_file_is_refused(fmt: str, needle: str) -> None:
    data = encode_audio(tone(1.0, 22050, 2), 22050, fmt)
    assert needle in _refused(data[: len(data) // 2]).reason


@pytest.mark.parametrize(
    "data", [b"", b"RIFF\x00\x00\x00\x00WAVEjunk", np.random.default_rng(3).bytes(4000)]
)
def test_garbage_is_refused(data: bytes) -> None:
    assert _refused(data).reason.startswith(("empty file", "cannot open", "not a supported"))


def test_a_video_without_sound_is_not_audio() -> None:
    err = _refused(encode_video(numbered_frames(5)))
    assert err.reason == "no audio stream in the file (streams: video)"


def test_audio_longer_than_the_limit_is_refused() -> None:
    limits = MediaOptions(limits=MediaLimits(max_audio_seconds=0.5))
    for fmt in ["wav", "mp3"]:
        err = _refused(encode_audio(tone(1.0, 8000), 8000, fmt), limits)
        assert err.reason.endswith("over the limit of 0.5 s (MediaLimits.max_audio_seconds)")
    err = _refused((tone(1.0, 8000), 8000), limits)
    assert err.reason == "1.0 s is over the limit of 0.5 s (MediaLimits.max_audio_seconds)"


def test_a_file_that_understates_its_length_is_cut_while_decoding() -> None:
    data = encode_audio(tone(1.0, 48000), 48000, "webm")
    # WebM's Segment Duration (element 0x4489, an 8-byte float in ms): claim 0.5 s.
    at = data.index(b"\x44\x89\x88") + 3
    lying = data[:at] + struct.pack(">d", 500.0) + data[at + 8 :]
    err = _refused(lying, MediaOptions(limits=MediaLimits(max_audio_seconds=0.6)))
    assert err.reason == (
        "it decodes to more than the limit of 0.6 s (MediaLimits.max_audio_seconds)"
    )


def test_the_request_decoded_bytes_limit_counts_a_file_as_decoded_and_as_converted() -> None:
    # One second of 44.1 kHz stereo decodes to 352,800 bytes of float32 and becomes 64,000 at
    # 16 kHz mono: both exist at once while it is converted.
    wav = encode_audio(tone(1.0, 44100, 2), 44100, "wav")
    options = MediaOptions(
        audio=AudioFormat(16000, mono=True),
        limits=MediaLimits(max_request_decoded_bytes=500_000),
    )
    assert _audio(wav, options).waveform.nbytes == 64_000
    with pytest.raises(MediaItemError) as info:
        parse_mm_data({"audio": [wav, wav]}, media=options)
    assert (info.value.modality, info.value.index) == ("audio", 1)
    assert "416,800 decoded bytes" in info.value.reason
    assert "(MediaLimits.max_request_decoded_bytes)" in info.value.reason


def test_a_small_file_of_many_channels_at_a_high_rate_is_refused_by_what_it_decodes_to() -> None:
    # 8 channels at 96 kHz for 20 s: a small FLAC of silence, 61 MB of samples once decoded,
    # 1.3 MB once downmixed to 16 kHz mono: the limit must see the 61 MB before decoding.
    flac = encode_audio(np.zeros((8, 96_000 * 20), np.float32), 96_000, "flac")
    assert len(flac) < 200_000
    options = MediaOptions(
        audio=AudioFormat(16000, mono=True),
        limits=MediaLimits(max_request_decoded_bytes=16 << 20),
    )
    err = _refused(flac, options)
    assert "62,720,000 decoded bytes" in err.reason  # 61,440,000 as decoded, 1,280,000 converted


def test_non_finite_samples_in_an_audio_file_are_refused_as_in_a_waveform() -> None:
    samples = tone(0.5, 16000)
    samples[100] = np.nan
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, 16000, format="WAV", subtype="FLOAT")
    assert "NaN or infinite" in _refused(buffer.getvalue()).reason
