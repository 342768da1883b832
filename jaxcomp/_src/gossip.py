"""Decentralized training: each device steps its own replica and averages with its neighbours.

Gossip is the third architecture beside parameter servers and all-reduce: no device ever
sees the mean, each averages its params with the few neighbours of a :mod:`topology
<jaxcomp._src.topology>` through ``jax.lax.ppermute``, so the bytes each device sends per
round do not grow with the number of devices. The replicas differ during training and
agree at the end; evaluate their mean (:func:`jaxcomp.mean_replica`) and watch their spread
(:func:`consensus_distance`). With a codec the neighbours exchange compressed differences to
public copies (CHOCO-SGD, Koloskova, Stich, Jaggi, ICML 2019).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import buckets, collectives, shards, skeleton
from jaxcomp._src import layout as layouts
from jaxcomp._src import topology as topologies
from jaxcomp._src.codecs.base import (
    Codec,
    check_int,
    check_positive_float,
    max_abs_over,
    scaled_norm,
)
from jaxcomp._src.older_states import NONE


class GossipState(NamedTuple):
    """State of :func:`gossip`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Per-device fields carry a leading axis of 1 on every array, this device's slot; the
    per-leaf ones mirror the params tree (``optax.MaskedNode`` at integer leaves; None
    without a codec).

    Attributes:
      inner: per device: the inner transform's state, every leaf with a leading slot of 1
      public: per device, f32[1, *leaf.shape] per float leaf: x_hat_i, this device's public copy
        (what its neighbours know of it); CHOCO only
      mixed: per device, f32[1, *leaf.shape] per float leaf: s_i = sum_j w_ij x_hat_j, the weighted
        public copies of itself and its neighbours; CHOCO only
      key: uint32[2], identical on every device (fold_in axis_index per device)
      count: int32[]: number of updates applied
      topology: int32[], identical on every device, CHOCO only: the topology whose mixing
        matrix ``mixed`` belongs to (its index in :data:`jaxcomp.TOPOLOGIES`); a state run
        in another topology restarts its copies (:func:`restart_copies`). None without a
        codec, and in a state saved before this field (then nothing is checked, as before)
    """

    inner: Any
    public: Any
    mixed: Any
    key: chex.PRNGKey
    count: jax.Array
    topology: Any = None

    PER_DEVICE_FIELDS = ("inner", "public", "mixed")
    #: Added since the first release (:func:`jaxcomp.complete_state`): a state saved without
    #: ``topology`` gets None, its copies run as they are (nothing checked, as before).
    ADDED_FIELDS = {"topology": NONE}
    #: Fields tied to the mixing matrix of the devices they were built on
    #: (``mixed = sum_j w_ij public_j``): no fold over another device count keeps that.
    TOPOLOGY_FIELDS = ("public", "mixed")


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            "`inner` must be an optax GradientTransformation (e.g. optax.sgd(0.1)), got "
            f"{type(inner).__name__}"
        )
    return optax.with_extra_args_support(inner)


def _check_gamma(gamma: Any) -> float:
    """The consensus step: None gives 1, else a number in (0, 1]."""
    if gamma is None:
        return 1.0
    return check_positive_float("gamma", gamma, upper=1.0)


def gossip(
    inner: optax.GradientTransformation,
    axis_name: Any,
    *,
    topology: str = "ring",
    codec: Codec | None = None,
    gamma: float | None = None,
    every: int = 1,
    seed: int = 0,
    bucket_bytes: int = buckets.BUCKET_BYTES,
    shard_axis: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Decentralized SGD: step ``inner`` on this device's replica, then gossip with neighbours.

    Each device ``i`` holds its own params ``x_i`` (replicas: :func:`jaxcomp.replica_params`)
    and its own gradient ``g_i``; there is no all-reduce. Every step::

        x_i^{+} = x_i + inner(g_i)                                    # local step
        x_i'    = x_i^{+} + gamma * (sum_j w_ij x_j^{+} - x_i^{+})    # exact gossip (codec None)

    with ``W = (w_ij)`` the doubly stochastic mixing matrix of ``topology`` (``j`` ranges over
    ``i`` and its neighbours, :func:`jaxcomp.topology`). With a ``codec`` it is CHOCO-SGD
    (Koloskova, Stich, Jaggi, "Decentralized Stochastic Optimization and Gossip Algorithms
    with Compressed Communication", ICML 2019, Algorithm 2, in its memory-efficient form):
    each device keeps its public copy ``x_hat_i`` (what all its neighbours know of it) and
    ``s_i = sum_j w_ij x_hat_j``, sends only the compressed difference, and every receiver
    updates its copies with the same ``q_j``::

        q_i     = C(x_i^{+} - x_hat_i)                     # encoded once, sent to each neighbour
        x_hat_i = x_hat_i + q_i
        s_i     = s_i + sum_j w_ij q_j                     # j: i and its neighbours
        x_i'    = x_i^{+} + gamma * (s_i - x_hat_i)        # consensus step gamma

    Because ``W`` is doubly stochastic, ``sum_i (s_i - x_hat_i) = 0``: the mean of the
    replicas moves exactly by the mean of the local steps (up to float rounding), whatever
    the codec, and the replicas contract towards it at a rate set by the topology's spectral
    gap and the codec's contraction ``delta`` (CHOCO converges with any contractive codec for
    ``gamma`` small enough: of order ``rho^2 delta``, ``rho`` the gap). Public copies start at
    the params given to ``init`` (the replicas must start equal), so a zero gradient moves
    nothing. Bytes each device sends per round: ``m`` neighbours times the payload of its
    params (``m = 2`` for the ring, at most 4 for the torus, ``ceil(log2 n)`` for the
    exponential graph; :func:`gossip_bytes`), plus one 4-byte all-reduce of a non-finite
    flag: never an all-reduce or all-gather of the params.

    ``update(grads, state, params)`` runs inside ``jax.shard_map`` (or ``jax.pmap``) on this
    device's own gradients and params (``jc.own(replicas)``); ``params`` is required. It
    returns the update that moves this device's params from ``x_i`` to ``x_i'``; integer
    leaves get the inner update alone. With ``every > 1`` the devices mix once every
    ``every`` steps (local steps in between, as local SGD with gossip instead of averaging).

    A non-finite gradient (or inner update) on any device makes every device's output NaN
    and leaves the whole state, the inner state and the public copies, unchanged on every
    device (one 4-byte flag all-reduce keeps the verdict identical). To skip such a step
    on every device wrap the gossip in ``jc.apply_if_finite(tx, axis_name, 3)``;
    ``optax.apply_if_finite`` around it decides per device and is refused at trace time.

    Args:
      inner: the optax transform each device steps with (e.g. ``optax.adam(1e-3)``); its
        state is per device. Nothing may follow this transform in an ``optax.chain``
        (it would change the mixing per device; ``jc.sharded_init`` refuses it).
      axis_name: the mesh axis the replicas live on (bound by ``shard_map`` or ``pmap``).
      topology: ``"ring"`` (default), ``"torus"`` or ``"exponential"``
        (:data:`jaxcomp.TOPOLOGIES`; :mod:`jaxcomp._src.topology` gives each one's shape and
        spectral gap).
      codec: None (exact gossip: the float params travel in their own dtype) or a jaxcomp
        codec (CHOCO-SGD: ``C(x - x_hat)`` travels). Stochastic codecs get independent noise
        per device.
      gamma: the consensus step in (0, 1]; None gives 1 (exact gossip; with a codec, right
        for fine codecs such as ``jc.int_quant(8)``; sparsifiers such as ``jc.top_k`` need
        a smaller step, of order ``rho^2 delta``, or the replicas diverge).
      every: mix once every ``every`` steps (an int >= 1).
      seed: seeds the PRNG key kept in the state (stochastic codecs).
      bucket_bytes: payloads of all leaves travel in buckets of about this many bytes, one
        ``ppermute`` per bucket per neighbour.
      shard_axis: the mesh axis (or tuple) over which the replicas are FSDP shards of one
        model (params ``P(axis_name, "data")``), as :func:`jaxcomp.diloco`'s: the non-finite
        flag is or-ed over it (one scalar ``psum``), so a non-finite shard skips the step of
        every shard (NaN updates, the whole state kept). Under ``check_vma=True`` jax's
        types tell (None works); under ``check_vma=False`` they do not, and with another
        manual axis bound beside ``axis_name`` the update warns where this is None. ``()``:
        the params are whole, no warning.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a :class:`GossipState`.

    Raises:
      ValueError: at construction, ``axis_name``, ``topology``, ``gamma``, ``every``, ``seed`` or
        ``bucket_bytes`` outside its rule (the message names the argument; the rules:
        docs/errors.md).
      TypeError: at construction, ``inner``, ``codec``, ``gamma``, ``every``, ``seed``,
        ``bucket_bytes``, ``shard_axis`` or ``axis_name`` of the wrong kind.

    Example (8 devices on a ring, int8 CHOCO)::

      tx = jc.gossip(optax.sgd(0.1, momentum=0.9), "data", codec=jc.int_quant(8))
      replicas = jc.replica_params(params, mesh, "data")
      state = jc.sharded_init(tx, params, mesh, "data")
      specs = jc.state_specs(state, "data")

      def step(replicas, state, x, y):
          p = jc.own(replicas)
          g = jax.grad(loss)(p, x, y)
          u, state = tx.update(g, state, p)
          return jc.slot(optax.apply_updates(p, u)), state

      step = jax.jit(jax.shard_map(step, mesh=mesh,
                                   in_specs=(P("data"), specs, P("data"), P("data")),
                                   out_specs=(P("data"), specs)))
      # evaluate jc.mean_replica(replicas); jc.consensus_distance(replicas) -> spread

    References:
      Koloskova, Stich, Jaggi, "Decentralized Stochastic Optimization and Gossip Algorithms
      with Compressed Communication", ICML 2019. Lian, Zhang, Zhang, Hsieh, Zhang, Liu, "Can
      Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017 (D-PSGD).
    """
    inner = _check_inner(inner)
    collectives.check_axis_name(axis_name)
    topology_name = topologies.check_topology(topology)
    if codec is not None:
        collectives.check_codec(codec)
    gamma = _check_gamma(gamma)
    every = check_int("every", every, 1)
    seed = check_int("seed", seed, 0)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    shard_axis = shards.check_shard_axis(shard_axis)
    code = topologies.TOPOLOGIES.index(topology_name)  # GossipState.topology (CHOCO)

    def fields(params: Any) -> dict[str, Any]:
        """The public copies: the params in float32 (the replicas start equal), per device,
        and the topology they are mixed by."""
        layout = layouts.layout_of(params)
        if codec is None:  # exact gossip keeps no copies (None: orbax saves no empty field)
            return {"public": None, "mixed": None, "topology": None}
        copies = skeleton.like_state(layout, _float_leaves(params, layout))
        return {"public": copies, "mixed": copies, "topology": jnp.int32(code)}

    def init_fn(params):
        return GossipState(
            inner=_slotted(inner.init(params)),
            key=jax.random.PRNGKey(seed),
            count=jnp.zeros([], jnp.int32),
            **fields(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "gossip: `params` is required: update(grads, state, params) with this "
                "device's own params (jc.own(replicas))"
            )
        n = skeleton.begin("gossip", updates, params, axis_name)
        layout = layouts.layout_of(params)
        abstract = _abstract(params)
        expected = jax.eval_shape(lambda: fields(abstract))
        expected["inner"] = jax.eval_shape(lambda: _slotted(inner.init(abstract)))
        if state.topology is None:  # saved before the field: nothing to check, as before
            del expected["topology"]
        skeleton.check_fields("gossip", state, expected, axis_name, updates)
        topo = topologies.topology(topology_name, n)
        inner_state = jax.tree.map(lambda x: x[0], state.inner)
        step, inner_new = inner.update(updates, inner_state, params, **extra_args)
        before = _float_leaves(params, layout)
        local = [p + s for p, s in zip(before, _float_leaves(step, layout), strict=True)]
        bad = collectives.local_nonfinite(local)
        if n > 1:  # one verdict for every device: the public copies must move together
            bad = jax.lax.pmax(bad.astype(jnp.int32), axis_name) > 0
        bad = shards.any_shard(bad)  # and for every shard of one model (shard_axis)
        key, step_key = jax.random.split(state.key)

        def mix(operands):
            xs, public, mixed = operands
            if codec is None:
                return _exact(xs, topo, gamma, axis_name, bucket_bytes, layout), public, mixed
            return _choco(xs, public, mixed, topo, gamma, codec, step_key, axis_name, bucket_bytes)

        public, mixed = [], []
        if codec is not None:
            public, mixed = skeleton.vectors(state.public), skeleton.vectors(state.mixed)
            if state.topology is not None:
                other = _other_matrix(state.topology, topology_name, n)
                public, mixed = restart_copies(other, public, mixed)
        operands = (local, public, mixed)
        if every == 1 or n == 1:
            mixed_out = mix(operands) if n > 1 else operands
        else:
            mixed_out = jax.lax.cond((state.count + 1) % every == 0, mix, lambda o: o, operands)
        after, public, mixed = mixed_out
        outs = [collectives.poison(a - b, bad) for a, b in zip(after, before, strict=True)]
        new_state = GossipState(
            inner=_slotted(inner_new),
            public=skeleton.like_state(layout, public) if codec is not None else state.public,
            mixed=skeleton.like_state(layout, mixed) if codec is not None else state.mixed,
            key=key,
            count=state.count + 1,
            topology=None if state.topology is None else jnp.int32(code),
        )
        new_state = skeleton.freeze(bad, state, new_state)
        # An empty float leaf (the layout's plain group) has nothing to mix: its update is empty.
        empty = [jnp.zeros_like(a) for a in layouts.leaves_of(step, layout, layouts.PLAIN)]
        return layouts.assemble(step, layout, outs, empty), new_state

    update_fn = shards.with_shard_axis(update_fn, "jc.gossip", axis_name, shard_axis)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def restart_copies(other: jax.Array, public: list, mixed: list) -> tuple[list, list]:
    r"""CHOCO's copies for a state whose ``mixed`` belongs to another mixing matrix
    (``other``: a bool identical on every device, e.g. a checkpoint restored into another
    ``topology``): both restart from zero, else they are kept as they are (bit for bit).

    ``s_i = sum_j w_ij x_hat_j`` holds for the old matrix only, and each step adds the new
    matrix's terms, so ``s_i - x_hat_i`` would keep a constant offset and the replicas would
    stop contracting. ``x_hat = s = 0`` satisfies the invariant for every matrix, with no
    exchange: it is CHOCO-SGD's own initialization (Koloskova, Stich, Jaggi, ICML 2019,
    Algorithm 2, ``x_hat^{(0)} = 0``), so the gossip goes on from the replicas as they are,
    sending ``C(x_i - x_hat_i)`` from ``x_hat_i = 0`` (the copies catch up in a few steps at
    the codec's contraction), and the mean of the replicas still moves only by the mean of
    the local steps.
    """
    zero = lambda xs: [jnp.where(other, jnp.zeros_like(x), x) for x in xs]  # noqa: E731
    return zero(public), zero(mixed)


def _other_matrix(code: jax.Array, name: str, n: int) -> jax.Array:
    """Whether the topology of index ``code`` in :data:`jaxcomp.TOPOLOGIES` (a restored
    state's) mixes by another matrix than ``name`` on ``n`` devices: names of one matrix
    (any two on 2 devices; the torus of a prime ``n`` and the ring) count as the same."""
    mine = sorted(topologies.topology(name, n).dests)
    same = [sorted(topologies.topology(t, n).dests) == mine for t in topologies.TOPOLOGIES]
    return jnp.logical_not(jnp.asarray(same)[code])


def _slotted(tree: Any) -> Any:
    """Every leaf with a leading slot of 1 (per-device state)."""
    return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _float_leaves(tree: Any, layout: layouts.Layout) -> list[jax.Array]:
    """The floating leaves of ``tree`` as float32 vectors (every non-empty float leaf is
    'compressed'; an empty one is 'plain' and takes no part in the gossip)."""
    return layouts.compressed_vectors(tree, layout)


def _receive(payloads: list[Any], topo: Any, axis_name: Any, bucket_bytes: int) -> list[list]:
    """What this device receives through each permutation: one list of payloads per neighbour."""
    return [
        buckets.exchange(
            payloads,
            lambda b, k=k: jax.lax.ppermute(b, axis_name, topo.pairs(k)),
            bucket_bytes=bucket_bytes,
        )
        for k in range(topo.neighbours)
    ]


def _exact(xs, topo, gamma, axis_name, bucket_bytes, layout) -> list[jax.Array]:
    """Exact gossip: the params travel in their own dtype, ``x + gamma w (sum_k x_k - m x)``."""
    dtypes = [dt for dt, g in zip(layout.dtypes, layout.groups, strict=True) if g == "compressed"]
    sent = [x.astype(dt) for x, dt in zip(xs, dtypes, strict=True)]
    received = _receive(sent, topo, axis_name, bucket_bytes)
    m, w = topo.neighbours, topo.weight
    out = []
    for i, x in enumerate(xs):
        total = sum(r[i].astype(jnp.float32) for r in received)
        out.append(x + (gamma * w) * (total - m * x))
    return out


def _choco(xs, public, mixed, topo, gamma, codec, key, axis_name, bucket_bytes):
    """CHOCO-SGD's gossip step (memory-efficient form): returns ``(x', x_hat', s')``."""
    device_key = collectives.device_key(key, codec, axis_name)
    keys = (
        [None] * len(xs)
        if device_key is None
        else [jax.random.fold_in(device_key, i) for i in range(len(xs))]
    )
    payloads = [codec.encode(x - h, k) for x, h, k in zip(xs, public, keys, strict=True)]
    received = _receive(payloads, topo, axis_name, bucket_bytes)
    w = topo.weight
    new_x, new_public, new_mixed = [], [], []
    for i, (x, h, s) in enumerate(zip(xs, public, mixed, strict=True)):
        d = x.shape[0]
        q = codec.decode(payloads[i], d)
        theirs = sum(codec.decode(r[i], d) for r in received)
        h = h + q
        s = s + w * (q + theirs)
        new_x.append(x + gamma * (s - h))
        new_public.append(h)
        new_mixed.append(s)
    return new_x, new_public, new_mixed


def gossip_bytes(
    params: Any, n: int, *, topology: str = "ring", codec: Codec | None = None, every: int = 1
) -> float:
    """Ring-model bytes each device sends per step under :func:`gossip` (what ``comm_report``
    counts: a ``collective-permute`` of ``S`` bytes costs ``S``).

    ``m * P / every + 2 (n-1)/n * 4``: ``m`` payloads per round (the topology's neighbours),
    ``P`` the payload of the params' float leaves (``codec.payload_bytes`` per leaf, or their
    own bytes without a codec), plus the 4-byte non-finite flag all-reduced every step.
    Flat in ``n`` for the ring (``m = 2``) and the torus (``m <= 4``); ``ceil(log2 n)``
    payloads for the exponential graph.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct`` (one replica).
      n: devices on the gossip axis.
      topology: one of :data:`jaxcomp.TOPOLOGIES`.
      codec: None or the codec of the gossip.
      every: mix once every ``every`` steps.

    Returns:
      Bytes per device per step (float).

    Raises:
      ValueError: ``topology`` outside its rule (the message names the argument;
        the rules: docs/errors.md).
    """
    topo = topologies.topology(topologies.check_topology(topology), n)
    every = check_int("every", every, 1)
    layout = layouts.layout_of(params)
    payload = 0
    for shape, dtype, group in zip(layout.shapes, layout.dtypes, layout.groups, strict=True):
        if group != "compressed":
            continue
        d = 1
        for s in shape:
            d *= s
        payload += d * jnp.dtype(dtype).itemsize if codec is None else codec.payload_bytes(d)
    flag = 2 * (n - 1) / n * 4 if n > 1 else 0.0
    return topo.neighbours * payload / every + flag


def consensus_distance(replicas: Any, axis_name: Any = None) -> jax.Array:
    """How far the replicas are from agreeing: ``max_i ||x_i - mean|| / ||mean||``.

    Norms over all floating leaves together; ``mean = (1/n) sum_i x_i``. Outside ``jit``
    (or inside, without collectives) pass the stacked replicas, leaves ``(n, *shape)``
    (``jc.replica_params`` layout, or ``pmap``'s). Inside ``shard_map``/``pmap`` pass this
    device's own params and ``axis_name``: the mean is a ``pmean`` of the params, an
    all-reduce as large as the model, so compute it in an evaluation step, not every
    training step.

    Args:
      replicas: stacked replicas, or this device's params with ``axis_name``.
      axis_name: None (stacked input) or the axis the replicas live on.

    Returns:
      A float32 scalar (the same on every device with ``axis_name``); 0 when the replicas
      agree (or the mean is zero); NaN when a replica is not finite.

    Raises:
      ValueError: when the call is traced, ``axis_name`` outside its rule (the message names the
        argument; the rules: docs/errors.md).
      TypeError: when the call is traced, ``axis_name`` of the wrong kind.

    Example::

      >>> import jax.numpy as jnp, jaxcomp as jc
      >>> float(jc.consensus_distance({"w": jnp.array([[1.0, 1.0], [3.0, 3.0]])}))
      0.5
    """
    leaves = [
        jnp.asarray(x, jnp.float32)
        for x in jax.tree.leaves(replicas)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if not leaves:
        return jnp.float32(0.0)
    if axis_name is None:
        flat = jnp.concatenate([x.reshape(x.shape[0], -1) for x in leaves], axis=1)
        mean = jnp.mean(flat, axis=0)
        spread = max_abs_over(scaled_norm(flat - mean, axis=1))[0]
    else:
        collectives.axis_size(axis_name)  # a named error where the axis is not bound
        flat = jnp.concatenate([x.reshape(-1) for x in leaves])
        mean = jax.lax.pmean(flat, axis_name)
        spread = jax.lax.pmax(scaled_norm(flat - mean), axis_name)
    # Scaled norms neither overflow (|x| from ~1e19) nor underflow to 0 (|x| below ~1e-19).
    # A non-finite replica makes the mean, so the norm, NaN or inf: the result is NaN, never
    # the 0 of agreeing replicas (norm > 0 is False for NaN).
    norm = scaled_norm(mean)
    return jnp.where(norm == 0, jnp.float32(0.0), spread / norm)
