"""A faster Triton interpreter for the CPU tests: the same kernels, the same results, less host time per call.

Triton's interpreter re-patches triton.language before every call of a @triton.jit helper from inside a kernel,
and each patch walks every member of the language modules with inspect.getmembers to find the builtins. The
builtins a module or class holds are fixed once imported (a patched one is no builtin: it is skipped, as
Triton skips it), so their names are looked up once and only those members are checked on each patch.
"""
from __future__ import annotations

import inspect


def speed_up_patching() -> None:
    """Replace the interpreter's _patch_builtin with one that walks the cached builtin names (module docstring).
    A Triton whose interpreter lacks the function it replaces is left as it is."""
    try:
        from triton.language.core import is_builtin
        from triton.runtime import interpreter
    except ImportError:  # no Triton: nothing interprets
        return

    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None or getattr(original, "cached_names", None) is not None:
        return
    names: dict[object, list[str]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        if pkg not in names:
            names[pkg] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name in names[pkg]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.cached_names = names
    interpreter._patch_builtin = patch_builtin
