"""The preprocessing path and the worker-count rules (pure functions, no threads)."""

from __future__ import annotations

import logging
import types

import _qwen_processor as qwen
import pytest
from mmproc.errors import ConfigurationError
from mmproc.worker_count import (
    DEFAULT_IO_WORKERS,
    IO_WORKERS_ENV,
    WORKERS_ENV,
    PreprocessingPath,
    fast_processor_kwargs,
    preprocessing_path,
    requested_worker_count,
    resolve_io_worker_count,
    resolve_worker_count,
)

make_image_processor = qwen.make_image_processor
make_qwen2_vl_processor = qwen.make_qwen2_vl_processor

CPU = PreprocessingPath.CPU
DEVICE = PreprocessingPath.DEVICE


@pytest.fixture(scope="module")
def pil_processor():
    return make_qwen2_vl_processor("pil")


@pytest.fixture(scope="module")
def torchvision_processor():
    return make_qwen2_vl_processor("torchvision")


# --- the path -----------------------------------------------------------------------------------


def test_pil_backend_is_the_cpu_path_whatever_the_device(pil_processor):
    assert preprocessing_path(pil_processor) is CPU
    # The PIL backend ignores the device: it is CPU work even when a GPU is named.
    assert preprocessing_path(pil_processor, device="cuda") is CPU


def test_torchvision_backend_follows_the_device(torchvision_processor):
    assert preprocessing_path(torchvision_processor) is CPU
    assert preprocessing_path(torchvision_processor, device="cpu") is CPU
    assert preprocessing_path(torchvision_processor, device="cuda") is DEVICE
    assert preprocessing_path(torchvision_processor, device="cuda:1") is DEVICE


def test_torch_device_objects_are_understood(torchvision_processor):
    torch = pytest.importorskip("torch")
    # Building a torch.device needs no GPU.
    assert preprocessing_path(torchvision_processor, device=torch.device("cuda", 0)) is DEVICE
    assert preprocessing_path(torchvision_processor, device=torch.device("cpu")) is CPU


def test_a_bare_fast_image_processor_is_its_own_component():
    fast = make_image_processor("torchvision")
    assert preprocessing_path(fast, device="cuda") is DEVICE
    assert preprocessing_path(make_image_processor("pil"), device="cuda") is CPU


def test_device_none_reads_the_image_processors_own_setting():
    fast = make_image_processor("torchvision")
    holder = types.SimpleNamespace(image_processor=fast)
    assert preprocessing_path(holder, device=None) is CPU  # no device attribute set
    fast.device = "cuda"
    assert preprocessing_path(holder, device=None) is DEVICE


def test_audio_only_model_is_the_cpu_path():
    from transformers import WhisperFeatureExtractor

    audio = types.SimpleNamespace(feature_extractor=WhisperFeatureExtractor(), tokenizer=object())
    assert preprocessing_path(audio, device="cuda") is CPU


def test_a_bare_tokenizer_is_the_cpu_path(pil_processor):
    # Some models load a tokenizer as their "processor".
    assert preprocessing_path(pil_processor.tokenizer, device="cuda") is CPU


def test_an_empty_device_is_a_configuration_error(torchvision_processor):
    with pytest.raises(ConfigurationError, match="device"):
        preprocessing_path(torchvision_processor, device="")


def test_device_kwargs_go_to_fast_processors_only(pil_processor, torchvision_processor):
    assert fast_processor_kwargs(torchvision_processor, "cuda") == {"device": "cuda"}
    assert fast_processor_kwargs(torchvision_processor) == {"device": "cpu"}
    assert fast_processor_kwargs(types.SimpleNamespace(tokenizer=object()), "cuda") == {}


def test_the_device_kwarg_reaches_the_fast_image_processor(torchvision_processor):
    from _qwen_processor import dummy_text, make_image

    kwargs = fast_processor_kwargs(torchvision_processor, "cpu")
    out = torchvision_processor(
        text=dummy_text(1), images=[make_image(64, 48)], return_tensors="pt", **kwargs
    )
    assert out["pixel_values"].device.type == "cpu"


