"""How many KV blocks fit on this rank's GPU, the way vLLM decides it.

--gpu-memory-utilization U is the share of the device's *total* memory this rank may use. What
is not the KV cache comes off it first:

    kv bytes = U * total - weights - peak activations - non-torch memory - graph reserve

- weights: what torch has allocated once the model (and its LoRA slots) is loaded;
- peak activations: measured by a profiling forward at the largest step the scheduler can
  send (one chunk of --max-num-batched-tokens at the end of a --max-model-len context, and
  the logits of --max-num-seqs rows); with tp x pp > 1 rank 0 can't run a forward before the
  other ranks join, so it uses `estimate_activation_bytes` instead;
- non-torch memory: what the device lost since start-up that torch did not allocate (NCCL
  and cuBLAS workspaces, library buffers);
- graph reserve: with CUDA graphs, the peak of one eager decode at the largest capture size
  (the graphs' shared memory pool holds about that); what capture really took is logged.

At start-up the device must have U * total free, as in vLLM: another process holding memory
fails start-up with the numbers, instead of an out-of-memory error later.
`--kv-cache-memory` (GiB) and `--num-kv-blocks` override all of this.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from actors.core.step import SchedulerOutput, StepRow

log = logging.getLogger("shoal.runner")
GiB = 2**30


@dataclass
class MemoryProfile:
    total: int  # the device's memory
    utilization: float  # --gpu-memory-utilization
    weights: int
    activations: int
    non_torch: int = 0
    graphs: int = 0

    @property
    def budget(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.weights - self.activations - self.non_torch - self.graphs

    def describe(self) -> str:
        return (f"{self.utilization:g} x {self.total / GiB:.2f} GiB = {self.budget / GiB:.2f} GiB; "
                f"weights {self.weights / GiB:.2f}, activations {self.activations / GiB:.2f}, "
                f"non-torch {self.non_torch / GiB:.2f}, CUDA graphs {self.graphs / GiB:.2f} GiB")


def kv_blocks(profile: MemoryProfile, block_bytes: int, useful_blocks: int) -> int:
    """Blocks the profile leaves room for (at most `useful_blocks`: more are never used).
    Raises ValueError when there is no room for even two blocks."""
    blocks = max(0, profile.kv_bytes) // block_bytes
    if blocks < 2:
        raise ValueError(f"no GPU memory left for the KV cache ({profile.describe()}): raise "
                         f"--gpu-memory-utilization, or lower --max-num-batched-tokens / --max-num-seqs")
    return min(blocks, useful_blocks)


def check_free_at_start(free: int, total: int, utilization: float) -> None:
    """vLLM's start-up check: this rank's share must be free when it starts."""
    if free < total * utilization:
        raise ValueError(f"free memory on the device ({free / GiB:.2f}/{total / GiB:.2f} GiB) at start-up "
                         f"is less than --gpu-memory-utilization {utilization:g} of it "
                         f"({total * utilization / GiB:.2f} GiB): lower it, or free the GPU")


def estimate_activation_bytes(hidden: int, intermediate: int, heads: int, kv_heads: int,
                              head_dim: int, vocab: int, tokens: int, seqs: int, tp: int,
                              itemsize: int) -> int:
    """An upper estimate of one forward's peak, for ranks that can't profile alone (tp x pp > 1):
    the residual stream, fused qkv, attention output and the MLP's gate/up of `tokens` tokens
    live at once, plus float32 logits (and a softmax-sized copy) of `seqs` rows over the vocab."""
    per_token = (2 * hidden + (heads + 2 * kv_heads) * head_dim // tp + heads * head_dim // tp
                 + 3 * intermediate // tp) * itemsize
    return tokens * per_token + 2 * seqs * vocab * 4


def profile_step_rows(tokens: int, max_model_len: int, block_size: int, pool_blocks: int):
    """The profiling step: one chunk of `tokens` tokens ending at `max_model_len`, its block table
    cycling over a small scratch pool of `pool_blocks` blocks (the keys are garbage; the memory
    use is the real one). Returns (token ids, start, block table)."""
    tokens = min(tokens, max_model_len)
    start = max_model_len - tokens
    table = [i % pool_blocks for i in range(-(-max_model_len // block_size))]
    return [0] * tokens, start, table


# --------------------------------------------------------------------------- measuring (CUDA)

def gpu_kv_blocks(runner, useful_blocks: int) -> int:
    """The pool size for this rank's GPU under --gpu-memory-utilization (see the top)."""
    import torch
    c = runner.config
    check_free_at_start(runner.free_at_start, runner.total_memory, c.gpu_memory_utilization)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated()
    tokens, seqs = c.max_num_batched_tokens, min(c.max_num_seqs, c.max_num_batched_tokens)
    if runner.p.world_size == 1:
        activations = profile_forward(runner, tokens, seqs)
        graphs = profile_decode(runner) if runner.graphs_off is None else 0
    else:
        a = runner.args
        activations = estimate_activation_bytes(a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads,
                                                a.head_dim, a.vocab_size, tokens, seqs, c.tp_size,
                                                runner.dtype.itemsize)
        graphs = 0
    free, total = torch.cuda.mem_get_info()
    used_since_start = runner.free_at_start - free
    non_torch = max(0, used_since_start - torch.cuda.memory_reserved())
    profile = MemoryProfile(total, c.gpu_memory_utilization, weights, activations, non_torch, graphs)
    blocks = kv_blocks(profile, runner.block_bytes(), useful_blocks)
    log.info("GPU memory: %s; KV cache %.2f GiB -> %d blocks", profile.describe(),
             profile.kv_bytes / GiB, blocks)
    return blocks


