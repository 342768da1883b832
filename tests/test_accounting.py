"""Tests for jaxcomp._src.accounting: exact ring-model bytes on real and hand-written programs."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src.accounting import (
    Collective,
    CommReport,
    array_nbytes,
    comm_report,
    format_bytes,
    parse_hlo_collectives,
    parse_stablehlo_collectives,
    ring_bytes,
)

# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture(scope="module")
def mesh2d():
    return jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)


DATA = P("data")


def smap(fn, mesh, in_specs=DATA, out_specs=DATA):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def put(x, mesh, spec=DATA):
    return jax.device_put(x, NamedSharding(mesh, spec))


def only(cs):
    assert len(cs) == 1, cs
    return cs[0]


# --------------------------------------------------------------------------- real programs


def test_psum_f32(mesh):
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)
    r = comm_report(smap(lambda a: jax.lax.psum(a, "data"), mesh), x)
    c = only(r.collectives)
    assert (c.kind, c.dtypes, c.shapes, c.group_size) == ("all-reduce", ("f32",), ((1024,),), 8)
    assert c.array_bytes == 4096
    assert r.bytes_per_device == 2 * 7 / 8 * 4096 == 7168
    assert r.logical_bytes_per_device == 7168
    assert r.count == 1
    assert r.by_kind() == {"all-reduce": 7168.0}
    assert not c.in_loop


def test_psum_f16_is_half(mesh):
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)
    r = comm_report(smap(lambda a: jax.lax.psum(a.astype(jnp.float16), "data"), mesh), x)
    assert only(r.collectives).dtypes == ("f16",)
    assert r.bytes_per_device == 3584
    assert r.logical_bytes_per_device == 3584


def test_psum_bf16_logical_vs_compiled(mesh):
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)
    r = comm_report(smap(lambda a: jax.lax.psum(a.astype(jnp.bfloat16), "data"), mesh), x)
    assert only(r.logical).dtypes == ("bf16",)
    assert r.logical_bytes_per_device == 3584
    # XLA:CPU widens the bf16 all-reduce to f32; other backends keep bf16.
    assert r.bytes_per_device in (3584, 7168)


def test_psum_tuple_combined(mesh):
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)

    def f(a):
        return jax.lax.psum((a, a[:10] * 2, a[:3].astype(jnp.int32)), "data")

    r = comm_report(smap(f, mesh, out_specs=(P("data"),) * 3), x)
    expected = 2 * 7 / 8 * (4096 + 40 + 12)
    assert len(r.logical) == 3
    assert r.logical_bytes_per_device == pytest.approx(expected)
    assert r.bytes_per_device == pytest.approx(expected)  # combined or not, same bytes
    assert sum(len(c.shapes) for c in r.collectives) == 3


@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather(mesh, tiled):
    u = put(jnp.ones((8, 4), jnp.uint32), mesh)

    def f(a):
        return jax.lax.all_gather(a if tiled else a[0], "data", tiled=tiled, to="invarying")

    r = comm_report(smap(f, mesh, out_specs=P()), u)
    for cs in (r.collectives, r.logical):
        c = only(cs)
        assert (c.kind, c.dtypes, c.shapes) == ("all-gather", ("u32",), ((8, 4),))
        assert c.array_bytes == 128
        assert c.bytes_per_device == 112


def test_all_to_all(mesh):
    y = put(jnp.ones((64, 3), jnp.float32), mesh)
    r = comm_report(smap(lambda a: jax.lax.all_to_all(a, "data", 0, 0, tiled=True), mesh), y)
    c = only(r.collectives)
    assert c.kind == "all-to-all" and c.array_bytes == 96
    assert r.bytes_per_device == 84
    assert r.logical_bytes_per_device == 84


def test_psum_scatter(mesh):
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)
    r = comm_report(smap(lambda a: jax.lax.psum_scatter(a, "data", tiled=True), mesh), x)
    for cs in (r.collectives, r.logical):
        c = only(cs)
        assert c.kind == "reduce-scatter" and c.shapes == ((128,),)
        assert c.array_bytes == 4096  # the input
        assert c.bytes_per_device == 3584


def test_ppermute(mesh):
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)
    perm = [(i, (i + 1) % 8) for i in range(8)]
    r = comm_report(smap(lambda a: jax.lax.ppermute(a, "data", perm), mesh), x)
    assert only(r.collectives).kind == "collective-permute"
    assert r.bytes_per_device == 4096
    assert r.logical_bytes_per_device == 4096


@pytest.mark.parametrize(("axis", "n", "expected"), [("b", 4, 1536), ("a", 2, 1024)])
def test_2d_mesh_group_size(mesh2d, axis, n, expected):
    z = put(jnp.ones((2, 4 * 256), jnp.float32), mesh2d, P("a", "b"))
    spec = P("a", "b")
    f = smap(lambda a: jax.lax.psum(a, axis), mesh2d, in_specs=spec, out_specs=spec)
    r = comm_report(f, z)
    for cs in (r.collectives, r.logical):
        assert only(cs).group_size == n
    assert r.bytes_per_device == expected == 2 * (n - 1) / n * 1024
    assert r.logical_bytes_per_device == expected


def test_pmap_psum():
    f = jax.pmap(lambda a: jax.lax.psum(a, "i"), axis_name="i")
    r = comm_report(f, jnp.ones((8, 1024), jnp.float32))
    assert only(r.collectives).group_size == 8
    assert r.bytes_per_device == 7168
    assert r.logical_bytes_per_device == 7168


def test_loop_collective_flagged(mesh):
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)

    def f(a):
        return jax.lax.fori_loop(0, 3, lambda i, c: c + jax.lax.psum(c, "data"), a)

    r = comm_report(smap(f, mesh), x)
    c = only(r.collectives)
    assert c.in_loop
    assert r.bytes_per_device == 7168  # counted once
    assert (c.runs, r.loop_bytes_per_device) == (3, 3 * 7168)  # as often as it runs
    assert "(loop x3)" in str(r) and "with the loops: 21.00 KiB" in str(r)


def test_loop_bytes_multiply_nested_trip_counts_and_are_nan_for_unknown_ones(mesh):
    """``bytes_per_device`` counts a collective in a loop once: a psum inside a ``lax.scan``
    of 3 inside one of 4 read 7 KiB where each call sends 84 KiB. ``Collective.runs`` is the
    product of XLA's known trip counts (12); a loop bound computed at run time has none."""
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)

    def inner(c, _):
        return c + jax.lax.psum(c, "data"), None

    def nested(a):
        return jax.lax.scan(
            lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None), a, None, length=4
        )[0]

    def dynamic(a):
        bound = jnp.int32(a[0] > 0) + 2
        return jax.lax.fori_loop(0, bound, lambda i, c: jax.lax.psum(c, "data") * 0.5, a)

    r = comm_report(smap(nested, mesh, DATA, DATA), x)
    c = only(r.collectives)
    assert (c.in_loop, c.runs, r.bytes_per_device) == (True, 12, 7168)
    assert r.loop_bytes_per_device == 12 * 7168
    r = comm_report(
        jax.jit(jax.shard_map(dynamic, mesh=mesh, in_specs=DATA, out_specs=DATA, check_vma=False)),
        x,
    )
    assert only(r.collectives).runs is None and math.isnan(r.loop_bytes_per_device)
    assert "(loop x?)" in str(r)


