"""The PyTorch runtime: run a lowered plan on torch.distributed, and check it against one device.

- :mod:`.env`, :mod:`.setup`: the torchrun environment, the process group and the DeviceMesh
- :mod:`.collectives`: resharding with functional collectives on one mesh axis, counting bytes
- :mod:`.graph_module`: a rank's program as an ordinary ``torch.fx.GraphModule``
- :mod:`.step`: :class:`CompiledStep`, one distributed training step with sharded state
- :mod:`.check`: the same steps on one device, compared tensor by tensor
- :mod:`.worker`: the per-rank entry point ``metadist run`` launches through torchrun
"""

from .check import CheckReport, Difference, ReferenceRun, TensorStream, Tolerance, compare_runs, reference_run
from .collectives import Collectives, CommRecord
from .env import TorchrunEnv, read_torchrun_env
from .errors import USER_ERRORS, CheckError, LocalOpError, RunInputError, RuntimeSetupError
from .graph_module import CheckingInterpreter, build_rank_module
from .setup import check_mesh_size, check_same_everywhere, setup_device_mesh, teardown
from .step import CompiledStep, shard_full_tensor

__all__ = [name for name in dir() if not name.startswith("_")]
