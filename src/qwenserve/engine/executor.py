"""Executors run a SchedulerOutput on every rank and return rank 0's ModelOutput.

``UniprocExecutor`` drives one in-process Worker; the multi-process tensor-parallel executor
implements the same three methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.config import EngineConfig
from qwenserve.core.cache.plan import CachePlan
from qwenserve.core.sched_output import ModelOutput, SchedulerOutput
from qwenserve.distributed.init import join_data_parallel_groups, leave_parallel_group
from qwenserve.distributed.parallel_group import ParallelGroup
from qwenserve.worker.worker import Worker

if TYPE_CHECKING:
    from qwenserve.engine.mp_executor import MultiprocExecutor
    from qwenserve.platforms.base import Platform


class UniprocExecutor:
    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        # DP x EP: this replica joins the MoE group over the replicas before the model is built
        # (its experts are this rank's share); the engine core steps in lock with the others.
        self.dp_group: ParallelGroup | None = None
        placement = config.parallel.data_parallel
        moe_group = None
        if placement is not None:
            groups = join_data_parallel_groups(platform.dist_backend, placement.rank,
                                               placement.size, 1, 0, placement.host,
                                               placement.port)
            self.dp_group, moe_group = groups.drivers, groups.moe
        try:
            self.worker = Worker(config, platform, dp_ep=moe_group)
            self.worker.load_model()
        except BaseException:
            self._leave_group()
            raise
        self.specs = self.worker.specs
        self.load_s = self.worker.load_s

    def plan_cache(self) -> CachePlan:
        return self.worker.plan_cache()

    def init_cache(self, plan: CachePlan) -> None:
        self.worker.init_cache(plan)
        self.worker.warm_up()

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        return self.worker.execute(sched)

    def weight_bytes(self) -> int:
        return self.worker.weight_bytes()

    def describe_device(self) -> str:
        return self.worker.platform.describe(self.worker.device)

    def shutdown(self) -> None:
        """The KV-transfer threads to stop in-process, and the data-parallel MoE group."""
        self.worker.close()
        self._leave_group()

    def _leave_group(self) -> None:
        if self.dp_group is not None:
            leave_parallel_group(self.dp_group)
            self.dp_group = None


def make_executor(config: EngineConfig, platform: Platform
                  ) -> UniprocExecutor | MultiprocExecutor:
    if config.parallel.tensor_parallel_size > 1:
        from qwenserve.engine.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config, platform)
    return UniprocExecutor(config, platform)