def test_plain_callable_and_kwargs():
    r = comm_report(lambda a, scale: a * scale, jnp.ones(4), scale=2.0)
    assert r.count == 0 and r.bytes_per_device == 0 and r.logical == ()


def test_report_helpers(mesh):
    x = put(jnp.ones((8 * 1024,), jnp.float32), mesh)

    def f(a):
        return jax.lax.psum(a, "data"), jax.lax.ppermute(a, "data", [(0, 1)])

    r = comm_report(smap(f, mesh, out_specs=(P("data"), P("data"))), x)
    assert r.by_kind() == {"all-reduce": 7168.0, "collective-permute": 4096.0}
    assert r.logical_by_kind() == r.by_kind()
    assert [c.kind for c in r.largest(1)] == ["all-reduce"]
    assert len(r.largest(10)) == 2
    half = CommReport(collectives=r.collectives[:0], logical=())
    assert r.ratio_to(r) == 1.0
    assert half.ratio_to(r) == math.inf
    assert math.isnan(half.ratio_to(half))
    text = str(r)
    for word in ("all-reduce", "collective-permute", "f32", "[1024]", "11.00 KiB"):
        assert word in text


# --------------------------------------------------------------------------- formulas


def test_ring_bytes_and_sizes():
    assert ring_bytes("all-reduce", 800, 8) == 1400
    assert ring_bytes("all-gather", 800, 8) == 700
    assert ring_bytes("reduce-scatter", 800, 8) == 700
    assert ring_bytes("all-to-all", 800, 8) == 700
    assert ring_bytes("collective-permute", 800, 8) == 800
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert ring_bytes(kind, 800, 1) == 0
    with pytest.raises(ValueError):
        ring_bytes("broadcast", 1, 2)
    assert array_nbytes("s4", (3,)) == 2
    assert array_nbytes("pred", (5,)) == 5
    assert array_nbytes("f8e4m3fn", (4, 4)) == 16
    assert array_nbytes("c128", ()) == 16
    assert array_nbytes("bf16", (0,)) == 0


