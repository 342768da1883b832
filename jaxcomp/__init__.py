"""jaxcomp: compressed collectives for data-parallel JAX training.

Codecs (``jc.sign()``, ``jc.int_quant(8)``, ...) compress a vector; ``jc.psum`` / ``jc.pmean``
reduce a pytree over a mesh axis through a codec; ``jc.compressed_allreduce`` is the optax
transform that adds error feedback; ``jc.comm_report`` reads the bytes on the wire from the
compiled program.
"""

from jaxcomp._src.accounting import CommReport, Conditional, at_count, comm_report, format_bytes
from jaxcomp._src.accumulate import AccumulateState, accumulate
from jaxcomp._src.adaptive import Accordion, AccordionState, accordion
from jaxcomp._src.autotune import AutotunePlan, autotune
from jaxcomp._src.budget import demo_ratio, demo_topk, sparseloco_density, sparseloco_ratio
from jaxcomp._src.clipping import clip_by_global_norm
from jaxcomp._src.codecs import (
    CODECS,
    Codec,
    cast,
    get_codec,
    identity,
    int_quant,
    natural,
    qsgd,
    sign,
    terngrad,
    threshold_2bit,
)
from jaxcomp._src.codecs.chunked import ChunkedTopK, chunked_top_k
from jaxcomp._src.codecs.sparse import random_k, threshold, top_k
from jaxcomp._src.collectives import (
    STRATEGIES,
    choose_strategy,
    hierarchical_bytes,
    pmean,
    psum,
    strategy_bytes,
)
from jaxcomp._src.compressed_allreduce import CompressedAllreduceState, compressed_allreduce
from jaxcomp._src.delayed import DelayedState, delayed
from jaxcomp._src.demo import DeMoState, demo, scale_by_demo
from jaxcomp._src.dgc import DGCState, dgc
from jaxcomp._src.diloco import DiLoCoState, diloco
from jaxcomp._src.finite import apply_if_finite
from jaxcomp._src.fsdp import fsdp_gather, fsdp_residual
from jaxcomp._src.gossip import GossipState, consensus_distance, gossip, gossip_bytes
from jaxcomp._src.local_sgd import LocalSGDState, local_sgd
from jaxcomp._src.nnx import nnx_local, nnx_optimizer, nnx_state_specs
from jaxcomp._src.older_states import complete_state, restore_template
from jaxcomp._src.onebit_adam import OneBitAdamState, onebit_adam
from jaxcomp._src.overlap import OverlappedStep, overlapped_step
from jaxcomp._src.powersgd import PowerSGDState, powersgd
from jaxcomp._src.replicas import mean_replica, own, replica_params, replica_specs, slot
from jaxcomp._src.resize import resize_state, restore_target
from jaxcomp._src.sgd import sgd
from jaxcomp._src.sharded import all_gather, psum_scatter
from jaxcomp._src.sharding import replicate, sharded_init, state_specs
from jaxcomp._src.sparseloco import SparseFeedbackState, SparseLoCoState, sparseloco
from jaxcomp._src.topology import TOPOLOGIES, Topology, topology
from jaxcomp._src.zero_one_adam import ZeroOneAdamState, zero_one_adam

__version__ = "0.1.0"

__all__ = [
    "apply_if_finite",
    "all_gather",
    "fsdp_gather",
    "fsdp_residual",
    "psum_scatter",
    "clip_by_global_norm",
    "Accordion",
    "AccordionState",
    "accordion",
    "AutotunePlan",
    "autotune",
    "AccumulateState",
    "accumulate",
    "CODECS",
    "ChunkedTopK",
    "chunked_top_k",
    "get_codec",
    "STRATEGIES",
    "Codec",
    "DGCState",
    "DeMoState",
    "demo",
    "demo_ratio",
    "demo_topk",
    "scale_by_demo",
    "DelayedState",
    "delayed",
    "OverlappedStep",
    "overlapped_step",
    "DiLoCoState",
    "diloco",
    "LocalSGDState",
    "local_sgd",
    "PowerSGDState",
    "dgc",
    "GossipState",
    "TOPOLOGIES",
    "Topology",
    "consensus_distance",
    "gossip",
    "gossip_bytes",
    "topology",
    "powersgd",
    "random_k",
    "threshold",
    "top_k",
    "CommReport",
    "Conditional",
    "at_count",
    "CompressedAllreduceState",
    "cast",
    "choose_strategy",
    "comm_report",
    "format_bytes",
    "hierarchical_bytes",
    "compressed_allreduce",
    "identity",
    "int_quant",
    "natural",
    "nnx_local",
    "nnx_optimizer",
    "nnx_state_specs",
    "OneBitAdamState",
    "ZeroOneAdamState",
    "zero_one_adam",
    "onebit_adam",
    "pmean",
    "psum",
    "qsgd",
    "replicate",
    "resize_state",
    "restore_target",
    "restore_template",
    "complete_state",
    "mean_replica",
    "own",
    "replica_params",
    "replica_specs",
    "slot",
    "sharded_init",
    "sign",
    "sgd",
    "SparseFeedbackState",
    "SparseLoCoState",
    "sparseloco",
    "sparseloco_density",
    "sparseloco_ratio",
    "state_specs",
    "strategy_bytes",
    "terngrad",
    "threshold_2bit",
]
