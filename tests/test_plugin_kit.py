"""The plugin author kit: ``mmproc new-plugin`` output passes its own tests from a wheel install,
and the conformance suite fails deliberately broken plugins with messages naming each problem.

The broken plugins are the scaffold's output with one mistake each, the ones authors make: a
kwarg filter closing over the original processor, a ``process_mm_data`` reading a stored
processor, a heavy import in the entry-point module, a placeholder count one off, a required hook
left out. Each is built as a wheel and installed into a folder of its own, and pytest runs the
suite on it in a fresh interpreter. The test distribution ``tests/plugins/flawed`` holds more: a
tiling model that keeps padded tiles whole, one deaf to per-request ``hf_kwargs`` and one with
blank pixels, next to the tiling model done right.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mmproc.cli import main
from mmproc.errors import ConfigurationError
from mmproc.scaffold import TEMPLATES, write_plugin

ARCH = "KitTestForConditionalGeneration"
FLAWED = Path(__file__).parent / "plugins" / "flawed"

CLOSURE_FILTER = """
    @hookimpl
    def load_hf_processor(self, ctx):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(ctx.require_model_path(), local_files_only=True)
        image_processor = processor.image_processor
        original = image_processor.preprocess

        def preprocess(images, **kwargs):  # closes over the original image processor
            return original(images, **kwargs)

        image_processor.preprocess = preprocess
        return processor
"""

STORED_PROCESSOR = """
    @hookimpl
    def load_hf_processor(self, ctx):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(
            ctx.require_model_path(), local_files_only=True
        )
        return self.processor

    @hookimpl
    def process_mm_data(self, prompt, mm_items, hf_kwargs):
        images = list(mm_items.get("image", ())) or None
        return self.processor(text=[prompt], images=images, return_tensors="pt", **hf_kwargs)