def test_format_bytes():
    assert format_bytes(112) == "112 B"
    assert format_bytes(84.5) == "84.5 B"
    assert format_bytes(7168) == "7.00 KiB"
    assert format_bytes(1.5 * 2**20) == "1.50 MiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


# --------------------------------------------------------------------------- HLO strings

HEADER = "HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}, num_partitions=8\n"


def hlo(*lines, header=HEADER):
    body = "\n".join("  " + line for line in lines)
    return f"{header}\nENTRY %main (p: f32[8]) -> f32[8] {{\n{body}\n}}\n"


@pytest.mark.parametrize(
    ("groups", "n"),
    [
        ("{{0,1,2,3},{4,5,6,7}}", 4),
        ("{{0,4},{1,5},{2,6},{3,7}}", 2),
        ("[2,4]<=[8]", 4),
        ("[4,2]<=[8]", 2),
        ("[2,4]<=[4,2]T(1,0)", 4),
        ("[1,8]<=[2,4]T(1,0)", 8),
        ("{}", 8),
        ("{{0},{1},{2},{3},{4},{5},{6},{7}}", 1),
    ],
)
def test_hlo_replica_group_formats(groups, n):
    text = hlo(
        f"ROOT %ar = f32[256]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
        "use_global_device_ids=true, to_apply=%add"
    )
    c = only(parse_hlo_collectives(text))
    assert c.group_size == n
    assert c.bytes_per_device == pytest.approx(2 * (n - 1) / n * 1024)


def test_hlo_empty_groups_without_header_uses_num_devices():
    text = "%ar = f32[256]{0} all-reduce(f32[256]{0} %p), replica_groups={}, to_apply=%add"
    assert only(parse_hlo_collectives(text, num_devices=4)).group_size == 4
    assert only(parse_hlo_collectives(text)).group_size == jax.device_count()
    no_groups = "%ar = f32[256]{0} all-reduce(%p), to_apply=%add"
    assert only(parse_hlo_collectives(no_groups, num_devices=2)).group_size == 2


def test_hlo_group_modes_from_header():
    header = "HloModule m, replica_count=2, num_partitions=4\n"
    # cross-replica (no channel): {} means all 2 replicas
    t = hlo("%a = f32[4]{0} all-reduce(%p), replica_groups={}, to_apply=%add", header=header)
    assert only(parse_hlo_collectives(t)).group_size == 2
    # cross-replica-and-partition: each listed replica brings its 4 partitions
    t = hlo(
        "%a = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%add",
        header=header,
    )
    assert only(parse_hlo_collectives(t)).group_size == 8
    # all-to-all with a channel works across partitions
    t = hlo("%a = f32[4]{0} all-to-all(%p), channel_id=1, replica_groups={}", header=header)
    assert only(parse_hlo_collectives(t)).group_size == 4


