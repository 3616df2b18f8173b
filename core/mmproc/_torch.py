"""Torch checks for modules that must not import torch (``import mmproc`` stays light)."""

from __future__ import annotations

import sys
from typing import Any


def is_torch_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor. A tensor can only exist once torch has been imported, so
    this never imports torch just to find out."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)
