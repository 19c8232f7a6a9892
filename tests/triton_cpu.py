"""Imported first by a test module whose Triton kernels must run without a CUDA device: then it
turns on Triton's CPU interpreter (TRITON_INTERPRET=1), which works only when set before triton
itself is imported, and says so if triton came first. With a CUDA device it does nothing.

It also spares the interpreter repeated work it does for nothing. A launch patches
`triton.language` with interpreted builtins (walking its modules' members) and restores it at the
end; every call of a `@triton.jit` device function inside the kernel (a helper such as
`attend_tile`, often in a loop) patches again, finding every builtin already replaced, and never
restores: with a helper called in a loop, a large share of a launch's time (the ring attention, the KV
stores and the local attention modules: 122 s of CPU without this, 100 s with it; kernels without
helpers, as the batch-invariant ones, gain nothing). Here a device call
made while a launch's patch is in force skips it (the same modules are patched either way); the
launch's own patch and restore are untouched. Where Triton's interpreter lacks the functions
this relies on, it is left as it is."""

import os
import sys

import torch


def _skip_repatching() -> None:
    """Wrap the interpreter's `_patch_lang` so a call inside a launch (its patch in force, the
    function's language modules among those patched) returns an empty scope."""
    from triton.runtime import interpreter

    patch_lang, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or getattr(patch_lang, "skips_repatching", False):
        return
    patched: set[int] = set()  # ids of the language modules the launch in progress patched

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core}

    def once_a_launch(fn):
        mine = langs(fn)
        if patched and mine <= patched:
            return scope_type()  # nothing new to patch, nothing to restore
        scope = patch_lang(fn)
        patched.update(mine)
        restore = scope.restore

        def restore_and_forget() -> None:
            restore()
            patched.clear()

        scope.restore = restore_and_forget
        return scope

    once_a_launch.skips_repatching = True
    interpreter._patch_lang = once_a_launch


if not torch.cuda.is_available():
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 could be set; its CPU interpreter is off")
    os.environ["TRITON_INTERPRET"] = "1"
    _skip_repatching()
