"""The hot path in copies of the gradient: one ``tx.update`` on one device, no network.

On one CPU device (a 1-device mesh, axis ``"data"``, inside ``jax.shard_map``) one jitted
``tx.update`` of ``jc.compressed_allreduce(codec, "data", error_feedback="residual")`` on
the gradient tree of the 25.2M-parameter MLP of ``common.py`` (1024-4096-4096-1024), the
gradient and the state donated and each call's output fed to the next, against a jitted
scale-and-copy of the same tree (``jax.tree.map(lambda g: g * 1.0001, grads)``, donated)
timed in the same run: ``copies = update_ms / copy_ms``. No bytes travel on one device, so
this is what encoding, decoding and the error-feedback memory cost: the floor is about
1.5-2 copies (read the gradient and the memory, write the memory and the output).

Rows: sign, int8, fp16 (unscaled) with residual feedback (the line drawn: 3 copies), top-k 1%
(approximate) with residual feedback, ``jc.powersgd(4, "data", start_step=0)``, the default
(scaled) fp16 and sign without feedback, plain ``jax.lax.pmean`` of the tree, sign, int8, fp16
with the memories in bfloat16 (``memory_dtype``), int8 and fp16 with ``fuse_residuals=True``
(each leaf encoded a chunk of ``--chunk`` values at a time, its memory written in the same
loop), and sign with blocks of 128 (``sign_block``) without and with it. Each row also records
the compiled update's temporaries and arguments (``memory_analysis()``, in copies of the
gradient: deterministic, unlike the times on a shared host) and each call's CPU time
(``time.process_time``, every thread: ``cpu_copies`` is the row's median over the copy's, less
disturbed by other work on the host than wall time), its minor page faults (``getrusage``:
pages touched for the first time since they were mapped; ``fault_copies`` in gradient copies of
4 KiB pages) and ``hlo_copies``, the bytes the compiled update's instructions read and write
over the bytes a copy moves (:func:`hlo_traffic`: a model of its memory traffic,
deterministic). The state is built with ``jc.sharded_init`` and its specs from
``jc.state_specs``, so the script does not depend on the state's layout. Each figure is the
median of ``--reps`` (>= 7) calls after ``--warmup``, each blocked until ready; the copy is
timed before and after the rows (its samples pooled). Writes
``benchmarks/results/hot_path[_LABEL].json`` and ``.png``::

    python -m benchmarks.hot_path --label before     # hot_path_before.json
    python -m benchmarks.hot_path                    # hot_path.json
    python -m benchmarks.hot_path --quick            # a 1.6M-param MLP, 3 rows (smoke test)
    python -m benchmarks.hot_path --reuse-buffers --label reuse   # freed memory reused
    python -m benchmarks.hot_path --rows int8 --ops 12  # + the 12 costliest ops of each row
    python -m benchmarks.hot_path --backend gpu --label gpu_h100  # on one GPU instead
    python -m benchmarks.hot_path --rows int8 "int8 (fused)" --chunk 16384 --label c16k
    python -m benchmarks.hot_path --rows sign int8 fp16 --reps 9 --label malloc \
        --settings default reuse GLIBC_TUNABLES=glibc.malloc.hugetlb=1 \
        "jemalloc:LD_PRELOAD=$JE,MALLOC_CONF=oversize_threshold:0"

Allocator settings (``--settings``): glibc reads its tunables when a process starts, so each
setting's rows are timed in a child process of its own, each against the copy timed in that
process, one after another; the rows carry their ``setting``: its name where it has one
(``NAME:VAR=VALUE,...``), else its variables with each file path cut to its file name (a
temporary path names nothing once the run is over). ``--reuse-buffers`` with ``--settings``
reuses freed memory in every setting's process.

XLA:CPU's compile options (``XLA_FLAGS``, read when a process starts) are settings too, one
process each, compared with XLA's defaults in one run; each row records the ``xla_flags`` it
was compiled under (the collective timeouts of ``jaxcomp.cpu.use_cpu_devices`` left out)::

    python -m benchmarks.hot_path --rows sign int8 fp16 --reps 9 --label xla_flags \
        --settings default "vw512:XLA_FLAGS=--xla_cpu_prefer_vector_width=512" \
        "fastmath:XLA_FLAGS=--xla_cpu_enable_fast_math=true"

The same options per program, in one process (``--compile-options``: ``jax.jit``'s
``compiler_options``, which apply to that program alone): each row is compiled once per set
and the sets' calls are interleaved (call ``i`` of each in turn, the order turned by one each
round, each on a gradient and a state of its own), so that a shared host's changing load
falls on each alike; each row gets ``paired_ratio`` (``paired_cpu_ratio``), the median over
calls of its time over the time of the first set's call beside it::

    python -m benchmarks.hot_path --rows sign int8 fp16 --reps 15 --label per_program \
        --compile-options default vw512:xla_cpu_prefer_vector_width=512

Op by op (``--ops N``): after its timed calls, each row runs ``--op-calls`` more under
``jax.profiler.trace`` (a Perfetto trace; XLA:CPU records one event per thunk), and the JSON
gets the row's ``N`` costliest HLO instructions of the compiled update: name, milliseconds
per call (wall, summed over the instruction's events), the instruction's shape and the jax
operation it came from (``op_name``). The profiled calls are not among the timed ones.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import pathlib
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from benchmarks import common

AXIS = "data"
QUICK_MLP = (256, 1024, 1024, 256)
# name -> (codec name or "powersgd4" / "pmean", error feedback[, memory_dtype]). The "fp16"
# rows are the unscaled cast with its residual, as measured before 2026-11-26 (the default
# jc.cast("fp16") is scaled since, and keeps no memory: row "fp16 scaled, no feedback").
ROWS = {
    "sign": ("sign", "residual"),
    "int8": ("int8", "residual"),
    "fp16": ("fp16_unscaled", "residual"),
    "fp16 scaled, no feedback": ("fp16", None),
    "topk1%": ("topk1%", "residual"),
    "powersgd4": ("powersgd4", "residual"),
    "sign (no feedback)": ("sign", None),
    "pmean": ("pmean", None),
    # Error-feedback memories in bfloat16 (memory_dtype=): half the memory traffic.
    "sign, bf16 memory": ("sign", "residual", "bfloat16"),
    "int8, bf16 memory": ("int8", "residual", "bfloat16"),
    "fp16, bf16 memory": ("fp16_unscaled", "residual", "bfloat16"),
    # The encoding and the new memory in one loop over cache-sized chunks of each leaf
    # (fuse_residuals=True, jaxcomp._src.fused_residual), for a comparison in one run.
    "int8 (fused)": ("int8", "residual", None, {"fuse_residuals": True}),
    "fp16 (fused)": ("fp16_unscaled", "residual", None, {"fuse_residuals": True}),
    "sign_block": ("sign_block", "residual"),
    "sign_block (fused)": ("sign_block", "residual", None, {"fuse_residuals": True}),
}
QUICK_ROWS = ["sign", "int8", "sign (no feedback)"]
TARGET_COPIES = 3.0  # int8 and fp16 with error feedback (sign: 2)


def timed(fn, args, reps: int, warmup: int, const=(), cpu=None, faults=None) -> list[float]:
    """Milliseconds of ``reps`` calls ``fn(*args, *const)`` after ``warmup``; each call's
    output is the next ``args`` (they are donated), each blocked until ready. ``cpu``: a list
    that gets each call's CPU milliseconds (``time.process_time``: every thread of the
    process, user + system), which other work on a shared host disturbs less than wall time.
    ``faults``: a list that gets each call's minor page faults (``getrusage``'s
    ``ru_minflt``, every thread: a page touched for the first time since it was mapped)."""
    import jax

    for _ in range(warmup):
        args = jax.block_until_ready(fn(*args, *const))
    times = []
    for _ in range(reps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0 = time.perf_counter(), time.process_time()
        args = jax.block_until_ready(fn(*args, *const))
        times.append(1e3 * (time.perf_counter() - t0))
        if cpu is not None:
            cpu.append(1e3 * (time.process_time() - c0))
        if faults is not None:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return times


_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(\S+) = (\([^)]*\)|\S+?\[[^\]]*\])?(?:.*?op_name=\"([^\"]*)\")?"
)


def entry_instructions(hlo_text: str) -> dict[str, dict]:
    """name -> {shape, op_name} of each instruction of the compiled module's entry
    computation (what a thunk's profiler event is named after)."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    found = {}
    for line in entry.splitlines()[1:]:
        m = _INSTRUCTION.match(line)
        if m:
            found[m.group(1)] = {"shape": m.group(2) or "", "op_name": m.group(3) or ""}
    return found


_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_ENTRY_LINE = re.compile(
    r"^\s*(?:ROOT )?%(\S+) = (\([^=]*?\)|\S+?\[[^\]]*\](?:\{[^}]*\})?) ([\w-]+)\((.*?)\)(?:,|$)"
)
# No data moves: views, tuples, the entry's inputs (a `call` is counted by what it calls).
_NO_TRAFFIC = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "call"}


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        total += _BYTES.get(dtype, 1) * math.prod(int(d) for d in dims.split(",") if d)
    return total


