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
# XLA:CPU's MLIR fusion emitters cost most of what is left of a compile at level 0: its
# legacy emitters compile in about a third of the CPU time (12 jc.sgd steps of a small MLP
# on 8 devices: 14.1 s -> 4.8 s). The collectives are the same; XLA fuses a little
# differently (sign: 75 -> 60 fusions, same temporary bytes; top-k 1%: +0.7% temporaries).
# XLA aborts the process on a flag it does not know, and newer XLA dropped the legacy
# emitters (jaxlib 0.11: "Unknown flag in XLA_FLAGS"): that flag is passed only where a
# probe process accepts it.
# XLA:CPU also splits each program's LLVM module into parts compiled in parallel: on 2 cores
# shared by 2 test workers that buys no time, and the parts repeat work. One part: 12
# jc.sgd-like steps on 8 devices 15.9 s -> 12.0 s of CPU, tests/test_codecs.py 50.8 s ->
# 47.6 s. Only the machine code's layout changes: the HLO, its fusions, buffers and
# collectives are the same.
_LEVEL_0 = "--xla_backend_optimization_level=0"
_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_ONE_MODULE = "--xla_cpu_parallel_codegen_split_count=1"


def _xla_accepts(flag: str) -> bool:
    """Whether XLA starts with ``flag`` in XLA_FLAGS (a process that lists the CPU devices)."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    try:
        return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _compile_flags() -> str:
    """The suite's compile flags: none at OPT_DEFAULT, else level 0 (+ legacy emitters, one
    LLVM module), each optional flag where XLA knows it (one probe when it knows both)."""
    if OPT_DEFAULT:
        return ""
    optional = [_EMITTERS, _ONE_MODULE]
    if not _xla_accepts(" ".join(optional)):
        optional = [f for f in optional if _xla_accepts(f)]
    return " ".join([_LEVEL_0, *optional])


def _with_flags(flags: str, more: str) -> str:
    """``flags`` and each flag of ``more`` whose name ``flags`` does not set already."""
    new = [f for f in more.split() if f.split("=")[0] not in flags]
    return " ".join([flags, *new]).strip()


# The first process to load this file decides; pytest-xdist's workers and the tests'
# subprocesses inherit its answer. The benchmarks' smoke runs (tests/test_benchmarks.py)
# start with their own XLA_FLAGS but compile the same way: the hot-path quick run
# 17 s -> 9 s, its temporaries unchanged. Flags set in XLA_FLAGS beforehand win.
if OPT_DEFAULT or "JAXCOMP_TEST_XLA_COMPILE_FLAGS" not in os.environ:
    os.environ["JAXCOMP_TEST_XLA_COMPILE_FLAGS"] = _compile_flags()
_COMPILE = os.environ["JAXCOMP_TEST_XLA_COMPILE_FLAGS"]
os.environ["XLA_FLAGS"] = _with_flags(os.environ.get("XLA_FLAGS", ""), f"{_FLAGS} {_COMPILE}")


def _configure_jax() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_threefry_partitionable", True)
    # With async dispatch, steps queue up ahead and the devices of two steps can starve each
    # other's collective rendezvous on few cores (an XLA:CPU deadlock seen here).
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def pytest_configure(config) -> None:
    """jax's settings, before any test module is imported. pytest-xdist's controller (``-n N``)
    runs no test and leaves jax unimported: 3 s of CPU less a run on 2 cores."""
    controller = "PYTEST_XDIST_WORKER" not in os.environ and config.getoption("numprocesses", 0)
    if not controller:
        _configure_jax()


# pytest-xdist (`make test`: -n 2 --dist loadscope --no-loadscope-reorder) hands each worker a
# whole module at a time, in collection order. Heaviest first, so that the run ends on small
# modules on both workers, not on one worker's long multi-process test while the other is
# idle: the modules' CPU seconds (tests and their subprocesses, getrusage per test on 2 cores,
# tests/module_cpu_seconds.json); a module not listed counts 0.3 s a test. Within a module
# the order is pytest's. xdist's own order (by test count) ended the run with test_replicas
# (31 s of CPU, one test) on one worker while the other had finished 77 s earlier; in this
# order the two workers finished 0.5 s apart (the whole suite, 2 cores at load 3-10).
_UNLISTED_SECONDS_PER_TEST = 0.3


def pytest_collection_modifyitems(config, items) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    import collections
    import json
    import pathlib

    here = pathlib.Path(__file__).parent
    seconds = json.loads((here / "module_cpu_seconds.json").read_text())
    module = lambda item: item.nodeid.split("::")[0].rsplit("/", 1)[-1]  # noqa: E731
    counts = collections.Counter(module(item) for item in items)
    weight = {m: seconds.get(m, _UNLISTED_SECONDS_PER_TEST * n) for m, n in counts.items()}
    items.sort(key=lambda item: (-weight[module(item)], module(item)))  # stable within one
