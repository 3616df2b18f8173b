"""An RGB image's pixels read where Pillow holds them: a view of one memory block, a copy
otherwise, the same pixels either way."""

from __future__ import annotations

import numpy as np
from mmproc.plugin import rgb_pixels, rgbx_pixels
from mmproc.testing import noise_image
from PIL import Image


def test_pixels_in_one_memory_block_are_read_without_a_copy() -> None:
    image = noise_image(1036, 756, seed=1)
    pixels, keep_alive = rgb_pixels(image)
    assert keep_alive is not None and not pixels.flags.owndata
    assert np.array_equal(pixels, np.asarray(image))
    rgbx, _ = rgbx_pixels(image)
    assert rgbx.shape == (756, 1036, 4) and np.array_equal(rgbx[..., :3], np.asarray(image))


def test_pixels_in_several_blocks_are_copied() -> None:
    large = Image.new("RGB", (4000, 3000), (1, 2, 3))  # 48 MB: Pillow holds it in several blocks
    pixels, keep_alive = rgb_pixels(large)
    assert keep_alive is None and pixels.shape == (3000, 4000, 3)
    assert (pixels == (1, 2, 3)).all()


def test_an_image_not_in_rgb_is_copied_as_it_is() -> None:
    grey = noise_image(40, 30, seed=2, mode="L")
    pixels, keep_alive = rgbx_pixels(grey)
    assert keep_alive is None and np.array_equal(pixels, np.asarray(grey))
