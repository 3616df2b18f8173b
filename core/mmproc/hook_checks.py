"""What a plugin got wrong about the hooks, said in terms of the hooks rather than pluggy's.

Used when a plugin's registration module and its model classes are checked against the hook
specifications: a hook that is not marked ``@mmproc.hookimpl`` (so it would never be called), a
misspelled hook name ("did you mean"), an argument a hook does not have (with the ones it has).
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Sequence

import pluggy

from mmproc.hookspecs import PROJECT_NAME

__all__ = [
    "did_you_mean",
    "explain_validation_error",
    "hook_arguments",
    "is_marked",
    "unmarked_hooks",
]

_MARKER = f"{PROJECT_NAME}_impl"
_HOOK_IN_MESSAGE = re.compile(r"for hook '(\w+)'")
_ARGUMENTS_IN_MESSAGE = re.compile(r"Argument\(s\) \{(.*?)\}")


def is_marked(function: object) -> bool:
    """Whether ``function`` carries the ``@mmproc.hookimpl`` marker."""
    return hasattr(function, _MARKER)


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    """``"'x' (did you mean 'y'?)"`` when a choice is close to ``name``, else ``"'x'"``."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


def hook_arguments(spec_class: type, hook: str) -> list[str]:
    """The arguments a hook provides (what an implementation may declare)."""
    return [p for p in inspect.signature(getattr(spec_class, hook)).parameters if p != "self"]


def unmarked_hooks(obj: object, hook_names: Sequence[str]) -> list[str]:
    """Hook-named callables of ``obj`` (a module, class or instance) without the marker."""
    return [
        name
        for name in hook_names
        if callable(getattr(obj, name, None)) and not is_marked(getattr(obj, name))
    ]


def explain_validation_error(
    exc: pluggy.PluginValidationError, spec_class: type, hook_names: Sequence[str]
) -> str:
    """pluggy's validation error, said as what to fix: the hook, its arguments, or its name."""
    text = str(exc)
    unknown = re.search(r"unknown hook '(\w+)'", text)
    if unknown:
        return (
            f"{did_you_mean(unknown.group(1), hook_names)} is not a hook; the hooks are: "
            f"{', '.join(hook_names)}"
        )
    hook = _HOOK_IN_MESSAGE.search(text)
    arguments = _ARGUMENTS_IN_MESSAGE.search(text)
    if hook and arguments and hasattr(spec_class, hook.group(1)):
        name = hook.group(1)
        wrong = sorted(a.strip().strip("'\"") for a in arguments.group(1).split(","))
        valid = hook_arguments(spec_class, name)
        hints = ", ".join(did_you_mean(arg, valid) for arg in wrong)
        return (
            f"hook {name!r} has no argument{'s' if len(wrong) > 1 else ''} {hints}; its "
            f"arguments are: {', '.join(valid)} (declare any of them, in any order)"
        )
    return text.replace("\n", "; ")
