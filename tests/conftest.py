"""Test set-up: 8 CPU devices, so every collective runs on a real 8-way mesh."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_threefry_partitionable", True)
# 8 virtual devices on a 2-core machine: with async dispatch, steps queue up ahead and the
# devices of two steps can starve each other's collective rendezvous (an XLA:CPU deadlock
# seen here). Synchronous dispatch on CPU avoids it.
jax.config.update("jax_cpu_enable_async_dispatch", False)
