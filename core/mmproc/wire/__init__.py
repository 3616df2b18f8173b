"""The wire between a front end and an engine core: codec, request schema, ZMQ transport.

* `encode` / `decode` -- msgpack with tensors as ``[dtype, shape, data]`` (vLLM's layout); tensors
  of at least the zero-copy threshold (env ``MMPROC_ZERO_COPY_THRESHOLD``, default 256 bytes)
  leave as their own frames, viewing the tensor's memory, and come back as read-only views over
  the received frames. `decode` is hardened (`DecodeLimits`) and raises only `DecodeError`.
* `EngineRequest` / `WireFeature` -- the versioned request schema (`SCHEMA_VERSION`), with
  `encode_request` / `decode_request`.
* `RequestSender` / `RequestReceiver` -- ZMQ PUSH / PULL over ``ipc://`` or ``tcp://``, zero-copy
  and tracked, with bounded queues; the receiver counts and skips malformed messages.

Importing this package imports torch, numpy, msgpack and zmq; ``import mmproc`` does not import it.
"""

from __future__ import annotations

from mmproc.errors import DecodeError, EncodeError
from mmproc.wire.codec import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_DEPTH,
    DEFAULT_THRESHOLD,
    EXT_RAW_VIEW,
    THRESHOLD_ENV,
    DecodeLimits,
    Frame,
    decode,
    encode,
    zero_copy_threshold,
)
from mmproc.wire.dtypes import DEFAULT_ALLOWED_DTYPES
from mmproc.wire.schema import (
    SCHEMA_VERSION,
    EngineRequest,
    WireFeature,
    decode_request,
    encode_request,
)
from mmproc.wire.transport import DEFAULT_HWM, RequestReceiver, RequestSender

# Plain sorted(), the order tests/test_public_api.py checks for mmproc itself (ruff's RUF022
# would group the constants first instead).
__all__ = [  # noqa: RUF022
    "DEFAULT_ALLOWED_DTYPES",
    "DEFAULT_HWM",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_THRESHOLD",
    "DecodeError",
    "DecodeLimits",
    "EXT_RAW_VIEW",
    "EncodeError",
    "EngineRequest",
    "Frame",
    "RequestReceiver",
    "RequestSender",
    "SCHEMA_VERSION",
    "THRESHOLD_ENV",
    "WireFeature",
    "decode",
    "decode_request",
    "encode",
    "encode_request",
    "zero_copy_threshold",
]
