"""The ``--model`` argument of ``mmproc demo`` and ``mmproc bench``: a folder or ``demo:NAME``.

Demo models come from plugins (``registry.register_demo`` in their registration hook): each is a
function writing a tiny local model folder with the model's real special tokens and preprocessor
settings. The core names none; with no ``--model``, the first demo model by name is used.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmproc.errors import PluginError
from mmproc.registry import DemoModel, Registry, get_registry

__all__ = ["DEMO_PREFIX", "add_model_arguments", "describe_demo_models", "open_model"]

DEMO_PREFIX = "demo:"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model FOLDER | demo:NAME`` and ``--list``."""
    parser.add_argument(
        "--model",
        metavar="FOLDER|demo:NAME",
        help="a local model folder, or a plugin's demo model (default: the first demo model)",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the demo models the installed plugins offer"
    )


def describe_demo_models(registry: Registry | None = None) -> str:
    """One line per demo model: ``demo:NAME  (plugin P)  description``."""
    demos = (registry or get_registry()).demo_models()
    if not demos:
        return "no demo models: no installed plugin offers one (`mmproc plugins` lists them)"
    width = max(len(DEMO_PREFIX + d.name) for d in demos)
    return "\n".join(
        f"{DEMO_PREFIX + d.name:<{width}}  (plugin {d.plugin})  {d.description}".rstrip()
        for d in demos
    )


def _default_demo(registry: Registry) -> DemoModel:
    demos = registry.demo_models()
    if not demos:
        raise PluginError(
            "no model to run: no installed plugin offers a demo model; pass --model FOLDER "
            "(`mmproc plugins` lists the installed plugins)"
        )
    return demos[0]


def open_model(
    argument: str | None, workdir: Path, registry: Registry | None = None
) -> tuple[Path, str]:
    """The model folder ``--model`` names (writing a demo model into ``workdir``), and a line
    saying what it is."""
    registry = registry or get_registry()
    if argument is not None and not argument.startswith(DEMO_PREFIX):
        return Path(argument), f"model folder {argument}"
    demo = (
        registry.demo_model(argument[len(DEMO_PREFIX) :])
        if argument is not None
        else _default_demo(registry)
    )
    folder = demo.write(workdir / demo.name)
    described = f" ({demo.description})" if demo.description else ""
    return folder, f"demo model {DEMO_PREFIX}{demo.name} from plugin {demo.plugin}{described}"
