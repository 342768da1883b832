"""jc.all_gather / jc.psum_scatter / jc.fsdp_gather against jax.lax, on 8 devices and a 2 x 4 mesh.

Cheap by design: one compiled program per mesh runs every codec, and each is run again with
a NaN input (same program). Inputs are small integers (exact float sums in any order), so the
identity codec and ``None`` are compared with ``jax.lax`` bit for bit.
"""

import functools
import io
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import N, mesh, per_device, shard
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp import launch

ROWS = 4  # per device
W = jnp.round(jax.random.normal(jax.random.PRNGKey(0), (N * ROWS, 6)) * 4)
X = jnp.round(jax.random.normal(jax.random.PRNGKey(1), (N * 3, N * ROWS)) * 2)
KEY = jax.random.PRNGKey(7)
# Codec, and the largest relative error of its reduce-scatter on these inputs.
SCATTER = {
    "int8": (jc.int_quant(8), 0.02),
    "int4": (jc.int_quant(4, block_size=32), 0.2),
    "bf16": (jc.cast("bf16"), 0.0),  # small integers are exact in bf16
    "sign": (jc.sign(), 0.9),
    "top_k": (jc.top_k(0.5), 0.45),
    "random_k": (jc.random_k(0.5), 1.5),  # unbiased, so scaled up: large error, mean right
}


def _loss(gather, w, x, *extra):
    return jnp.sum((x @ gather(w, *extra)) ** 2) / 2


def _lax(w):
    return jax.lax.all_gather(w, "data", tiled=True)


def collectives_1d(w, x):
    """Every collective on one device's inputs: a dict of per-device results (leading 1)."""
    full = jnp.tile(w, (N, 1))  # each device's full-size value: N chunks of its shard
    out = {
        "ag_lax": _lax(w),
        "ag_id": jc.all_gather(w, "data", jc.identity()),
        "ag_lax_stack": jax.lax.all_gather(w, "data", axis=1, tiled=False),
        "ag_id_stack": jc.all_gather(w, "data", jc.identity(), axis=1, tiled=False),
        "ag_int8": jc.all_gather({"w": w, "i": jnp.arange(3)}, "data", jc.int_quant(8)),
        "rs_lax": jax.lax.psum_scatter(full, "data", tiled=True),
        "rs_id": jc.psum_scatter(full, "data", jc.identity()),
        "rs_lax_drop": jax.lax.psum_scatter(full.reshape(N, -1), "data", scatter_dimension=0),
        "rs_id_drop": jc.psum_scatter(full.reshape(N, -1), "data", jc.identity(), tiled=False),
    }
    for name, (codec, _) in SCATTER.items():
        out["rs_" + name] = jc.psum_scatter(full, "data", codec, key=KEY)
    fsdp = {
        "none": functools.partial(jc.fsdp_gather, weights=None, grads=None),
        "id": functools.partial(jc.fsdp_gather, weights=jc.identity(), grads=jc.identity()),
        "q": jc.fsdp_gather,  # int8 weights, int4 gradients
        "w8": functools.partial(jc.fsdp_gather, grads=None),  # int8 weights, exact reduction
    }
    for name, g in {
        "lax": _lax,
        **{k: functools.partial(v, axis_name="data") for k, v in fsdp.items()},
    }.items():
        out["w_" + name], out["g_" + name] = g(w), jax.grad(functools.partial(_loss, g))(w, x)
    residual = jc.fsdp_residual(w, "data")
    ef = functools.partial(jc.fsdp_gather, axis_name="data")
    grad_ef = jax.grad(lambda w, r, x: _loss(lambda w: ef(w, residual=r), w, x), argnums=(0, 1))
    out["g_ef"], out["residual"] = grad_ef(w, residual, x)
    out["g_ef2"], _ = grad_ef(w, out["residual"], x)  # the second step adds the residual back
    return jax.tree.map(lambda a: a[None], out)


@functools.cache
def run_1d():
    return per_device(collectives_1d, (P("data"), P("data")), P("data"))


@functools.cache
def results_1d():
    return run_1d()(shard(W), shard(X))