_CALLS = re.compile(r"calls=%([\w.\-]+)")
_VIEWS = {"bitcast", "reshape"}
_SLICES = {"slice", "dynamic-slice"}


def _computations(hlo_text: str) -> dict[str, str]:
    """name -> body text of every computation of the module (the entry as ``ENTRY``), the
    ``/*index=N*/`` comments of long tuples removed."""
    hlo_text = re.sub(r"/\*index=\d+\*/", "", hlo_text)
    found = dict(re.findall(r"\n%([\w.\-]+) \([^\n]*\{\n(.*?)\n\}", hlo_text, re.S))
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    found["ENTRY"] = entry[entry.index("\n", 1) + 1 : entry.index("\n}")]
    return found


def _lines(body: str) -> dict[str, tuple[str, list[str], str]]:
    """name -> (op, operand names, shape) of each instruction of a computation's body."""
    lines = {}
    for line in body.splitlines():
        m = _ENTRY_LINE.match(line)
        if m:
            lines[m.group(1)] = (m.group(3), re.findall(r"%([\w.\-]+)", m.group(4)), m.group(2))
    return lines


def _sliced_parameters(hlo_text: str) -> dict[str, dict[int, int]]:
    """Per fused computation, the bytes read of each parameter that it reads only through
    slices (through views of it too), or only as the buffer a ``dynamic-update-slice``
    writes in place (0 bytes): a fusion that takes one value of a gradient-sized operand
    reads that value, not the operand."""
    found: dict[str, dict[int, int]] = {}
    for head, body in _computations(hlo_text).items():
        lines = _lines(body)
        users: dict[str, list[str]] = {}
        for name, (_, operands, _) in lines.items():
            for o in operands:
                users.setdefault(o, []).append(name)

        params = {}
        for name, (op, _, _) in lines.items():
            index = re.search(rf"%{re.escape(name)} = .*? parameter\((\d+)\)", body)
            bytes_read = _read_through_slices(name, lines, users)
            if op == "parameter" and index and bytes_read is not None:
                params[int(index.group(1))] = bytes_read
        found[head] = params
    return found


