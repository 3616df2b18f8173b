"""Bad input never crashes the processor: random garbage requests get mmproc errors only.

Whatever a client sends (random bytes, arrays of odd dtypes and shapes, nested junk, bad prompts,
odd hf_kwargs), the processor answers with an :class:`~mmproc.errors.MmprocError` (or a result),
and the next good request is still served correctly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mmproc.errors import MmprocError
from mmproc.factory import get_processor
from mmproc_qwen_vl.demo import write_qwen2_vl_folder
from PIL import Image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory):
    folder = write_qwen2_vl_folder(tmp_path_factory.mktemp("fuzz") / "qwen")
    with get_processor(folder, backend="pil", cache_bytes=1 << 20) as proc:
        yield proc


arrays = st.builds(
    lambda dtype, shape, seed: np.random.default_rng(seed).integers(0, 255, shape).astype(dtype),
    st.sampled_from(["uint8", "int16", "float32", "float64", "bool", "int64"]),
    st.lists(st.integers(0, 6), min_size=0, max_size=5).map(tuple),
    st.integers(0, 100),
)
good_images = st.builds(
    lambda h, w, seed: Image.fromarray(
        np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ),
    st.integers(1, 64),
    st.integers(1, 64),
    st.integers(0, 100),
)
junk_items = st.one_of(
    good_images,
    good_images,
    st.binary(max_size=64),
    arrays,
    st.text(max_size=20),
    st.integers(),
    st.none(),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.tuples(arrays, st.integers(-5, 48000)),
)
mm_data = st.dictionaries(
    st.sampled_from(["image", "video", "audio", "images", ""]),
    st.one_of(junk_items, st.lists(junk_items, max_size=3)),
    max_size=3,
)
prompts = st.one_of(
    st.integers(0, 3).map(lambda n: "look " + IMAGE * n),
    st.integers(0, 3).map(lambda n: "look " + IMAGE * n),
    st.text(max_size=30).map(lambda t: t + IMAGE),
    st.lists(st.integers(-3, 700), max_size=12),
    st.binary(max_size=8),
    st.none(),
)
hf_kwargs = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from(["do_resize", "patch_size", "size", "nonsense"]),
        st.one_of(st.booleans(), st.integers(-2, 50), st.text(max_size=4)),
        max_size=2,
    ),
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(prompt=prompts, data=mm_data, kwargs=hf_kwargs)
def test_garbage_requests_get_mmproc_errors_only(processor, prompt, data, kwargs) -> None:
    try:
        out = processor.process(prompt, data, hf_kwargs=kwargs)
    except MmprocError as exc:
        event(type(exc).__name__)
    else:
        event("processed")
        assert all(f.placeholder.length > 0 for f in out.features)


def test_the_processor_still_serves_after_the_garbage(processor) -> None:
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    out = processor.process(f"ok {IMAGE}", {"image": [image]})
    ref = processor.hf_processor(text=[f"ok {IMAGE}"], images=[image], return_tensors="pt")
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    assert json.dumps(out.prompt_token_ids)  # plain ints
