"""Registration of the flawed test plugins: light, imports no model code.

``tiles`` is a LLaVA-NeXT-style model done right: each image's tiles, padded by the HF processor
to the batch's largest count, are cut to the image's own count. ``tiles_batched`` splits the
padded batch row by row instead, so an item's tiles depend on its batch. ``fixed_deaf`` drops
the caller's per-request ``hf_kwargs``. ``fixed_blank`` returns blank pixels: prompts right,
tensors not what HF gives.
"""

from mmproc.plugin import ModelRegistrar, hookimpl


def _register(
    registry: ModelRegistrar, plugin: str, architecture: str, model: str, demo: str
) -> None:
    registry.register(architecture, f"mmproc_test_flawed.{model}")
    registry.register_demo(
        plugin.replace("_", "-"), f"mmproc_test_flawed.{demo}", description="flawed test model"
    )


class Tiles:
    """Serves TilesForTest right."""

    @staticmethod
    @hookimpl
    def mmproc_register_models(registry):  # type: ignore[no-untyped-def]
        _register(registry, "tiles", "TilesForTest", "tiles:Tiles", "tiles:write_tiles_folder")


class TilesBatched:
    """Serves TilesBatchedForTest, splitting padded tiles row by row."""

    @staticmethod
    @hookimpl
    def mmproc_register_models(registry):  # type: ignore[no-untyped-def]
        _register(
            registry,
            "tiles_batched",
            "TilesBatchedForTest",
            "tiles:TilesBatched",
            "tiles:write_tiles_batched_folder",
        )


class FixedDeaf:
    """Serves FixedDeafForTest, deaf to the caller's hf_kwargs."""

    @staticmethod
    @hookimpl
    def mmproc_register_models(registry):  # type: ignore[no-untyped-def]
        _register(
            registry, "fixed_deaf", "FixedDeafForTest", "fixed:Deaf", "fixed:write_deaf_folder"
        )


class FixedBlank:
    """Serves FixedBlankForTest, with blank pixels."""

    @staticmethod
    @hookimpl
    def mmproc_register_models(registry):  # type: ignore[no-untyped-def]
        _register(
            registry, "fixed_blank", "FixedBlankForTest", "fixed:Blank", "fixed:write_blank_folder"
        )
