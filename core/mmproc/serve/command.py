"""``mmproc serve --model FOLDER|demo:NAME``: the command line of the render service.

The processor options are ``get_processor``'s (``--workers``, ``--backend``, ``--option
KEY=VALUE`` for any other); the media policy is closed by default, as a server for untrusted
clients needs it: no local paths (``--allowed-media-path DIR`` opens a directory) and no URL
fetching (``--remote-media-domain`` allows hosts); items per request are capped
(``--max-items-per-request``, 64 of each modality by default); request item ids are not taken
(``--trust-request-ids`` takes them, for callers of one tenant); the limits of ``MediaLimits``
and the server's own (body size, concurrency, queue, time) have flags of their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MAX_ITEMS_PER_REQUEST", "add_arguments", "run_serve"]

#: Items of each modality one request may have, unless ``--max-items-per-request`` says otherwise:
#: a server's clients need a bound (each part of a body is a decode), and a chat rarely needs more.
DEFAULT_MAX_ITEMS_PER_REQUEST = 64


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _byte_size(flag: str) -> Callable[[str], int]:
    """The parser of a size option (``4294967296``, ``512MiB``), its errors naming ``flag``."""

    def parse(text: str) -> int:
        from mmproc.cache import parse_byte_size
        from mmproc.errors import ConfigurationError

        try:
            return parse_byte_size(text, name=flag)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _heap_reserve_size(text: str) -> int:
    from mmproc.serve.allocator import MMAP_THRESHOLD

    value = _byte_size("--heap-reserve-bytes")(text)
    if value >= MMAP_THRESHOLD:
        # malloc would map a block that large on its own, never touching the heap's top.
        raise argparse.ArgumentTypeError(
            f"--heap-reserve-bytes must be below {MMAP_THRESHOLD >> 20} MiB, got {text!r}"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``mmproc serve`` options."""
    from mmproc.bench import parse_option
    from mmproc.demo_models import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--workers", type=_positive_int, help="preprocessing workers")
    parser.add_argument("--backend", choices=("pil", "torchvision"), help="image backend")
    parser.add_argument(
        "--worker-kind",
        choices=("thread", "process"),
        help="workers as threads (default) or processes, for hosts with many cores",
    )
    parser.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other get_processor option, e.g. hash_algorithm=xxh3 (repeatable)",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a name requests may give as 'model' (repeatable; default: the --model argument)",
    )
    parser.add_argument(
        "--max-model-len", type=_positive_int, help="the model's context, for max_tokens"
    )
    parser.add_argument(
        "--allowed-media-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory clients may name files in (file:// URLs); default: none",
    )
    parser.add_argument(
        "--remote-media-domain",
        action="append",
        default=[],
        metavar="HOST",
        help="a host clients may name http(s) URLs on ('*.example.com'); default: URLs refused",
    )
    parser.add_argument(
        "--max-items-per-request",
        type=_positive_int,
        default=DEFAULT_MAX_ITEMS_PER_REQUEST,
        metavar="N",
        help="items of each modality one request may have (default "
        f"{DEFAULT_MAX_ITEMS_PER_REQUEST}; the processor option max_items_per_request)",
    )
    parser.add_argument("--max-item-bytes", type=_positive_int, help="MediaLimits.max_item_bytes")
    parser.add_argument(
        "--max-request-decoded-bytes",
        type=_positive_int,
        help="MediaLimits.max_request_decoded_bytes",
    )
    parser.add_argument("--max-body-bytes", type=_positive_int, default=64 << 20)
    parser.add_argument("--max-concurrency", type=_positive_int, default=64, help="renders at once")
    parser.add_argument("--max-queue", type=_positive_int, default=256, help="requests waiting")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument(
        "--engine-item-cache-bytes",
        type=_byte_size("--engine-item-cache-bytes"),
        metavar="SIZE",
        help="bytes of items the engine's receiver keeps (its item_cache_bytes; set it to the "
        "receiver's): sent by reference, and only stand-ins kept here (0: none; default 1GiB)",
    )
    parser.add_argument(
        "--encoded-item-cache-bytes",
        type=_byte_size("--encoded-item-cache-bytes"),
        metavar="SIZE",
        help="items kept encoded in vLLM's format for repeats (4294967296, 512MiB, 0: none; "
        "default 1GiB)",
    )
    parser.add_argument(
        "--heap-reserve-bytes",
        type=_heap_reserve_size,
        metavar="SIZE",
        help="free memory kept faulted in at the top of malloc's heap, ahead of the requests "
        "(below 32MiB; 0: none; default 24MiB)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in requests (code the server runs)",
    )
    parser.add_argument(
        "--trust-request-ids",
        action="store_true",
        help="take a content part's 'uuid' as its item's id (the cache and the answer's "
        "mm_hashes key the item by it). Default: dropped, items keyed by their content, since "
        "one client could otherwise fetch what another sent under an id. Only for callers of "
        "one tenant, e.g. an engine's own front end that namespaces its ids",
    )
    parser.add_argument(
        "--engine", metavar="ADDR", help="send requests to this engine (ipc:// or tcp://)"
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )


