"""What the pipeline hands an engine: prompt token ids and one feature per media item."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmproc.prompt_update import PlaceholderRange

if TYPE_CHECKING:
    from mmproc.norm_spec import NormSpec
    from mmproc.wire import EngineRequest

__all__ = ["MultiModalFeature", "ProcessedInputs"]


@dataclass(frozen=True)
class MultiModalFeature:
    """One media item of a processed request.

    ``data`` holds the item's own tensors (e.g. its pixel patches and grid), ``placeholder``
    where its embeddings go in ``prompt_token_ids``, ``hash`` the content hash (the item, the
    model and the options that shape the outputs). ``norm`` is set when the pixels named by it
    are raw uint8 and the engine must normalise them (:class:`mmproc.fused_norm.FusedInputNorm`).
    Tensors may be shared with the cache: treat them as read-only. ``cache_key`` is the key the
    processor's cache keeps the item under ("" when it did not come from a processor).

    A feature from a stand-in (:meth:`mmproc.processor.Processor.keep_stand_ins`) holds meta
    tensors in place of its big ones: it can only go to an engine that holds the item.
    """

    modality: str
    item_index: int
    hash: str
    data: Mapping[str, Any]
    placeholder: PlaceholderRange
    norm: NormSpec | None = None
    cache_key: str = ""


@dataclass(frozen=True)
class ProcessedInputs:
    """What an engine core needs for one request.

    ``prompt_outputs`` holds the model's outputs with one entry per prompt token (its plugin's
    ``get_prompt_outputs`` hook, e.g. ``mm_token_type_ids``), as 1-D torch tensors.
    """

    prompt_token_ids: list[int]
    features: list[MultiModalFeature] = field(default_factory=list)
    prompt_outputs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def placeholders(self) -> dict[str, list[PlaceholderRange]]:
        """Modality -> placeholder ranges in item order."""
        result: dict[str, list[PlaceholderRange]] = {}
        for feature in sorted(self.features, key=lambda f: (f.modality, f.item_index)):
            result.setdefault(feature.modality, []).append(feature.placeholder)
        return result

    def to_engine_request(
        self, request_id: str, params: Mapping[str, Any] | None = None
    ) -> EngineRequest:
        """This request in the wire schema, ready for :class:`mmproc.wire.RequestSender`."""
        import torch

        from mmproc.wire import EngineRequest, WireFeature

        features = []
        for feature in self.features:
            mask = feature.placeholder.is_embed
            features.append(
                WireFeature(
                    modality=feature.modality,
                    item_index=feature.item_index,
                    hash=feature.hash,
                    offset=feature.placeholder.offset,
                    length=feature.placeholder.length,
                    is_embed=None if mask is None else torch.tensor(mask, dtype=torch.bool),
                    data={k: _host_tensor(v) for k, v in feature.data.items()},
                    norm=None if feature.norm is None else feature.norm.to_wire(),
                )
            )
        return EngineRequest(
            request_id,
            list(self.prompt_token_ids),
            features,
            dict(params or {}),
            {name: torch.as_tensor(value).cpu() for name, value in self.prompt_outputs.items()},
        )


def _host_tensor(value: Any) -> Any:
    """``value`` as a tensor the wire can carry. The wire carries host memory: outputs of a
    processor running on a GPU (device="cuda") are copied back here; CPU tensors are not copied,
    and a stand-in's meta tensors stay as they are (they go by reference)."""
    import torch

    tensor = torch.as_tensor(value)
    return tensor if tensor.is_meta else tensor.cpu()
