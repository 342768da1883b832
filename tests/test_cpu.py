"""The CPU-host helpers of jaxcomp.cpu."""

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's mallopt")
def test_reuse_large_buffers_sets_glibc_and_steps_still_run():
    # In a fresh process: the setting lasts for the whole process.
    code = (
        "import jaxcomp.cpu as c\n"
        "assert c.reuse_large_buffers() is True\n"
        "import jax, jax.numpy as jnp\n"
        "f = jax.jit(lambda a: a * 2 + 1)\n"
        "for _ in range(3):\n"
        "    out = f(jnp.ones((20_000_000,)))\n"
        "assert float(out[0]) == 3.0 and float(out.sum()) == 6e7\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