def test_hlo_tuple_results_and_comments():
    text = hlo(
        "%all-to-all = (f32[1,3]{1,0}, f32[1,3]{1,0}, f32[1,3]{1,0}, f32[1,3]{1,0}, "
        "f32[1,3]{1,0}, /*index=5*/f32[1,3]{1,0}, f32[1,3]{1,0}, f32[1,3]{1,0}) "
        "all-to-all(%w, %w.1, %w.2, %w.3, %w.4, /*index=5*/%w.5, %w.6, %w.7), channel_id=1, "
        'replica_groups={{0,1,2,3,4,5,6,7}}, metadata={op_name="x"}',
        "%all-reduce = (f32[1024]{0}, bf16[10]{0}) all-reduce(%a, %b), channel_id=2, "
        "replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%r",
        "%get-tuple-element.3 = f32[1024]{0} get-tuple-element(%all-reduce), index=0",
        "ROOT %psum_invariant.14 = f16[8]{0} all-reduce(%wrapped_convert), channel_id=3, "
        "replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_0.0",
    )
    a2a, ar, ar16 = parse_hlo_collectives(text)
    assert a2a.name == "all-to-all" and a2a.kind == "all-to-all"
    assert a2a.shapes == ((1, 3),) * 8 and a2a.array_bytes == 96
    assert a2a.bytes_per_device == 84
    assert ar.dtypes == ("f32", "bf16") and ar.array_bytes == 4096 + 20
    assert ar.bytes_per_device == pytest.approx(2 * 7 / 8 * 4116)
    assert (ar16.name, ar16.dtypes, ar16.array_bytes, ar16.bytes_per_device) == (
        "psum_invariant.14",
        ("f16",),
        16,
        28,
    )


def test_hlo_async_start_ops():
    groups = "replica_groups={{0,1,2,3,4,5,6,7}}"
    text = hlo(
        f"%ag-start = ((f32[4]{{0}}), f32[32]{{0}}) all-gather-start(%p), channel_id=1, {groups}, "
        "dimensions={0}, use_global_device_ids=true",
        "%ag-done = f32[32]{0} all-gather-done(%ag-start)",
        f"%ar-start = f32[8]{{0}} all-reduce-start(%p), channel_id=2, {groups}, to_apply=%add, "
        "use_global_device_ids=true",
        "%ar-done = f32[8]{0} all-reduce-done(%ar-start)",
        "%cp-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p), "
        "channel_id=3, source_target_pairs={{0,1},{1,0}}",
        "%cp-done = f32[8]{0} collective-permute-done(%cp-start)",
        "%rs-start = ((f32[64]{0}), f32[8]{0}) reduce-scatter-start(%q), channel_id=4, "
        f"{groups}, dimensions={{0}}, to_apply=%add, use_global_device_ids=true",
        "%rs-done = f32[8]{0} reduce-scatter-done(%rs-start)",
        "%a2a-start = ((f32[8]{0}), f32[8]{0}, s32[]) all-to-all-start(%p), channel_id=5, "
        f"{groups}",
        "%a2a-done = f32[8]{0} all-to-all-done(%a2a-start)",
        "%ag2-start = ((f32[4]{0}, s8[2]{0}), (f32[32]{0}, s8[16]{0})) all-gather-start(%p, %b), "
        f"channel_id=6, {groups}, dimensions={{0}}, use_global_device_ids=true",
    )
    cs = parse_hlo_collectives(text)
    assert [c.kind for c in cs] == [
        "all-gather",
        "all-reduce",
        "collective-permute",
        "reduce-scatter",
        "all-to-all",
        "all-gather",
    ]
    ag, ar, cp, rs, a2a, ag2 = cs
    assert ag.shapes == ((32,),) and ag.bytes_per_device == 112
    assert ar.shapes == ((8,),) and ar.bytes_per_device == 56
    assert cp.shapes == ((8,),) and cp.group_size == 2 and cp.bytes_per_device == 32
    assert rs.array_bytes == 256 and rs.bytes_per_device == 224
    assert a2a.shapes == ((8,),) and a2a.bytes_per_device == 28
    assert ag2.dtypes == ("f32", "s8") and ag2.array_bytes == 144


def test_hlo_collective_permute_self_pairs_send_nothing():
    text = hlo("%cp = f32[8]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,0}}")
    assert only(parse_hlo_collectives(text)).bytes_per_device == 0


