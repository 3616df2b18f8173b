"""``mmproc new-plugin``: write a working plugin distribution to start a model's support from.

Each template (:data:`TEMPLATES`) is a complete plugin: the pyproject with both entry points (and
ruff settings the generated code passes), the light registration module, the model hooks, a demo
model, a README, and tests that run mmproc's conformance suite. ``image`` is a fixed-size image
model in the style of LLaVA-1.5; ``grid`` an image model whose token count follows a patch grid,
in the style of Qwen2-VL. The files under ``scaffold/template/common`` are every template's; those
under ``scaffold/template/<name>`` the template's own. A template file's name is its path in the
plugin, its folders joined by ``+`` (``__package__+model.py.tmpl`` is ``mmproc_<name>/model.py``):
one level of folders, which the package data of mmproc's wheel holds. The generated code
imports only :mod:`mmproc.plugin` (its tests also :mod:`mmproc.testing`). Its tests pass as
generated; an author then puts in their model's real settings and changes the hooks until the
suite passes again.
"""

from __future__ import annotations

import keyword
import re
from importlib import resources
from pathlib import Path

from mmproc.errors import ConfigurationError

__all__ = ["TEMPLATES", "write_plugin"]

TEMPLATES: dict[str, str] = {
    "image": "a fixed-size image model: every image the same token count (LLaVA-1.5's recipe)",
    "grid": "a token count from each image's patch grid (Qwen2-VL's recipe)",
}
"""Template name -> what it starts from."""

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ARCHITECTURE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PACKAGE_DIR = "__package__"
_SUFFIX = ".tmpl"
_FOLDER_SEPARATOR = "+"


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


def write_plugin(
    name: str, architecture: str, path: str | Path | None = None, *, template: str = "image"
) -> Path:
    """Write the plugin distribution ``mmproc-<name>`` serving ``architecture``; returns its folder.

    ``path`` is the folder to write (default ``./mmproc-<name>``); it must not exist or be empty.
    ``template`` is one of :data:`TEMPLATES`.
    """
    import mmproc
    from mmproc.hookspecs import PLUGIN_API_VERSION

    _check(name, architecture)
    if template not in TEMPLATES:
        raise ConfigurationError(
            f"unknown template {template!r}; the templates are: "
            + "; ".join(f"{key} ({what})" for key, what in TEMPLATES.items())
        )
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
    root = resources.files("mmproc.scaffold") / "template"
    written = 0
    sources = [
        entry
        for folder in ("common", template)
        for entry in (root / folder).iterdir()
        if entry.name.endswith(_SUFFIX)
    ]
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for key, value in values.items():
            text = text.replace("{{" + key + "}}", value)
        parts = source.name.removesuffix(_SUFFIX).split(_FOLDER_SEPARATOR)
        destination = target.joinpath(
            *(values["package"] if part == _PACKAGE_DIR else part for part in parts)
        )
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(text, encoding="utf-8")
        written += 1
    if not written:
        raise ConfigurationError(f"the scaffold template {template!r} is missing from this mmproc")
    return target
