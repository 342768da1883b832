"""Faults: non-finite gradients, a process that dies mid-run, and run-to-run determinism.

* Non-finite policy (compressed_allreduce with each error-feedback kind and strategy family
  here; DGC, PowerSGD and top-k in tests/test_contract.py): a NaN or inf in ONE device's
  gradient makes the output non-finite on EVERY device (never a silently finite wrong
  update) and leaves the transform's state bit-identical; with ``optax.apply_if_finite``
  around the optimizer after it, the run continues and ends bit-identical to a run that
  never saw the bad steps.
* Determinism: the same seed gives bit-identical params twice in a row, and again after
  a fresh trace and compile, stochastic codecs included.
* Process faults: one of 3 gloo processes crashes (``os._exit``) mid-run; the others must
  fail with a clear error on their own, quickly (no hang), the launcher returns non-zero;
  restarting all 3 from the last orbax checkpoint ends on the uninterrupted run's params.
  Three, not four: each launch is mostly the processes' start-up and compile (4 processes
  took 22 s of CPU a launch on 2 cores), and three still leave two survivors that must each
  notice on their own.
"""

from __future__ import annotations

import functools
import io
import os
import re
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import N, mesh, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp import launch as jc_launch

PARAMS = {"w": jnp.full((16, 64), 0.1), "b": jnp.zeros((64,))}
BAD_DEVICE = 5


def transforms():
    """The transforms the non-finite test runs end to end. Top-k with residual feedback, DGC
    two-phase and PowerSGD are left to tests/test_contract.py's rows topk-*, dgc-two_phase and
    powersgd-start2 (test_nonfinite_gradient_poisons_output_and_freezes_state: every output
    non-finite, the state bit for bit, apply_if_finite's zero update and inner state kept).
    Sign stays here: an inf in a compressed leaf, whose sign is a finite +-1."""
    ca = lambda codec, **kw: jc.compressed_allreduce(codec, "data", min_size=64, **kw)  # noqa: E731
    return {
        "sign_residual_two_phase": ca(jc.sign(), error_feedback="residual", strategy="two_phase"),
        "int4_ef21_allgather": ca(jc.int_quant(4), error_feedback="ef21", strategy="allgather"),
        "qsgd_none_auto": ca(jc.qsgd(8, bucket_size=128)),
        "random_k_allreduce": ca(jc.random_k(0.1), strategy="allreduce"),
        "bf16_allreduce_residual": ca(jc.cast("bf16"), error_feedback="residual"),
    }


def _varying(x):
    """``x`` typed as varying over 'data' (adding a varying zero), to return it per device."""
    return x + (0 * jax.lax.axis_index("data")).astype(x.dtype)


def make_run(comp):
    """(step, init): one jitted step of comp followed by apply_if_finite(momentum SGD)."""
    opt = optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), max_consecutive_errors=3)
    m = mesh()
    cstate = jc.sharded_init(comp, PARAMS, m, "data")
    cspecs = jc.state_specs(cstate, "data")
    ostate = jax.tree.map(lambda a: shard(a, m, P()), opt.init(PARAMS))
    params = jax.tree.map(lambda a: shard(a, m, P()), PARAMS)

    def step(params, cstate, ostate, grads):
        g = jax.tree.map(lambda a: a[0], grads)
        out, cstate = comp.update(g, cstate, params)
        upd, ostate = opt.update(out, ostate, params)
        seen = jax.tree.map(lambda a: _varying(a)[None], out)  # what each device got
        return optax.apply_updates(params, upd), cstate, ostate, seen

    fn = per_device(step, (P(), cspecs, P(), P("data")), (P(), cspecs, P(), P("data")), m)
    return fn, (params, cstate, ostate)


def grads(t):
    key = jax.random.PRNGKey(100 + t)
    return {
        "w": jax.random.normal(key, (N, 16, 64)) + 0.2,
        "b": jax.random.normal(jax.random.fold_in(key, 1), (N, 64)),
    }


def poisoned(t, value):
    g = grads(t)
    g["w"] = g["w"].at[BAD_DEVICE, 3, 7].set(value)
    return g


