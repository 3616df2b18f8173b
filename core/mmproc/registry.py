"""Plugin discovery and the architecture table.

Plugins are pip-installed distributions with an entry point in the ``mmproc.plugins`` group. The
registry reads entry points on first use (never at ``import mmproc``), applies the allow- and
block-lists before importing anything, skips plugins that target another plugin API, then imports
each remaining entry point on its own and calls its ``mmproc_register_models`` hook. A plugin that
raises is recorded and rolled back; the others keep working. The registry only maps names to lazy
references: architectures to model classes (imported by
:func:`mmproc.model_hooks.load_model_hooks` when a model is used) and demo-model names to folder
writers (:class:`DemoModel`).

Environment (read at discovery):

``MMPROC_PLUGINS``
    Comma-separated allow-list of plugin names; set but empty means no plugin at all.
``MMPROC_DISABLE_PLUGINS``
    Comma-separated block-list of plugin names.
``MMPROC_PREFER``
    ``"Arch=plugin,Arch2=plugin2"``: which plugin wins when several claim one architecture.
``MMPROC_STRICT_PLUGINS``
    ``1`` makes a plugin that fails to load (or is incompatible) raise instead of being recorded.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from mmproc import hookspecs
from mmproc.errors import (
    ConfigurationError,
    IncompatiblePluginError,
    PluginConflictError,
    PluginError,
    PluginLoadError,
    PluginSpecError,
    UnknownArchitectureError,
)
from mmproc.hook_checks import explain_validation_error, unmarked_hooks
from mmproc.hookspecs import (
    PLUGIN_API_VERSION,
    PROJECT_NAME,
    SUPPORTED_PLUGIN_API_VERSIONS,
    DiscoverySpec,
)

__all__ = [
    "API_ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUP",
    "DemoModel",
    "ModelReference",
    "ModelRegistrar",
    "PluginInfo",
    "PluginStatus",
    "Registry",
    "get_registry",
]

ENTRY_POINT_GROUP = "mmproc.plugins"
API_ENTRY_POINT_GROUP = "mmproc.plugin_api"

_TARGET_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_DEMO_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_API_TARGET_PATTERN = re.compile(r"^mmproc\.hookspecs:PLUGIN_API_V(\d+)$")


class PluginStatus(enum.StrEnum):
    """Where a plugin stands after discovery."""

    LOADED = "loaded"
    FAILED = "failed"
    DISABLED = "disabled"
    INCOMPATIBLE = "incompatible"


@dataclass(frozen=True)
class ModelReference:
    """A lazy pointer from an architecture name to the plugin class serving it (imported by
    :func:`mmproc.model_hooks.load_model_hooks`)."""

    architecture: str
    target: str  # "package.module:ClassName"
    plugin: str


@dataclass(frozen=True)
class DemoModel:
    """A tiny model folder a plugin can write, for ``mmproc demo`` and ``mmproc bench``.

    ``target`` is ``"package.module:function"``; the function takes a folder path, writes the
    model folder there (a ``config.json`` naming the architecture, the model's real special tokens
    and preprocessor settings, no weights) and returns its path.
    """

    name: str
    target: str
    plugin: str
    description: str = ""

    def write(self, folder: str | os.PathLike[str]) -> Path:
        """Write the demo model into ``folder``; errors name the plugin and the demo model."""
        module_name, _, attr_path = self.target.partition(":")
        try:
            writer: Any = importlib.import_module(module_name)
            for part in attr_path.split("."):
                writer = getattr(writer, part)
            return Path(writer(Path(folder)))
        except Exception as exc:
            raise PluginError(
                f"plugin {self.plugin!r}: writing demo model {self.name!r} with {self.target!r} "
                f"failed: {type(exc).__name__}: {exc}",
                plugin=self.plugin,
            ) from exc


@dataclass
class PluginInfo:
    """One plugin as ``mmproc plugins`` shows it."""

    name: str
    distribution: str | None
    version: str | None
    status: PluginStatus
    architectures: list[str] = field(default_factory=list)
    demo_models: list[str] = field(default_factory=list)
    conflicts: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the fields of ``mmproc plugins --json``."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": str(self.status),
            "architectures": list(self.architectures),
            "demo_models": list(self.demo_models),
            "conflicts": [dict(c) for c in self.conflicts],
            "error": self.error,
        }


class ModelRegistrar:
    """The ``registry`` a plugin's ``mmproc_register_models`` hook receives.

    Registrations are staged here and only enter the registry when the hook returns, so a plugin
    that raises half-way leaves nothing behind.
    """

    def __init__(self, plugin: str) -> None:
        self.plugin = plugin
        self._staged: dict[str, str] = {}
        self._demos: dict[str, DemoModel] = {}

    def register(self, architectures: str | Sequence[str], target: str) -> None:
        """Serve ``architectures`` (one name or a list) with the class at ``target``.

        ``target`` is ``"package.module:ClassName"``; it is imported only on lookup. Registering
        the same architecture to the same target again is a no-op.
        """
        names = [architectures] if isinstance(architectures, str) else list(architectures)
        self._check_target(target, "model target", "package.module:ClassName")
        for name in names:
            if not isinstance(name, str) or not name:
                raise PluginSpecError(
                    f"plugin {self.plugin!r}: architecture names must be non-empty strings, "
                    f"got {name!r}",
                    plugin=self.plugin,
                )
            previous = self._staged.get(name)
            if previous is not None and previous != target:
                raise PluginSpecError(
                    f"plugin {self.plugin!r} registers {name} twice, to {previous!r} and "
                    f"{target!r}",
                    plugin=self.plugin,
                )
            self._staged[name] = target

    def register_demo(self, name: str, target: str, *, description: str = "") -> None:
        """Offer a demo model: ``target`` (``"package.module:function"``) writes its folder.

        ``name`` is what users type after ``demo:`` (``mmproc demo --model demo:NAME``): lower
        case letters, digits, ``.``, ``_`` and ``-``. The function is imported only when the demo
        model is written.
        """
        if not isinstance(name, str) or not _DEMO_NAME_PATTERN.match(name):
            raise PluginSpecError(
                f"plugin {self.plugin!r}: demo model name {name!r} must be lower case letters, "
                "digits, '.', '_' or '-'",
                plugin=self.plugin,
            )
        self._check_target(target, "demo model target", "package.module:function")
        if name in self._demos and self._demos[name].target != target:
            raise PluginSpecError(
                f"plugin {self.plugin!r} registers demo model {name!r} twice", plugin=self.plugin
            )
        self._demos[name] = DemoModel(name, target, self.plugin, str(description))

    def _check_target(self, target: object, what: str, shape: str) -> None:
        if not isinstance(target, str) or not _TARGET_PATTERN.match(target):
            raise PluginSpecError(
                f"plugin {self.plugin!r}: {what} {target!r} must look like {shape!r}",
                plugin=self.plugin,
            )

    @property
    def staged(self) -> dict[str, str]:
        """Architecture -> target, as registered so far."""
        return dict(self._staged)

    @property
    def demos(self) -> dict[str, DemoModel]:
        """Demo model name -> demo model, as registered so far."""
        return dict(self._demos)


@dataclass
class _PluginSource:
    """A plugin before loading: where it comes from and how to load it."""

    name: str
    distribution: str | None
    version: str | None
    load: Any  # () -> module or object with hook implementations
    api_version: int | None
    api_error: str | None = None


def _split_names(value: str) -> set[str]:
    return {part.strip() for part in value.split(",") if part.strip()}


def parse_preferences(value: str) -> dict[str, str]:
    """Parse ``"Arch=plugin,Arch2=plugin2"``; a malformed entry is a clear error."""
    prefs: dict[str, str] = {}
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        arch, sep, plugin = part.partition("=")
        if not sep or not arch.strip() or not plugin.strip():
            raise ConfigurationError(
                f"MMPROC_PREFER entry {part!r} must look like 'Architecture=plugin'"
            )
        prefs[arch.strip()] = plugin.strip()
    return prefs


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ConfigurationError(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")


def _entry_point_sources() -> list[_PluginSource]:
    """Read the two entry-point groups without importing any plugin."""
    api_targets: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=API_ENTRY_POINT_GROUP):
        api_targets.setdefault(ep.name, ep.value.strip())
    sources: list[_PluginSource] = []
    seen: set[str] = set()
    for ep in sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name
    ):
        dist = ep.dist
        dist_name = dist.metadata["Name"] if dist is not None else None
        version = dist.version if dist is not None else None
        if ep.name in seen:
            # The same plugin name from a second distribution (or a second copy on sys.path):
            # the first on the path wins, as Python's import system would pick it too.
            continue
        seen.add(ep.name)
        api_version, api_error = _parse_api_target(api_targets.get(ep.name))
        sources.append(
            _PluginSource(
                name=ep.name,
                distribution=dist_name,
                version=version,
                load=ep.load,
                api_version=api_version,
                api_error=api_error,
            )
        )
    return sources


def _parse_api_target(target: str | None) -> tuple[int | None, str | None]:
    """The plugin API version a plugin's ``mmproc.plugin_api`` entry point declares, and why
    the plugin cannot be loaded (None when it can). The version is the value of the constant
    named (``mmproc.hookspecs.PLUGIN_API_V2`` is 2); a constant this core does not define names
    an API it does not provide, whose number is read from the name to say so."""
    if target is None:
        return None, (
            f"declares no plugin API version (add an entry point in group "
            f"{API_ENTRY_POINT_GROUP!r} pointing at 'mmproc.hookspecs:PLUGIN_API_V<N>')"
        )
    match = _API_TARGET_PATTERN.match(target)
    if match is None:
        return None, f"plugin API declaration {target!r} is not 'mmproc.hookspecs:PLUGIN_API_V<N>'"
    value = getattr(hookspecs, target.partition(":")[2], None)
    version = value if isinstance(value, int) else int(match.group(1))
    if version not in SUPPORTED_PLUGIN_API_VERSIONS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_PLUGIN_API_VERSIONS))
        return version, f"targets plugin API {version}; this mmproc provides {supported}"
    return version, None


_DISCOVERY_HOOKS: tuple[str, ...] = ("mmproc_register_models",)


def _register_discovery_hook(name: str, plugin: Any, registrar: ModelRegistrar) -> None:
    """Check a plugin's discovery hook against its spec and run it into ``registrar``."""
    if isinstance(plugin, type):
        plugin = plugin()  # a class whose methods are the hooks
    for unmarked in unmarked_hooks(plugin, _DISCOVERY_HOOKS):
        raise PluginSpecError(
            f"plugin {name!r}: {unmarked!r} is not marked @mmproc.hookimpl, so it would never "
            "be called and the plugin would serve nothing",
            plugin=name,
        )
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(DiscoverySpec)
    try:
        manager.register(plugin, name=name)
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        explained = explain_validation_error(exc, DiscoverySpec, _DISCOVERY_HOOKS)
        raise PluginSpecError(f"plugin {name!r}: {explained}", plugin=name) from exc
    if not manager.hook.mmproc_register_models.get_hookimpls():
        raise PluginSpecError(
            f"plugin {name!r} implements no mmproc_register_models hook, so it serves nothing "
            "(its entry point must name a module or object with that @mmproc.hookimpl function)",
            plugin=name,
        )
    manager.hook.mmproc_register_models(registry=registrar)