# --- the count ----------------------------------------------------------------------------------


def resolve(**overrides):
    args = {"requested": None, "hint": None, "supports_concurrency": True, "path": CPU}
    args.update(overrides)
    return resolve_worker_count(**args, model="Qwen2VLForConditionalGeneration")


def test_cpu_path_defaults_to_two_workers():
    assert resolve(path=CPU) == 2


def test_cpu_path_takes_the_models_hint():
    assert resolve(path=CPU, hint=3) == 3
    assert resolve(path=CPU, hint=1) == 1


def test_device_path_defaults_to_one_worker():
    assert resolve(path=DEVICE) == 1


def test_device_path_caps_a_count_the_model_declared(caplog):
    with caplog.at_level(logging.INFO, logger="mmproc"):
        assert resolve(path=DEVICE, hint=2) == 1
    assert "capped to 1" in caplog.text


def test_explicit_request_overrides_the_device_cap(caplog):
    with caplog.at_level(logging.WARNING, logger="mmproc"):
        assert resolve(path=DEVICE, hint=1, requested=2) == 2
    # Honoured, but the user is told what the device path measured.
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "serving device" in record.getMessage()


def test_explicit_request_overrides_the_cpu_default_and_hint(caplog):
    with caplog.at_level(logging.WARNING, logger="mmproc"):
        assert resolve(path=CPU, hint=3, requested=1) == 1
        assert resolve(path=CPU, requested=5) == 5
    assert not caplog.records


def test_opt_out_gets_one_worker_whatever_was_asked_with_a_warning_naming_the_model(caplog):
    with caplog.at_level(logging.WARNING, logger="mmproc"):
        assert resolve(supports_concurrency=False, requested=4) == 1
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "Qwen2VLForConditionalGeneration" in record.getMessage()
    assert "instead of 4" in record.getMessage()


def test_opt_out_warns_when_it_takes_the_cpu_default_away(caplog):
    with caplog.at_level(logging.WARNING, logger="mmproc"):
        assert resolve(supports_concurrency=False, path=CPU, hint=3) == 1
    assert "Qwen2VLForConditionalGeneration" in caplog.text


def test_opt_out_on_the_device_path_has_nothing_to_warn_about(caplog):
    with caplog.at_level(logging.WARNING, logger="mmproc"):
        assert resolve(supports_concurrency=False, path=DEVICE) == 1
    assert not caplog.records


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_counts_are_configuration_errors(bad):
    with pytest.raises(ConfigurationError):
        resolve(requested=bad)
    with pytest.raises(ConfigurationError, match="worker_count_hint"):
        resolve(hint=bad)


def test_path_given_as_its_string_value_works():
    assert resolve(path="device") == 1


# --- where the request comes from ---------------------------------------------------------------


def test_the_option_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert requested_worker_count(5) == 5
    assert requested_worker_count(None) == 3


def test_environment_values(monkeypatch):
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert requested_worker_count() is None
    for unset in ("", " auto ", "AUTO"):
        monkeypatch.setenv(WORKERS_ENV, unset)
        assert requested_worker_count() is None
    monkeypatch.setenv(WORKERS_ENV, " 4 ")
    assert requested_worker_count() == 4


@pytest.mark.parametrize("bad", ["two", "0", "-3", "1.5"])
def test_a_bad_environment_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(WORKERS_ENV, bad)
    with pytest.raises(ConfigurationError, match=WORKERS_ENV):
        requested_worker_count()


def test_io_worker_count(monkeypatch):
    monkeypatch.delenv(IO_WORKERS_ENV, raising=False)
    assert resolve_io_worker_count() == DEFAULT_IO_WORKERS == 4
    assert resolve_io_worker_count(hint=8) == 8
    assert resolve_io_worker_count(requested=2, hint=8) == 2
    monkeypatch.setenv(IO_WORKERS_ENV, "6")
    requested = requested_worker_count(None, env=IO_WORKERS_ENV)
    assert resolve_io_worker_count(requested=requested, hint=8) == 6
    with pytest.raises(ConfigurationError):
        resolve_io_worker_count(requested=0)
