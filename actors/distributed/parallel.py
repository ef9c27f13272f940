"""Where this process sits in the tensor x pipeline layout, and the collectives it uses.

Global rank = pp_rank * tp_size + tp_rank. Rank 0 is the scheduler's process: it schedules,
broadcasts each step to the other ranks, and samples. Tensors cross ranks on the rank's
device (NCCL on CUDA, gloo on CPU); Python objects go over CPU (gloo) groups.

Deadlines: the process group's timeout (--dist-timeout) bounds start-up and every collective
of a step in flight. The step broadcast itself, where ranks 1.. wait however long the replica
is idle, runs on its own gloo group without a deadline: a peer that dies closes its socket,
which ends that wait at once, and the scheduler watches the ranks through Ray as well.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Parallel:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: object = None  # this stage's tensor-parallel group (tensors, on `device`)
    tp_cpu_group: object = None  # the same ranks over gloo (Python objects)
    control_group: object = None  # every rank over gloo, no deadline: the step broadcast
    layer_split: list[int] = field(default_factory=list)  # first layer of each stage, then the end
    # Expert parallelism: the stage's TP group splits the experts instead of each expert's width.
    expert_parallel: bool = False
    redundant_experts: int = 0  # extra physical expert slots holding copies of hot experts

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.expert_parallel else 0

    def peer(self, pp_rank: int) -> int:
        """The global rank with this process's tp rank at another pipeline stage."""
        return pp_rank * self.tp_size + self.tp_rank

    def layers(self, num_layers: int) -> range:
        split = self.layer_split or even_split(num_layers, self.pp_size)
        return range(split[self.pp_rank], split[self.pp_rank + 1])

    # ---- collectives (no-ops without tensor parallelism) -------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def broadcast_in_stage(self, obj):
        """`obj` as the stage's tp rank 0 has it, on every rank of the stage."""
        if self.tp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.pp_rank * self.tp_size, group=self.tp_cpu_group)
        return box[0]

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


def layout(config, layer_split: list[int], rank: int) -> Parallel:
    """Rank `rank`'s place in the layout an EngineConfig asks for."""
    return Parallel(config.tp_size, config.pp_size, rank, layer_split=layer_split,
                    expert_parallel=config.expert_parallel, redundant_experts=config.num_redundant_experts)


def even_split(num_layers: int, stages: int) -> list[int]:
    """Layer boundaries giving each stage an equal share (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def parse_layer_split(spec: str | None, num_layers: int, stages: int) -> list[int]:
    """'4,4' (layers per stage) -> boundaries; None -> an even split."""
    if not spec:
        return even_split(num_layers, stages)
    sizes = [int(x) for x in str(spec).split(",")]
    if len(sizes) != stages or sum(sizes) != num_layers or min(sizes) < 1:
        raise ValueError(f"--pp-layer-split {spec!r} must give {stages} positive layer counts "
                         f"summing to {num_layers}")
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return bounds


# "No deadline" for the idle wait; gloo needs some number (a year fits its clock).
IDLE_WAIT = datetime.timedelta(days=365)


def init_distributed(p: Parallel, master_addr: str, master_port: int, timeout_s: float,
                     backend: str) -> None:
    """Join the process group and build the groups (every rank creates every group, in order)."""
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=p.rank, world_size=p.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    p.control_group = dist.new_group(list(range(p.world_size)), backend="gloo", timeout=IDLE_WAIT)
    for stage in range(p.pp_size):
        ranks = list(range(stage * p.tp_size, (stage + 1) * p.tp_size))
        group = cpu_group = None
        if p.tp_size > 1:
            group = dist.new_group(ranks)
            cpu_group = group if backend == "gloo" else dist.new_group(ranks, backend="gloo")
        if stage == p.pp_rank:
            p.tp_group, p.tp_cpu_group = group, cpu_group