class Registry:
    """Discovers plugins and maps architecture names to model classes.

    Thread-safe; discovery happens once, on the first call that needs it. Most code uses the
    process-wide instance from :func:`get_registry`.
    """

    def __init__(
        self,
        *,
        strict: bool | None = None,
        prefer: Mapping[str, str] | None = None,
        environ: Mapping[str, str] | None = None,
        entry_points: bool = True,
    ) -> None:
        self._environ = os.environ if environ is None else environ
        self._strict = strict
        self._prefer = dict(prefer or {})
        self._use_entry_points = entry_points
        self._lock = threading.RLock()
        self._discovered = False
        self._plugins: dict[str, PluginInfo] = {}
        self._claims: dict[str, list[ModelReference]] = {}
        self._demos: dict[str, list[DemoModel]] = {}
        # Architectures a plugin registered before it failed: named in lookup errors.
        self._failed_claims: dict[str, list[str]] = {}

    # --- discovery ---------------------------------------------------------------------------

    @property
    def strict(self) -> bool:
        """Whether a plugin that fails to load raises instead of being recorded."""
        if self._strict is not None:
            return self._strict
        return _env_flag(self._environ, "MMPROC_STRICT_PLUGINS")

    def add_plugin(
        self, plugin: Any, *, name: str, api_version: int = PLUGIN_API_VERSION
    ) -> PluginInfo:
        """Register an in-process plugin: a module, an object or a class (made with no arguments)
        whose methods or functions implement the discovery hook.

        For tests and embedding: the plugin goes through the same checks as an installed one, and
        a plugin that fails them raises (:class:`~mmproc.errors.PluginLoadError` or
        :class:`~mmproc.errors.IncompatiblePluginError`) besides being recorded as such.
        """
        source = _PluginSource(
            name=name, distribution=None, version=None, load=lambda: plugin, api_version=api_version
        )
        if api_version not in SUPPORTED_PLUGIN_API_VERSIONS:
            source.api_error = f"targets plugin API {api_version}; this mmproc does not provide it"
        self.discover()
        with self._lock:
            failure = self._load_source(source, strict=True)
            if failure is not None:
                raise failure
            return self._plugins[name]

    def discover(self) -> None:
        """Load every plugin once. Later calls do nothing."""
        with self._lock:
            if self._discovered:
                return
            sources = _entry_point_sources() if self._use_entry_points else []
            allow_value = self._environ.get("MMPROC_PLUGINS")
            allow = None if allow_value is None else _split_names(allow_value)
            block = _split_names(self._environ.get("MMPROC_DISABLE_PLUGINS", ""))
            for source in sources:
                if allow is not None and source.name not in allow:
                    self._record(source, PluginStatus.DISABLED, "not in MMPROC_PLUGINS")
                elif source.name in block:
                    self._record(source, PluginStatus.DISABLED, "listed in MMPROC_DISABLE_PLUGINS")
                else:
                    failure = self._load_source(source)
                    if failure is not None:
                        raise failure
            self._discovered = True

    def _record(self, source: _PluginSource, status: PluginStatus, error: str | None) -> PluginInfo:
        info = PluginInfo(source.name, source.distribution, source.version, status, error=error)
        self._plugins[source.name] = info
        return info

    def _load_source(self, source: _PluginSource, *, strict: bool = False) -> Exception | None:
        """Load one plugin and record it; the error to raise when it failed and ``strict`` (or
        strict mode) asks for errors, else None."""
        if source.api_error is not None:
            self._record(source, PluginStatus.INCOMPATIBLE, source.api_error)
            if strict or self.strict:
                return IncompatiblePluginError(
                    f"plugin {source.name!r} ({source.distribution}): {source.api_error}",
                    plugin=source.name,
                )
            return None
        registrar = ModelRegistrar(source.name)
        try:
            _register_discovery_hook(source.name, source.load(), registrar)
        except Exception as exc:
            info = self._record(source, PluginStatus.FAILED, f"{type(exc).__name__}: {exc}")
            info.architectures = sorted(registrar.staged)
            for arch in registrar.staged:
                self._failed_claims.setdefault(arch, []).append(source.name)
            if strict or self.strict:
                error = PluginLoadError(
                    source.name,
                    distribution=source.distribution,
                    version=source.version,
                    cause=exc,
                )
                error.__cause__ = exc
                return error
            return None
        info = self._record(source, PluginStatus.LOADED, None)
        info.architectures = sorted(registrar.staged)
        info.demo_models = sorted(registrar.demos)
        for arch, target in registrar.staged.items():
            claims = self._claims.setdefault(arch, [])
            if not any(ref.plugin == source.name for ref in claims):
                claims.append(ModelReference(arch, target, source.name))
        for name, demo in registrar.demos.items():
            offers = self._demos.setdefault(name, [])
            if not any(d.plugin == source.name for d in offers):
                offers.append(demo)
        return None

    # --- queries -----------------------------------------------------------------------------

    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen, with status, architectures, conflicts and errors."""
        self.discover()
        with self._lock:
            infos = sorted(self._plugins.values(), key=lambda info: info.name)
            prefs = self._preferences()
            for info in infos:
                info.conflicts = []
                for arch in info.architectures:
                    claimants = [ref.plugin for ref in self._claims.get(arch, [])]
                    if len(claimants) > 1 and info.name in claimants:
                        preferred = prefs.get(arch)
                        info.conflicts.append(
                            {
                                "architecture": arch,
                                "plugins": sorted(claimants),
                                "preferred": preferred if preferred in claimants else None,
                            }
                        )
            return infos

    def architectures(self) -> dict[str, list[str]]:
        """Architecture -> names of the loaded plugins claiming it."""
        self.discover()
        with self._lock:
            return {arch: [r.plugin for r in refs] for arch, refs in sorted(self._claims.items())}

    def demo_models(self) -> list[DemoModel]:
        """Every demo model the loaded plugins offer, by name."""
        self.discover()
        with self._lock:
            return [demo for name in sorted(self._demos) for demo in self._demos[name]]

    def demo_model(self, name: str) -> DemoModel:
        """The demo model called ``name``; a clear error lists the ones there are."""
        self.discover()
        with self._lock:
            offers = list(self._demos.get(name, []))
            available = sorted(self._demos)
        if len(offers) == 1:
            return offers[0]
        if offers:
            raise PluginConflictError(f"demo:{name}", [d.plugin for d in offers])
        if not available:
            raise PluginError(
                f"no demo model {name!r}: no installed plugin offers demo models "
                "(`mmproc plugins` lists the installed plugins)"
            )
        raise ConfigurationError(
            f"no demo model {name!r}; the installed plugins offer: "
            + ", ".join(f"demo:{n}" for n in available)
        )

    def _preferences(self, prefer: Mapping[str, str] | None = None) -> dict[str, str]:
        prefs = parse_preferences(self._environ.get("MMPROC_PREFER", ""))
        prefs.update(self._prefer)
        prefs.update(prefer or {})
        return prefs

    def resolve(
        self, architecture: str, *, prefer: Mapping[str, str] | None = None
    ) -> ModelReference:
        """The plugin class serving ``architecture``.

        Raises :class:`UnknownArchitectureError` when nothing serves it and
        :class:`PluginConflictError` when several plugins do and no preference picks one.
        """
        self.discover()
        with self._lock:
            claims = list(self._claims.get(architecture, []))
            if not claims:
                raise self._unknown_architecture(architecture)
            if len(claims) == 1:
                return claims[0]
            preferred = self._preferences(prefer).get(architecture)
            if preferred is not None:
                for ref in claims:
                    if ref.plugin == preferred:
                        return ref
                raise ConfigurationError(
                    f"the preference {architecture}={preferred} names a plugin that does not "
                    f"serve it; it is served by: {', '.join(sorted(r.plugin for r in claims))}"
                )
            raise PluginConflictError(architecture, [ref.plugin for ref in claims])

    def _unknown_architecture(self, architecture: str) -> UnknownArchitectureError:
        """The lookup error, naming the failed plugins that claimed it, or else (when none did)
        the plugins that never said what they serve (disabled, incompatible, failed early)."""
        claimed = [
            f"{name} ({self._plugins[name].error})"
            for name in self._failed_claims.get(architecture, [])
        ]
        silent = [
            f"{info.name} ({info.status}: {info.error})"
            for info in sorted(self._plugins.values(), key=lambda i: i.name)
            if info.status is not PluginStatus.LOADED and not info.architectures
        ]
        return UnknownArchitectureError(architecture, list(self._claims), claimed, silent)

    def resolve_folder(
        self, folder: str | os.PathLike[str], *, prefer: Mapping[str, str] | None = None
    ) -> ModelReference:
        """The plugin class serving a local model folder, by its ``config.json`` architectures."""
        from mmproc.context import read_model_config

        path = Path(folder)
        config = read_model_config(path)
        names = config.get("architectures")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise UnknownArchitectureError(
                f"(none listed in {path / 'config.json'})", list(self.architectures())
            )
        first_error: UnknownArchitectureError | None = None
        for name in names:
            try:
                return self.resolve(name, prefer=prefer)
            except UnknownArchitectureError as exc:
                first_error = first_error or exc
        assert first_error is not None
        raise first_error


_default_registry: Registry | None = None
_default_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry (created on first use; discovery still waits for a lookup)."""
    global _default_registry
    with _default_lock:
        if _default_registry is None:
            _default_registry = Registry()
        return _default_registry
