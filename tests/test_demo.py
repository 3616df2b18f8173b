"""`mmproc demo`, the main job end to end: preprocess, ship over ipc://, normalise on the engine."""

from __future__ import annotations

import pytest
from mmproc.cli import main


@pytest.mark.parametrize("extra", [[], ["--no-device-normalize", "--workers", "1"]])
def test_demo_runs_end_to_end(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    assert main(["demo", "--requests", "4", *extra]) == 0
    out = capsys.readouterr().out
    assert "4/4 received and prepared by the engine" in out
    assert "cache 2 hits / 4 misses" in out  # the second burst repeats the first's images
    assert ("pixels shipped as float32" if extra else "pixels shipped as uint8") in out