def _in_place_bytes(hlo_text: str) -> dict[str, int]:
    """Per fused computation whose root is a ``dynamic-update-slice``: the bytes it writes
    (the update, not the buffer it is written into in place)."""
    found = {}
    for head, body in _computations(hlo_text).items():
        lines = _lines(body)
        root = re.search(r"ROOT %([\w.\-]+) = ", body)
        if root and lines.get(root.group(1), ("",))[0] == "dynamic-update-slice":
            update = lines[root.group(1)][1][1]
            found[head] = _shape_bytes(lines[update][2]) if update in lines else 0
    return found


def _read_through_slices(name: str, lines: dict, users: dict) -> int | None:
    """Bytes of ``name`` its users read, where each is a slice or a view of it read so, or
    a ``dynamic-update-slice`` writing into it in place (nothing read); None where any
    reads it otherwise."""
    total = 0
    for u in users.get(name, []):
        op, operands, shape = lines[u]
        if op in _SLICES:
            total += _shape_bytes(shape)
            continue
        if op == "dynamic-update-slice" and operands[0] == name and operands.count(name) == 1:
            continue
        part = _read_through_slices(u, lines, users) if op in _VIEWS else None
        if part is None:
            return None
        total += part
    return total


_TRIPS = re.compile(r'known_trip_count":\{"n":"(\d+)"')
_BODY = re.compile(r"body=%([\w.\-]+)")
_TO_APPLY = re.compile(r"to_apply=%([\w.\-]+)")


#: In a loop's body, buffers of at most this many bytes (a chunk of a leaf, its payload
#: row) are taken to stay in cache: reading and writing them counts nothing.
LOOP_CACHE_BYTES = 1 << 20


class _Module(NamedTuple):
    """A compiled module's text, parsed once for :func:`hlo_traffic`."""

    bodies: dict[str, str]  # computation name -> body (the entry as "ENTRY")
    sliced: dict[str, dict[int, int]]  # see _sliced_parameters
    in_place: dict[str, int]  # see _in_place_bytes