def test_identity_and_none_equal_jax_lax_exactly():
    o = results_1d()
    for a, b in [("ag_lax", "ag_id"), ("ag_lax_stack", "ag_id_stack"), ("rs_lax", "rs_id")]:
        np.testing.assert_array_equal(o[a], o[b])
    np.testing.assert_array_equal(o["rs_lax_drop"], o["rs_id_drop"])
    assert o["ag_id"].shape == (N, N * ROWS, 6) and o["ag_id_stack"].shape == (N, ROWS, N, 6)
    for name in ("none", "id"):  # fsdp_gather: value and gradient
        np.testing.assert_array_equal(o["w_" + name], o["w_lax"])
        np.testing.assert_array_equal(o["g_" + name], o["g_lax"])


def test_identity_and_none_are_jax_lax_bit_for_bit_on_float16():
    """Values that are not small integers, in float16: a float32 sum rounded once differs
    from jax.lax's own (up to 8e-4 relative before), so the exact paths are jax.lax's."""
    w = jax.random.normal(jax.random.PRNGKey(2), (N * ROWS, 6), jnp.float16)
    x = jax.random.normal(jax.random.PRNGKey(3), (N * 3, N * ROWS), jnp.float16)

    def step(w, x):
        full = jnp.tile(w * 1.37, (N, 1))
        out = {"rs_lax": jax.lax.psum_scatter(full, "data", tiled=True)}
        out["rs_id"] = jc.psum_scatter(full, "data", jc.identity())
        out["g_lax"] = jax.grad(functools.partial(_loss, _lax))(w, x)
        for name, codec in (("none", None), ("id", jc.identity())):
            g = functools.partial(jc.fsdp_gather, axis_name="data", weights=codec, grads=codec)
            out["g_" + name] = jax.grad(functools.partial(_loss, g))(w, x)
        return jax.tree.map(lambda a: a[None], out)

    o = per_device(step, (P("data"), P("data")), P("data"))(shard(w), shard(x))
    assert o["rs_id"].dtype == jnp.float16 and o["g_id"].dtype == jnp.float16
    np.testing.assert_array_equal(o["rs_id"], o["rs_lax"])
    np.testing.assert_array_equal(o["g_none"], o["g_lax"])
    np.testing.assert_array_equal(o["g_id"], o["g_lax"])


def test_every_codec_family_reduce_scatters_within_its_bound():
    o = results_1d()
    exact = o["rs_lax"]
    for name, (_, bound) in SCATTER.items():
        err = float(jnp.linalg.norm(o["rs_" + name] - exact) / jnp.linalg.norm(exact))
        assert err <= bound, (name, err)
        assert err > 0 or bound == 0, name
    gathered = o["ag_int8"]
    # int8 blocks: at most half a step (max|w| / 127 / 2) per value; integer leaves exact.
    assert float(jnp.max(jnp.abs(gathered["w"] - o["ag_lax"]))) <= float(jnp.max(jnp.abs(W))) / 254
    np.testing.assert_array_equal(gathered["i"], np.tile(np.arange(3), (N, N)))


def test_fsdp_gather_int8_int4_and_error_feedback():
    o = results_1d()
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    assert rel(o["w_q"], o["w_lax"]) <= 8e-3
    assert 0 < rel(o["g_q"], o["g_lax"]) <= 0.12
    # First step: zero residual, so the same gradient; the residual is what was not sent:
    # the devices' residuals of chunk i add up to exact minus compressed gradient shard i
    # (both through the same int8 weights).
    np.testing.assert_array_equal(o["g_ef"], o["g_q"])
    res = np.asarray(o["residual"], np.float64)  # [device j, chunk i, rows, 6]
    np.testing.assert_allclose(
        res.sum(0), np.asarray(o["g_w8"] - o["g_q"]), rtol=1e-4, atol=1e-4 * np.abs(res).max()
    )
    # Second step, residual added back: over both steps, closer to twice the exact gradient.
    assert rel(o["g_ef2"] + o["g_ef"], 2 * o["g_lax"]) < rel(2 * o["g_q"], 2 * o["g_lax"])


