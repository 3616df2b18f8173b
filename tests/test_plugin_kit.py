"""The plugin author kit: ``mmproc new-plugin`` output passes its own tests from a wheel install,
and the conformance suite fails deliberately broken plugins with messages naming each problem.

The broken plugins are the scaffold's output with one mistake each, the ones authors make: a
kwarg filter closing over the original processor, a ``process_mm_data`` reading a stored
processor, a heavy import in the entry-point module, a placeholder count one off, a required hook
left out. Each is built as a wheel and installed into a folder of its own, and pytest runs the
suite on it in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mmproc.cli import main
from mmproc.errors import ConfigurationError
from mmproc.scaffold import write_plugin

ARCH = "KitTestForConditionalGeneration"

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
            "from mmproc.plugin import hookimpl",
            "import torch  # noqa: F401\nfrom mmproc.plugin import hookimpl",
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


def install(sources: list[Path], site: Path) -> None:
    """Build each distribution as a wheel and install them all into ``site``."""
    wheels = site.parent / "wheels"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    for source in sources:
        subprocess.run(
            [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
            check=True,
            capture_output=True,
        )
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), *map(str, wheels.glob("*.whl"))],
        check=True,
        capture_output=True,
    )


def run_mmproc(code: str, site: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter that sees the wheels installed in ``site``."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("MMPROC_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )


def run_pytest(tests: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """pytest on ``tests`` in a fresh interpreter that sees the wheels installed in ``site``."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("MMPROC_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", str(tests)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,  # not the sources' folder: the wheel's copy is the one imported
        timeout=600,
    )


def test_new_plugin_output_passes_its_own_tests_from_a_wheel(tmp_path: Path) -> None:
    assert (
        main(["new-plugin", "kit_good", "--architecture", ARCH, "--path", str(tmp_path / "src")])
        == 0
    )
    install([tmp_path / "src"], tmp_path / "site")
    result = run_pytest(tmp_path / "src" / "tests", tmp_path / "site", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


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
    result = run_pytest(tests, tmp_path / "site", cwd=tmp_path)
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
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    for name, (_, test, message) in FLAWS.items():
        mine = [line for line in failed if f"Test_{name}::" in line]
        assert any(f"::{test}" in line for line in mine), (name, mine)
        assert message in result.stdout, (name, message)
        # Failures point at the mistake: what it does not touch still passes.
        if name != "kit_missing":  # without the hook, no processor can be built at all
            assert not any("::test_a_cache_hit_gives_what_the_miss_gave" in x for x in mine)


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