"""

# name -> (file, text to find, its replacement), the failing test, what its message says
FLAWS = {
    "kit_closure": (
        ("model.py", '    """Hooks for ', CLOSURE_FILTER.lstrip("\n") + '\n    """Hooks for '),
        "test_a_deep_copy_of_the_processor_does_not_reach_the_original",
        "closure over the original CLIPImageProcessor",
    ),
    "kit_stored": (
        ("model.py", '    """Hooks for ', STORED_PROCESSOR.lstrip("\n") + '\n    """Hooks for '),
        "test_process_mm_data_uses_the_processor_it_is_given",
        "process_mm_data must use the `processor` argument",
    ),
    "kit_heavy": (
        (
            "plugin.py",
            "from mmproc.plugin import ModelRegistrar, hookimpl",
            "import torch  # noqa: F401\nfrom mmproc.plugin import ModelRegistrar, hookimpl",
        ),
        "test_the_entry_point_module_imports_nothing_heavy",
        "imports torch",
    ),
    "kit_count": (
        ("model.py", "count -= 1", "pass  # forgot: the default strategy drops the CLS feature"),
        "test_requests_match_the_hf_processor",
        "image placeholder tokens (",
    ),
    "kit_missing": (
        ("model.py", "    @hookimpl\n    def get_mm_fields(", "    def fields("),
        "test_the_model_class_passes_the_hook_checks",
        "does not implement the required hook 'get_mm_fields'",
    ),
}

# A test of the suite that none of the flaws but a missing hook should fail.
UNTOUCHED = "test_a_cache_hit_gives_what_the_miss_gave"


def install(sources: list[Path], site: Path) -> None:
    """Build each distribution as a wheel and install them all into ``site``."""
    wheels = site.parent / "wheels"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), *map(str, sources)],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), *map(str, wheels.glob("*.whl"))],
        check=True,
        capture_output=True,
    )


def site_env(site: Path) -> dict[str, str]:
    """The environment of a fresh interpreter that sees the wheels installed in ``site`` (ahead
    of this one's path, so the mmproc under test is the one it imports) and every plugin."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    env.pop("MMPROC_PLUGINS", None)
    return env


def run_mmproc(code: str, site: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (with ``flags``, e.g. ``-O``) that sees ``site``."""
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        capture_output=True,
        text=True,
        env=site_env(site),
        timeout=300,
    )


def run_pytest(
    tests: Path, site: Path, cwd: Path, *options: str
) -> subprocess.CompletedProcess[str]:
    """pytest on ``tests`` (with ``options``, e.g. ``-k``) in a fresh interpreter that sees the
    wheels installed in ``site``."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfEs",
            *options,
            str(tests),
        ],
        capture_output=True,
        text=True,
        env=site_env(site),
        cwd=cwd,  # not the sources' folder: the wheel's copy is the one imported
        timeout=600,
    )


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_new_plugin_output_passes_its_own_tests_from_a_wheel(tmp_path: Path, template: str) -> None:
    source = tmp_path / "src"
    args = ["new-plugin", "kit_good", "--architecture", ARCH, "--path", str(source)]
    assert main([*args, "--template", template]) == 0
    install([source], tmp_path / "site")
    result = run_pytest(source / "tests", tmp_path / "site", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
    assert " skipped" not in result.stdout  # device normalisation and every check apply


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_new_plugin_output_passes_ruff_with_its_defaults_and_ours(
    tmp_path: Path, template: str
) -> None:
    source = write_plugin("kit_lint", ARCH, tmp_path / "src", template=template)
    ours = ["--select", "E,F,W,I,B,UP,RUF", "--ignore", "RUF001,RUF002,RUF003"]
    for command in (
        ["check", "--isolated"],  # ruff's default rules
        ["check", "--isolated", "--line-length", "100", *ours],  # mmproc's
        ["check"],  # the generated pyproject's
        ["format", "--check", "--isolated"],
        ["format", "--check"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "--no-cache", "."],
            capture_output=True,
            text=True,
            cwd=source,
        )
        assert result.returncode == 0, (command, result.stdout + result.stderr)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_new_plugin_output_imports_only_the_plugin_face_and_in_tests_the_kit(
    tmp_path: Path, template: str
) -> None:
    import ast

    source = write_plugin("kit_face", ARCH, tmp_path / "src", template=template)
    for path in source.rglob("*.py"):
        allowed = {"mmproc.plugin"} | (
            {"mmproc", "mmproc.testing.suite"} if "tests" in path.parts else set()
        )
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                if name == "mmproc" or name.startswith("mmproc."):
                    assert name in allowed, f"{path.relative_to(source)} imports {name}"


def test_new_plugin_refuses_an_unknown_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigurationError, match="unknown template 'tiles'; the templates are: "):
        write_plugin("ok", ARCH, tmp_path / "a", template="tiles")
    with pytest.raises(SystemExit):
        main(["new-plugin", "ok", "--architecture", ARCH, "--template", "tiles"])
    assert "invalid choice: 'tiles'" in capsys.readouterr().err