def hlo_traffic(hlo_text: str, computation: str = "ENTRY") -> int:
    """Bytes a computation's instructions read and write (the entry's by default): each
    instruction's output plus each distinct operand, once (a fusion that reads an operand
    only through slices is counted as reading those slices; one that updates a slice of a
    buffer in place, as writing that slice). Views (bitcast, tuples) move nothing. A
    ``while`` loop counts its body's traffic times its known trip count (its operands are
    the buffers the body reads and writes in place, counted there), where buffers of at
    most :data:`LOOP_CACHE_BYTES` count nothing (in cache; a slice of a larger buffer is
    counted each time an instruction reads it, in cache or not); a loop without a known trip
    count (a non-finite step's restore: no trip on a finite one) counts nothing. A ``call``
    counts the traffic of the computation it calls, where the call sits (in the entry as the
    entry's instructions, in a loop body as the body's): jaxlib 0.12's XLA:CPU wraps loops
    in ``call(..., to_apply=%C), frontend_attributes={xla_cpu_small_call="true"}``, which
    moves nothing itself. A model of the memory traffic of one call, deterministic, against
    which the timed copies can be read. A named ``computation`` other than the entry is
    counted as a loop body."""
    module = _Module(
        _computations(hlo_text), _sliced_parameters(hlo_text), _in_place_bytes(hlo_text)
    )
    return _traffic(module, computation, in_loop=computation != "ENTRY")


def _traffic(module: _Module, computation: str, in_loop: bool) -> int:
    """:func:`hlo_traffic` of one computation; ``in_loop``: it runs inside a loop's body,
    where buffers of at most :data:`LOOP_CACHE_BYTES` stay in cache."""
    sizes: dict[str, int] = {}
    total = 0
    for line in module.bodies[computation].splitlines():
        m = _ENTRY_LINE.match(line)
        if not m:
            continue
        name, shape, op, operands = m.groups()
        sizes[name] = _shape_bytes(shape)
        if op == "call" and (target := _TO_APPLY.search(line)):
            total += _traffic(module, target.group(1), in_loop)
            continue
        if op in _NO_TRAFFIC:
            continue
        if op == "while":
            trips, body = _TRIPS.search(line), _BODY.search(line)
            if body:
                count = int(trips.group(1)) if trips else 0
                total += count * _traffic(module, body.group(1), in_loop=True)
                continue
        calls = _CALLS.search(line)
        fused = calls.group(1) if op == "fusion" and calls else None
        only = module.sliced.get(fused, {}) if fused else {}
        names = re.findall(r"%([\w.\-]+)", operands)
        read = {
            o: 0
            if in_loop and sizes.get(o, 0) <= LOOP_CACHE_BYTES
            else min(sizes.get(o, 0), only.get(i, sizes.get(o, 0)))
            for i, o in enumerate(names)
        }
        written = (
            0
            if in_loop and sizes[name] <= LOOP_CACHE_BYTES
            else module.in_place.get(fused, sizes[name])
        )
        total += written + sum(read.values())
    return total


