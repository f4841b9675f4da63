"""Pipeline parallelism: stages cut from the captured step, each sharded by the ILP, priced with its schedule.

:func:`plan_pipeline` plans one mesh with a ``pp`` axis; :func:`search_pipeline` chooses the pp
degree, the microbatch count and the schedule for a device count. Framework-free.
"""

from .planner import pipeline_estimate, plan_pipeline
from .search import Candidate, PipelineSearch, search_pipeline

__all__ = ["Candidate", "PipelineSearch", "pipeline_estimate", "plan_pipeline", "search_pipeline"]
