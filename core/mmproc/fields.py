"""Fields: how each key of a batched HF processor output splits into per-item values.

An HF processor called on N items of a modality returns batched outputs; the cache and the engine
want them per item. A model describes every output key with one field spec:

:class:`BatchedField`
    One row per item along dim 0 (``image_grid_thw``: ``(N, 3)``). Item ``i`` gets ``value[i]``,
    the row without the batch dimension; :func:`join_items` stacks rows back.
:class:`FlatField`
    Items concatenated along ``dim`` with a per-item row count (``pixel_values``: ``(sum_i t*h*w,
    C*P*P)``). The sizes are given, computed by a callable from the outputs, or taken from a grid
    key: ``FlatField.from_grid("image", "image_grid_thw")`` gives item ``i``
    ``prod(image_grid_thw[i]) // divisor`` rows. Item values are views (``Tensor.split``, numpy
    slicing), never copies; :func:`join_items` concatenates them back.
:class:`PaddedField`
    One row per item, padded along ``dim`` to the batch's longest (``input_values`` of audio:
    ``(N, samples)``; LLaVA-OneVision's ``pixel_values``: ``(N, max_tiles, C, H, W)``). Item
    ``i`` gets its row cut to its own length, so an item does not depend on its batch; the
    lengths come from another output (``length_key="audio_length"``) or from ``lengths=`` (a
    sequence, or a callable of the whole outputs dict, as ``FlatField``'s ``sizes=``).
    :func:`join_items` pads them back.
:class:`SharedField`
    One value shared by every item of the modality; each item holds the same object and
    :func:`join_items` takes the first.

Writing your own field: subclass :class:`FieldSpec` (a frozen dataclass, like the ones here)
with a ``modality`` attribute and two methods, which the pipeline and the cache rely on:

``split(key, value, count, outputs) -> list``
    ``count`` per-item values of the batched ``value`` of output ``key``, in item order.
    ``outputs`` is the whole output dict, to read sizes or lengths from. An item's value must not
    depend on the other items of its batch (the cache serves it later in other batches), and
    should be a view, not a copy, where the layout allows. With ``count == 0`` the value must
    hold nothing for the modality (return ``[]``). Raise :class:`~mmproc.errors.FieldSpecError`
    naming ``key``, the modality and the numbers when the value does not fit.
``join(key, values) -> value``
    The batched value of per-item ``values`` (from one batch or from several: cached items come
    from earlier calls), as the HF processor would give it for those items together:
    ``split`` then ``join`` gives the value back, and ``join`` then ``split`` gives the items
    back. ``assert_matches_hf`` compares mmproc's items with HF's outputs through ``join``.

Values may be torch tensors, numpy arrays or lists. torch is never imported here unless a value
already is a tensor.

:func:`split_outputs` checks that the spec covers every output key (less ``ignore``: the keys the
pipeline handles itself, like ``input_ids``) and that row counts add up, raising
:class:`~mmproc.errors.FieldSpecError` with the key, modality and numbers otherwise.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmproc._torch import is_torch_tensor
from mmproc.errors import FieldSpecError

__all__ = [
    "DEFAULT_IGNORED_KEYS",
    "BatchedField",
    "FieldSpec",
    "FlatField",
    "PaddedField",
    "SharedField",
    "join_items",
    "prompt_ids_row",
    "split_outputs",
]

DEFAULT_IGNORED_KEYS: frozenset[str] = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}
)
"""Output keys of the text side that the pipeline handles itself (a convenient ``ignore``)."""

SizesFn = Callable[[Mapping[str, Any]], Sequence[int]]


def _length(value: Any, dim: int, key: str, modality: str) -> int:
    if is_torch_tensor(value) or isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise FieldSpecError(f"{key!r} ({modality}): a 0-d value has no rows to split")
        return int(value.shape[dim])
    if isinstance(value, list | tuple):
        if dim != 0:
            raise FieldSpecError(f"{key!r} ({modality}): a list can only be split along dim 0")
        return len(value)
    raise FieldSpecError(
        f"{key!r} ({modality}): cannot split a {type(value).__name__}; expected a tensor, an array "
        "or a list (or declare the key a SharedField)"
    )


class FieldSpec(ABC):
    """How one output key splits per item of ``modality``: the base of every field.

    Subclass it for a layout the built-in fields do not cover; the contract of :meth:`split`
    and :meth:`join` is in the module docs (items independent of their batch, ``join`` the
    inverse of ``split``, :class:`~mmproc.errors.FieldSpecError` naming the key on a mismatch).
    """

    modality: str

    @abstractmethod
    def split(self, key: str, value: Any, count: int, outputs: Mapping[str, Any]) -> list[Any]:
        """Return ``count`` per-item values of ``value`` (``outputs`` is the whole output dict)."""

    @abstractmethod
    def join(self, key: str, values: Sequence[Any]) -> Any:
        """Return the batched value of per-item ``values`` (the inverse of :meth:`split`)."""


@dataclass(frozen=True)
class BatchedField(FieldSpec):
    """One row per item along dim 0; item ``i`` gets ``value[i]`` (a view)."""

    modality: str

    def split(self, key: str, value: Any, count: int, outputs: Mapping[str, Any]) -> list[Any]:
        """Return the rows of ``value``, checking there is one per item."""
        rows = _length(value, 0, key, self.modality)
        if rows != count:
            raise FieldSpecError(
                f"{key!r} (batched, {self.modality}): {rows} rows along dim 0 but "
                f"{count} {self.modality} item(s)"
            )
        if is_torch_tensor(value):
            return list(value.unbind(0))  # views, one Python call
        return [value[i] for i in range(count)]

    def join(self, key: str, values: Sequence[Any]) -> Any:
        """Stack rows back into a batch (tensors and arrays; lists stay lists)."""
        first = values[0]
        if is_torch_tensor(first):
            import torch

            return torch.stack(list(values))
        if isinstance(first, np.ndarray):
            return np.stack(values)
        return list(values)


@dataclass(frozen=True)
class FlatField(FieldSpec):
    """Items concatenated along ``dim``; item ``i`` has a given number of rows.

    Exactly one of ``sizes`` (a sequence, or a callable taking the whole output dict) and
    ``grid_key`` must be given. With ``grid_key``, item ``i`` has
    ``prod(outputs[grid_key][i]) // grid_divisor`` rows (the grid must divide exactly).
    """

    modality: str
    sizes: Sequence[int] | SizesFn | None = None
    grid_key: str | None = None
    grid_divisor: int = 1
    dim: int = 0

    def __post_init__(self) -> None:
        if (self.sizes is None) == (self.grid_key is None):
            raise FieldSpecError(
                f"FlatField({self.modality!r}) needs exactly one of sizes= and grid_key="
            )
        if self.grid_divisor < 1:
            raise FieldSpecError(
                f"FlatField({self.modality!r}): grid_divisor must be >= 1, got {self.grid_divisor}"
            )

    @classmethod
    def from_grid(
        cls, modality: str, grid_key: str, *, divisor: int = 1, dim: int = 0
    ) -> FlatField:
        """Rows per item = product of the item's row of ``grid_key`` (e.g. ``image_grid_thw``).

        ``divisor`` handles outputs coarser than the grid, e.g. merged embeddings with
        ``spatial_merge_size ** 2`` fewer rows than patches.
        """
        return cls(modality, grid_key=grid_key, grid_divisor=divisor, dim=dim)

    def item_sizes(self, key: str, count: int, outputs: Mapping[str, Any]) -> list[int]:
        """Return the per-item row counts for ``count`` items, checked."""
        if self.grid_key is not None:
            sizes = self._sizes_from_grid(key, self.grid_key, count, outputs)
        else:
            raw = self.sizes(outputs) if callable(self.sizes) else self.sizes
            try:
                sizes = [int(s) for s in raw]  # type: ignore[union-attr]
            except (TypeError, ValueError) as exc:
                raise FieldSpecError(
                    f"{key!r} (flat, {self.modality}): sizes are not integers: {exc}"
                ) from exc
        if len(sizes) != count:
            raise FieldSpecError(
                f"{key!r} (flat, {self.modality}): {len(sizes)} sizes for "
                f"{count} {self.modality} item(s)"
            )
        if any(s < 0 for s in sizes):
            raise FieldSpecError(f"{key!r} (flat, {self.modality}): negative size in {sizes}")
        return sizes

    def _sizes_from_grid(
        self, key: str, grid_key: str, count: int, outputs: Mapping[str, Any]
    ) -> list[int]:
        if grid_key not in outputs:
            raise FieldSpecError(
                f"{key!r} (flat, {self.modality}): its grid key {grid_key!r} is not in the outputs "
                f"(keys: {', '.join(sorted(outputs))})"
            )
        grid = outputs[grid_key]
        rows = grid.tolist() if hasattr(grid, "tolist") else [list(r) for r in grid]
        if len(rows) != count:
            raise FieldSpecError(
                f"{key!r} (flat, {self.modality}): grid {grid_key!r} has {len(rows)} rows for "
                f"{count} {self.modality} item(s)"
            )
        sizes = []
        for i, row in enumerate(rows):
            n = math.prod(int(x) for x in (row if isinstance(row, list) else [row]))
            if n % self.grid_divisor:
                raise FieldSpecError(
                    f"{key!r} (flat, {self.modality}): item {i} grid {row} has {n} cells, not a "
                    f"multiple of the divisor {self.grid_divisor}"
                )
            sizes.append(n // self.grid_divisor)
        return sizes

    def split(self, key: str, value: Any, count: int, outputs: Mapping[str, Any]) -> list[Any]:
        """Return per-item views of ``value`` along ``dim``."""
        sizes = self.item_sizes(key, count, outputs)
        rows = _length(value, self.dim, key, self.modality)
        if sum(sizes) != rows:
            raise FieldSpecError(
                f"{key!r} (flat, {self.modality}): per-item sizes {sizes} sum to {sum(sizes)} but "
                f"the output has {rows} rows along dim {self.dim}"
            )
        if is_torch_tensor(value):
            return list(value.split(sizes, dim=self.dim))  # views
        if isinstance(value, np.ndarray):
            return np.split(value, np.cumsum(sizes[:-1]), axis=self.dim)  # views
        bounds = np.cumsum([0, *sizes]).tolist()
        return [value[bounds[i] : bounds[i + 1]] for i in range(count)]

    def join(self, key: str, values: Sequence[Any]) -> Any:
        """Concatenate per-item values along ``dim``."""
        first = values[0]
        if is_torch_tensor(first):
            import torch

            return torch.cat(list(values), dim=self.dim)
        if isinstance(first, np.ndarray):
            return np.concatenate(values, axis=self.dim)
        return [row for v in values for row in v]


@dataclass(frozen=True)
class PaddedField(FieldSpec):
    """One row per item along dim 0, each padded along ``dim`` to the batch's longest.

    Item ``i`` gets its row cut to its own length (a view), so that an item's value does not
    depend on which others shared its batch (and a cached item fits any later batch). Exactly one
    of two gives the lengths:

    * ``length_key``: an output holding each item's unpadded length (an audio feature
      extractor's sample counts, ``PaddedField("audio", "audio_length")``);
    * ``lengths``: a sequence, or a callable taking the whole outputs dict, for processors that
      return no length output. LLaVA-OneVision pads each image's tiles to the batch's largest
      count; the count follows from ``image_sizes``:
      ``PaddedField("image", lengths=lambda outputs: [...], dim=1)``.

    ``dim`` counts the dimensions of the batched value: ``pixel_values (N, tiles, C, H, W)``
    pads along ``dim=1`` (or ``-4``); dim 0 is the batch and is refused. Each item's value lacks
    the batch dimension, so it is cut along ``dim - 1`` of the item for a positive ``dim`` (the
    same axis from the end for a negative one). :meth:`join` pads the rows back with
    ``padding_value``, at the end, as processors pad by default.
    """

    modality: str
    length_key: str | None = None
    dim: int = -1
    padding_value: float = 0.0
    lengths: Sequence[int] | SizesFn | None = None

    def __post_init__(self) -> None:
        if (self.length_key is None) == (self.lengths is None):
            raise FieldSpecError(
                f"PaddedField({self.modality!r}) needs exactly one of length_key= (an output "
                "holding each item's length) and lengths= (a sequence, or a callable of the "
                "outputs)"
            )
        if self.dim == 0:
            raise FieldSpecError(
                f"PaddedField({self.modality!r}): dim 0 is the batch (one row per item); pad "
                "along another dim of the batched value (e.g. 1 for tiles, -1 for samples)"
            )

    def _item_axis(self, key: str, batched_ndim: int) -> int:
        """The axis of an item's value (the batched value without dim 0) that ``dim`` names."""
        where = f"{key!r} (padded, {self.modality})"
        if self.dim >= batched_ndim:
            raise FieldSpecError(
                f"{where}: dim {self.dim} is out of range for a {batched_ndim}-d value"
            )
        if self.dim <= -batched_ndim:
            raise FieldSpecError(
                f"{where}: dim {self.dim} of a {batched_ndim}-d value is the batch dimension "
                "(or beyond it); pad along another one"
            )
        return self.dim - 1 if self.dim > 0 else self.dim

    def item_lengths(self, key: str, count: int, outputs: Mapping[str, Any]) -> list[int]:
        """Return each item's unpadded length, from ``length_key`` or ``lengths``."""
        if self.length_key is not None:
            if self.length_key not in outputs:
                raise FieldSpecError(
                    f"{key!r} (padded, {self.modality}): its length key {self.length_key!r} is "
                    f"not in the outputs (keys: {', '.join(sorted(outputs))})"
                )
            raw: Any = outputs[self.length_key]
        else:
            raw = self.lengths(outputs) if callable(self.lengths) else self.lengths
        try:
            return [int(n) for n in (raw.tolist() if hasattr(raw, "tolist") else raw)]
        except (TypeError, ValueError) as exc:
            raise FieldSpecError(
                f"{key!r} (padded, {self.modality}): lengths are not integers: {exc}"
            ) from exc

    def split(self, key: str, value: Any, count: int, outputs: Mapping[str, Any]) -> list[Any]:
        """Return each item's row, cut to its length."""
        rows = _length(value, 0, key, self.modality)
        if rows != count:
            raise FieldSpecError(
                f"{key!r} (padded, {self.modality}): {rows} rows along dim 0 but "
                f"{count} {self.modality} item(s)"
            )
        axis = self._item_axis(key, value.ndim)
        lengths = self.item_lengths(key, count, outputs)
        longest = _length(value, self.dim, key, self.modality)
        if len(lengths) != count or any(n < 0 or n > longest for n in lengths):
            source = repr(self.length_key) if self.length_key is not None else "lengths="
            raise FieldSpecError(
                f"{key!r} (padded, {self.modality}): lengths {lengths} from {source} do not fit "
                f"{count} rows of length {longest} along dim {self.dim}"
            )
        parts = []
        for i, n in enumerate(lengths):
            row = value[i]
            index = [slice(None)] * row.ndim
            index[axis] = slice(0, n)
            parts.append(row[tuple(index)])
        return parts

    def join(self, key: str, values: Sequence[Any]) -> Any:
        """Pad the rows to the longest along ``dim`` and stack them."""
        first = values[0]
        axis = self._item_axis(key, first.ndim + 1)
        longest = max(int(v.shape[axis]) for v in values)
        if is_torch_tensor(first):
            import torch

            padded = []
            for v in values:
                shape = list(v.shape)
                shape[axis] = longest - v.shape[axis]
                padded.append(torch.cat([v, v.new_full(shape, self.padding_value)], dim=axis))
            return torch.stack(padded)
        widths = []
        for v in values:
            width = [(0, 0)] * v.ndim
            width[axis] = (0, longest - v.shape[axis])
            widths.append(width)
        return np.stack(
            [
                np.pad(v, w, constant_values=self.padding_value)
                for v, w in zip(values, widths, strict=True)
            ]
        )


