"""Where a step runs: rank 0's model runner in this process and, for tp x pp > 1, the shard
ranks it starts, places, watches and stops (actors/executor/shards.py).

The engine hands the executor each step's SchedulerOutput and gets the sampled tokens back;
it never sees Ray, placement groups or the process group. With one rank a step is a call on
the runner. With more, the executor first broadcasts the step to every rank over
torch.distributed (actors/distributed/pipeline.py: one message per step, no Ray call), then
rank 0 runs its stage and samples; an expert re-plan (EPLB) rides on the same broadcast, so
every rank switches placement before the same step.
"""
from __future__ import annotations

import logging
import resource
import time

from actors.config import EngineConfig
from actors.core.step import RunnerOutput, SchedulerOutput
from actors.distributed.pipeline import REBALANCE, STOP, broadcast_step
from actors.worker.model_runner import ModelRunner
from actors.worker.model_spec import ModelSpec
from kernels.env import flag

log = logging.getLogger("shoal.engine")


class Executor:
    def __init__(self, config: EngineConfig, spec: ModelSpec, placement: tuple | None = None,
                 draft_block_bytes: int = 0):
        """placement: (placement group, first bundle for shard rank 1) when the caller reserved
        one; draft_block_bytes: a draft model's KV block, whose pool rank 0's is sized with."""
        start = time.perf_counter()
        self.runner = ModelRunner(config, spec, draft_block_bytes=draft_block_bytes)
        log.info("rank 0 loaded in %.2f s: %s; peak RSS %.0f MiB", time.perf_counter() - start,
                 self.runner.describe_startup(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        self.shards = None
        self.mid_step = False  # a multi-rank step was broadcast and has not returned on this rank
        if self.runner.p.world_size > 1:
            from actors.executor.shards import start_shards  # Ray: only for multi-rank layouts
            self.shards = start_shards(config, spec, self.runner, placement)
        # Whether the next step may be executed before this one's tokens are read (execute's
        # `previous`): async scheduling with one rank, whose sampled tokens stay on its device.
        self.runs_ahead = self.async_scheduling and self.shards is None and flag("SHOAL_SCHEDULE_AHEAD", True)

    @property
    def num_blocks(self) -> int:
        """KV blocks per rank (every rank holds the same number)."""
        return self.runner.num_blocks

    @property
    def device(self):
        return self.runner.device

    def padded_rows(self, rows: int) -> int:
        """The token rows a step of `rows` computes: its compiled step's bucket, else `rows`."""
        return self.runner.padded_rows(rows)

    @property
    def async_scheduling(self) -> bool:
        """Whether execute() may return before the GPU has run the step (RunnerOutput.resolve)."""
        return self.runner.async_scheduling

    def rank_infos(self) -> list[dict]:
        """Where every rank runs (/stats): pid, node, device, GPU ids."""
        from actors.executor.shards import rank_info
        return [rank_info(0, self.runner.device)] + (self.shards.infos if self.shards else [])

    def execute(self, output: SchedulerOutput, previous: RunnerOutput | None = None) -> RunnerOutput:
        """previous: the step before, not read yet (runs_ahead)."""
        if not output.seqs:
            return RunnerOutput([], [], [])
        if self.shards is None:
            return self.runner.execute(output, previous)
        rebalance = self.runner.experts is not None and self.runner.experts.due()
        self.mid_step = True
        broadcast_step(self.runner.p, (REBALANCE, output) if rebalance else output)
        if rebalance:  # every rank re-plans at this same step
            self.runner.experts.rebalance()
        result = self.runner.execute(output, previous)
        self.mid_step = False  # (an exception leaves it set: the shard ranks may wait inside the step)
        return result

    def idle(self) -> None:
        """Nothing to run for a while (rank 0's runner may load its compiled decode step)."""
        self.runner.idle()

    def check(self, timeout: float) -> str | None:
        """None while every rank is healthy (always, for one rank); else what is wrong."""
        return self.shards.check(timeout) if self.shards is not None else None

    def expert_stats(self) -> dict | None:
        return self.runner.expert_stats()

    @property
    def graph_replays(self) -> int:
        return self.runner.graph_replays

    def shutdown(self) -> None:
        """Stop the shard ranks' loops and actors, and leave the process group."""
        if self.shards is None:
            return
        if self.mid_step:  # a step broke off on this rank: the others wait inside it, not for STOP
            log.warning("a step broke off: the shard ranks are stopped without their loops' goodbye")
        else:
            try:
                broadcast_step(self.runner.p, STOP)
            except Exception as exc:  # a shard already gone: killing them below is all that is left
                log.warning("could not stop the shard loops cleanly: %s", exc)
        self.shards.shutdown()
        self.shards = None
        import torch.distributed as dist
        dist.destroy_process_group()
