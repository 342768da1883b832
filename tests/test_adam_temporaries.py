"""1-bit Adam and 0/1 Adam: the compiled step's temporaries (deterministic, compile only)."""

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc


def test_step_temporaries_of_onebit_and_zero_one_adam():
    # The donated data-parallel step of the small MLP of benchmarks.memory on 8 devices,
    # temporaries in copies of the f32 params (optax.adamw: 2.00). Both held 3.81: the
    # warm-up's pmean divided into a buffer of its own while its non-finite flag, fused into
    # the all-reduce's output, kept the sum alive; 1-bit Adam's codec input was a temporary
    # of its own, and its flag's partial sums came on top of the cond's operand and output.
    # 0/1 Adam then held 3.50: its momentum read the old variance after the new one was
    # written, so XLA copied the old variance at the start and held it to the end. 1-bit
    # Adam then held 3.19: the rms scale of each worker row wrote x / max|x| out whole for
    # its sum of squares (3.16 with it folded; 10.0M MLP of benchmarks.memory 3.27 -> 3.16).
    # 1-bit Adam then held 2.78: the cond's operand, the decoded mean and the new memory
    # (with the server's) had each left the compressed round in a buffer of its own; the
    # memory is now formed after the cond, in place, from this device's payloads. 0/1 Adam
    # then held 2.53 (3.41 before): its memory formed after the switch the same way, from
    # its codec input formed before the switch, and the new variance's fill reduced from a
    # copy of its own (XLA had written the new variance out beside the switch's operand and
    # output). variance_rounds="coded" 4.63 -> 3.53 (its float32 mean in a cond before).
    from benchmarks import memory

    mesh = jax.make_mesh((8,), ("data",))
    rep = NamedSharding(mesh, P())
    params = jax.jit(lambda: memory.common.mlp_params(memory.QUICK_MLP), out_shardings=rep)()
    rows = {
        "onebit": jc.onebit_adam(1e-3, "data", freeze_step=100),
        "zero_one": jc.zero_one_adam(1e-3, "data", var_freeze_step=100),
    }
    temps = {
        k: memory.measure(k, tx, False, params, mesh, 8)["temporaries"] for k, tx in rows.items()
    }
    assert temps["onebit"] < 2.85 and temps["zero_one"] < 2.6, temps
