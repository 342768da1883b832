"""Simulated devices on a CPU (laptops, Colab, CI): ``use_cpu_devices(8)`` before any jax work.

XLA:CPU runs the collectives of ``n`` virtual devices as ``n`` threads that meet at a
rendezvous. On a machine with few cores two things go wrong, both seen on 2 cores here:

* a thread waits long for a core, and XLA aborts the process once a rendezvous takes 40 s;
* a second multi-device program dispatched while one runs can deadlock both.

So this sets long rendezvous timeouts, turns CPU async dispatch off, and training loops
should ``jax.block_until_ready`` each step (:func:`blocking`). None of this is needed on
GPU/TPU.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

_FLAGS = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
    "--xla_cpu_collective_call_terminate_timeout_seconds=900",
    "--xla_cpu_collective_timeout_seconds=900",
)


def use_cpu_devices(n: int = 8) -> None:
    """Ask for ``n`` CPU devices and the settings above. Call before jax creates its backends.

    Warns where ``XLA_FLAGS`` holds a compile option that breaks jaxcomp's handling of
    non-finite gradients (:func:`unsafe_xla_flags`)."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in unsafe_xla_flags(flags):
        warnings.warn(
            f"XLA_FLAGS sets {flag}: under it XLA:CPU no longer detects a non-finite step in "
            "jaxcomp's updates, and a NaN gradient corrupts the error-feedback memory. Unset "
            'it; docs/hot-path-xla.md, "XLA:CPU\'s compile options".',
            stacklevel=2,
        )
    missing = [f for f in _FLAGS if f.split("=")[0] not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_cpu_enable_async_dispatch", False)


#: XLA:CPU options under which jaxcomp's updates no longer keep a non-finite step out of the
#: error-feedback memory (measured: ``python -m benchmarks.xla_options``), each with the test
#: of its value (None: given bare, ``--name``) that makes it unsafe.
_UNSAFE = {
    "xla_cpu_enable_fast_math": lambda v: v is None or v.lower() in ("true", "1"),
    "xla_cpu_experimental_ynn_fusion_type": lambda v: bool(v),
}


def unsafe_xla_flags(flags: str) -> list[str]:
    """The flags of ``flags`` (an ``XLA_FLAGS`` value) that break jaxcomp's handling of a
    non-finite gradient on XLA:CPU: ``--xla_cpu_enable_fast_math=true`` (XLA then folds
    ``x * 0`` to 0, whatever ``xla_cpu_fast_math_honor_nans`` and ``_infs`` say, so the
    finiteness flag ``sum(x * 0)`` is always 0 and the memory takes a NaN step) and a
    non-empty ``--xla_cpu_experimental_ynn_fusion_type`` (other values on every step; int8's
    memory non-finite after a NaN step). A flag given twice counts at its last value, as
    XLA reads it; each is named once, in the order of its last occurrence."""
    last: dict[str, str | None] = {}
    for token in flags.split():
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            last.pop(name, None)  # re-inserted: the order of the last occurrence
            last[name] = value if eq else None
    return ["--" + name for name, value in last.items() if name in _UNSAFE and _UNSAFE[name](value)]


def blocking(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that waits for its result (keeps ``.lower`` for :func:`jaxcomp.comm_report`)."""
    import jax

    def call(*args, **kwargs):
        return jax.block_until_ready(fn(*args, **kwargs))

    call.lower = fn.lower  # type: ignore[attr-defined]
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def reuse_large_buffers() -> bool:
    """Keep freed memory for reuse instead of returning it to the OS (glibc only).

    XLA:CPU allocates a program's temporaries and outputs per call. glibc serves every block
    above 32 MiB with a fresh ``mmap`` and unmaps it on free, so each gradient-sized buffer
    page-faults on every step (one fault per 4 KiB page): on a CPU host that, not
    arithmetic, is most of what a compressed step's codec passes cost. This turns ``mmap``
    off for large blocks and the heap's trimming off (``mallopt(M_MMAP_MAX, 0)``,
    ``mallopt(M_TRIM_THRESHOLD, INT_MAX)``), the same as ``MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_=2147483647`` in the environment. The process keeps its peak
    memory.

    It governs glibc's main heap only, which serves the thread that runs a program when
    asynchronous dispatch is off (:func:`use_cpu_devices` turns it off). With jax's default
    asynchronous dispatch on a CPU, buffers come from a worker thread's heap, which still
    maps large blocks afresh: there this changes nothing. Most calls then reuse freed memory,
    not all: glibc's aligned allocation passes over a freed block that small allocations have
    since bordered. ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment (glibc >=
    2.35, transparent huge pages on) works with either dispatch: glibc asks the kernel for
    huge pages on its mapped blocks, which then fault once per huge page, not per 4 KiB.
    ``docs/hot-path-allocator.md`` has the measurements.

    Returns:
      True where glibc took both settings; False where glibc is absent.

    Example::

        import jaxcomp.cpu
        jaxcomp.cpu.use_cpu_devices(1)       # asynchronous dispatch off
        jaxcomp.cpu.reuse_large_buffers()    # before the first step
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