def test_the_conformance_suite_names_the_problem_of_each_broken_plugin(tmp_path: Path) -> None:
    sources = []
    for name, ((file, find, replace), _, _) in FLAWS.items():
        folder = write_plugin(name, f"{name.title().replace('_', '')}Arch", tmp_path / name)
        target = folder / f"mmproc_{name}" / file
        text = target.read_text()
        assert find in text, f"the scaffold changed: {find!r} is not in {file}"
        target.write_text(text.replace(find, replace, 1))
        sources.append(folder)
    install(sources, tmp_path / "site")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_broken.py").write_text(
        "from mmproc.testing.suite import PluginConformance\n"
        + "".join(
            f"\n\nclass Test_{name}(PluginConformance):\n"
            f"    plugin = {name!r}\n    model = {'demo:' + name.replace('_', '-')!r}\n"
            for name in FLAWS
        )
    )
    # Each class runs the test each flaw should fail, and one no flaw but a missing hook
    # touches: every plugin must fail its own flaw's test and pass the others.
    judged = sorted({test for _, test, _ in FLAWS.values()} | {UNTOUCHED})
    result = run_pytest(tests, tmp_path / "site", tmp_path, "-k", " or ".join(judged))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    # `mmproc which FOLDER --check` runs a request and reports the count one off too.
    check = run_mmproc(
        "import sys; from mmproc.registry import get_registry; from mmproc.cli import main; "
        f"folder = get_registry().demo_model('kit-count').write({str(tmp_path / 'count')!r}); "
        "sys.exit(main(['which', str(folder), '--check']))",
        tmp_path / "site",
    )
    assert check.returncode == 1, check.stdout + check.stderr
    assert "image: against the HF processor called directly" in check.stdout
    assert "image placeholder tokens (" in check.stdout and "get_prompt_updates" in check.stdout
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    for name, (_, test, message) in FLAWS.items():
        mine = {
            line.split("::")[2].split()[0].split("[")[0]
            for line in failed
            if f"Test_{name}::" in line
        }
        assert message in result.stdout, (name, message)
        # Failures point at the mistake: what it does not touch still passes. Without the hook
        # no processor can be built, so every test that needs one fails too.
        if name == "kit_missing":
            assert {test, UNTOUCHED} <= mine, (name, mine)
        else:
            assert mine == {test}, (name, mine)


def test_new_plugin_refuses_bad_names_and_a_used_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="plugin name 'My-Model'"):
        write_plugin("My-Model", ARCH, tmp_path / "a")
    with pytest.raises(ConfigurationError, match="architecture 'not an id'"):
        write_plugin("ok", "not an id", tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "file").write_text("x")
    with pytest.raises(ConfigurationError, match="exists and is not an empty folder"):
        write_plugin("ok", ARCH, tmp_path / "c")


def test_which_check_runs_a_request_per_modality_through_both_paths_and_hf(
    qwen_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["which", str(qwen_folder), "--check"]) == 0
    out = capsys.readouterr().out
    assert "(hooks and one request per modality checked)" in out
    assert "image: ok (the cached path, HF expansion and HF agree)" in out
    assert "video: ok (the cached path, HF expansion and HF agree)" in out


