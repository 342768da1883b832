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
from collections.abc import Callable
from typing import Any

_FLAGS = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
    "--xla_cpu_collective_call_terminate_timeout_seconds=900",
    "--xla_cpu_collective_timeout_seconds=900",
)


def use_cpu_devices(n: int = 8) -> None:
    """Ask for ``n`` CPU devices and the settings above. Call before jax creates its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in _FLAGS if f.split("=")[0] not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def blocking(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that waits for its result (keeps ``.lower`` for :func:`jaxcomp.comm_report`)."""
    import jax

    def call(*args, **kwargs):
        return jax.block_until_ready(fn(*args, **kwargs))

    call.lower = fn.lower  # type: ignore[attr-defined]
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