def op_profile(fn, args, const, calls: int, instructions: dict, top: int) -> tuple[list, object]:
    """The ``top`` costliest instructions of ``fn`` over ``calls`` profiled calls (ms per
    call, from a Perfetto trace of ``jax.profiler``), and the last call's output."""
    import jax

    totals: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                args = jax.block_until_ready(fn(*args, *const))
        (trace,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(trace) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    for e in events:
        if e.get("ph") == "X" and e.get("name") in instructions:
            totals[e["name"]] = totals.get(e["name"], 0.0) + e.get("dur", 0) / 1e3
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    ops = [{"op": k, "ms": round(v / calls, 3), **instructions[k]} for k, v in ranked]
    return ops, args


def _time_row(mapped, fresh_grads, new_state, params, variants, reps: int, warmup: int):
    """Per ``(name, compiler_options)`` of ``variants``: ``mapped`` jitted with those options
    (the gradient and the state donated), compiled, and timed as :func:`timed` does, each on
    a gradient and a state of its own; with several, their calls interleaved (call ``i`` of
    each in turn, starting with a different one each round, so that none is always first),
    so that a shared host's changing load falls on each alike. Returns per
    variant (the jitted update, its compiled program, wall ms, CPU ms, minor faults)."""
    import jax

    updates, compiled, args = [], [], []
    for _, opts in variants:
        update = jax.jit(mapped, donate_argnums=(0, 1), compiler_options=opts or None)
        grads, state = fresh_grads(), new_state()
        compiled.append(update.lower(grads, state, params).compile())
        updates.append(update)
        args.append((grads, state))
    measured = [([], [], []) for _ in variants]
    for i in range(warmup + reps):
        for j in range(len(updates)):  # call i of each, the order turned by one each round
            k = (i + j) % len(updates)
            update = updates[k]
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            args[k] = jax.block_until_ready(update(*args[k], params))
            if i >= warmup:
                times, cpu, faults = measured[k]
                times.append(1e3 * (time.perf_counter() - t0))
                cpu.append(1e3 * (time.process_time() - c0))
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return [(u, c, *m) for u, c, m in zip(updates, compiled, measured, strict=True)]


def parse_compile_options(spec: str) -> tuple[str, dict]:
    """``'default'`` -> ``("default", {})``; ``NAME:option=value[,option=value]`` -> ``(NAME,
    {option: value})``, each value ``true``/``false`` as a bool, digits as an int, else the
    text (the ``compiler_options`` of ``jax.jit``: XLA's debug options, e.g.
    ``vw512:xla_cpu_prefer_vector_width=512``)."""
    if spec == "default":
        return "default", {}
    name, sep, rest = spec.partition(":")
    pairs = [p.split("=", 1) for p in rest.split(",")] if sep else []
    if not name or not pairs or not all(len(p) == 2 and p[0] for p in pairs):
        raise ValueError(
            f"--compile-options: {spec!r} is neither 'default' nor NAME:option=value[,...]"
        )

    def value(text: str):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        return int(text) if text.lstrip("-").isdigit() else text

    return name, {k: value(v) for k, v in pairs}


def run(
    sizes,
    names,
    reps: int,
    warmup: int,
    ops: int = 0,
    op_calls: int = 3,
    backend: str = "cpu",
    compile_options: list[tuple[str, dict]] | None = None,
) -> dict:
    import warnings

    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    mesh = Mesh(np.array(jax.devices(backend)[:1]), (AXIS,), axis_types=(AxisType.Explicit,))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(common.mlp_params(sizes), replicated)
    n_params = sum(int(a.size) for a in jax.tree.leaves(params))

    leaves, treedef = jax.tree.flatten(params)
    # One compiled program for every fresh gradient tree (a jit per call compiled it 5 times).
    make = jax.jit(
        lambda ks: jax.tree.unflatten(
            treedef,
            [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(ks, leaves, strict=True)],
        ),
        out_shardings=replicated,
    )
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))

    def fresh_grads():
        return make(keys)

    copy = jax.jit(lambda g: (jax.tree.map(lambda x: x * 1.0001, g),), donate_argnums=0)

    copy_cpu: list[float] = []
    copy_faults: list[int] = []

    def copy_times():
        return timed(copy, (fresh_grads(),), reps, warmup, cpu=copy_cpu, faults=copy_faults)

    copy_ms = copy_times()
    variants = compile_options or [("default", {})]
    rows = []
    for name in names:
        what, feedback, *rest = ROWS[name]
        dtype = [rest[0]] if rest and rest[0] else []
        options = rest[1] if len(rest) > 1 else {}
        if what == "pmean":
            tx = None
        elif what.startswith("powersgd"):
            tx = jc.powersgd(int(what[len("powersgd") :]), AXIS, start_step=0)
        else:
            tx = jc.compressed_allreduce(
                common.make_codec(what),
                AXIS,
                error_feedback=feedback,
                memory_dtype=dtype[0] if dtype else None,
                **options,
            )
        t_start = time.perf_counter()
        if tx is None:
            specs = ()

            def body(g, s, p):
                return jax.lax.pmean(jax.lax.pcast(g, AXIS, to="varying"), AXIS), s

        else:
            # the specs only: each compile option set's update gets a state of its own
            specs = jc.state_specs(jc.sharded_init(tx, params, mesh, AXIS), AXIS)

            def body(g, s, p, tx=tx):
                return tx.update(jax.lax.pcast(g, AXIS, to="varying"), s, p)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs))

        def new_state(tx=tx):
            return jc.sharded_init(tx, params, mesh, AXIS) if tx else ()

        timed_rows = _time_row(mapped, fresh_grads, new_state, params, variants, reps, warmup)
        for (option_name, opts), timed_row in zip(variants, timed_rows, strict=True):
            update, compiled, times, cpu, faults = timed_row
            memory = compiled.memory_analysis()
            top_ops = []
            if ops:
                instructions = entry_instructions(compiled.as_text())
                top_ops, _ = op_profile(
                    update,
                    (fresh_grads(), jc.sharded_init(tx, params, mesh, AXIS) if tx else ()),
                    (params,),
                    op_calls,
                    instructions,
                    ops,
                )
            row = {
                "name": name,
                "codec": what,
                "error_feedback": feedback,
                "memory_dtype": dtype[0] if dtype else "float32",
                "fused": options.get("fuse_residuals", False),
                # compiled, deterministic: buffers the update allocates / takes, in gradient
                # copies
                "temp_copies": memory.temp_size_in_bytes / (4 * n_params),
                "argument_copies": memory.argument_size_in_bytes / (4 * n_params),
                # bytes the compiled update's instructions read + write, in copies (a copy of
                # the gradient reads and writes 4 bytes per parameter: 1)
                "hlo_copies": hlo_traffic(compiled.as_text()) / (8 * n_params),
                "update_ms": statistics.median(times),
                "update_min_ms": min(times),
                "times_ms": [round(t, 3) for t in times],
                "update_cpu_ms": statistics.median(cpu),
                "cpu_times_ms": [round(t, 3) for t in cpu],
                # minor page faults per call (median), in pages of 4 KiB per gradient copy
                "faults": statistics.median(faults),
                "fault_copies": statistics.median(faults) * resource.getpagesize() / (4 * n_params),
                "seconds": round(time.perf_counter() - t_start, 1),
            }
            if compile_options:
                row["compile_options"] = option_name
                row["compiler_options"] = " ".join(f"{k}={v}" for k, v in opts.items())
            if ops:
                row["ops"] = top_ops  # the costliest instructions, ms per call (profiled calls)
            rows.append(row)
            print(f"{name:20s} {option_name:16s} {row['update_ms']:9.1f} ms", flush=True)
            for op in top_ops:
                print(f"    {op['ms']:8.2f} ms  {op['op']:34s} {op['shape']:24s} {op['op_name']}")
            del update, compiled
        del timed_rows
    copy_ms += copy_times()
    copy_median = statistics.median(copy_ms)
    copy_cpu_median = statistics.median(copy_cpu)
    for row in rows:
        row["copies"] = row["update_ms"] / copy_median
        row["cpu_copies"] = row["update_cpu_ms"] / copy_cpu_median  # CPU time, in copies
        row["copies_spread"] = [  # the row's fastest and slowest call, in copies
            min(row["times_ms"]) / copy_median,
            max(row["times_ms"]) / copy_median,
        ]
    if compile_options:
        first: dict[str, dict] = {}
        for row in rows:  # each row against the first compile options' calls, pair by pair
            base = first.setdefault(row["name"], row)
            for key, times in (("paired_ratio", "times_ms"), ("paired_cpu_ratio", "cpu_times_ms")):
                pairs = zip(row[times], base[times], strict=True)
                row[key] = statistics.median(a / b for a, b in pairs)
    return {
        "params": n_params,
        "leaves": len(jax.tree.leaves(params)),
        "mlp": list(sizes),
        "copy_ms": copy_median,
        "copy_times_ms": [round(t, 3) for t in copy_ms],
        "copy_cpu_ms": copy_cpu_median,
        "copy_faults": statistics.median(copy_faults),
        "reps": reps,
        "warmup": warmup,
        "target_copies": TARGET_COPIES,
        "rows": rows,
    }


