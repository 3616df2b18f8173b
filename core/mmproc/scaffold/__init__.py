"""``mmproc new-plugin``: write a working plugin distribution to start a model's support from.

The template (``scaffold/template/``) is a complete plugin for a fixed-size image model in the
style of LLaVA-1.5: the pyproject with both entry points, the light registration module, the
model hooks, a demo model, a README, and tests that run mmproc's conformance suite. Its tests
pass as generated; an author then puts in their model's real settings and changes the hooks until
the suite passes again.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from mmproc.errors import ConfigurationError

__all__ = ["write_plugin"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ARCHITECTURE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PACKAGE_DIR = "__package__"
_SUFFIX = ".tmpl"


def _check(name: str, architecture: str) -> None:
    if not _NAME.match(name) or keyword.iskeyword(name):
        raise ConfigurationError(
            f"plugin name {name!r} must be lower case letters, digits and '_', starting with a "
            "letter (it names the package mmproc_<name> and the entry point)"
        )
    if not _ARCHITECTURE.match(architecture):
        raise ConfigurationError(
            f"architecture {architecture!r} must be a Python identifier, as config.json's "
            "'architectures' entries are (e.g. 'MyModelForConditionalGeneration')"
        )


def write_plugin(name: str, architecture: str, path: str | Path | None = None) -> Path:
    """Write the plugin distribution ``mmproc-<name>`` serving ``architecture``; returns its folder.

    ``path`` is the folder to write (default ``./mmproc-<name>``); it must not exist or be empty.
    """
    import mmproc
    from mmproc.hookspecs import PLUGIN_API_VERSION

    _check(name, architecture)
    distribution = f"mmproc-{name.replace('_', '-')}"
    target = Path(path) if path is not None else Path.cwd() / distribution
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigurationError(f"{target} exists and is not an empty folder: choose --path")
    values = {
        "name": name,
        "architecture": architecture,
        "distribution": distribution,
        "package": f"mmproc_{name}",
        "demo": name.replace("_", "-"),
        "mmproc_version": mmproc.__version__,
        "api_version": str(PLUGIN_API_VERSION),
    }
    template = resources.files("mmproc.scaffold") / "template"
    written = 0
    for source, relative in _template_files(template, Path()):
        text = source.read_text(encoding="utf-8")
        for key, value in values.items():
            text = text.replace("{{" + key + "}}", value)
        parts = [values["package"] if part == _PACKAGE_DIR else part for part in relative.parts]
        destination = target.joinpath(*parts).with_name(relative.name.removesuffix(_SUFFIX))
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(text, encoding="utf-8")
        written += 1
    assert written, "the scaffold template is missing from the installed mmproc"
    return target


def _template_files(
    folder: resources.abc.Traversable, relative: Path
) -> Iterator[tuple[resources.abc.Traversable, Path]]:
    for entry in folder.iterdir():
        if entry.is_dir():
            yield from _template_files(entry, relative / entry.name)
        elif entry.name.endswith(_SUFFIX):
            yield entry, relative / entry.name
