"""2 processes x 4 devices over gloo give the numbers of 1 process x 8 devices.

One launch of ``tests/scripts/process_equal.py`` (the process start-up paid once) against the
same script run in this process, on the same 8-device mesh and the same global inputs:

* ``jc.fsdp_gather`` (int8 weights, int4 reduce-scatter, error feedback), 3 steps: the
  shards and the residuals, bit for bit;
* ``jc.psum_scatter`` with int8 and top-k: bit for bit;
* ``jc.diloco`` with an int8 codec and ``jc.sparseloco``, the replica axis across the
  processes, 4 steps (2 syncs): bit for bit, but DiLoCo's biases within 2.3e-10 (gloo sums
  float32 in another order: docs/multihost.md);
* ``jc.fsdp_gather`` over a (2, 4) mesh whose rows are the processes, int8 / int4 over them
  and ``inner_axis_name`` inside: within 6.0e-8 (weights) and 4.7e-9 (residuals),
  the float32 reduce-scatter of the fast hop summed in gloo's order;
* a ``jc.sgd`` (int8, residual feedback) state saved by orbax on 1 process and restored on 2,
  2 more steps, saved on 2 and restored here on 1: params and every state field as the
  1-process run's (the params within 1e-9, the memories bit for bit);
* a live ``jc.sgd`` int8 state of the 8 devices (2 steps) moved by ``jc.resize_state`` to 4
  devices, 2 of each process's, and stepped once: memories and params bit for bit (until
  2026-11-27 the 2 processes refused it with jax's "Fetching value for `jax.Array` that spans
  non-addressable ... devices", naming no argument; on one process it moved);
* ``jc.comm_report`` of the FSDP and ``jc.sgd`` steps: the same bytes on every process and
  on one (2,079 and 343 bytes per device);
* ``jc.autotune``: the same plan and table (timings reduced over processes) on both, also
  where process 1's clock reads 1000 s more (the timing budget spent is the max over the
  processes: until 2026-11-27 process 1 alone stopped timing, and the two processes' next
  collectives mismatched in gloo: "Received data size doesn't match expected size").

46 to 112 s on the loaded 2-core host (load 10 to 14): the processes' start-up and compiles.
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp import launch

SCRIPT = Path(__file__).parent / "scripts" / "process_equal.py"


def _script():
    spec = importlib.util.spec_from_file_location("process_equal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


@pytest.mark.slow
def test_two_processes_give_the_numbers_of_one(tmp_path):
    pe = _script()
    mesh = jax.make_mesh((8,), ("data",))
    tx, params, _, run = pe.sgd_setup(mesh)
    p, s = params, jc.sharded_init(tx, params, mesh, "data")
    for t in (0, 1):
        p, s = jax.block_until_ready(run(p, s, pe.sgd_batch(mesh, t)))
    pe.save(tmp_path / "one_at_2", {"params": p, "opt_state": s})  # restored by 2 processes
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
    pe.compute(mesh, tmp_path / "one", tmp_path / "one_at_2", tmp_path / "one_at_4", plan=False)
    out = io.StringIO()
    argv = [str(tmp_path / d) for d in ("two", "one_at_2", "two_at_4")]
    status = launch.run([str(SCRIPT), *argv], 2, local_devices=4, timeout=600, grace=30, out=out)
    text = out.getvalue()
    assert status == 0, text[-4000:]
    assert "[1] process 1 of 2: 8 devices" in text, text[-4000:]
    one = dict(np.load(tmp_path / "one" / "p0.npz"))
    two = [dict(np.load(tmp_path / "two" / f"p{r}.npz")) for r in (0, 1)]
    exact = ["fsdp_w", "fsdp_e", "scatter_int8", "scatter_topk", "diloco_w", "sgd_w"]
    exact += ["sgd_memory_w", "bytes_fsdp", "bytes_sgd", "sparseloco_w", "sparseloco_b"]
    exact += ["resize_memory_w0", "resize_memory_w", "resize_w"]
    for rank in (0, 1):  # every array's largest difference, for the log (pytest -s)
        print({k: _max_diff(two[rank][k], one[k]) for k in one if one[k].dtype.kind == "f"})
    for rank in (0, 1):
        for key in exact:
            assert np.array_equal(two[rank][key], one[key]), (rank, key)
        assert _max_diff(two[rank]["diloco_b"], one["diloco_b"]) <= 1e-9
        # a float32 sum over "local" first, in gloo's order: 6.0e-8 and 4.7e-9 seen
        assert _max_diff(two[rank]["hsdp_w"], one["hsdp_w"]) <= 1e-6
        assert _max_diff(two[rank]["hsdp_e"], one["hsdp_e"]) <= 1e-7
    assert float(one["bytes_fsdp"]) == 2079.0 and float(one["bytes_sgd"]) == 343.0
    assert np.abs(one["fsdp_w"]).max() > 1 and np.abs(one["fsdp_e"]).max() > 1e-4  # trained
    assert np.abs(one["hsdp_e"]).max() > 1e-3
    # one plan on both processes, from the same (reduced) timings
    assert str(two[0]["plan"]) == str(two[1]["plan"]) and "'none', 'pmean'" in str(two[0]["plan"])
    # process 1's clock 1000 s ahead: the budget spent is the max over processes, so both stop
    # after plain pmean (before 2026-11-27 process 0 alone timed int8: a gloo size mismatch)
    assert str(two[0]["skewed_plan"]) == str(two[1]["skewed_plan"]) == "(None, ['none'])"
    # the state the 2 processes saved, restored here on 1 process
    like = {"params": params, "opt_state": jc.sharded_init(tx, params, mesh, "data")}
    theirs = pe.restore(tmp_path / "two_at_4", like)
    mine = pe.restore(tmp_path / "one_at_4", like)
    diffs = jax.tree.map(_max_diff, theirs, mine)
    assert max(jax.tree.leaves(diffs["params"])) <= 1e-9, diffs
    assert max(jax.tree.leaves(diffs["opt_state"])) == 0.0, diffs