def test_hlo_dtypes():
    groups = "replica_groups={{0,1}}"
    text = hlo(
        f"%a = s4[3]{{0}} all-gather(%p), {groups}, dimensions={{0}}",
        f"%b = f8e5m2[10]{{0}} all-gather(%p), {groups}, dimensions={{0}}",
        f"%c = pred[] all-reduce(%p), {groups}, to_apply=%or",
        f"%d = c64[2,2]{{1,0}} all-reduce(%p), {groups}, to_apply=%add",
    )
    assert [c.array_bytes for c in parse_hlo_collectives(text)] == [2, 10, 1, 32]


def test_hlo_nested_computations_and_loops():
    text = (
        "HloModule m, replica_count=8\n"
        + """
%region_1.0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%a, %b)
}

%inner (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  ROOT %ag = f32[16]{0} all-gather(%p), replica_groups=[4,2]<=[8], dimensions={0}
}

%body (param: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %param = (s32[], f32[1024]{0}) parameter(0)
  %g = f32[1024]{0} get-tuple-element(%param), index=1
  %psum.7 = f32[1024]{0} all-reduce(%g), replica_groups={}, to_apply=%region_1.0
  %call = f32[16]{0} call(%x), to_apply=%inner
  ROOT %tuple.10 = (s32[], f32[1024]{0}) tuple(%i, %psum.7)
}

%cond (param.1: (s32[], f32[1024])) -> pred[] {
  ROOT %lt = pred[] compare(%x, %y), direction=LT
}

%true_branch (p: f32[8]) -> f32[8] {
  ROOT %cp = f32[8]{0} collective-permute(%p), channel_id=3, source_target_pairs={{0,1},{1,2}}
}

ENTRY %main (param.3: f32[1024]) -> f32[1024] {
  %while.9 = (s32[], f32[1024]{0}) while(%tuple.8), condition=%cond, body=%body
  %c = f32[8]{0} conditional(%pred, %x, %y), true_computation=%true_branch, false_computation=%cond
  ROOT %out = f32[1024]{0} all-reduce(%z), channel_id=4, replica_groups={}, to_apply=%region_1.0
}
"""
    )
    ag, ar, cp, root = parse_hlo_collectives(text)
    assert (ag.kind, ag.group_size, ag.in_loop) == ("all-gather", 2, True)  # called from body
    assert (ar.name, ar.group_size, ar.in_loop) == ("psum.7", 8, True)
    assert (cp.group_size, cp.in_loop, cp.bytes_per_device) == (3, False, 32)
    assert (root.name, root.in_loop) == ("out", False)


# --------------------------------------------------------------------------- StableHLO strings

MLIR = """module @jit_f attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x4xui32>) -> (tensor<8x4xui32>) {
    %5 = "stablehlo.all_gather"(%4) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1, 2, 3, 4, 5, 6, 7]]> : tensor<1x8xi64>, use_global_device_ids}> : (tensor<1x4xui32>) -> tensor<8x4xui32>
    %9 = "stablehlo.all_reduce"(%8) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, replica_groups = dense<[[0, 1, 2, 3], [4, 5, 6, 7]]> : tensor<2x4xi64>, use_global_device_ids}> ({
    ^bb0(%arg2: tensor<f16>, %arg3: tensor<f16>):
      %3 = stablehlo.add %arg2, %arg3 : tensor<f16>
      stablehlo.return %3 : tensor<f16>
    }) : (tensor<8xf16>) -> tensor<8xf16>
    %10:2 = "stablehlo.all_reduce"(%a, %b) <{channel_handle = #stablehlo.channel_handle<handle = 3, type = 1>, replica_groups = dense<> : tensor<0x0xi64>, use_global_device_ids}> ({
    ^bb0(%arg2: tensor<bf16>, %arg3: tensor<bf16>):
      %3 = stablehlo.add %arg2, %arg3 : tensor<bf16>
      stablehlo.return %3 : tensor<bf16>
    }) : (tensor<16xbf16>, tensor<4xi32>) -> (tensor<16xbf16>, tensor<4xi32>)
    %11 = "stablehlo.reduce_scatter"(%arg1) <{channel_handle = #stablehlo.channel_handle<handle = 4, type = 1>, replica_groups = dense<[[0, 4], [1, 5], [2, 6], [3, 7]]> : tensor<4x2xi64>, scatter_dimension = 0 : i64, use_global_device_ids}> ({
    ^bb0(%arg2: tensor<f32>, %arg3: tensor<f32>):
      %2 = stablehlo.add %arg2, %arg3 : tensor<f32>
      stablehlo.return %2 : tensor<f32>
    }) : (tensor<1024xf32>) -> tensor<512xf32>
    %12 = "stablehlo.all_to_all"(%arg1) <{channel_handle = #stablehlo.channel_handle<handle = 5, type = 1>, concat_dimension = 0 : i64, replica_groups = dense<[[0, 1, 2, 3, 4, 5, 6, 7]]> : tensor<1x8xi64>, split_count = 8 : i64, split_dimension = 0 : i64}> : (tensor<8x3xf32>) -> tensor<8x3xf32>
    %13 = "stablehlo.collective_permute"(%arg1) <{channel_handle = #stablehlo.channel_handle<handle = 6, type = 1>, source_target_pairs = dense<[[0, 1], [1, 2], [2, 3], [3, 0]]> : tensor<4x2xi64>}> : (tensor<1024xf32>) -> tensor<1024xf32>
    %14 = "stablehlo.all_reduce"(%c) <{replica_groups = dense<0> : tensor<8x1xi64>}> ({
    ^bb0(%arg2: tensor<i1>, %arg3: tensor<i1>):
      %2 = stablehlo.or %arg2, %arg3 : tensor<i1>
      stablehlo.return %2 : tensor<i1>
    }) : (tensor<4xi1>) -> tensor<4xi1>
    return %5 : tensor<8x4xui32>
  }
}
"""  # noqa: E501