def _max_model_len(folder: Path) -> int | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for holder in (config, config.get("text_config") or {}):
        value = holder.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def run_serve(args: argparse.Namespace) -> int:
    """Build the processor and serve it until SIGTERM."""
    from mmproc.demo_models import describe_demo_models, open_model
    from mmproc.factory import get_processor
    from mmproc.media import MediaLimits, RemoteMedia
    from mmproc.media.items import MODALITIES

    if args.list:
        print(describe_demo_models())
        return 0
    from mmproc.serve import ServeSettings, create_app, run
    from mmproc.serve.allocator import HEAP_RESERVE, keep_freed_memory, reserve_heap

    workdir = Path(tempfile.mkdtemp(prefix="mmproc-serve-"))
    try:
        folder, described = open_model(args.model, workdir)
        options: dict[str, Any] = dict(args.option)
        if args.workers:
            options["workers"] = args.workers
        if args.backend:
            options["backend"] = args.backend
        if args.worker_kind:
            options["worker_kind"] = args.worker_kind
        options.setdefault("allowed_media_paths", args.allowed_media_path)
        options.setdefault(
            "max_items_per_request", dict.fromkeys(MODALITIES, args.max_items_per_request)
        )
        if args.remote_media_domain:
            options.setdefault(
                "remote_media", RemoteMedia(allowed_domains=tuple(args.remote_media_domain))
            )
        limits = {
            name: value
            for name, value in (
                ("max_item_bytes", args.max_item_bytes),
                ("max_request_decoded_bytes", args.max_request_decoded_bytes),
            )
            if value is not None
        }
        if limits:
            options.setdefault("media_limits", MediaLimits(**limits))
        keep_freed_memory()  # before the processor's first buffers and threads
        if args.heap_reserve_bytes != 0:
            reserve_heap(args.heap_reserve_bytes or HEAP_RESERVE)
        processor = get_processor(folder, warm_up=True, **options)
        names = tuple(args.served_model_name) or (args.model or str(folder),)
        settings = ServeSettings(
            served_model_names=names,
            max_model_len=args.max_model_len or _max_model_len(folder),
            max_body_bytes=args.max_body_bytes,
            max_concurrency=args.max_concurrency,
            max_queue=args.max_queue,
            request_timeout_s=args.timeout,
            trust_request_chat_template=args.trust_request_chat_template,
            trust_request_ids=args.trust_request_ids,
            engine=args.engine,
        )
        if args.encoded_item_cache_bytes is not None:
            settings = dataclasses.replace(
                settings, encoded_item_cache_bytes=args.encoded_item_cache_bytes
            )
        if args.engine_item_cache_bytes is not None:
            settings = dataclasses.replace(
                settings, engine_item_cache_bytes=args.engine_item_cache_bytes
            )
        print(
            f"mmproc serve: {described}, as {names[0]!r}, on http://{args.host}:{args.port}",
            flush=True,
        )
        run(
            create_app(processor, settings),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            limit_concurrency=settings.connection_limit,
        )
    finally:
        # The demo model folders are written here; the processor has read what it needs.
        shutil.rmtree(workdir, ignore_errors=True)
    return 0