def test_which_checks_a_demo_model_by_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["which", "demo:qwen2.5-vl", "--check", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["architecture"] == "Qwen2_5_VLForConditionalGeneration"
    # Its videos go with their frames' times (Qwen2.5-VL's second_per_grid_ts reads them).
    assert record["requests"] == {"image": "ok", "video": "ok"}


def test_which_check_builds_the_processors_with_the_options_given(
    qwen_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["which", str(qwen_folder), "--check", "--option", "backend=pil", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["options"] == {"backend": "pil"}
    assert record["checked"] == "hooks and one request per modality with backend='pil'"
    assert record["requests"] == {"image": "ok", "video": "ok"}


def test_which_check_options_that_do_not_fit_are_errors_naming_them(
    qwen_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["which", str(qwen_folder), "--check", "--option", "hash_algo=xxh3"]) == 2
    assert "did you mean 'hash_algorithm'" in capsys.readouterr().err
    assert main(["which", str(qwen_folder), "--check", "--option", "workers=2"]) == 2
    assert "mmproc which --check sets workers itself" in capsys.readouterr().err
    assert main(["which", "Qwen2VLForConditionalGeneration", "--option", "backend=pil"]) == 2
    assert "--option goes with --check on a model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["which", str(qwen_folder), "--check", "--option", "novalue"])
    assert "option must be KEY=VALUE" in capsys.readouterr().err


# --- the flawed test plugins ----------------------------------------------------------------------

FLAWED_SUITES = """
from mmproc.testing.suite import PluginConformance


class TestTiles(PluginConformance):
    plugin = "tiles"
    model = "demo:tiles"


class TestTilesBatched(PluginConformance):
    plugin = "tiles_batched"
    model = "demo:tiles-batched"


class TestFixedDeaf(PluginConformance):
    plugin = "fixed_deaf"
    model = "demo:fixed-deaf"
    request_kwargs = {"size": {"shortest_edge": 56}, "crop_size": {"height": 56, "width": 56}}
"""


@pytest.fixture(scope="module")
def flawed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The flawed test plugins, built as a wheel and installed into a folder of their own."""
    root = tmp_path_factory.mktemp("flawed")
    # From a copy, so that no build/ or egg-info folders land in the source tree.
    source = shutil.copytree(FLAWED, root / "source")
    install([source], root / "site")
    return root / "site"


@pytest.fixture(scope="module")
def flawed_suite(flawed_site: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """pytest's report of the conformance suite on the flawed plugins (one run for all)."""
    root = tmp_path_factory.mktemp("flawed-tests")
    (root / "tests").mkdir()
    (root / "tests" / "test_flawed.py").write_text(FLAWED_SUITES)
    result = run_pytest(root / "tests", flawed_site, cwd=root)
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-2000:]
    return result.stdout


def failures_of(report: str, cls: str) -> list[str]:
    """The ``FAILED`` lines of the suite class ``cls``."""
    return [
        line
        for line in report.splitlines()
        if line.startswith(f"FAILED tests/test_flawed.py::{cls}::")
    ]


def test_a_plugin_that_cuts_padded_tiles_per_item_passes_the_suite(flawed_suite: str) -> None:
    assert failures_of(flawed_suite, "TestTiles") == [], flawed_suite[-3000:]
    assert "TestTiles::test_an_item_in_a_batch_of_others_equals_the_item_processed_alone" not in (
        flawed_suite
    )


def test_a_plugin_that_keeps_padded_tiles_whole_fails_the_suite_naming_get_mm_fields(
    flawed_suite: str,
) -> None:
    failed = failures_of(flawed_suite, "TestTilesBatched")
    assert [line.split("::")[2].split()[0] for line in failed] == [
        "test_an_item_in_a_batch_of_others_equals_the_item_processed_alone"
    ], flawed_suite[-3000:]
    assert (
        "image item 1 of 3 processed together (with others of other sizes) and the same item"
        in (flawed_suite)
    )
    assert "shape (5, 3, 56, 56) vs (4, 3, 56, 56)" in flawed_suite
    assert "check get_mm_fields (an output padded to the batch's longest needs PaddedField" in (
        flawed_suite
    )


def test_a_plugin_that_ignores_request_kwargs_fails_the_suite_naming_process_mm_data(
    flawed_suite: str,
) -> None:
    failed = failures_of(flawed_suite, "TestFixedDeaf")
    assert [line.split("::")[2].split()[0] for line in failed] == [
        "test_per_request_hf_kwargs_match_the_hf_processor_called_with_them"
    ], flawed_suite[-3000:]
    assert "(process_mm_data must pass the request's hf_kwargs on to the HF processor" in (
        flawed_suite
    )


def test_which_check_fails_a_plugin_that_differs_from_hf_under_python_O(
    flawed_site: Path, tmp_path: Path
) -> None:
    code = (
        "import sys; from mmproc.registry import get_registry; from mmproc.cli import main; "
        "print('debug', __debug__); "
        f"folder = get_registry().demo_model('fixed-blank').write({str(tmp_path / 'blank')!r}); "
        "sys.exit(main(['which', str(folder), '--check']))"
    )
    check = run_mmproc(code, flawed_site, "-O")
    assert "debug False" in check.stdout  # asserts are off in that interpreter
    assert check.returncode == 1, check.stdout + check.stderr
    assert "image: against the HF processor called directly:" in check.stdout
    assert "'pixel_values' differs from HF's: check process_mm_data" in check.stdout
