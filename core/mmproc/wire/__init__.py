"""The wire between a front end and an engine core: codec, request schema, ZMQ transport.

* `encode` / `decode` -- msgpack with tensors as ``[dtype, shape, data]`` (vLLM's layout); tensors
  of at least the zero-copy threshold (env ``MMPROC_ZERO_COPY_THRESHOLD``, default 256 bytes)
  leave as their own frames, viewing the tensor's memory, and come back as read-only views over
  the received frames. `decode` is hardened (`DecodeLimits`) and raises only `DecodeError`.
* `EngineRequest` / `WireFeature` -- the versioned request schema (`SCHEMA_VERSION`), with
  `encode_request` / `decode_request`.
* `RequestSender` / `RequestReceiver` -- ZMQ DEALER / ROUTER over ``ipc://`` or ``tcp://``,
  zero-copy and tracked, with bounded queues. The receiver acknowledges each request it hands to
  the engine and refuses malformed ones; the sender re-sends what goes unacknowledged and reports
  what it gives up on (`DeliveryFailure`); a receiver never hands out one request twice (the
  guarantee, across restarts too, is in `mmproc.wire.transport`). Each end keeps track of the
  media items the receiver holds, so that an item sent once goes again as a reference only
  (`mmproc.wire.items`); `SenderStats` / `ReceiverStats` count what went which way.

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
from mmproc.wire.delivery import Delivery, DeliveryFailure
from mmproc.wire.dtypes import DEFAULT_ALLOWED_DTYPES
from mmproc.wire.items import (
    DEFAULT_ITEM_CACHE_BYTES,
    ItemCache,
    MissingItemsError,
    StandInsNotHeldError,
    is_stand_in,
    item_key,
)
from mmproc.wire.schema import (
    SCHEMA_VERSION,
    EngineRequest,
    WireFeature,
    decode_request,
    encode_request,
)
from mmproc.wire.stats import ReceiverStats, SenderStats
from mmproc.wire.transport import (
    DEFAULT_ACK_TIMEOUT,
    DEFAULT_HWM,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_WINDOW,
    RequestReceiver,
    RequestSender,
)

# Plain sorted(), the order tests/test_public_api.py checks for mmproc itself (ruff's RUF022
# would group the constants first instead).
__all__ = [  # noqa: RUF022
    "DEFAULT_ACK_TIMEOUT",
    "DEFAULT_ALLOWED_DTYPES",
    "DEFAULT_HWM",
    "DEFAULT_ITEM_CACHE_BYTES",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_THRESHOLD",
    "DEFAULT_WINDOW",
    "DecodeError",
    "DecodeLimits",
    "Delivery",
    "DeliveryFailure",
    "EXT_RAW_VIEW",
    "EncodeError",
    "EngineRequest",
    "Frame",
    "ItemCache",
    "MissingItemsError",
    "ReceiverStats",
    "RequestReceiver",
    "RequestSender",
    "SCHEMA_VERSION",
    "SenderStats",
    "StandInsNotHeldError",
    "THRESHOLD_ENV",
    "WireFeature",
    "decode",
    "decode_request",
    "encode",
    "encode_request",
    "is_stand_in",
    "item_key",
    "zero_copy_threshold",
]
