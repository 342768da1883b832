"""Checkpoints: a jaxcomp state restored in a FRESH process resumes training bit-identically.

Every transform's state saves, restores and continues bit-identically within a process (the
contract suite, tests/test_contract.py). Here the restore happens in another process, for
EF21 inside ``jc.accumulate`` (saved in the middle of an accumulation): train 40 steps, saving
params and optimizer state (per-device memories sharded ``P("data")``) at step 20 with orbax's
``StandardCheckpointer``; a fresh process restores the checkpoint onto the same shardings,
trains the last 20 steps and writes its params; they must equal the uninterrupted run's bit
for bit. This file is also the fresh process (``python tests/test_checkpoint.py DIR``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

STEPS, SAVE_AT = 40, 20
SHAPES = {"w": (48, 64), "b": (64,)}


def transforms():
    import optax

    import jaxcomp as jc

    return {
        # every 3rd call applies: step 20 is saved, and 40 ends, mid-accumulation
        "accumulate_ef21": jc.accumulate(
            optax.chain(
                jc.compressed_allreduce(jc.sign(), "data", error_feedback="ef21"),
                optax.sgd(0.05, momentum=0.9),
            ),
            3,
        ),
    }


def setup(name):
    """(mesh, params, abstract state with shardings, jitted step, batch(t)) for one transform."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp.cpu import blocking

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    tx = transforms()[name]
    key = jax.random.PRNGKey(0)
    params = {
        k: 0.1 * jax.random.normal(jax.random.fold_in(key, i), s)
        for i, (k, s) in enumerate(SHAPES.items())
    }
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(state, "data")
    target = jax.random.normal(jax.random.fold_in(key, 99), (SHAPES["w"][0], SHAPES["w"][1]))

    def loss(p, x):
        return jnp.mean((x @ p["w"] + p["b"] - x @ target) ** 2)

    def step_fn(p, s, x):
        g = jax.grad(loss)(jax.lax.pcast(p, "data", to="varying"), x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = blocking(
        jax.jit(
            jax.shard_map(
                step_fn, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)
            )
        )
    )

    def batch(t):
        x = jax.random.normal(jax.random.fold_in(key, 1000 + t), (8 * 4, SHAPES["w"][0]))
        return jax.device_put(x, NamedSharding(mesh, P("data")))

    return params, state, step, batch


def train(step, params, state, batch, start, stop):
    for t in range(start, stop):
        params, state = step(params, state, batch(t))
    return params, state


def abstract(tree):
    """ShapeDtypeStructs carrying each array's sharding: the restore target."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def resume(directory: Path) -> None:
    """The fresh process: restore each checkpoint, train the rest, write the final params."""
    import jax
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    for name in transforms():
        params, state, step, batch = setup(name)  # only for shapes, shardings and the step
        template = {"params": params, "opt_state": state}
        # Unused state fields are None (no leaves), so the state saves as it is.
        restored = ckpt.restore(directory / name, abstract(template))
        specs_ok = jax.tree.map(lambda a, b: a.sharding == b.sharding, restored["opt_state"], state)
        assert all(jax.tree.leaves(specs_ok)), f"{name}: restored shardings differ"
        final, _ = train(step, restored["params"], restored["opt_state"], batch, SAVE_AT, STEPS)
        np.savez(directory / f"{name}.npz", **{k: np.asarray(v) for k, v in final.items()})
        # Sensitivity: resuming with a fresh optimizer state (memories lost) must differ.
        fresh, _ = train(step, restored["params"], state, batch, SAVE_AT, STEPS)
        assert not np.array_equal(np.asarray(fresh["w"]), np.asarray(final["w"])), name
    ckpt.close()


@pytest.mark.slow
def test_restore_in_fresh_process_continues_bit_identically(tmp_path):
    import jax
    import orbax.checkpoint as ocp

    import jaxcomp as jc

    ckpt = ocp.StandardCheckpointer()
    finals = {}
    for name in transforms():
        params, state, step, batch = setup(name)
        params, state = train(step, params, state, batch, 0, SAVE_AT)
        ckpt.save(tmp_path / name, {"params": params, "opt_state": state})
        ckpt.wait_until_finished()
        finals[name], state = train(step, params, state, batch, SAVE_AT, STEPS)
        first = state if isinstance(state, jc.AccumulateState) else state[0]
        memories = [getattr(first, f) for f in type(first).PER_DEVICE_FIELDS]
        biggest = max(float(abs(m).max()) for m in jax.tree.leaves(memories))
        assert biggest > 0, f"{name}: no per-device state to test"
    ckpt.close()

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, params in finals.items():
        resumed = np.load(tmp_path / f"{name}.npz")
        for k, v in params.items():
            np.testing.assert_array_equal(resumed[k], np.asarray(v), err_msg=f"{name}/{k}")


if __name__ == "__main__":
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(8)
    import jax

    jax.config.update("jax_threefry_partitionable", True)
    resume(Path(sys.argv[1]))