def draw(data: dict, path) -> None:
    import numpy as np

    rows = data["rows"]

    def one(ax):
        several = len({(r.get("setting"), r.get("compile_options")) for r in rows}) > 1
        names = [
            r["name"] + (f"\n{r['setting'][:28]} {r.get('compile_options', '')}" if several else "")
            for r in rows
        ]
        vals = [r["copies"] for r in rows]
        ax.bar(np.arange(len(names)), vals, color="tab:blue")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(TARGET_COPIES, color="tab:red", linestyle="--", label="3 copies")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("one tx.update, in copies of the gradient tree")
        ax.legend()

    label = f" ({data['label']})" if data.get("label") else ""
    title = (
        f"Hot path on one {data['environment']['device']} device{label}: "
        f"{data['params'] / 1e6:.1f}M params, copy {data['copy_ms']:.1f} ms"
    )
    common.plot(path, one, title)


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="hot_path.json and .png (`--label L`: hot_path_L.*; `--quick`: *_quick)",
        takes="under a minute of timed calls on the 2-core CPU host (41 s), plus compiles",
    )
    ap.add_argument("--quick", action="store_true", help="a 1.6M-param MLP, 3 rows")
    ap.add_argument(
        "--rows",
        nargs="+",
        default=None,
        choices=list(ROWS),
        metavar="ROW",
        help="rows to run (None: all)",
    )
    ap.add_argument("--reps", type=int, default=7, help="timed calls per row (at least 7)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first (compile)")
    ap.add_argument("--label", default=None, help="write hot_path_LABEL.json (e.g. before)")
    ap.add_argument(
        "--ops", type=int, default=0, help="record each row's N costliest ops (0: none)"
    )
    ap.add_argument("--op-calls", type=int, default=3, help="profiled calls per row (--ops)")
    ap.add_argument(
        "--reuse-buffers",
        action="store_true",
        help="jaxcomp.cpu.reuse_large_buffers(): freed memory reused, no page faults "
        "(with --settings: in every setting's process)",
    )
    ap.add_argument(
        "--backend",
        default="cpu",
        choices=("cpu", "gpu"),
        help="the device to time on: cpu (default) or gpu, where one is present",
    )
    ap.add_argument(
        "--settings",
        nargs="+",
        default=None,
        metavar="SETTING",
        help="time the rows once per setting (an allocator, XLA_FLAGS), each in a process "
        "of its own: "
        "'default' (none), 'reuse' (--reuse-buffers) or [NAME:]VAR=VALUE[,VAR=VALUE] "
        "environment variables (e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1, "
        "jemalloc:LD_PRELOAD=/path/libjemalloc.so.2); the rows and the JSON name a setting "
        "by its NAME (else its variables, paths cut to file names); None: this process only",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="values per chunk of the fused rows (fuse_residuals=True; None: "
        "jaxcomp._src.fused_residual.CHUNK)",
    )
    ap.add_argument(
        "--compile-options",
        nargs="+",
        default=None,
        metavar="OPTIONS",
        help="compile each row once per set of jax.jit compiler_options, 'default' (none) or "
        "NAME:option=value[,option=value] (e.g. vw512:xla_cpu_prefer_vector_width=512), "
        "their calls interleaved in one process; rows get paired_ratio against the first",
    )
    ap.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reps < 7 and not args.quick:
        ap.error("--reps must be at least 7 (or use --quick)")
    try:
        for setting in args.settings or ():
            setting_env(setting)
        for spec in args.compile_options or ():
            parse_compile_options(spec)
    except ValueError as e:
        ap.error(str(e))
    names = args.rows or (QUICK_ROWS if args.quick else list(ROWS))
    if args.settings:
        data = run_settings(args, names)
    else:
        data = run_here(args, names)
    if args.child_json:
        common.write_json(pathlib.Path(args.child_json), data, quiet=True)
        return 0
    report(data)
    name = "hot_path" + (f"_{args.label}" if args.label else "")
    common.write_json(common.result_path(name, args.quick), data)
    draw(data, common.result_path(name, args.quick, "png"))
    return 0


