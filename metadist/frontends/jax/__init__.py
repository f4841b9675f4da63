"""The JAX frontend: capture a JAX training step into MetaIR, execute MetaIR ops with JAX, run plans through XLA.

- :mod:`.capture`: ``capture_jax(workload) -> JaxStep`` (a flat MetaIR graph from the step's jaxpr)
- :mod:`.control_flow`, :mod:`.keys`: ``scan``/``cond``/``while`` expanded flat; PRNG keys carried as key data
- :mod:`.params`, :mod:`.primitives`: equation params and primitives as MetaIR data, and back
- :mod:`.execute`: run one node (``primitive.bind``) or a whole graph (jitted interpreter)
- :mod:`.discovery`: ShardCombine's ``OpExecutor`` for JAX primitives (rules under framework ``"jax"``)
- :mod:`.sharded`: a plan as XLA shardings on a ``jax.sharding.Mesh``; collectives counted from the HLO
- :mod:`.cli_support`: ``plan_jax`` and ``run_jax``, the pipeline the CLI drives
- :mod:`.multihost`: ``run_jax_multihost``, one plan on several processes joined by ``jax.distributed``
"""

from .capture import JaxStep, capture_jax, capture_step
from .errors import JaxCaptureError
from .execute import bind_node, interpret, jit_graph, run_graph
from .workload import JaxWorkload

__all__ = ["JaxCaptureError", "JaxStep", "JaxWorkload", "bind_node", "capture_jax", "capture_step", "interpret",
           "jit_graph", "run_graph"]