def test_stablehlo_parser():
    cs = parse_stablehlo_collectives(MLIR)
    assert [c.kind for c in cs] == [
        "all-gather",
        "all-reduce",
        "all-reduce",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
        "all-reduce",
    ]
    ag, ar16, ar2, rs, a2a, cp, ar1 = cs
    assert (ag.name, ag.dtypes, ag.shapes, ag.group_size) == ("%5", ("u32",), ((8, 4),), 8)
    assert ag.bytes_per_device == 112
    assert (ar16.dtypes, ar16.group_size, ar16.bytes_per_device) == (("f16",), 4, 24)
    assert ar2.name == "%10:2" and ar2.dtypes == ("bf16", "s32")
    assert ar2.group_size == 8 and ar2.array_bytes == 48
    assert ar2.bytes_per_device == 84
    assert (rs.group_size, rs.array_bytes, rs.bytes_per_device) == (2, 4096, 2048)
    assert a2a.bytes_per_device == 84
    assert (cp.group_size, cp.bytes_per_device) == (4, 4096)
    assert (ar1.dtypes, ar1.group_size, ar1.bytes_per_device) == (("pred",), 1, 0)


def test_stablehlo_without_module_attrs_uses_num_devices():
    text = MLIR.replace("mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32", "")
    ar2 = parse_stablehlo_collectives(text, num_devices=4)[2]
    assert ar2.group_size == 4


def test_collective_display():
    c = Collective("all-to-all", ("f32",) * 8, ((1, 3),) * 8, 96, 8, 84.0)
    assert c.shape_str() == "[1,3]x8" and c.dtype == "f32"
    c = Collective("all-reduce", ("f32",) * 6, tuple((i,) for i in range(6)), 60, 8, 105.0)
    assert c.shape_str() == "[0] [1] [2] ... (6 arrays)"


def test_hlo_generic_async_wrapper_counted_once():
    text = (
        HEADER
        + """
%async_computation.29 (p: bf16[8,2]) -> bf16[8,2] {
  %p = bf16[8,2]{1,0} parameter(0)
  ROOT %a2a = bf16[8,2]{1,0} all-to-all(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

ENTRY %main (x: bf16[8,2]) -> bf16[8,2] {
  %x = bf16[8,2]{1,0} parameter(0)
  %all-to-all-start.29 = ((bf16[8,2]{1,0}), bf16[8,2]{1,0}) async-start(%x), calls=%async_computation.29
  ROOT %all-to-all-done.29 = bf16[8,2]{1,0} async-done(%all-to-all-start.29)
}
"""  # noqa: E501
    )
    c = only(parse_hlo_collectives(text))
    assert (c.kind, c.name, c.array_bytes, c.bytes_per_device) == ("all-to-all", "a2a", 32, 28)


