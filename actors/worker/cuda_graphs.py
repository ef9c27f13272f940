"""Decode steps as CUDA graphs: one graph per batch-size bucket, replayed with padded inputs.

A step whose rows are all one-token decodes, whose batch fits the largest bucket and whose
longest context fits --max-seq-len-to-capture runs as a graph: its inputs are copied into
static buffers (padded up to the bucket with rows that write to and read from a spare block
of the KV pool that the block manager never hands out), the bucket's graph is replayed, and
the first rows of the static output are the step's hidden states. Any other step runs
eagerly. All graphs share one memory pool (as vLLM's do).

A bucket is captured when it recurs, not at start-up (issue 46: capturing never makes a run
slower than eager): its first CAPTURE_AFTER - 1 decode steps run eagerly, and the next one
captures it (two warm-up forwards and the captured one, about what those eager steps cost)
and replays it from then on. A run that meets a batch size once or twice never pays for its
graph, start-up captures nothing, and `make serve` on a GPU starts in seconds. An idle engine
captures the remaining buckets, largest first, one per idle second (ModelRunner.idle).

Buckets follow vLLM's --cuda-graph-sizes: none given, [1, 2, 4, 8, 16, ...] up to
min(2 x --max-num-seqs, 512); one value N, the same pattern up to N; several, those sizes;
never above --max-num-seqs.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import time

import torch

from actors.core.step import SchedulerOutput
from actors.worker.input_batch import InputBatch, PaddedDecode, PendingTokens
from kernels.attention import AttentionMetadata
from kernels.flash_attention import FlashMetadata
from kernels.host_copies import staged
from kernels.triton_attention import TritonMetadata

log = logging.getLogger("shoal.runner")

CAPTURE_AFTER = 3  # the step of a bucket that captures it: its first two run eagerly


def capture_sizes(cuda_graph_sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending (vLLM's --cuda-graph-sizes rule)."""
    if not cuda_graph_sizes or len(cuda_graph_sizes) == 1:
        top = cuda_graph_sizes[0] if cuda_graph_sizes else min(2 * max_num_seqs, 512)
        sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    else:
        sizes = cuda_graph_sizes
    sizes = sorted({s for s in sizes if s <= max_num_seqs})
    return sizes or [max_num_seqs]


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `batch` rows, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """The captured graphs of one runner and their static buffers.

    capture_fn: (fn, pool) -> (graph, pool), capture_cuda_graph on a GPU (tests emulate it);
    around_capture: a context manager the captures run in (the expert load recorder's pause)."""

    def __init__(self, model, sizes: list[int], batch: InputBatch, *, block_size: int, max_seq_len: int,
                 hidden_size: int, dtype, device, flash_ops=None, triton: bool = False,
                 capture_fn=None, around_capture=contextlib.nullcontext):
        self.model, self.sizes, self.block_size, self.batch = model, sizes, block_size, batch
        self.capture_fn, self.around_capture = capture_fn or capture_cuda_graph, around_capture
        self.max_seq_len, self.flash_ops, self.triton = max_seq_len, flash_ops, triton
        self.width = -(-max_seq_len // block_size)
        n = sizes[-1]
        z = lambda *shape, dt=torch.long: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.input_ids, self.positions, self.slots = z(n), z(n), z(n)
        self.context_lens = z(n, dt=torch.int32)
        self.block_tables = z(n, self.width, dt=torch.int32 if flash_ops or triton else torch.long)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.keys = torch.arange(self.width * block_size, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, object] = {}
        self.pool = None  # the graphs' shared memory pool, made by the first capture
        self.eager_steps: dict[int, int] = {}  # decode steps each uncaptured bucket has run eagerly
        self.failed: set[int] = set()  # buckets whose capture failed: they stay eager
        self.replays = 0  # decode steps that ran as a graph (the progress line)
        log.info("CUDA graphs: decode batch sizes %d..%d (%d buckets), each captured when its size recurs "
                 "(decode step %d of that size)", sizes[0], sizes[-1], len(sizes), CAPTURE_AFTER)

    # ---- which steps ----------------------------------------------------------------
    def can_run(self, output) -> bool:
        """Whether this step runs as a graph: it fits one, and its bucket is captured, or
        recurs often enough now to be (captured here, before it replays)."""
        rows = output.rows
        if not (rows and output.num_decodes == len(rows) and len(rows) <= self.sizes[-1]
                and max(r.start + 1 for r in rows) <= self.max_seq_len):
            return False
        size = padded_size(len(rows), self.sizes)
        if size in self.graphs:
            return True
        if size in self.failed:
            return False
        self.eager_steps[size] = self.eager_steps.get(size, 0) + 1
        return self.eager_steps[size] >= CAPTURE_AFTER and self.capture(size)

    def run(self, output, batch: InputBatch, pending: PendingTokens | None = None) -> torch.Tensor:
        """Hidden states of the step's rows (a view into the static output); `pending` fills the
        input ids the previous step is still sampling."""
        size = padded_size(len(output.rows), self.sizes)
        self._fill(batch.padded_decode(output, size, self.width))
        if pending is not None:
            pending.apply(self.input_ids)
        self.graphs[size].replay()
        self.replays += 1
        return self.hidden[:len(output.rows)]

    def _fill(self, p: PaddedDecode) -> None:
        n = p.size
        for static, given in ((self.input_ids, p.input_ids), (self.positions, p.positions), (self.slots, p.slots),
                              (self.context_lens, p.context_lens), (self.block_tables, p.block_tables)):
            static[:n].copy_(staged(given, static.device), non_blocking=True)

    # ---- capture --------------------------------------------------------------------
    def forward(self, n: int) -> None:
        """The model over the first n static rows, into the static output (what a graph holds)."""
        self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n], self.metadata(n))

    def metadata(self, n: int) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self.slots[:n], num_decode_tokens=n, block_size=self.block_size)
        ctx, tables = self.context_lens[:n], self.block_tables[:n]
        if self.flash_ops is not None:
            cu_k = torch.cat([self.cu_seqlens[:1], ctx.cumsum(0, dtype=torch.int32)])  # in the graph
            meta.flash = FlashMetadata(self.flash_ops, self.block_size, n, self.cu_seqlens[:n + 1], ctx,
                                       cu_k, tables, 1, self.max_seq_len)
        elif self.triton:
            meta.triton = TritonMetadata(self.cu_seqlens[:n + 1], ctx, tables, self.block_size)
        else:
            meta.decode_block_tables, meta.decode_context_lens = tables, ctx
            meta.decode_mask = (self.keys[None, :] < ctx[:, None])[:, None, None, :]
        return meta

    def capture(self, size: int) -> bool:
        """Capture `size`'s graph on padding rows; False (the bucket stays eager) where the
        capture fails, say for want of memory."""
        start, free = time.perf_counter(), _free_memory(self.hidden.device)
        self._fill(self.batch.padded_decode(SchedulerOutput([], 0, []), size, self.width))
        try:
            with torch.inference_mode(), self.around_capture():
                self.graphs[size], self.pool = self.capture_fn(lambda: self.forward(size), self.pool)
        except RuntimeError as e:
            self.failed.add(size)
            log.warning("CUDA graph of decode batch size %d not captured (%s): its steps run eagerly",
                        size, str(e).splitlines()[0][:200])
            return False
        self.eager_steps.pop(size, None)
        log.info("CUDA graph of decode batch size %d captured in %.0f ms, %.0f MiB (%d of %d buckets)", size,
                 (time.perf_counter() - start) * 1e3, (free - _free_memory(self.hidden.device)) / 2**20,
                 len(self.graphs), len(self.sizes))
        return True

    def capture_next(self) -> bool:
        """The largest bucket not yet captured (or tried), now: the engine is idle. False when
        none is left."""
        left = [n for n in self.sizes if n not in self.graphs and n not in self.failed]
        return bool(left) and (self.capture(left[-1]) or True)

    def capture_all(self) -> None:
        """Every bucket now, largest first (benchmarks that time runs without captures)."""
        while self.capture_next():
            pass


def _free_memory(device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def capture_cuda_graph(fn, pool):
    """(graph, pool): `fn` warmed up on a side stream, then captured into `pool`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    torch.cuda.synchronize()
    return graph, pool
