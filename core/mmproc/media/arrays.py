"""numpy arrays and torch tensors alike, for the decoders that accept both."""

from __future__ import annotations

from typing import Any

import numpy as np

from mmproc._torch import is_torch_tensor

__all__ = ["is_array", "to_numpy"]


def is_array(obj: Any) -> bool:
    """Whether ``obj`` is a numpy array or a torch tensor."""
    return isinstance(obj, np.ndarray) or is_torch_tensor(obj)


def to_numpy(raw: Any) -> np.ndarray:
    """``raw`` as a numpy array, sharing memory with a CPU tensor (a GPU one is copied)."""
    if isinstance(raw, np.ndarray):
        return raw
    tensor = raw.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.numpy()
