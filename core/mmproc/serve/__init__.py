"""``mmproc serve``: the render tier as a service, a drop-in for vLLM's ``vllm launch render``.

One model's :class:`~mmproc.Processor` behind vLLM 0.33's render endpoints, on uvicorn:

``app``          the ASGI application: routes, admission, limits, errors (:func:`create_app`)
``protocol``     the request bodies and vLLM's ``GenerateRequest`` answers
``vllm_items``   media items in vLLM's ``kwargs_data`` format (base64 msgpack per item)
``engine_link``  the native path: rendered requests sent to the engine over mmproc's wire
``metrics``      the Prometheus metrics of ``GET /metrics``
``allocator``    the serving process's malloc: freed buffers kept, the heap's top faulted in ahead

``command``      the ``mmproc serve`` command line

Needs the ``serve`` extra (``pip install 'mmproc[serve]'``: starlette, uvicorn, prometheus_client,
orjson); ``import mmproc`` does not import this package, and importing it imports
the server's libraries only when :func:`create_app` or :class:`ServeSettings` is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ServeSettings", "create_app", "run"]

_LAZY = {"ServeSettings": "mmproc.serve.app", "create_app": "mmproc.serve.app"}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mmproc.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


if TYPE_CHECKING:
    from mmproc.serve.app import ServeSettings, create_app


def run(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    limit_concurrency: int | None = None,
) -> None:
    """Serve ``app`` with uvicorn until SIGTERM or SIGINT, which drain the requests in flight
    (up to 30 s) before the process exits with status 0. Past ``limit_concurrency`` connections
    (``ServeSettings.connection_limit``) uvicorn answers 503 itself."""
    import signal

    import uvicorn

    # uvicorn drains on SIGTERM, then raises the signal again once it has restored the handlers
    # it found: with this one, that ends the drained process with status 0, as it should.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=30,
        access_log=False,
        limit_concurrency=limit_concurrency,
    )
    uvicorn.Server(config).run()