@dataclass(frozen=True)
class SharedField(FieldSpec):
    """One value for all items of the modality; every item holds the same object."""

    modality: str

    def split(self, key: str, value: Any, count: int, outputs: Mapping[str, Any]) -> list[Any]:
        """Return ``value`` once per item."""
        return [value] * count

    def join(self, key: str, values: Sequence[Any]) -> Any:
        """Return the first item's value (items of one model share it by definition)."""
        return values[0]


def split_outputs(
    outputs: Mapping[str, Any],
    fields: Mapping[str, FieldSpec],
    mm_counts: Mapping[str, int],
    *,
    ignore: Collection[str] = DEFAULT_IGNORED_KEYS,
) -> dict[str, list[dict[str, Any]]]:
    """Split batched processor outputs into one dict per item, per modality.

    Args:
        outputs: The HF processor's outputs (a ``BatchFeature`` is a mapping).
        fields: Output key -> its field spec. Specs for keys absent from ``outputs`` are fine
            (a model declares its video keys even when a request has no video).
        mm_counts: Items per modality in this call; a modality not listed has 0.
        ignore: Output keys not to split (the text side: ``input_ids``, ...).

    Returns:
        Modality -> a list with one dict per item (``key -> value``), for every modality in
        ``mm_counts`` (an empty list for 0 items).

    Raises:
        FieldSpecError: output keys no field covers (all listed), or row counts that do not fit.
    """
    ignored = set(ignore)
    missing = sorted(k for k in outputs if k not in fields and k not in ignored)
    if missing:
        raise FieldSpecError(
            f"the model's field spec is incomplete: no field for output key(s) {', '.join(missing)}"
            f" (covered: {', '.join(sorted(fields)) or 'none'})"
        )
    result: dict[str, list[dict[str, Any]]] = {
        modality: [{} for _ in range(int(n))] for modality, n in mm_counts.items()
    }
    for key, value in outputs.items():
        if key in ignored:
            continue
        spec = fields[key]
        count = int(mm_counts.get(spec.modality, 0))
        parts = spec.split(key, value, count, outputs)
        if count == 0:
            continue  # split() checked that the value has nothing for this modality
        for item, part in zip(result[spec.modality], parts, strict=True):
            item[key] = part
    return result


def join_items(
    items: Sequence[Mapping[str, Any]],
    fields: Mapping[str, FieldSpec],
) -> dict[str, Any]:
    """Batch per-item dicts (of one modality, e.g. from the cache) back into processor outputs.

    The inverse of :func:`split_outputs` for one modality: ``join_items(split[m], fields)`` equals
    the outputs' keys of modality ``m``. Every item must have the same keys.

    Raises:
        FieldSpecError: items with different keys, or a key no field covers.
    """
    if not items:
        return {}
    keys = list(items[0])
    for i, item in enumerate(items):
        if set(item) != set(keys):
            raise FieldSpecError(
                f"item {i} has keys {sorted(item)}, item 0 has {sorted(keys)}; cannot join"
            )
    missing = [k for k in keys if k not in fields]
    if missing:
        raise FieldSpecError(f"no field for item key(s) {', '.join(sorted(missing))}")
    return {key: fields[key].join(key, [item[key] for item in items]) for key in keys}


def prompt_ids_row(input_ids: Any) -> list[int]:
    """The prompt's ids from an HF processor's ``input_ids`` (a batch of one, or one row; a
    tensor, an array or lists)."""
    rows = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    return list(rows[0]) if rows and isinstance(rows[0], list) else list(rows)