def test_mesh_axes_replica_groups_of_newer_jax():
    """jax >= 0.11 prints groups as mesh axes, in HLO and in StableHLO (Shardy)."""
    hlo = (
        "ENTRY %main {\n"
        "  %ar = f32[256]{0} all-reduce(f32[256]{0} %p), channel_id=1, "
        "replica_groups=mesh['data'=2,'local'=4] {'local'}, use_global_device_ids=true, "
        "to_apply=%add\n"
        "  %ag = f32[8,64]{1,0} all-gather(f32[1,64]{1,0} %q), channel_id=2, "
        "replica_groups=mesh['data'=2,'local'=4] {'data','local'}, dimensions={0}, "
        "use_global_device_ids=true\n"
        "}\n"
    )
    ar, ag = parse_hlo_collectives(hlo, 8)
    assert (ar.group_size, ag.group_size) == (4, 8)
    assert ar.bytes_per_device == ring_bytes("all-reduce", 1024, 4)
    shlo = (
        'sdy.mesh @mesh = <["data"=2, "local"=4]>\n'
        '%0 = "stablehlo.all_reduce"(%arg0) <{channel_handle = #stablehlo.channel_handle<'
        "handle = 1, type = 1>, replica_groups = #stablehlo.replica_group_mesh_axes<"
        'mesh = @mesh, axes = [#stablehlo.axis_ref<name = "data">]>, use_global_device_ids}> ({\n'
        "^bb0(%a: tensor<f32>, %b: tensor<f32>):\n"
        '  %s = "stablehlo.add"(%a, %b) : (tensor<f32>, tensor<f32>) -> tensor<f32>\n'
        '  "stablehlo.return"(%s) : (tensor<f32>) -> ()\n'
        "}) : (tensor<256xf32>) -> tensor<256xf32>\n"
    )
    (c,) = parse_stablehlo_collectives(shlo, 8)
    assert c.group_size == 2 and c.bytes_per_device == ring_bytes("all-reduce", 1024, 2)


# --------------------------------------------------------------------------- branches


_REPORTS = {}  # one compile shared by the branch tests


def _cond_program(mesh):
    """psum f32[2] always; cond: false -> psum f16[8], true -> switch(0: nothing,
    1: psum f32[8], 2: all_gather f32[8])."""
    if "cond" not in _REPORTS:
        _REPORTS["cond"] = _compile_cond_program(mesh)
    return _REPORTS["cond"]


def _compile_cond_program(mesh):
    def f(x, c):
        def inner(y):
            return jax.lax.switch(
                jnp.clip(c[1], 0, 2),
                [
                    lambda y: y,
                    lambda y: jax.lax.psum(y, "data"),
                    lambda y: jax.lax.all_gather(y, "data", tiled=True)[:8],
                ],
                y,
            )

        def half(y):
            return jax.lax.psum(y.astype(jnp.float16), "data").astype(jnp.float32)

        y = jax.lax.cond(c[0] > 0, inner, half, x)
        return jax.lax.psum(y[:2], "data")

    step = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=(DATA, P()), out_specs=P(), check_vma=False)
    )
    return comm_report(step, put(jnp.ones(64), mesh), put(jnp.zeros(2, jnp.int32), mesh, P()))


def test_branches_each_counted_and_weighted(mesh):
    r = _cond_program(mesh)
    f16, f32, gather, always = 2 * 7 / 8 * 16, 2 * 7 / 8 * 32, 7 / 8 * 256, 2 * 7 / 8 * 8
    assert r.bytes_per_device == always + f16 + f32 + gather == 322.0
    for logical in (False, True):
        conds = r.logical_conditionals if logical else r.conditionals
        assert [(c.index, c.num_branches, c.parent) for c in conds] == [
            (0, 2, None),
            (1, 3, (0, 1)),
        ]
        branches = [c.branch for c in (r.logical if logical else r.collectives)]
        assert sorted(branches) == [(), ((0, 0),), ((0, 1), (1, 1)), ((0, 1), (1, 2))]
        assert r.branch_bytes(logical) == {
            None: always,
            (0, 0): f16,
            (0, 1): 0.0,
            (1, 0): 0.0,
            (1, 1): f32,
            (1, 2): gather,
        }
        # 3 of 4 calls take the true branch; of those, 1:1:1 over the switch (counts are fine).
        mean = r.mean_bytes_per_device({0: [1, 3], 1: [5, 5, 5]}, logical=logical)
        assert mean == pytest.approx(always + f16 / 4 + 3 / 4 * (f32 + gather) / 3) == 91.0
    assert "[cond 1 branch 2]" in str(r)


