"""The operation graph: describe a computation as tensors and nodes, validate it, fuse it into as
few kernels as possible (generated Triton kernels for pointwise and reduction groups, tritondnn's
ops with fused epilogues for the rest), then execute, explain and serialize the plan.

Files: ``types`` (tensors, nodes, errors), ``nodes`` (the builders), ``graph`` (``Graph``),
``pointwise`` (the pointwise modes), ``partition`` (fusion), ``codegen`` and ``kernel_lib``
(generated kernels), ``lowering`` and ``runners`` (steps), ``plan`` (``Plan``), ``serialize``
(JSON), ``reference`` (the meaning, in PyTorch), ``bridge`` (``compile_graph``: PyTorch
functions traced into plans).
"""

from .bridge import CompiledGraph, GraphFallbackWarning, compile_graph
from .codegen import STATS as KERNEL_CACHE_STATS
from .graph import MODES, Graph
from .plan import Candidate, Outputs, Plan
from .pointwise import OPS as POINTWISE_OPS
from .reference import reference
from .serialize import GRAPH_SCHEMA, PLAN_SCHEMA
from .types import GraphDtypeError, GraphError, GraphTensor, Node

__all__ = [
    "GRAPH_SCHEMA",
    "KERNEL_CACHE_STATS",
    "MODES",
    "PLAN_SCHEMA",
    "POINTWISE_OPS",
    "Candidate",
    "CompiledGraph",
    "Graph",
    "GraphDtypeError",
    "GraphError",
    "GraphFallbackWarning",
    "GraphTensor",
    "Node",
    "Outputs",
    "Plan",
    "compile_graph",
    "reference",
]
