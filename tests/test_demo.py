"""`mmproc demo`, the main job end to end: preprocess, ship over ipc://, normalise on the engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mmproc.cli import main


@pytest.mark.parametrize("extra", [[], ["--no-device-normalize", "--workers", "1"]])
def test_demo_runs_end_to_end(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    assert main(["demo", "--model", "demo:qwen2-vl", "--requests", "4", *extra]) == 0
    out = capsys.readouterr().out
    assert "model: demo model demo:qwen2-vl from plugin qwen_vl" in out
    assert "4/4 received and prepared by the engine" in out
    assert "cache 2 hits / 4 misses" in out  # the second burst repeats the first's images
    assert ("no uint8 pixels" if extra else "; uint8 pixels") in out


def test_demo_runs_on_another_plugins_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", "demo:paddleocr-vl", "--requests", "2"]) == 0
    out = capsys.readouterr().out
    assert "PaddleOCRVLForConditionalGeneration" in out
    assert "2/2 received and prepared by the engine" in out


def test_demo_lists_the_demo_models_of_the_installed_plugins(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out
    assert "demo:qwen2-vl  " in out and "(plugin qwen_vl)" in out
    assert "demo:paddleocr-vl" in out


def test_an_unknown_demo_model_lists_the_ones_there_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--model", "demo:qwen9"]) == 2
    err = capsys.readouterr().err
    assert "no demo model 'qwen9'" in err and "demo:qwen2-vl" in err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_with_no_plugin_installed_demo_and_bench_say_so_in_one_line(command: str) -> None:
    env = {**os.environ, "MMPROC_PLUGINS": ""}  # an empty allow-list: no plugin at all
    result = subprocess.run(
        [sys.executable, "-m", "mmproc.cli", command], capture_output=True, text=True, env=env
    )
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "no installed plugin offers a demo model" in lines[0]