def run_here(args, names) -> dict:
    """The rows timed in this process (its allocator as the environment left it)."""
    import jaxcomp.cpu

    jaxcomp.cpu.use_cpu_devices(1)
    reuse = args.reuse_buffers and jaxcomp.cpu.reuse_large_buffers()
    from jaxcomp._src import fused_residual

    fused_residual.CHUNK = args.chunk or fused_residual.CHUNK
    sizes = QUICK_MLP if args.quick else common.MLP
    compile_options = [parse_compile_options(c) for c in args.compile_options or ()]
    data = run(
        sizes, names, args.reps, args.warmup, args.ops, args.op_calls, args.backend, compile_options
    )
    setting = os.environ.get("JAXCOMP_HOT_PATH_SETTING") or ("reuse" if reuse else "default")
    for row in data["rows"]:
        row["setting"] = setting
        row["xla_flags"] = compile_flags()
        row["reuse_large_buffers"] = bool(reuse)
    return {
        "environment": common.environment(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],  # other work on the host
        "label": args.label,
        "reuse_large_buffers": reuse,
        "chunk": fused_residual.CHUNK,  # values per chunk of the fused rows
        **data,
    }


def compile_flags() -> str:
    """This process's ``XLA_FLAGS`` less the collective timeouts that
    ``jaxcomp.cpu.use_cpu_devices`` adds (they change no compiled program): the compile
    options a row ran under ('' for XLA's defaults)."""
    import jaxcomp.cpu

    timeouts = {f.split("=")[0] for f in jaxcomp.cpu._FLAGS}
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if f.split("=")[0] not in timeouts)


#: ``NAME:`` at the start of a setting, before its first ``VAR=`` (values may hold colons)
_SETTING_NAME = re.compile(r"^([a-z][a-z0-9_.-]*):(?=[A-Z_][A-Z0-9_]*=)")


def setting_name(setting: str) -> str:
    """How rows and the JSON name ``setting``: its ``NAME:`` prefix where it has one (e.g.
    ``jemalloc`` for ``jemalloc:LD_PRELOAD=/tmp/x/libjemalloc.so.2``), else the setting with
    every file path cut to its file name (``LD_PRELOAD=libjemalloc.so.2``)."""
    named = _SETTING_NAME.match(setting)
    return named.group(1) if named else file_names(setting)


