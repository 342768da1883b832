"""The CPU-host helpers of jaxcomp.cpu, and the allocator settings that
docs/hot-path-allocator.md gives."""

import os
import pathlib
import platform
import resource
import subprocess
import sys

import pytest

# An 80 MB output per call (above glibc's 32 MiB mmap threshold), async dispatch off (as
# jaxcomp.cpu.use_cpu_devices sets it); prints each call's minor page faults, 4 calls before
# and 8 after `jaxcomp.cpu.reuse_large_buffers()` when the first argument says so.
FAULTS = """
import resource, sys
import jax, jax.numpy as jnp
import jaxcomp.cpu as c
jax.config.update('jax_cpu_enable_async_dispatch', False)
f = jax.jit(lambda a: a * 2 + 1)
x = jnp.ones((20_000_000,))
def faults(calls):
    f(x).block_until_ready()
    counts = []
    for _ in range(calls):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = f(x).block_until_ready()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return counts, out
before, out = faults(4)
assert float(out[0]) == 3.0 and float(out.sum()) == 6e7
if sys.argv[1] == 'reuse':
    assert c.reuse_large_buffers() is True
    after, out = faults(8)
    assert float(out[0]) == 3.0 and float(out.sum()) == 6e7
    before += after
print(*before)
"""
PAGES = 80_000_000 // resource.getpagesize()


def _faults(which: str, env=None) -> list[int]:
    proc = subprocess.run(
        [sys.executable, "-c", FAULTS, which], capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [int(v) for v in proc.stdout.split()]


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's mallopt")
def test_reuse_large_buffers_sets_glibc_and_steps_still_run():
    # In a fresh process: the setting lasts for the whole process. By default every call
    # faults on each 4 KiB page of its output (19,532 of 19,532 measured); once freed memory
    # is kept, most calls reuse it, not all (glibc's aligned allocation skips a freed block
    # that small allocations have since bordered). Calls of 8 after the setting with 0
    # faults, one process each: jaxlib 0.10.2 5-7 (12 processes), 0.12.0.1 3-6 (32), where
    # 3 processes of 41 reused in none of their first 4 calls.
    counts = _faults("reuse")
    before, after = counts[:4], counts[4:]
    assert len(after) == 8 and min(before) >= 0.95 * PAGES, counts
    assert sum(c <= 0.01 * PAGES for c in after) >= 2, counts


def _transparent_huge_pages() -> bool:
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc"
    or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 35)
    or not _transparent_huge_pages(),
    reason="glibc >= 2.35 (the glibc.malloc.hugetlb tunable) and transparent huge pages",
)
def test_hugetlb_tunable_cuts_page_faults():
    # GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (docs/hot-path-allocator.md): glibc asks for huge pages
    # on its mapped blocks, one fault per huge page, not per 4 KiB page (625 of 19,532
    # measured on every call).
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    counts = _faults("default", env)
    assert max(counts) <= 0.1 * PAGES, counts


def test_unsafe_xla_flags_named_and_warned():
    """``--xla_cpu_enable_fast_math=true`` (XLA folds ``x * 0``, jaxcomp's finiteness flag,
    to 0: the error-feedback memory takes a NaN step) and a YNN fusion type are named; other
    flags, and fast math off, are not; ``use_cpu_devices`` warns with the flag's name before
    jax starts."""
    from jaxcomp.cpu import unsafe_xla_flags

    fast, ynn = "--xla_cpu_enable_fast_math", "--xla_cpu_experimental_ynn_fusion_type"
    for flags in (f"{fast}=true", f"{fast}=True --a=1", f"--a=1 {fast}", f"{fast}=1"):
        assert unsafe_xla_flags(flags) == [fast], flags
    assert unsafe_xla_flags(f"{ynn}=eltwise {fast}=true") == [ynn, fast]
    for flags in ("", f"{fast}=false", f"{fast}_x=true", f"{ynn}=", "--xla_cpu_ftz=true"):
        assert unsafe_xla_flags(flags) == [], flags
    # a flag given again counts at its last value (XLA's reading), named once
    assert unsafe_xla_flags(f"{fast}=true --a=1 {fast}=false") == []
    assert unsafe_xla_flags(f"{fast}=false {fast} {ynn}=x {fast}=1") == [ynn, fast]
    code = "import jaxcomp.cpu as c; c.use_cpu_devices(1)"
    env = {**os.environ, "XLA_FLAGS": f"{fast}=true", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0 and f"XLA_FLAGS sets {fast}" in proc.stderr, proc.stderr[-2000:]


def test_fast_math_folds_the_finiteness_flag():
    """Why ``--xla_cpu_enable_fast_math=true`` is unsafe with jaxcomp: XLA:CPU folds ``x * 0``
    to 0 under it (the honor flags left true), so ``sum(x * 0)``, the flag that is NaN exactly
    when ``x`` holds a NaN or an inf, reads finite. Per program here (``compiler_options``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def flag_is_nan(x):
        return jnp.isnan(jnp.sum(x * jnp.zeros([], x.dtype)))

    x = jnp.array([np.nan, 1.0, np.inf], jnp.float32)
    fast = {"xla_cpu_enable_fast_math": True, "xla_cpu_fast_math_honor_nans": True}
    assert bool(jax.jit(flag_is_nan)(x)) is True
    assert bool(jax.jit(flag_is_nan, compiler_options=fast)(x)) is False
    assert bool(jax.jit(jnp.isnan, compiler_options=fast)(x)[0]) is True  # isnan alone stays
