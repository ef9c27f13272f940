"""Decode steps through torch.compile on CPU: the CPU's counterpart of CUDA graphs.

Inductor fuses the elementwise work between the matmuls (RMSNorm, rotary, SiLU x up, the
residual adds) into C++ loops and drops most of the per-op dispatch, which is ~15-25% of an
eager decode step on CPU (docs/benchmarks.md). One graph serves every batch size and context
length (dynamic shapes). A step of two or more rows, all one-token decodes, runs through it;
any other step (prefill chunks) runs eagerly, and so does a batch of one: at one row MKL takes
its matrix-vector path, faster than any compiled 2-row step (14 vs 19 ms a step on the bench
model, docs/benchmarks.md).

torch.compile specialises sizes 0 and 1, so block tables are padded to at least 2 blocks
(with the spare block of the KV pool the block manager never hands out, as CUDA graphs pad:
actors/worker/input_batch.py), and the graph is compiled at start-up on 2 padding rows that
write to and read from that block: every step then runs on the one graph.

The graph ends with the LM head. Its linear layers run through kernels/linear.py on the
weights the runner packed at start (actors/worker/kernel_choice.py): float32 on an AVX-512 CPU
through shoal's panel kernel, else through oneDNN, which builds and keeps a kernel (~0.6 MB)
for every row count it meets. So the rows are padded to the next of a few bucket sizes (CUDA
graphs' capture sizes: 2, 4, 8, then multiples of 8 up to --max-num-seqs): the kernels kept
stay few and the memory bounded, for at most 7 padding rows of work.

Compiling takes ~20-40 s on 2 cores (less with inductor's cache warm in
/tmp/torchinductor_$USER), once per engine start, at start-up; `--eager-decode` (or
SHOAL_EAGER_DECODE=1, which the test suite sets) skips it. If compiling fails (no C++
compiler, say), the engine logs why and decodes eagerly.
"""
from __future__ import annotations

import logging
import time

import torch

from actors.core.step import SchedulerOutput
from actors.worker.cuda_graphs import padded_size
from actors.worker.input_batch import InputBatch, PaddedDecode, PendingTokens
from kernels.attention import AttentionMetadata

log = logging.getLogger("shoal.runner")

MIN_ROWS = MIN_BLOCKS = 2  # below these torch.compile would specialise a second graph


class CompiledDecode:
    """The compiled model of one runner; `run` takes decode-only steps."""

    def __init__(self, model, *, sizes: list[int], block_size: int):
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as shape_config

        inductor_config.compile_threads = 1  # compile in this process: no worker pool left behind
        # Sizes that happen to be equal when compiling (2 padding rows, the KV pool's K/V axis)
        # must not become one symbol, or the first real batch recompiles.
        shape_config.use_duck_shape = False
        self.fn = torch.compile(lambda ids, positions, meta: model.compute_logits(model(ids, positions, meta)),
                                dynamic=True, fullgraph=True)
        self.sizes = sorted({max(MIN_ROWS, s) for s in sizes})
        self.block_size = block_size
        self.replays = 0  # decode steps that ran compiled (the progress line's graph=True)

    def can_run(self, output) -> bool:
        return (MIN_ROWS <= len(output.rows) <= self.sizes[-1]
                and output.num_decodes == len(output.rows))

    def run(self, output, batch: InputBatch, pending: PendingTokens | None = None) -> torch.Tensor:
        """Logits of the step's rows (the LM head is part of the graph); `pending` fills the
        input ids the previous step sampled."""
        rows = output.rows
        width = max(MIN_BLOCKS, -(-max(r.start + 1 for r in rows) // self.block_size))
        padded = batch.padded_decode(output, padded_size(len(rows), self.sizes), width)
        if pending is not None:
            pending.apply(padded.input_ids)
        logits = self.fn(*self._inputs(padded))
        self.replays += 1
        return logits[:len(rows)]

    def _inputs(self, p: PaddedDecode):
        meta = AttentionMetadata(slot_mapping=p.slots, num_decode_tokens=p.size, block_size=self.block_size,
                                 decode_block_tables=p.block_tables, decode_context_lens=p.context_lens)
        return p.input_ids, p.positions, meta

    @torch.inference_mode()
    def compile(self, batch: InputBatch) -> None:
        """Compile now, on padding rows only (what the first decode step would otherwise pay)."""
        start = time.perf_counter()
        self.fn(*self._inputs(batch.padded_decode(SchedulerOutput([], 0, []), MIN_ROWS, MIN_BLOCKS)))
        log.info("compiled decode ready in %.1f s", time.perf_counter() - start)
