"""Property tests (hypothesis) of every registered codec and every strategy, and error-feedback
conservation of every transform.

Codecs: everything in ``jc.CODECS`` (whatever is registered when the tests run) plus the
sparse families in several value modes. Sizes: 0, 1, primes, non-multiples of 32 and of the
block sizes, up to a few million (shape-only checks are cheap, so they go big; value checks
use a fixed pool of sizes so compiled programs are reused). Dtypes f32/bf16/f16; values zero,
denormal, huge (1e30; 6e4 in fp16), normal, and all of them mixed. Invariants:

* payload shapes are static: ``jax.eval_shape`` gives them from the size alone, and a concrete
  encode of any values has exactly those shapes; ``payload_bytes(d)`` is their exact size;
* finite in -> finite out; zero in -> exactly zero out;
* unbiased codecs: the mean of many decodes passes a z-test against ``x``;
* biased contractive codecs: ``||C(x) - x||^2 <= (1 - delta(d)) ||x||^2`` (inputs in the
  normal range: XLA flushes subnormals to zero, so an all-subnormal vector decodes to 0).

Strategies: ``jc.pmean`` with every strategy on 8 devices keeps shapes and dtypes, maps zero
to zero and finite to finite, and averages exactly with the identity codec.

Conservation, 100 steps on 8 devices (one jitted ``lax.scan``): for residual feedback
``sum_t out_t + mean_i e_i + sum_i s_i = sum_t mean_i g_i`` (``s_i``: two-phase server
residual); for EF21 the global estimate stays the mean of the device estimates
(``h + sum_i s_i = mean_i h_i``); for DGC ``sum_t out_t + mean_i v_i + sum_i s_i =
sum_t mean_i u_i`` where ``u_i`` is the momentum-corrected velocity fed in (without masking,
``u_i`` is plain momentum of the gradients, so the identity is in the gradients alone).
Sign with residual feedback (allgather, two_phase) and PowerSGD
(``sum_t out_t + mean_i E_i = sum_t mean_i G_i``) are rows of the contract suite
(tests/test_contract.py), which checks the same law step by step.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    N,
    device_mean,
    empty,
    mesh,
    per_device,
    replicated_per_leaf,
    server_per_leaf,
    shard,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

EXTRA = [
    jc.top_k(0.01),
    jc.top_k(0.1, approx=True),
    jc.top_k(0.1, values="bf16"),
    jc.top_k(0.1, values="int8"),
    jc.top_k(0.2, values="sign"),
    jc.random_k(0.05),
    jc.random_k(0.1, values="bf16"),
    jc.threshold(0.5, 64),
    jc.threshold(0.1, 16, values="sign"),
]


def all_codecs():
    codecs = {name: jc.get_codec(name) for name in sorted(jc.CODECS)}
    for c in EXTRA:
        if c not in codecs.values():
            codecs[str(c)] = c
    return codecs


CODECS = all_codecs()
NAMES = sorted(CODECS)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
KEY = jax.random.PRNGKey(0)
PRIMES = [2, 3, 5, 7, 31, 37, 127, 257, 1009, 4099, 65537, 1_000_003]
# Sizes for value checks: a fixed pool, so each (codec, size, dtype) compiles once.
VALUE_SIZES = [0, 1, 2, 3, 31, 33, 100, 257, 1000, 4099]
KINDS = ("zero", "denormal", "huge", "normal", "mixed")  # order: see test_roundtrip

sizes = st.one_of(
    st.sampled_from([0, 1, 32, 33, 255, 256, 257, 511, 513, *PRIMES]),
    st.integers(0, 5000),
    st.integers(0, 4_000_000),
)


def nbytes(tree):
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def shapes(tree):
    return [(tuple(a.shape), jnp.dtype(a.dtype)) for a in jax.tree.leaves(tree)]


# --------------------------------------------------------------------------- shapes and bytes


# 30 examples: every registry codec's bytes and shapes at ten fixed sizes (0 to 4099) are
# also checked deterministically in tests/test_codecs.py.
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), d=sizes, dtype=st.sampled_from(sorted(DTYPES)))
@example(name="int8", d=3_000_017, dtype="bf16")
@example(name="sign_block", d=2_999_999, dtype="f16")
def test_payload_shapes_static_and_bytes_exact(name, d, dtype):
    codec = CODECS[name]
    x = jax.ShapeDtypeStruct((d,), DTYPES[dtype])
    payload = jax.eval_shape(codec.encode, x, KEY)
    assert nbytes(payload) == codec.payload_bytes(d), (name, d)
    y = jax.eval_shape(lambda p: codec.decode(p, d), payload)
    assert (y.shape, y.dtype) == ((d,), jnp.float32)


# --------------------------------------------------------------------------- values


def make_values(kind: str, d: int, dtype, seed: int) -> np.ndarray:
    """``d`` values of ``kind`` representable in ``dtype`` (as float32 numpy)."""
    rng = np.random.default_rng(seed)
    tiny = 3e-6 if dtype == jnp.float16 else 1e-40  # subnormal in the dtype
    huge = 6e4 if dtype == jnp.float16 else 1e30
    signs = rng.choice([-1.0, 1.0], d)
    parts = {
        "zero": np.zeros(d),
        "denormal": signs * tiny * rng.uniform(0.5, 1.0, d),
        "huge": signs * huge * rng.uniform(0.5, 1.0, d),
        "normal": rng.standard_normal(d),
    }
    if kind == "mixed":
        pick = rng.integers(0, 4, d)
        x = np.choose(pick, [parts["zero"], parts["denormal"], parts["huge"], parts["normal"]])
    else:
        x = parts[kind]
    return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))


@functools.cache
def _encode_decode(codec, d: int, dtype):
    """Jitted encode+decode of a stack of inputs (one per value kind): one compile each."""

    def one(x, key):
        payload = codec.encode(x.astype(dtype), key)
        return payload, codec.decode(payload, d)

    return jax.jit(jax.vmap(one))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(NAMES),
    d=st.sampled_from(VALUE_SIZES),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**16),
)
@example(name="int8", d=2_000_003, dtype="f32", seed=1)
@example(name=str(jc.top_k(0.01)), d=1_000_003, dtype="bf16", seed=2)
def test_roundtrip_invariants(name, d, dtype, seed):
    codec = CODECS[name]
    xs = np.stack([make_values(kind, d, DTYPES[dtype], seed) for kind in KINDS])
    keys = jax.random.split(jax.random.PRNGKey(seed), len(KINDS))
    payloads, ys = _encode_decode(codec, d, DTYPES[dtype])(xs, keys)
    # Static shapes: every concrete payload is what eval_shape promised; bytes exact.
    abstract = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((d,), DTYPES[dtype]), KEY)
    for i, kind in enumerate(KINDS):
        payload = jax.tree.map(lambda a, i=i: a[i], payloads)
        assert shapes(payload) == shapes(abstract)
        assert sum(a.nbytes for a in jax.tree.leaves(payload)) == codec.payload_bytes(d)
        x, y = xs[i], np.asarray(ys[i])
        assert y.shape == (d,) and y.dtype == np.float32
        assert np.isfinite(y).all(), f"{name} {kind} {dtype}: finite in, non-finite out"
        if kind == "zero":
            np.testing.assert_array_equal(y, 0.0)
        delta = codec.delta(d)
        if delta is not None and d:
            # XLA flushes subnormals to zero (CPU and GPU): the codec may see them as 0, so
            # the bound is on the normal part; a subnormal x_i may come back as 0 or even as
            # -x_i (its sign read as +), an error of at most (2 x_i)^2 < 1e-75 each.
            x64, y64 = x.astype(np.float64), y.astype(np.float64)
            normal = np.where(np.abs(x) < np.finfo(np.float32).tiny, 0.0, x64)
            err, norm = np.sum((y64 - x64) ** 2), np.sum(normal**2)
            lost = np.sum((x64 - normal) ** 2)
            bound = (1 - delta) * norm * (1 + 1e-5) + 4 * lost + 1e-300
            assert err <= bound, (name, kind, err, norm, delta)


UNBIASED = [n for n in NAMES if CODECS[n].unbiased]
DRAWS = 4000


@pytest.mark.parametrize("name", UNBIASED)
def test_unbiased_codecs_pass_a_z_test(name):
    """Mean of DRAWS decodes against x, per coordinate: |z| < 5.5 (37 coordinates)."""
    codec = CODECS[name]
    d = 37
    x = np.random.default_rng(5).standard_normal(d).astype(np.float32)
    x[[3, 20]] = 0.0
    keys = jax.random.split(jax.random.PRNGKey(1), DRAWS)
    ys = np.asarray(jax.jit(jax.vmap(lambda k: codec.roundtrip(jnp.asarray(x), k)))(keys), float)
    mean, sd = ys.mean(0), ys.std(0)
    deterministic = sd == 0
    np.testing.assert_allclose(mean[deterministic], x[deterministic], rtol=1e-6, atol=1e-7)
    z = (mean - x)[~deterministic] / (sd[~deterministic] / np.sqrt(DRAWS))
    assert np.abs(z).max(initial=0.0) < 5.5, (name, np.abs(z).max())


# --------------------------------------------------------------------------- strategies

STRATEGY_CODECS = {  # one or two per strategy: every compile costs seconds on 2 cores
    "allreduce": ["identity", str(jc.random_k(0.05))],
    "allgather": [str(jc.top_k(0.1, values="int8"))],
    "two_phase": ["sign"],
    "majority_vote": ["signsgd"],
    "auto": ["int8_sr"],
}
TREE_SIZES = (0, 1, 13, 1031)


@pytest.mark.parametrize(
    "strategy,name",
    [(s, n) for s, names in STRATEGY_CODECS.items() for n in names if n in CODECS],
)
def test_pmean_every_strategy_zero_finite_shapes(strategy, name):
    codec = CODECS[name]

    def fn(tree):
        tree = jax.tree.map(lambda a: a[0], tree)
        return jc.pmean(tree, "data", codec, key=jax.random.PRNGKey(3), strategy=strategy)

    specs = {f"x{d}": P() for d in TREE_SIZES} | {"steps": P("data")}  # ints pass through
    step = per_device(fn, P("data"), specs)
    rng = np.random.default_rng(0)
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float32)
    mixed = {
        f"x{d}": jnp.asarray(make_values("mixed", N * d, dt, d).reshape(N, d), dt)
        for d, dt in zip(TREE_SIZES, dtypes, strict=True)
    }
    mixed["steps"] = jnp.asarray(rng.integers(0, 9, (N, 3)), jnp.int32)  # passes through
    # No collective carries the empty leaf: XLA:CPU 0.11 segfaults compiling such a program.
    text = step.lower(shard(mixed)).as_text()
    collective = r'"stablehlo\.(?:all_\w+|reduce_scatter)"\(.*?(?:\}\) )?: \(([^)]*)\)'
    ops = re.findall(collective, text, re.S)  # the operand types of every collective
    assert ops and not [o for o in ops if re.search(r"tensor<(\d+x)*0x", o)], ops
    out = step(shard(mixed))
    np.testing.assert_array_equal(out.pop("steps"), np.ravel(mixed["steps"]))
    for k, v in out.items():
        assert v.shape == mixed[k].shape[1:] and v.dtype == mixed[k].dtype, k
        assert np.isfinite(np.asarray(v, np.float32)).all(), (name, strategy, k)
    zeros = jax.tree.map(jnp.zeros_like, mixed)
    for v in jax.tree.leaves(step(shard(zeros))):
        np.testing.assert_array_equal(np.asarray(v, np.float32), 0.0)
    if name == "identity":
        normal = {
            k: jnp.asarray(rng.standard_normal(v.shape), v.dtype)
            for k, v in mixed.items()
            if k != "steps"
        }
        normal["steps"] = mixed["steps"]
        for k, v in step(shard(normal)).items():
            if k == "steps":
                continue
            np.testing.assert_allclose(
                np.asarray(v, np.float32), np.asarray(normal[k], np.float32).mean(0), atol=2e-2
            )


# --------------------------------------------------------------------------- conservation

STEPS = 100
SHAPES = {"w": (12, 40), "v": (300,), "b": (7,)}  # "b" is below min_size: plain pmean


def _gradients(t):
    """Device-varying random gradients of step t (inside shard_map), with a common drift."""
    key = jax.random.fold_in(jax.random.PRNGKey(9), t)
    key = jax.random.fold_in(key, jax.lax.axis_index("data"))
    return {
        k: jax.random.normal(jax.random.fold_in(key, i), s) + 0.3
        for i, (k, s) in enumerate(SHAPES.items())
    }


PARAMS = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def run_scan(tx, fed_fn):
    """100 steps of tx.update in one jitted lax.scan; returns (sum of outputs, sum of fed,
    final state) with per-device state fields stacked over devices."""
    params = jax.tree.map(jnp.asarray, PARAMS)
    m = mesh()
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")

    def body(carry, t):
        state, out_sum, fed_sum = carry
        g = _gradients(t)
        fed = fed_fn(g, state)
        out, state = tx.update(g, state, params)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return (state, add(out_sum, out), add(fed_sum, fed)), None

    def loop(state):
        zeros = jax.tree.map(jnp.zeros_like, params)
        fed0 = jax.lax.pcast(zeros, "data", to="varying")
        (state, out_sum, fed_sum), _ = jax.lax.scan(body, (state, zeros, fed0), jnp.arange(STEPS))
        return state, out_sum, jax.lax.pmean(fed_sum, "data")

    fn = per_device(loop, (specs,), (specs, P(), P()), m)
    state, out_sum, fed_sum = fn(state)
    return jax.tree.map(np.asarray, out_sum), jax.tree.map(np.asarray, fed_sum), state


def _flat(tree, keys=("v", "w")):  # the compressed leaves, in tree (sorted-key) order
    return np.concatenate([np.ravel(tree[k]).astype(np.float64) for k in keys])


def _server(state):
    """The whole two-phase server residual per leaf (owned chunks joined), 0 where none."""
    field = state.server_residual
    whole = {} if field is None else server_per_leaf(field, PARAMS)
    return {k: np.zeros(s) if whole.get(k) is None else whole[k] for k, s in SHAPES.items()}


# majority_vote is left out on purpose: its output is the sign of the vote, not the mean of
# what the devices sent, so no memory can account for the difference. sign with residual
# feedback over allgather and two_phase, and powersgd, are the contract suite's rows
# (tests/test_contract.py, item 1: sign-allgather, sign-two_phase, powersgd-start0/2).
CA_CASES = [
    ("bf16", "residual", "allreduce"),
    (str(jc.top_k(0.1, values="int8")), "residual", "two_phase"),
    ("int2", "ef21", "allgather"),
    ("sign_block", "ef21", "two_phase"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,kind,strategy", CA_CASES)
def test_error_feedback_conserves_over_100_steps(name, kind, strategy):
    tx = jc.compressed_allreduce(
        CODECS[name], "data", error_feedback=kind, strategy=strategy, min_size=10
    )
    out_sum, fed_sum, state = run_scan(tx, lambda g, s: g)
    np.testing.assert_allclose(out_sum["b"], fed_sum["b"], rtol=1e-5, atol=1e-4)  # plain pmean
    server = _flat(_server(state))
    assert empty(state.memory["b"])  # plain pmean: no memory
    if kind == "residual":
        memory = _flat(device_mean(state.memory, PARAMS))
        lhs, rhs = _flat(out_sum) + memory + server, _flat(fed_sum)
        # bf16 payloads are *added* in bf16 inside the psum: rounding no memory can see.
        atol = 0.5 if name == "bf16" else 2e-3
        np.testing.assert_allclose(lhs, rhs, atol=atol)
        assert np.abs(memory).max() > 0 or name == "bf16"
    else:  # ef21: the global estimate is the mean of the device estimates (+ server residual)
        estimate = _flat(replicated_per_leaf(state.estimate, PARAMS))
        local = _flat(device_mean(state.memory, PARAMS))
        np.testing.assert_allclose(estimate + server, local, atol=1e-3)
        # and it tracks the last mean gradient (nothing drifts away)
        assert np.isfinite(estimate).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "masking,strategy,nesterov",
    [
        (True, "two_phase", True),
        (False, "allgather", False),
    ],
)
def test_dgc_conserves_momentum_corrected_velocity(masking, strategy, nesterov):
    m_ = 0.9
    tx = jc.dgc(
        0.05,
        "data",
        momentum=m_,
        nesterov=nesterov,
        momentum_masking=masking,
        strategy=strategy,
        min_size=10,
        warmup_steps=0,
    )

    def fed(g, s):  # what enters the accumulation this step (compressed leaves: only "w")
        u = s.velocity["w"].reshape(SHAPES["w"])  # this device's slot (1, *shape)
        gw = g["w"]
        new = m_ * (u + gw) + gw if nesterov else m_ * u + gw
        return {"w": new, "v": g["v"], "b": g["b"]}

    out_sum, fed_sum, state = run_scan(tx, fed)
    assert empty(state.velocity["v"]) and empty(state.accumulation["v"])  # 1-D: plain
    waiting = device_mean(state.accumulation, PARAMS)["w"]
    lhs = np.ravel(out_sum["w"] + waiting + _server(state)["w"])
    np.testing.assert_allclose(lhs, np.ravel(fed_sum["w"]), rtol=1e-4, atol=2e-3)
    if not masking and not nesterov:
        # Without masking u_t = m u_{t-1} + g_t exactly, so
        # sum_t u_t = sum_t g_t (1 - m^(T-t)) / (1 - m): an identity in the gradients alone.
        grads = np.zeros(SHAPES["w"])
        for t in range(STEPS):
            g_t = np.mean([np.asarray(_host_gradient(t, i)) for i in range(N)], axis=0)
            grads += g_t * (1 - m_ ** (STEPS - t)) / (1 - m_)
        np.testing.assert_allclose(fed_sum["w"], grads, rtol=1e-4, atol=2e-3)


@functools.cache
def _host_gradient_fn():
    def g(t, i):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(9), t), i)
        return jax.random.normal(jax.random.fold_in(key, 0), SHAPES["w"]) + 0.3

    return jax.jit(g)


def _host_gradient(t, i):
    return _host_gradient_fn()(t, i)
