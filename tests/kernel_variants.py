"""Which Triton kernel variants a piece of code launches: the compiled kernels it needs, on the CPU or the GPU.

On a GPU, Triton calls knobs.runtime.jit_cache_hook before compiling (or loading
from its disk cache) a variant this process has not launched yet. Under the
CPU interpreter nothing compiles, so the variant a GPU would compile is worked
out from each launch as Triton's JIT keys it: the constexpr values, each other
argument's specialisation (an integer's 1, multiple of 16 or neither, a
pointer's 16-byte alignment, unless the kernel opts out) and the launch
options.
"""
from __future__ import annotations

import inspect

import torch


class KernelVariants:
    """with KernelVariants() as seen: ... -- seen holds (kernel name, variant) of every launch inside."""

    def __init__(self):
        self.seen: set[tuple[str, object]] = set()

    def __enter__(self) -> set[tuple[str, object]]:
        if torch.cuda.is_available():
            from triton import knobs

            self._restore = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._compiling
        else:
            from triton.runtime.interpreter import InterpretedFunction

            run = InterpretedFunction.run
            seen = self.seen

            def recording_run(fn, *args, grid, warmup, **kwargs):
                seen.add((fn.fn.__qualname__, interpreted_variant(fn, args, kwargs)))
                return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

            self._restore = run
            InterpretedFunction.run = recording_run
        return self.seen

    def _compiling(self, *, key, repr, **_) -> bool:
        self.seen.add((repr.split("[")[0], str(key)))
        return False  # compile as usual

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._restore
        else:
            from triton.runtime.interpreter import InterpretedFunction

            InterpretedFunction.run = self._restore


def interpreted_variant(fn, args: tuple, kwargs: dict) -> tuple:
    """The key Triton's JIT would compile this launch of an interpreted kernel under."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = list(inspect.signature(fn.fn).parameters.values())
    values = dict(zip(fn.arg_names, args), **{k: v for k, v in kwargs.items() if k in fn.arg_names})
    no_value = set(fn.kwargs.get("do_not_specialize") or ())
    no_align = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    key = []
    for p in params:
        value = values.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            key.append((p.name, repr(value)))
        else:
            key.append((p.name, native_specialize_impl(BaseBackend, value, False, p.name not in no_value,
                                                       p.name not in no_align)))
    options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in fn.arg_names))
    return tuple(key) + options


def describe_new(seen: set, before: set) -> str:
    """The variants in seen but not before, each with how it differs from the nearest one before (interpreted
    variants, whose entries are (argument, specialisation) pairs)."""
    lines = []
    for name, variant in sorted(seen - before, key=str):
        known = [v for n, v in before if n == name and isinstance(v, tuple)]
        if not isinstance(variant, tuple) or not known:
            lines.append(f"{name}: {variant}")
            continue
        nearest = min(known, key=lambda v: sum(a != b for a, b in zip(v, variant)))
        diff = ", ".join(f"{a[0]}={a[1]} (before: {b[1]})" for a, b in zip(variant, nearest) if a != b)
        lines.append(f"{name}: {diff}")
    return "\n".join(lines)
