"""The plugin registry, on real distributions installed with pip into a temporary folder.

Each test runs a fresh Python process whose path holds those distributions, so entry points,
imports and environment variables behave exactly as in a user's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TEST_PLUGINS = Path(__file__).parent / "plugins"
ALL_TEST_PLUGINS = "good,broken,halfway,rival,future,typo"


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test plugin distributions, built and installed for real into their own folder."""
    target = tmp_path_factory.mktemp("plugin-site")
    build = tmp_path_factory.mktemp("plugin-build")
    # Build from copies so no build/ or egg-info folders land in the source tree.
    sources = []
    for src in sorted(TEST_PLUGINS.iterdir()):
        dst = build / src.name
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        sources.append(str(dst))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(target),
            *sources,
        ],
        check=True,
        capture_output=True,
    )
    return target


def run_python(
    site: Path, code: str, *, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that sees the test plugins (and only those)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MMPROC_")}
    full_env["PYTHONPATH"] = str(site)
    full_env.setdefault("MMPROC_PLUGINS", ALL_TEST_PLUGINS)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_cli(site: Path, *args: str, env: dict[str, str] | None = None):
    return run_python(
        site, f"import sys; from mmproc.cli import main; sys.exit(main({list(args)!r}))", env=env
    )


def plugins_json(site: Path, env: dict[str, str] | None = None) -> dict[str, dict]:
    result = run_cli(site, "plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)}


def test_plugins_json_reports_every_plugin_with_its_fields(plugin_site: Path) -> None:
    plugins = plugins_json(plugin_site)
    test_plugins = {"good", "broken", "halfway", "rival", "future", "typo"}
    assert test_plugins <= set(plugins)
    # Plugins installed in the environment but not allow-listed are listed, as disabled.
    assert {p["status"] for n, p in plugins.items() if n not in test_plugins} <= {"disabled"}
    for record in plugins.values():
        assert set(record) == {
            "name",
            "distribution",
            "version",
            "status",
            "architectures",
            "demo_models",
            "conflicts",
            "error",
        }
    good = plugins["good"]
    assert good["status"] == "loaded"
    assert good["distribution"] == "mmproc-test-good"
    assert good["version"] == "1.2.3"
    assert good["architectures"] == ["GoodModelForTest", "SharedArch"]
    assert good["error"] is None


def test_broken_plugin_is_failed_and_the_good_one_still_serves(plugin_site: Path) -> None:
    plugins = plugins_json(plugin_site)
    assert plugins["broken"]["status"] == "failed"
    assert "RuntimeError: broken plugin exploded on import" in plugins["broken"]["error"]
    result = run_cli(plugin_site, "which", "GoodModelForTest")
    assert result.returncode == 0, result.stderr
    assert "plugin good" in result.stdout
    assert "mmproc_test_good.model:GoodModel" in result.stdout


def test_failed_registration_is_rolled_back_and_named_at_lookup(plugin_site: Path) -> None:
    plugins = plugins_json(plugin_site)
    assert plugins["halfway"]["status"] == "failed"
    assert "halfway plugin gave up" in plugins["halfway"]["error"]
    result = run_python(
        plugin_site,
        """
        import mmproc
        from mmproc.errors import UnknownArchitectureError
        registry = mmproc.get_registry()
        assert "HalfwayArch" not in registry.architectures()
        try:
            registry.resolve("HalfwayArch")
        except UnknownArchitectureError as exc:
            print(exc)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "claimed by plugins that then failed to load: halfway (ValueError: halfway plugin gave up"
        in result.stdout
    )


def test_unknown_architecture_lists_what_is_registered(plugin_site: Path) -> None:
    result = run_cli(plugin_site, "which", "NoSuchModel")
    assert result.returncode == 2
    assert "no plugin serves architecture 'NoSuchModel'" in result.stderr
    assert "GoodModelForTest" in result.stderr
    # Plugins that never loaded may serve it: they are named.
    assert "broken (failed" in result.stderr
    assert "future (incompatible" in result.stderr


def test_disabled_plugin_is_named_when_its_architecture_is_asked_for(plugin_site: Path) -> None:
    env = {"MMPROC_DISABLE_PLUGINS": "good"}
    plugins = plugins_json(plugin_site, env)
    assert plugins["good"]["status"] == "disabled"
    assert "MMPROC_DISABLE_PLUGINS" in plugins["good"]["error"]
    result = run_cli(plugin_site, "which", "GoodModelForTest", env=env)
    assert result.returncode == 2
    assert "good (disabled" in result.stderr


def test_allow_list_acts_before_import(plugin_site: Path) -> None:
    plugins = plugins_json(plugin_site, {"MMPROC_PLUGINS": "good"})
    assert plugins["good"]["status"] == "loaded"
    # 'broken' raises on import: disabled means it was never imported.
    assert plugins["broken"]["status"] == "disabled"
    assert plugins["broken"]["error"] == "not in MMPROC_PLUGINS"
    empty = plugins_json(plugin_site, {"MMPROC_PLUGINS": ""})
    assert {p["status"] for p in empty.values()} == {"disabled"}


def test_incompatible_plugin_is_reported_and_never_imported(plugin_site: Path) -> None:
    plugins = plugins_json(plugin_site)
    future = plugins["future"]
    assert future["status"] == "incompatible"
    assert "targets plugin API 99" in future["error"]
    # Its module raises AssertionError on import, so 'incompatible' (not 'failed') proves it
    # was not imported.
    assert "AssertionError" not in future["error"]


def test_the_declared_api_version_is_the_value_of_the_constant_named(plugin_site: Path) -> None:
    # The good plugin names mmproc.hookspecs:PLUGIN_API_V2; were that constant to say 3, the
    # plugin would declare API 3, which this core does not provide.
    result = run_python(
        plugin_site,
        """
        import mmproc.hookspecs
        mmproc.hookspecs.PLUGIN_API_V2 = 3
        import mmproc
        [good] = [p for p in mmproc.get_registry().plugins() if p.name == "good"]
        print(good.status, good.error)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "incompatible targets plugin API 3" in result.stdout


def test_conflict_is_an_error_naming_both_until_a_preference_resolves_it(plugin_site: Path) -> None:
    result = run_cli(plugin_site, "which", "SharedArch")
    assert result.returncode == 2
    assert "claimed by several plugins: good, rival" in result.stderr
    plugins = plugins_json(plugin_site)
    assert plugins["rival"]["conflicts"] == [
        {"architecture": "SharedArch", "plugins": ["good", "rival"], "preferred": None}
    ]
    resolved = run_cli(
        plugin_site, "which", "SharedArch", env={"MMPROC_PREFER": "SharedArch=rival"}
    )
    assert resolved.returncode == 0, resolved.stderr
    assert "plugin rival" in resolved.stdout
    by_argument = run_python(
        plugin_site,
        """
        import mmproc
        print(mmproc.get_registry().resolve("SharedArch", prefer={"SharedArch": "good"}).plugin)
        """,
    )
    assert by_argument.stdout.strip() == "good", by_argument.stderr


def test_bad_preference_setting_is_a_clear_error(plugin_site: Path) -> None:
    result = run_cli(plugin_site, "which", "SharedArch", env={"MMPROC_PREFER": "SharedArch"})
    assert result.returncode == 2
    assert "MMPROC_PREFER entry 'SharedArch' must look like 'Architecture=plugin'" in result.stderr
    wrong = run_cli(plugin_site, "which", "SharedArch", env={"MMPROC_PREFER": "SharedArch=typo"})
    assert "names a plugin that does not serve it" in wrong.stderr


def test_strict_mode_raises_for_a_broken_plugin(plugin_site: Path) -> None:
    code = """
        import mmproc
        from mmproc.errors import PluginLoadError
        try:
            mmproc.get_registry().plugins()
        except PluginLoadError as exc:
            print("raised:", exc.plugin, exc.distribution, exc.version, type(exc.cause).__name__)
        """
    by_env = run_python(plugin_site, code, env={"MMPROC_STRICT_PLUGINS": "1"})
    assert "raised: broken mmproc-test-broken 1.2.3 RuntimeError" in by_env.stdout, by_env.stderr
    by_argument = run_python(
        plugin_site,
        """
        from mmproc.registry import Registry
        from mmproc.errors import PluginLoadError
        try:
            Registry(strict=True).discover()
        except PluginLoadError as exc:
            print("raised:", exc.plugin)
        """,
    )
    assert "raised: broken" in by_argument.stdout, by_argument.stderr


@pytest.mark.parametrize(
    ("architecture", "message"),
    [
        ("MisspelledHookModel", "(did you mean 'get_prompt_updates'?) is not a hook"),
        ("WrongArgumentModel", "get_dummy_text"),
        ("UnmarkedHookModel", "method 'get_dummy_text' is not marked @mmproc.hookimpl"),
        ("MissingHookModel", "does not implement the required hooks 'get_mm_fields', "),
    ],
)
def test_hook_mistakes_are_errors_naming_plugin_class_and_hook(
    plugin_site: Path, architecture: str, message: str
) -> None:
    result = run_cli(plugin_site, "which", "--check", architecture)
    assert result.returncode == 2
    assert "plugin 'typo'" in result.stderr
    assert f"class mmproc_test_typo.model.{architecture.removesuffix('Model')}" in result.stderr
    assert message in result.stderr


def test_wrong_argument_names_the_argument_and_the_hooks_arguments(plugin_site: Path) -> None:
    result = run_cli(plugin_site, "which", "--check", "WrongArgumentModel")
    assert "hook 'get_dummy_text' has no argument 'counts' (did you mean 'mm_counts'?)" in (
        result.stderr
    )
    assert "its arguments are: ctx, mm_counts" in result.stderr


def test_listing_plugins_imports_no_model_class_and_no_transformers(plugin_site: Path) -> None:
    result = run_python(
        plugin_site,
        """
        import sys
        import mmproc
        assert "transformers" not in sys.modules and "torch" not in sys.modules
        from mmproc.cli import main
        main(["plugins"])
        heavy = [m for m in ("transformers", "torch", "mmproc_test_good.model") if m in sys.modules]
        print("HEAVY", heavy)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


def test_lookup_by_model_folder_uses_config_architectures(
    plugin_site: Path, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["NotServed", "GoodModelForTest"]})
    )
    result = run_cli(plugin_site, "which", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["architecture"] == "GoodModelForTest"
    (tmp_path / "config.json").write_text("{not json")
    bad = run_cli(plugin_site, "which", str(tmp_path))
    assert bad.returncode == 2
    assert "config.json is not valid JSON" in bad.stderr


def test_model_relay_uses_model_answers_then_core_defaults(plugin_site: Path) -> None:
    result = run_python(
        plugin_site,
        """
        import mmproc
        from mmproc.context import ModelContext
        from mmproc.model_hooks import load_model_hooks
        hooks = load_model_hooks(mmproc.get_registry().resolve("GoodModelForTest"))
        ctx = ModelContext("GoodModelForTest", plugin=hooks.plugin)
        print(hooks.get_dummy_text(ctx, {"image": 2}))
        print(hooks.worker_count_hint(ctx, "cpu"))
        print(hooks.supports_concurrency(ctx))
        print(hooks.device_norm_spec(ctx, None))
        print(hooks.get_prompt_updates(ctx, None, {}, {}))
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["<img><img>", "3", "False", "None", "[]"]


def test_in_process_plugin_goes_through_the_same_checks() -> None:
    from mmproc import hookimpl
    from mmproc.errors import PluginLoadError, PluginSpecError
    from mmproc.model_hooks import load_model_hooks
    from mmproc.registry import PluginStatus, Registry

    class Plugin:
        @hookimpl
        def mmproc_register_models(self, registry):
            registry.register("InProcessArch", "mmproc_test_missing.model:Nothing")

    class BadPlugin:
        @hookimpl
        def mmproc_register_modles(self, registry):
            pass

    class UnmarkedPlugin:
        def mmproc_register_models(self, registry):
            registry.register("NeverArch", "mmproc_test_missing.model:Nothing")

    registry = Registry(entry_points=False)
    # A class is made with no arguments, as an installed plugin's object would be.
    assert registry.add_plugin(Plugin, name="inproc").status is PluginStatus.LOADED
    with pytest.raises(PluginLoadError, match=r"did you mean 'mmproc_register_models'\?"):
        registry.add_plugin(BadPlugin(), name="bad")
    with pytest.raises(PluginLoadError, match=r"is not marked @mmproc\.hookimpl"):
        registry.add_plugin(UnmarkedPlugin(), name="unmarked")
    statuses = {info.name: info.status for info in registry.plugins()}
    assert statuses == {
        "inproc": PluginStatus.LOADED,
        "bad": PluginStatus.FAILED,
        "unmarked": PluginStatus.FAILED,
    }
    with pytest.raises(PluginSpecError, match="cannot import model class"):
        load_model_hooks(registry.resolve("InProcessArch"))


def test_importing_mmproc_is_light() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mmproc, sys; assert 'transformers' not in sys.modules; "
            "assert 'torch' not in sys.modules; print(sorted(mmproc.__all__) == mmproc.__all__)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "True"


def test_plugins_strict_exits_non_zero_listing_every_plugin_that_failed(plugin_site: Path) -> None:
    lenient = run_cli(plugin_site, "plugins")
    assert lenient.returncode == 0
    strict = run_cli(plugin_site, "plugins", "--strict")
    assert strict.returncode == 1
    for line in (
        "mmproc: plugin broken is failed: ",
        "mmproc: plugin halfway is failed: ",
        "mmproc: plugin future is incompatible: ",
    ):
        assert line in strict.stderr
    assert "plugin good" not in strict.stderr
    assert "good  [loaded]" in strict.stdout  # the listing itself is the same
    only_good = run_cli(plugin_site, "plugins", "--strict", env={"MMPROC_PLUGINS": "good"})
    assert only_good.returncode == 0 and only_good.stderr == ""


def test_plugins_listing_shows_demo_models_and_says_why_a_plugin_is_disabled(
    plugin_site: Path,
) -> None:
    result = run_cli(plugin_site, "plugins", env={"MMPROC_PLUGINS": "good,qwen_vl"})
    assert result.returncode == 0, result.stderr
    assert "    demo model: demo:qwen2-vl\n" in result.stdout
    broken = result.stdout.split("broken  [disabled]")[1].splitlines()[1]
    assert broken == "    why: not in MMPROC_PLUGINS"
    assert "error:" not in result.stdout
