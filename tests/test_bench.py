"""`mmproc bench`: latency, throughput, cache and wire figures for a model, as a table or JSON."""

from __future__ import annotations

import json

import pytest
from mmproc.cli import main

SMALL = ["--model", "demo:qwen2-vl", "--requests", "3", "--callers", "2", "--size", "64x48"]


def test_bench_reports_every_worker_count_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *SMALL, "--workers", "1", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"].startswith("demo model demo:qwen2-vl from plugin qwen_vl")
    assert report["architecture"] == "Qwen2VLForConditionalGeneration"
    assert report["plugin"] == "qwen_vl"
    assert (report["modality"], report["item"], report["requests"]) == ("image", "64x48", 3)
    assert [row["workers"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["path"] == "cpu"
        assert row["device_normalize"] is True
        assert 0 < row["latency_p50_ms"] <= row["latency_p95_ms"]
        assert row["throughput_rps"] > 0
    assert report["cache"]["cache_hit_p50_ms"] > 0
    assert report["cache"]["cache_id_hit_p50_ms"] > 0
    assert report["cache"]["cache_miss_p50_ms"] > 0
    wire = report["wire"]
    assert wire["wire_frames"] >= 1 and wire["wire_bytes"] > 0
    assert wire["encode_request_us"] > 0 and wire["decode_request_us"] > 0


def test_bench_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *SMALL, "--workers", "1", "--no-device-normalize"]) == 0
    out = capsys.readouterr().out
    assert "image items of 64x48, float32" in out
    assert "workers    p50 ms    p95 ms     req/s  vs first  path" in out
    assert "1.00x  cpu" in out
    assert "hit" in out and "by caller id" in out and "wire: " in out


def test_bench_measures_video(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", *SMALL, "--workers", "1", "--modality", "video", "--frames", "2", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["modality"], report["item"]) == ("video", "2x64x48")


@pytest.mark.parametrize(
    ("modality", "extra", "item"),
    [
        ("image", [], "64x48 as PNG"),
        ("video", ["--frames", "2", "--size", "63x47"], "2x63x47 as mp4"),
        ("audio", ["--seconds", "1"], "1 s as WAV"),
    ],
)
def test_bench_sends_items_as_files_with_encoded(
    capsys: pytest.CaptureFixture[str], modality: str, extra: list[str], item: str
) -> None:
    model = "demo:midashenglm" if modality == "audio" else "demo:qwen2-vl"
    args = [*SMALL, "--model", model, "--workers", "1", "--modality", modality, *extra]
    assert main(["bench", *args, "--encoded", "--stages", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["item"] == item
    assert report["stages"]["miss_ms"]["decode"] > 0  # a miss decodes the file
    assert report["cache"]["cache_hit_p50_ms"] < report["cache"]["cache_miss_p50_ms"]


def test_bench_errors_name_what_was_wrong(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--size", "64"])
    assert exited.value.code == 2
    assert "size must be WIDTHxHEIGHT, got '64'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--workers", "0"])
    assert "expected a positive integer, got '0'" in capsys.readouterr().err
    assert main(["bench", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # a modality the model does not take: said so, not a traceback
    assert main(["bench", *SMALL, "--workers", "1", "--modality", "audio", "--seconds", "1"]) == 2
    assert "takes no audio items; it takes image, video" in capsys.readouterr().err


def test_bench_passes_other_options_to_the_processor(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", *SMALL, "--workers", "1", "--option", "hash_algorithm=xxh3", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["workers"] == 1
    assert main(["bench", *SMALL, "--workers", "1", "--option", "hash_algo=xxh3"]) == 2
    assert "did you mean 'hash_algorithm'" in capsys.readouterr().err
    assert main(["bench", *SMALL, "--option", "workers=3"]) == 2
    assert "sets workers itself: give the counts to measure with --workers" in (
        capsys.readouterr().err
    )
    assert main(["bench", *SMALL, "--option", "cache_bytes=0"]) == 2
    assert "sets cache_bytes itself: off for the latency" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--option", "novalue"])
    assert "option must be KEY=VALUE" in capsys.readouterr().err
    assert main(["bench", *SMALL, "--backend", "pil", "--option", "backend=torchvision"]) == 2
    assert "backend given twice" in capsys.readouterr().err


def test_bench_lists_the_demo_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    assert "demo:qwen2-vl" in capsys.readouterr().out


def test_bench_stages_break_a_miss_and_a_hit_down_next_to_the_bare_hf_call(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mmproc.stages import STAGES

    assert main(["bench", *SMALL, "--workers", "1", "--stages", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    miss, hit = stages["miss_ms"], stages["hit_ms"]
    assert set(miss) == set(hit) == {*STAGES, "total"}
    assert miss["hf_call"] > 0 and miss["hash"] > 0 and miss["cache_insert"] > 0
    assert hit["hf_call"] == hit["split"] == hit["cache_insert"] == 0  # a hit runs no HF call
    assert hit["tokenize"] > 0 and hit["expand"] > 0
    assert stages["bare_hf_call_ms"] > 0
    assert main(["bench", *SMALL, "--workers", "1", "--stages"]) == 0
    table = capsys.readouterr().out
    for stage in STAGES:
        assert f"\n{stage:<15} " in table
    assert "bare HF call (process_mm_data on the caller's thread, outputs kept" in table


def test_bench_stages_decide_the_overhead_target_from_the_median_of_several_samples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import statistics

    args = ["bench", *SMALL, "--workers", "1", "--stages", "--samples", "3"]
    assert main([*args, "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    samples = stages["overhead_samples_ms"]
    assert len(samples) == 3
    assert stages["overhead_ms"] == statistics.median(samples)
    assert stages["overhead_target_met"] == (stages["overhead_ms"] <= stages["overhead_target_ms"])
    assert stages["requests"] == 3 * 8  # every sample a whole pass over the 8 items
    assert main(args) == 0
    assert "over it, the median of 3 samples (" in capsys.readouterr().out
    assert main(["bench", *SMALL, "--workers", "1", "--stages", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["stages"]["overhead_samples_ms"]) == 5
    with pytest.raises(SystemExit):
        main(["bench", "--samples", "0"])
    assert "expected a positive integer, got '0'" in capsys.readouterr().err