def test_nonfinite_input_is_never_hidden_and_keeps_the_residual():
    bad_w = W.at[3, 2].set(jnp.nan)  # device 0's shard
    o = run_1d()(shard(bad_w), shard(X))
    for name in ("ag_int8", "rs_int8", "rs_int4", "rs_top_k", "rs_sign", "g_q", "g_ef"):
        for leaf in jax.tree.leaves(o[name]):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert bool(jnp.all(jnp.isnan(leaf))), name  # NaN on every device, everywhere
    # The identity is jax.lax.all_gather itself (since 2026-11-27; it went through float32
    # and poisoned everything): the NaN lands on every device, where jax.lax puts it.
    np.testing.assert_array_equal(o["ag_id"], o["ag_lax"])
    assert bool(jnp.all(jnp.isnan(o["ag_id"][:, 3, 2]))) and int(jnp.isnan(o["ag_id"]).sum()) == N
    np.testing.assert_array_equal(o["residual"], 0.0)  # the memory is left as it was
    bad_x = X.at[0, 0].set(jnp.inf)  # a gradient goes non-finite on device 0 only
    o = run_1d()(shard(W), shard(bad_x))
    assert bool(jnp.all(jnp.isfinite(o["w_q"]))) and bool(jnp.all(jnp.isnan(o["g_q"])))
    np.testing.assert_array_equal(o["residual"], 0.0)


def test_zero_input_gives_zero():
    o = run_1d()(shard(jnp.zeros_like(W)), shard(X))
    for name in ("ag_int8", "rs_int4", "rs_sign", "rs_top_k", "w_q", "g_q", "residual"):
        for leaf in jax.tree.leaves(o[name]):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                np.testing.assert_array_equal(leaf, 0.0)


# --------------------------------------------------------------------------- two hops, bytes


def mesh_2x4():
    return jax.make_mesh(
        (2, 4), ("host", "local"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:8]
    )


def collectives_2d(w, x):
    both = ("host", "local")
    full = jnp.tile(w, (N, 1))
    lax_g = lambda w: jax.lax.all_gather(w, both, tiled=True)  # noqa: E731
    two = functools.partial(jc.fsdp_gather, axis_name="host", inner_axis_name="local")
    out = {
        "ag_lax": lax_g(w),
        "ag_id": jc.all_gather(w, "host", jc.identity(), inner_axis_name="local"),
        "ag_int8": jc.all_gather(w, "host", jc.int_quant(8), inner_axis_name="local"),
        "rs_lax": jax.lax.psum_scatter(full, both, tiled=True),
        "rs_id": jc.psum_scatter(full, "host", jc.identity(), inner_axis_name="local"),
        "rs_int4": jc.psum_scatter(full, "host", jc.int_quant(4), inner_axis_name="local"),
        "g_lax": jax.grad(functools.partial(_loss, lax_g))(w, x),
        "g_id": jax.grad(
            functools.partial(_loss, functools.partial(two, weights=None, grads=None))
        )(w, x),
        "g_q": jax.grad(functools.partial(_loss, two))(w, x),
    }
    return jax.tree.map(lambda a: a[None], out)


def test_two_hops_match_jax_lax_over_both_axes():
    m = mesh_2x4()
    spec = P(("host", "local"))
    fn = per_device(collectives_2d, (spec, spec), spec, m=m)
    o = fn(shard(W, m, spec), shard(X, m, spec))
    for name in ("ag", "rs", "g"):
        exact = o[name + "_lax"]
        np.testing.assert_array_equal(o[name + "_id"], exact)
    assert float(jnp.max(jnp.abs(o["ag_int8"] - o["ag_lax"]))) <= float(jnp.max(jnp.abs(W))) / 254
    for name, bound in (("rs_int4", 0.15), ("g_q", 0.12)):
        lax = o[name.split("_")[0] + "_lax"]
        assert float(jnp.linalg.norm(o[name] - lax) / jnp.linalg.norm(lax)) <= bound, name