def test_nested_jit_collectives_count_in_the_branch_that_calls_them(mesh):
    """A nested ``jax.jit`` lowers to a ``func.call`` of a private function: its collectives
    count in the branch that calls it, once per call. Until 2026-11-27 the logical program
    counted them once, as unconditional (1-bit Adam's round, a nested jit since 0ee6a18:
    every step weighed as a compressed round)."""
    inner = jax.jit(lambda x: jax.lax.psum(x, "data"))

    def step(x, c):
        y = jax.lax.cond(c > 0, inner, lambda x: 2.0 * x, x)
        return inner(inner(y))  # called twice outside the cond: runs twice

    fn = smap(step, mesh, in_specs=(P(), P()), out_specs=P())
    r = comm_report(fn, put(jnp.ones(1024), mesh, P()), jnp.int32(1))
    ring = 2 * 7 / 8 * 4096
    assert [(c.index, c.num_branches) for c in r.logical_conditionals] == [(0, 2)]
    assert r.branch_bytes(logical=True) == {None: 2 * ring, (0, 0): 0.0, (0, 1): ring}
    assert r.mean_bytes_per_device({0: [3, 1]}, logical=True) == pytest.approx(2.25 * ring)
    assert r.branch_bytes(logical=True) == r.branch_bytes()  # as the compiled program


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        (None, "no weights for conditional 0 .*28 B, 0 B"),
        ([1, 1], "has 2 conditionals"),
        ({0: [1, 1], 1: [1, 1]}, "must be 3 finite"),
        ({0: [1, 1], 1: [0, 0, 0]}, "not all zero"),
        ({0: [1, -1], 1: [1, 1, 1]}, "non-negative"),
        ({0: [1, 1], 1: [1, 1, 1], 2: [1]}, r"conditionals \[2\]"),
    ],
)
def test_branch_weights_errors(mesh, weights, match):
    with pytest.raises(ValueError, match=match):
        _cond_program(mesh).mean_bytes_per_device(weights)


def test_onebit_adam_warmup_branch_and_at_count(mesh):
    import optax

    import jaxcomp as jc

    params = put({"w": jnp.ones((64, 64))}, mesh, P())
    tx = jc.onebit_adam(1e-3, "data", freeze_step=10)
    state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(state, "data")
    x = put(jnp.ones((8, 64)), mesh)

    def report(count=None):
        def step(p, s, x):
            p_varying = jax.lax.pcast(p, "data", to="varying")
            g = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(p_varying)
            u, s = tx.update(g, s if count is None else jc.at_count(s, count), p)
            return optax.apply_updates(p, u), s

        shapes = dict(in_specs=(P(), specs, DATA), out_specs=(P(), specs))
        return comm_report(jax.jit(jax.shard_map(step, mesh=mesh, **shapes)), params, state, x)

    r, warmup = report(), report(0)
    # all-to-all + all-gather of 1-bit words, scales and (exact zeros) a word of zero flags;
    # no ordering psum (_after_memory): the worker memory is formed after the cond
    sign = 2 * 7 / 8 * (8 * 16 * 4 + 8 * 4 + 8 * 4)
    full = 2 * 7 / 8 * 4096 * 4
    level = 2 * 7 / 8 * 4  # every step, outside the cond: one float32 per leaf (the rescale)
    assert r.branch_bytes() == {None: level, (0, 0): sign, (0, 1): full}
    # the logical program too: the round is a nested jit, counted in its branch
    assert r.branch_bytes(logical=True) == {None: level, (0, 0): sign, (0, 1): full}
    assert warmup.bytes_per_device == full + level and warmup.conditionals == ()
    # 1000 steps: 10 warm-up (the cond's true branch), 990 compressed.
    want = (990 * sign + 10 * full) / 1000 + level
    assert r.mean_bytes_per_device([990, 10]) == pytest.approx(want)
