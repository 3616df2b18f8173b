"""The ``mmproc`` command line.

``mmproc plugins [--json] [--strict]`` lists plugins; ``mmproc which ARCH_OR_FOLDER [--check]
[--option KEY=VALUE ...]`` says which plugin and class serve an architecture (and with a folder
and ``--check``, runs a request through the processor, built with those options); ``mmproc demo
[--model FOLDER|demo:NAME]`` runs the main job end to end on a model (a plugin's demo model by
default); ``mmproc bench`` measures preprocessing latency and throughput; ``mmproc new-plugin
NAME --architecture ARCH [--template NAME]`` writes a plugin to start from; ``mmproc serve
--model FOLDER|demo:NAME`` runs the render service (:mod:`mmproc.serve`).
Listing plugins imports no model class and no transformers: it only reads entry points and runs
the plugins' light registration modules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmproc.errors import ConfigurationError, MmprocError

__all__ = ["main"]


def _cmd_plugins(args: argparse.Namespace) -> int:
    from mmproc.registry import PluginStatus, get_registry

    infos = get_registry().plugins()
    broken = [i for i in infos if i.status in (PluginStatus.FAILED, PluginStatus.INCOMPATIBLE)]
    status = 1 if args.strict and broken else 0
    if args.strict and broken:
        for info in broken:
            print(f"mmproc: plugin {info.name} is {info.status}: {info.error}", file=sys.stderr)
    if args.json:
        print(json.dumps([info.to_dict() for info in infos], indent=2))
        return status
    if not infos:
        print("no mmproc plugins installed")
        return status
    for info in infos:
        dist = f"{info.distribution} {info.version}" if info.distribution else "(in-process)"
        print(f"{info.name}  [{info.status}]  {dist}")
        for arch in info.architectures:
            print(f"    {arch}")
        for demo in info.demo_models:
            print(f"    demo model: demo:{demo}")
        for conflict in info.conflicts:
            chosen = conflict["preferred"] or "unresolved: set MMPROC_PREFER"
            print(
                f"    conflict on {conflict['architecture']}: "
                f"{', '.join(conflict['plugins'])} ({chosen})"
            )
        if info.error:
            # A disabled plugin is the user's choice, not a fault: say why, not "error".
            label = "why" if info.status == PluginStatus.DISABLED else "error"
            print(f"    {label}: {info.error}")
    return status


def _cmd_which(args: argparse.Namespace) -> int:
    import tempfile

    from mmproc.demo_models import DEMO_PREFIX, open_model
    from mmproc.registry import get_registry

    registry = get_registry()
    if not args.architecture.startswith(DEMO_PREFIX):
        return _which(args, args.architecture, registry)
    with tempfile.TemporaryDirectory() as workdir:  # a demo model: its folder, written here
        folder, _ = open_model(args.architecture, Path(workdir), registry)
        return _which(args, str(folder), registry)


def _which(args: argparse.Namespace, target: str, registry: Any) -> int:
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
    problems: list[str] = []
    options = dict(args.option)
    if options and not (args.check and os.path.isdir(target)):
        raise ConfigurationError(
            "--option goes with --check on a model folder (it sets get_processor options for "
            "the request the check runs)"
        )
    if args.check:
        from mmproc.model_hooks import load_model_hooks

        load_model_hooks(ref)
        record["checked"] = "hooks"
        if os.path.isdir(target):
            from mmproc.check import check_model_folder

            results = check_model_folder(Path(target), **options)
            record["checked"] = "hooks and one request per modality"
            if options:
                record["options"] = options
                record["checked"] += " with " + ", ".join(f"{k}={v!r}" for k, v in options.items())
            record["requests"] = {modality: problem or "ok" for modality, problem in results}
            problems = [f"{modality}: {problem}" for modality, problem in results if problem]
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        dist = f"{info.distribution} {info.version}" if info.distribution else "in-process"
        checked = f" ({record['checked']} checked)" if args.check else ""
        print(f"{ref.architecture}: plugin {ref.plugin} ({dist}), class {ref.target}{checked}")
        for modality, outcome in record.get("requests", {}).items():
            said = "ok (the cached path, HF expansion and HF agree)" if outcome == "ok" else outcome
            print(f"    {modality}: {said}")
    return 1 if problems else 0


def _cmd_new_plugin(args: argparse.Namespace) -> int:
    from mmproc.scaffold import write_plugin

    folder = write_plugin(args.name, args.architecture, args.path, template=args.template)
    print(f"wrote {folder}: plugin {args.name!r} serving {args.architecture} ({args.template})")
    print(f"next: pip install -e '{folder}[test]' && pytest {folder}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from mmproc.demo import run_demo

    return run_demo(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from mmproc.bench import run_bench

    return run_bench(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from mmproc.serve.command import run_serve

    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mmproc`` command."""
    parser = argparse.ArgumentParser(
        prog="mmproc", description="Multimodal preprocessing for LLM serving engines."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="list installed plugins and their status")
    plugins.add_argument("--json", action="store_true", help="print a JSON array")
    plugins.add_argument(
        "--strict", action="store_true", help="exit 1 when a plugin failed or is incompatible"
    )
    plugins.set_defaults(run=_cmd_plugins)

    which = sub.add_parser("which", help="which plugin and class serve an architecture")
    which.add_argument(
        "architecture", help="architecture name, local model folder or demo:NAME (a demo model)"
    )
    which.add_argument(
        "--check",
        action="store_true",
        help="check the class's hooks; for a folder, also run a request through the processor",
    )
    from mmproc.bench import parse_option

    which.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --check on a folder: a get_processor option, e.g. backend=pil (repeatable)",
    )
    which.add_argument("--json", action="store_true", help="print a JSON object")
    which.set_defaults(run=_cmd_which)

    from mmproc.serve.command import add_arguments as add_serve_arguments

    serve = sub.add_parser("serve", help="the render service, a drop-in for vLLM's render tier")
    add_serve_arguments(serve)
    serve.set_defaults(run=_cmd_serve)

    from mmproc.demo import add_arguments

    demo = sub.add_parser("demo", help="preprocess, ship and normalise requests on a demo model")
    add_arguments(demo)
    demo.set_defaults(run=_cmd_demo)

    new_plugin = sub.add_parser("new-plugin", help="write a plugin distribution to start from")
    new_plugin.add_argument("name", help="plugin name: lower case letters, digits and '_'")
    new_plugin.add_argument("--architecture", required=True, help="architecture it serves")
    new_plugin.add_argument(
        "--path", default=None, help="folder to write (default ./mmproc-<name>)"
    )
    from mmproc.scaffold import TEMPLATES

    new_plugin.add_argument(
        "--template",
        choices=sorted(TEMPLATES),
        default="image",
        help="what to start from: "
        + "; ".join(f"{key}: {what}" for key, what in TEMPLATES.items())
        + " (default image)",
    )
    new_plugin.set_defaults(run=_cmd_new_plugin)

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
