"""An RGB image's pixels read where Pillow holds them: a view of one memory block, a copy
otherwise, the same pixels either way; and an image made over memory that is already there,
which keeps that memory mapped for as long as it lives."""

from __future__ import annotations

from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest
from mmproc.media.pillow_pixels import borrowed_image, still_borrowed
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


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_a_borrowed_image_is_the_memory_it_was_made_over_and_keeps_it_mapped(mode: str) -> None:
    given = noise_image(37, 23, seed=3, mode=mode)
    stored = rgbx_pixels(given)[0] if mode == "RGB" else np.asarray(given)  # Pillow's layout
    block = SharedMemory(create=True, size=stored.nbytes + 64)
    try:
        block.buf[64:] = stored.tobytes()
        image, token = borrowed_image(block.buf[64:], mode, given.size)  # type: ignore[misc]
        assert (image.mode, image.size, image.readonly) == (mode, given.size, 1)
        assert np.array_equal(np.asarray(image), np.asarray(given))
        block.buf[64] = (int(stored.flat[0]) + 1) % 256
        assert np.asarray(image).flat[0] == (int(stored.flat[0]) + 1) % 256  # no copy
        assert still_borrowed(token)
        with pytest.raises(BufferError):  # the block stays mapped while the image holds it
            block.close()
        del image
        assert not still_borrowed(token)
        block.close()
    finally:
        block.unlink()


def test_memory_that_does_not_fit_an_image_gives_none_to_copy_instead() -> None:
    four_by_three = bytearray(4 * 3 * 4)
    assert borrowed_image(memoryview(bytes(four_by_three)), "RGB", (4, 3)) is None  # read-only
    assert borrowed_image(memoryview(four_by_three), "RGB", (4, 2)) is None  # the wrong size
    assert borrowed_image(memoryview(four_by_three), "LA", (4, 6)) is None  # another layout
    assert borrowed_image(memoryview(four_by_three), "RGB", (4, 3)) is not None