def fsdp_step(weights, grads, w, x):
    g = functools.partial(jc.fsdp_gather, axis_name="data", weights=weights, grads=grads)
    return jax.grad(functools.partial(_loss, g))(w, x)


def test_fsdp_step_bytes_int8_weights_int4_grads_under_a_fifth(n=8):
    """comm_report of the compiled step: <= 0.2x the float32 FSDP step; the ratio is the
    formula's, which does not depend on n (benchmarks/sharded.py measures n = 4 too)."""
    m = mesh(n)
    w, x = jnp.ones((n * 512, 64)), jnp.ones((n, n * 512))
    ratios = []
    for codecs in [(None, None), (jc.int_quant(8), jc.int_quant(4))]:
        step = jax.jit(
            jax.shard_map(
                functools.partial(fsdp_step, *codecs),
                mesh=m,
                in_specs=(P("data"), P("data")),
                out_specs=P("data"),
            )
        )
        ratios.append(jc.comm_report(step, shard(w, m), shard(x, m)).bytes_per_device)
    f32 = (n - 1) * 512 * 64 * 4 * 2  # all-gather + reduce-scatter of float32 shards
    assert ratios[0] == f32
    # (1 + 4/256) / 4 for int8 and (1/2 + 4/256) / 4 for int4, plus 8 bytes of non-finite flag.
    assert ratios[1] / ratios[0] == pytest.approx((1.015625 + 0.515625) / 8, abs=1e-4)
    assert ratios[1] / ratios[0] <= 0.2


# --------------------------------------------------------------------------- two processes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fsdp_example_over_two_gloo_processes():
    """examples/fsdp_lm.py in 2 processes x 2 CPU devices: a 2 x 2 mesh (replica x data),
    FSDP with error feedback inside, jc.compressed_allreduce across: both end equal. One
    decoder block (the compile is most of each process's cost: 35.0 -> 27.1 s of CPU)."""
    out = io.StringIO()
    args = ["--multiprocess", "--steps", "3", "--no-baseline", "--no-report", "--d-model", "32"]
    args += ["--layers", "1"]
    status = launch.run(
        [str(ROOT / "examples" / "fsdp_lm.py"), *args, "--replicas", "2", "--ef"],
        2,
        local_devices=2,
        timeout=600,
        out=out,
    )
    text = out.getvalue()
    assert status == 0, text[-3000:]
    digests = dict(re.findall(r"^\[(\d)\] \[\d\] params sha256 ([0-9a-f]{64})$", text, re.M))
    assert sorted(digests) == ["0", "1"] and digests["0"] == digests["1"], text[-3000:]
    losses = re.findall(r"train loss ([\d.]+) -> ([\d.]+)", text)
    assert len(losses) == 2 and all(float(b) < float(a) for a, b in losses), text[-3000:]


def test_hpz_remat_policy_keeps_the_backward_regather_on_the_fast_axis():
    """Under jax.checkpoint, the re-gather of the backward crosses the slow axis again
    unless the slow hop's result ("fsdp_secondary") is saved: then only the inner hop."""
    m = mesh_2x4()
    spec = P(("host", "local"))
    two = functools.partial(jc.fsdp_gather, axis_name="host", inner_axis_name="local")

    def grad_fn(policy):
        layer = jax.checkpoint(
            lambda w, x: jax.lax.psum(_loss(two, w, x), ("host", "local")), policy=policy
        )
        value_and_grad = jax.value_and_grad(layer)  # the loss too: the forward is not dead
        step = jax.shard_map(value_and_grad, mesh=m, in_specs=(spec, spec), out_specs=(P(), spec))
        return jax.jit(step)

    def slow_gathers(policy):
        report = jc.comm_report(grad_fn(policy), shard(W, m, spec), shard(X, m, spec))
        return [c for c in report.logical if c.kind == "all-gather" and c.group_size == 2]

    saved = jax.checkpoint_policies.save_only_these_names("fsdp_secondary")
    remat_all, hpz = slow_gathers(None), slow_gathers(saved)
    assert len(hpz) == 2  # int8 codes and their scales, once (the forward)
    assert len(remat_all) == 4  # and again in the backward
