"""The ``mmproc`` command line.

``mmproc plugins [--json]`` lists plugins; ``mmproc which ARCH_OR_FOLDER [--check]`` says which
plugin and class serve an architecture; ``mmproc demo [--model FOLDER|demo:NAME]`` runs the main
job end to end on a model (a plugin's demo model by default); ``mmproc bench`` measures
preprocessing latency and throughput.
Listing plugins imports no model class and no transformers: it only reads entry points and runs
the plugins' light registration modules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from mmproc.errors import MmprocError

__all__ = ["main"]


def _cmd_plugins(args: argparse.Namespace) -> int:
    from mmproc.registry import get_registry

    infos = get_registry().plugins()
    if args.json:
        print(json.dumps([info.to_dict() for info in infos], indent=2))
        return 0
    if not infos:
        print("no mmproc plugins installed")
        return 0
    for info in infos:
        dist = f"{info.distribution} {info.version}" if info.distribution else "(in-process)"
        print(f"{info.name}  [{info.status}]  {dist}")
        for arch in info.architectures:
            print(f"    {arch}")
        for conflict in info.conflicts:
            chosen = conflict["preferred"] or "unresolved: set MMPROC_PREFER"
            print(
                f"    conflict on {conflict['architecture']}: "
                f"{', '.join(conflict['plugins'])} ({chosen})"
            )
        if info.error:
            print(f"    error: {info.error}")
    return 0


def _cmd_which(args: argparse.Namespace) -> int:
    from mmproc.registry import get_registry

    registry = get_registry()
    target = args.architecture
    if os.path.isdir(target):
        ref = registry.resolve_folder(target)
    else:
        ref = registry.resolve(target)
    info = next(i for i in registry.plugins() if i.name == ref.plugin)
    record: dict[str, Any] = {
        "architecture": ref.architecture,
        "plugin": ref.plugin,
        "distribution": info.distribution,
        "version": info.version,
        "class": ref.target,
    }
    if args.check:
        from mmproc.model_hooks import load_model_hooks

        load_model_hooks(ref)
        record["checked"] = True
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        dist = f"{info.distribution} {info.version}" if info.distribution else "in-process"
        checked = " (hooks checked)" if args.check else ""
        print(f"{ref.architecture}: plugin {ref.plugin} ({dist}), class {ref.target}{checked}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from mmproc.demo import run_demo

    return run_demo(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from mmproc.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mmproc`` command."""
    parser = argparse.ArgumentParser(
        prog="mmproc", description="Multimodal preprocessing for LLM serving engines."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="list installed plugins and their status")
    plugins.add_argument("--json", action="store_true", help="print a JSON array")
    plugins.set_defaults(run=_cmd_plugins)

    which = sub.add_parser("which", help="which plugin and class serve an architecture")
    which.add_argument("architecture", help="architecture name or local model folder")
    which.add_argument("--check", action="store_true", help="import the class and check its hooks")
    which.add_argument("--json", action="store_true", help="print a JSON object")
    which.set_defaults(run=_cmd_which)

    from mmproc.demo import add_arguments

    demo = sub.add_parser("demo", help="preprocess, ship and normalise requests on a demo model")
    add_arguments(demo)
    demo.set_defaults(run=_cmd_demo)

    from mmproc.bench import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="measure preprocessing latency and throughput of a model")
    add_bench_arguments(bench)
    bench.set_defaults(run=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for an mmproc error)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except MmprocError as exc:
        print(f"mmproc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
