"""Test set-up: 8 CPU devices, so every collective runs on a real 8-way mesh."""

import os

# 8 virtual devices share 2 cores in CI: a device thread can wait long for a core, and
# XLA:CPU aborts the process when a collective's rendezvous takes over 40 s. Give it time.
_FLAGS = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=900 "
    "--xla_cpu_collective_timeout_seconds=900"
)
# The suite compiles hundreds of small programs and runs each for milliseconds, so LLVM's
# optimizer is most of their cost on XLA:CPU. Level 0 cuts the compile-bound tests by about
# a third and the whole suite on 2 cores from 589 s to 506 s (runs of many steps get
# slower). The HLO (what is tested: collectives, fusions, bytes on the wire) is optimized as
# usual; only the CPU machine code is not. Tests' subprocesses inherit it. Set the flag
# yourself to override. JAXCOMP_XLA_OPT_DEFAULT=1 keeps XLA's default level, the code users
# run: `make test` runs the tests marked `smoke` (tests/test_smoke.py) that way.
OPT_DEFAULT = os.environ.get("JAXCOMP_XLA_OPT_DEFAULT", "") not in ("", "0")
_COMPILE = ""
if not OPT_DEFAULT and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _COMPILE += " --xla_backend_optimization_level=0"
# XLA:CPU's MLIR fusion emitters cost most of what is left of a compile at level 0: its
# legacy emitters compile in about a third of the CPU time (12 jc.sgd steps of a small MLP
# on 8 devices: 14.1 s -> 4.8 s). The collectives are the same; XLA fuses a little
# differently (sign: 75 -> 60 fusions, same temporary bytes; top-k 1%: +0.7% temporaries).
if not OPT_DEFAULT and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    _COMPILE += " --xla_cpu_use_fusion_emitters=false"
_FLAGS += _COMPILE
# The benchmarks' smoke runs (tests/test_benchmarks.py) start with their own XLA_FLAGS but
# compile the same way: the hot-path quick run 17 s -> 9 s, its temporaries unchanged.
os.environ["JAXCOMP_TEST_XLA_COMPILE_FLAGS"] = _COMPILE.strip()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAGS).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_threefry_partitionable", True)
# With async dispatch, steps queue up ahead and the devices of two steps can starve each
# other's collective rendezvous on few cores (an XLA:CPU deadlock seen here).
jax.config.update("jax_cpu_enable_async_dispatch", False)