def check_pool_fits(runner) -> None:
    """Ranks 1.. take rank 0's block count: say so when it puts this rank over its share."""
    import torch
    used = runner.free_at_start - torch.cuda.mem_get_info()[0]
    share = runner.total_memory * runner.config.gpu_memory_utilization
    if used > share:
        log.warning("rank %d uses %.2f GiB with rank 0's %d KV blocks, over its --gpu-memory-utilization "
                    "share of %.2f GiB", runner.p.rank, used / GiB, runner.num_blocks, share / GiB)


def _measure(runner, pool_blocks: int, run) -> int:
    """Peak bytes `run()` allocates over what is allocated now, a scratch pool left out."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    runner.bind_kv_cache(pool_blocks)
    pool = torch.cuda.memory_allocated() - base
    with torch.inference_mode():
        run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - pool
    runner.bind_kv_cache(None)
    torch.cuda.empty_cache()
    return max(0, peak)


def profile_forward(runner, tokens: int, seqs: int) -> int:
    """Peak activations of the largest step: a `tokens` chunk at the end of the longest context,
    then float32 logits of `seqs` rows with a softmax and a sort (what sampling allocates)."""
    pool_blocks = -(-tokens // runner.block_size) + 1
    ids, start, table = profile_step_rows(tokens, runner.max_model_len, runner.block_size, pool_blocks)
    rows = list(range(len(ids) - min(seqs, len(ids)), len(ids)))
    step = SchedulerOutput([StepRow(0, ids, start)], int(len(ids) == 1), rows, [(0, 0, table)])

    def run():
        hidden = runner.model(*_inputs(runner, step, 1, len(table)))
        logits = runner.model.compute_logits(hidden[rows])
        logits.softmax(-1).sort(-1, descending=True)
    return _measure(runner, pool_blocks, run)


def profile_decode(runner) -> int:
    """Peak of one eager decode at the largest graph size and the longest captured context: about
    what the graphs' memory pool holds."""
    c, bs = runner.config, runner.block_size
    size = runner.graph_sizes[-1]
    context = min(c.max_seq_len_to_capture, runner.max_model_len)
    pool_blocks = size + 1
    table = [i % pool_blocks for i in range(-(-context // bs))]
    step = SchedulerOutput([StepRow(i, [0], context - 1) for i in range(size)], size, list(range(size)),
                           [(i, 0, table) for i in range(size)])
    return _measure(runner, pool_blocks, lambda: runner.model(*_inputs(runner, step, size, len(table))))


def _inputs(runner, step, rows: int, width: int):
    """The model's inputs for a made-up step, from an input batch of its own."""
    from actors.worker.input_batch import InputBatch
    batch = InputBatch(rows, width, runner.block_size, recurrent=runner.recurrent)
    batch.update(step)
    return batch.prepare(step, runner.device, runner.flash_ops, runner.triton)