def train(fn, init, bad_after=None, steps=6):
    params, cstate, ostate = init
    for t in range(steps):
        params, cstate, ostate, _ = fn(params, cstate, ostate, shard(grads(t)))
        if t == bad_after:
            for value in (jnp.nan, jnp.inf, -jnp.inf):
                new_params, new_cstate, ostate, seen = fn(
                    params, cstate, ostate, shard(poisoned(t, value))
                )
                per_device_finite = np.isfinite(np.asarray(seen["w"])).reshape(N, -1).all(1)
                assert not per_device_finite.any(), f"{value}: finite output on some device"
                jax.tree.map(np.testing.assert_array_equal, new_cstate, cstate)  # state frozen
                jax.tree.map(np.testing.assert_array_equal, new_params, params)  # step skipped
    return params


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(transforms()))
def test_nonfinite_on_one_device_poisons_all_and_apply_if_finite_loses_nothing(name):
    fn, init = make_run(transforms()[name])
    with_bad = train(fn, init, bad_after=2)
    clean = train(fn, init)
    jax.tree.map(np.testing.assert_array_equal, with_bad, clean)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(clean))


def test_same_seed_bit_identical_twice_and_after_recompile():
    # Stochastic rounding with independent noise per device, two-phase (the auto strategy).
    comp = jc.compressed_allreduce(jc.int_quant(4, stochastic=True), "data", min_size=64, seed=3)
    fn, init = make_run(comp)
    first, second = train(fn, init, steps=4), train(fn, init, steps=4)
    # A fresh closure is traced and compiled anew (jax.clear_caches() would also throw away
    # the compiled programs that later tests in this process reuse).
    fn, init = make_run(comp)
    third = train(fn, init, steps=4)
    for other in (second, third):
        jax.tree.map(np.testing.assert_array_equal, first, other)
    assert not np.array_equal(np.asarray(first["w"]), np.asarray(PARAMS["w"]))


# --------------------------------------------------------------------------- process faults

SCRIPT = Path(__file__).parent / "scripts" / "replica_train.py"


class TimedLines(io.TextIOBase):
    """A stream for ``launch.run(out=...)`` that records when each line arrived."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def write(self, s):
        with self._lock:
            self.lines.extend((time.monotonic(), line) for line in s.splitlines())
        return len(s)

    def text(self):
        return "\n".join(line for _, line in self.lines)

    def find(self, pattern):
        return [(t, line) for t, line in self.lines if re.search(pattern, line)]


PROCESSES = 3


def launch_all(args, timeout=240.0, grace=60.0, env=None):
    out = TimedLines()
    status = jc_launch.run(
        [str(SCRIPT), *args], PROCESSES, timeout=timeout, grace=grace, out=out, env=env
    )
    return status, out, time.monotonic()


def finals(out, word="FINAL"):
    digests = {line.split()[0]: line.split()[2] for _, line in out.find(rf"^\[\d\] {word} ")}
    assert sorted(digests) == [f"[{r}]" for r in range(PROCESSES)], out.text()[-3000:]
    assert len(set(digests.values())) == 1, digests
    return next(iter(digests.values()))


@pytest.mark.slow
def test_killed_process_fails_fast_and_restart_from_checkpoint_matches(tmp_path):
    common = ["fault", "--family", "sign_ef", "--steps", "20", "--every", "10"]
    ckpt = str(tmp_path / "ckpt")
    # The three launches compile the same step: JAX's persistent cache lets the second and
    # third load it (saves 2 compilations of every process on 2 cores).
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")}
    run = functools.partial(launch_all, env=env)

    # 1. Rank 2 crashes after step 15 (last checkpoint: step 10).
    status, out, end = run([*common, "--ckpt", ckpt, "--die-rank", "2", "--die-step", "15"])
    died = out.find(r"^\[2\] DYING at step 15")
    assert status != 0 and died, out.text()[-3000:]
    assert not out.find(r"^\[\d\] FINAL "), "a process finished although a peer died"
    # The survivors notice on their own (gloo sees the closed connection, the coordinator the
    # missing heartbeats) and exit: the launcher never had to kill anybody.
    assert not out.find(r"\[launch\] killing"), out.text()[-3000:]
    assert end - died[0][0] < 60, f"survivors took {end - died[0][0]:.0f} s to exit"
    for rank in (0, 1):
        clear = out.find(
            rf"^\[{rank}\] .*(Connection closed by peer|heartbeat timeout|"
            r"detected fatal errors|tasks are unhealthy)"
        )
        assert clear, f"rank {rank} printed no clear error:\n" + out.text()[-3000:]

    # 2. Restart all from the last checkpoint, 3. then, in the same processes (one start-up
    # less: 57 s -> 44 s of CPU), an uninterrupted run from step 0: the same params.
    clean = str(tmp_path / "clean")
    status, resumed, _ = run([*common, "--ckpt", ckpt, "--resume", "--clean-ckpt", clean])
    assert status == 0, resumed.text()[-3000:]
    assert len(resumed.find(r"RESUMED at step 10")) == PROCESSES
    assert finals(resumed) == finals(resumed, "CLEAN")
