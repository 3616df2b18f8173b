"""Probes for the mistakes a plugin author makes that work in one thread and fail in the pool.

* :func:`links_to_original`: after ``copy.deepcopy(processor)`` (what every worker does), a
  customisation that still reaches the original (a closure over it, a method bound to it, a stored
  reference) makes every worker call into the one original: the seed's Sarashina2 bug.
* :func:`poisoned`: replaces the working parts of processors with stand-ins that raise when used,
  so a ``process_mm_data`` that calls a stored processor instead of the clone it is given fails
  loudly: the seed's ERNIE-4.5-VL / MiDashengLM bug.
* :func:`heavy_imports`: what importing an entry-point module imports (it must stay light).
"""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["HEAVY_MODULES", "heavy_imports", "links_to_original", "poisoned"]

HEAVY_MODULES = ("torch", "transformers", "torchvision", "numpy", "PIL")
"""Modules a plugin's entry-point module must not import (``mmproc plugins`` stays instant)."""

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, type)
# The parts of an HF processor worth poisoning: whatever does the work when it is called.
_WORKING_PARTS = ("tokenizer", "image_processor", "video_processor", "feature_extractor")


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """The objects ``obj`` holds, with a path step for messages."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, list | tuple | set | frozenset):
        for index, value in enumerate(obj):
            yield f"[{index}]", value
    else:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            for key, value in state.items():
                yield f".{key}", value


def _walk(root: Any, name: str) -> Iterator[tuple[str, Any]]:
    """Every object reachable from ``root`` through containers and instance dicts, with its path.

    Functions, methods, modules and classes are reported but not entered: their insides belong to
    code, not to the processor's state.
    """
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(name, root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        yield path, obj
        if isinstance(obj, types.FunctionType | types.MethodType | types.ModuleType | type):
            continue
        stack.extend((path + step, child) for step, child in _children(obj))


def links_to_original(original: Any, clone: Any, *, name: str = "processor") -> list[str]:
    """Where ``clone`` (a deep copy of ``original``) still reaches objects of ``original``.

    Looks at every function and bound method held in the clone's state: a bound method whose
    ``__self__``, or a function whose closure, is an object of the original's. Each finding is a
    line naming the attribute path and what it points at.
    """
    originals = {id(obj) for _, obj in _walk(original, name)}
    findings: list[str] = []
    for path, obj in _walk(clone, name):
        if isinstance(obj, types.MethodType) and id(obj.__self__) in originals:
            findings.append(
                f"{path} is a method bound to the original {type(obj.__self__).__name__}, not "
                "to the copy (a function assigned after binding it by hand?)"
            )
        function = obj.__func__ if isinstance(obj, types.MethodType) else obj
        if isinstance(function, types.FunctionType) and function.__closure__:
            for cell in function.__closure__:
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                # A captured bound method reaches the original through its __self__.
                held = value.__self__ if isinstance(value, types.MethodType) else value
                if id(held) in originals:
                    findings.append(
                        f"{path} ({function.__qualname__}) is a closure over the original "
                        f"{type(held).__name__}: bind it with types.MethodType so that "
                        "copy.deepcopy rebinds it to each copy"
                    )
    return findings


class _Poison:
    """Stands in for a processor part that must not be used; says so on any use."""

    def __init__(self, what: str) -> None:
        self._what = what

    def _fail(self) -> Any:
        raise AssertionError(
            f"{self._what} was used: process_mm_data must use the `processor` argument (the "
            "worker thread's own clone), never a processor stored on the model or elsewhere"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._fail()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fail()


@contextmanager
def poisoned(*holders: Any, what: str = "a stored processor") -> Iterator[None]:
    """Within the block, the working parts of every processor in ``holders`` raise when used.

    A holder is a processor (its tokenizer, image / video processor and feature extractor are
    poisoned) or any object whose attributes hold processors (a model object: each attribute
    that has working parts is poisoned the same way). Everything is restored afterwards.
    """
    undo: list[tuple[Any, str, Any]] = []
    try:
        for holder in holders:
            targets = [(holder, "")]
            state = getattr(holder, "__dict__", {})
            targets += [(value, f".{key}") for key, value in state.items()]
            for target, step in targets:
                target_state = getattr(target, "__dict__", None)
                if not isinstance(target_state, dict):
                    continue
                for part in _WORKING_PARTS:
                    if part in target_state and target_state[part] is not None:
                        undo.append((target, part, target_state[part]))
                        label = f"{what}{step}.{part}"
                        setattr(target, part, _Poison(label))
        yield
    finally:
        for target, part, value in reversed(undo):
            setattr(target, part, value)


def heavy_imports(module: str, heavy: tuple[str, ...] = HEAVY_MODULES) -> list[str]:
    """The ``heavy`` modules that importing ``module`` imports, in a fresh interpreter."""
    code = (
        "import sys, importlib\n"
        "before = set(sys.modules)\n"
        f"importlib.import_module({module!r})\n"
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules and m not in before))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        raise AssertionError(f"importing {module} failed:\n{result.stderr.strip()}")
    return result.stdout.split()