def file_names(text: str) -> str:
    """``text`` with every file path cut to its file name (``/tmp/x/lib.so`` -> ``lib.so``)."""
    return re.sub(r"(?:[^\s,:=/]*/)+([^\s,:=/]+)", r"\1", text)


def setting_env(setting: str) -> dict[str, str]:
    """The environment variables of ``setting`` ('default' and 'reuse' set none; a
    ``NAME:`` prefix names it, see :func:`setting_name`)."""
    if setting in ("default", "reuse"):
        return {}
    setting = _SETTING_NAME.sub("", setting)
    # a comma starts the next variable only where NAME= follows (values may hold commas)
    pairs = [p.split("=", 1) for p in re.split(r",(?=[A-Z_][A-Z0-9_]*=)", setting)]
    if not all(len(p) == 2 and p[0] and p[0].isupper() for p in pairs):
        raise ValueError(
            f"--settings: {setting!r} is neither 'default', 'reuse' nor "
            "[NAME:]VAR=VALUE[,VAR=VALUE]"
        )
    return dict(pairs)


def run_settings(args, names) -> dict:
    """Each setting's rows timed in a child process of its own (glibc reads its tunables
    when a process starts), one after another; each row's copies are taken against the copy
    timed in its own process. The first setting's copy heads the result."""
    parts = []
    for setting in args.settings:
        name = setting_name(setting)
        env = {**os.environ, **setting_env(setting), "JAXCOMP_HOT_PATH_SETTING": name}
        with tempfile.TemporaryDirectory() as folder:
            out = pathlib.Path(folder) / "part.json"
            command = [sys.executable, "-m", "benchmarks.hot_path", "--child-json", str(out)]
            command += ["--rows", *names, "--reps", str(args.reps), "--warmup", str(args.warmup)]
            command += ["--ops", str(args.ops), "--op-calls", str(args.op_calls)]
            command += ["--backend", args.backend] + ["--quick"] * args.quick
            command += ["--reuse-buffers"] * (setting == "reuse" or args.reuse_buffers)
            command += ["--chunk", str(args.chunk)] * bool(args.chunk)
            if args.compile_options:  # (unpacking None raised before the multiply)
                command += ["--compile-options", *args.compile_options]
            print(f"setting {name}:", flush=True)
            subprocess.run(command, env=env, check=True, cwd=common.ROOT)
            parts.append(json.loads(out.read_text()))
    keys = ("copy_ms", "copy_cpu_ms", "copy_faults", "loadavg")
    data = {**parts[0], "label": args.label, "reuse_large_buffers": None}
    # this command (not the first child's, whose --child-json is a temporary file), its
    # settings' paths cut to file names
    command = [pathlib.Path(sys.executable).name, *map(file_names, common._argv())]
    data["environment"] = {**data["environment"], "command": " ".join(command)}
    data["settings"] = [
        {"setting": setting_name(s), **{k: p[k] for k in keys}}
        for s, p in zip(args.settings, parts, strict=True)
    ]
    data["rows"] = [{**r, "setting_copy_ms": p["copy_ms"]} for p in parts for r in p["rows"]]
    return data


def report(data: dict) -> None:
    print(
        f"\ncopy of the tree: {data['copy_ms']:.2f} ms ({data['params'] / 1e6:.1f}M params, "
        f"{data['copy_faults']:.0f} page faults)"
    )
    for s in data.get("settings", ()):
        print(f"  {s['setting']}: copy {s['copy_ms']:.2f} ms, {s['copy_faults']:.0f} faults")
    for r in data["rows"]:
        setting = r["setting"] + (f" {r['compile_options']}" if "compile_options" in r else "")
        paired = f" (x{r['paired_cpu_ratio']:.2f} CPU, paired)" if "paired_ratio" in r else ""
        print(
            f"{r['name']:20s} {setting[:24]:24s} {r['update_ms']:9.1f} ms{paired} "
            f"{r['copies']:7.1f} copies "
            f"(calls {r['copies_spread'][0]:.1f}-{r['copies_spread'][1]:.1f}; "
            f"CPU time {r['cpu_copies']:.1f}; page faults {r['faults']:.0f}; "
            f"HLO traffic {r['hlo_copies']:.2f}); "
            f"temporaries {r['temp_copies']:.2f}, arguments {r['argument_copies']:.2f} copies"
        )


if __name__ == "__main__":
    sys.exit(main())
