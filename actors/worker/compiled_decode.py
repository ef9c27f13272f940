"""Decode steps through torch.compile on CPU: the CPU's counterpart of CUDA graphs.

Inductor fuses the elementwise work between the matmuls (RMSNorm, rotary, SiLU x up, the
residual adds) into C++ loops and drops most of the per-op dispatch, which is ~15-25% of an
eager decode step on CPU (docs/benchmarks.md). One graph serves every batch size and context
length (dynamic shapes). A step of two or more rows, all one-token decodes, runs through it.
So does a step with chunks of several tokens, each token as a decode row of its own
(input_batch.padded_decode): speculative verify chunks, and the short prompt chunks the
pacer puts beside the decodes (actors/core/step_times.py), where an eager step cost the
waiting streams ~20-35 ms more than the compiled one (docs/benchmarks.md). A step's logits are computed in the graph
for the rows sampled from only (an index input). Prompt chunks ending past MAX_CHUNK_CONTEXT
positions and steps of more rows than the largest bucket (2,048-token prefill chunks) run
eagerly (each decode row reads its whole context, where prefill attention shares it), and so
do steps of prompts alone and steps that give a prompt's log-probs (so /loglikelihood and echo
answer the same before and after the compiled step is loaded). A batch of one decode runs eagerly too: at one row MKL takes its
matrix-vector path, faster than any compiled 2-row step (14 vs 19 ms a step on the bench
model, docs/benchmarks.md).

torch.compile specialises sizes 0 and 1, so block tables are padded to at least 2 blocks
(with the spare block of the KV pool the block manager never hands out, as CUDA graphs pad:
actors/worker/input_batch.py), and the graph is traced on 2 padding rows that write to and read
from that block: every step then runs on the one graph.

The graph ends with the LM head. Its linear layers run through kernels/linear.py on the
weights the runner packed at start (actors/worker/kernel_choice.py): float32 on an AVX-512 CPU
through shoal's panel kernel, else through oneDNN, which builds and keeps a kernel (~0.6 MB)
for every row count it meets. So the rows are padded to the next of a few bucket sizes (CUDA
graphs' capture sizes: 2, 4, 8, then multiples of 8 up to --max-num-seqs, then multiples of
MIXED_BUCKET up to MIXED_ROWS past it for steps with prompt chunks): the kernels kept stay few
and the memory bounded, for at most 7 (31) padding rows of work.

Compiling is never paid at start-up, and never slows a run down (issue 46). Tracing and
inductor take 15-45 s of Python on 2 cores, and a compiling thread would hold the GIL against
the engine's (an eager step ran ~75x slower beside a busy thread), so:
- the compiled step is an artifact on disk (`torch.compile(...).aot_compile`, saved with the
  model as external data and no guards), named by a hash of everything it depends on
  (`artifact_path`): the model's config, dtype, KV cache dtype (and, for an fp8 cache, the
  checkpoint's KV scales, which the traced step holds as constants), block size, kernels, this
  CPU, torch, and shoal's model and kernel sources;
- without one, a process of its own compiles it at the lowest CPU priority (SCHED_IDLE)
  (actors/worker/compile_job.py: the model built without reading its weights) while the engine
  decodes eagerly; the job dies with the engine;
- loading it takes ~3 s (inductor's imports, its kernels' libraries), so the runner loads it
  when the engine has been idle a second, or once eager steps the compiled one could have run
  have taken SWAP_AFTER_S: a short offline run stays eager, a long one or a server switches.
  A start with the artifact on disk pays nothing either way.
`SHOAL_COMPILE_CACHE=DIR` moves the artifacts (default `~/.cache/shoal/compiled`);
`SHOAL_COMPILE_WAIT=1` makes start-up wait for the compiled step (benchmarks); `--eager-decode`
(or SHOAL_EAGER_DECODE=1, which the test suite sets) skips all of it. If compiling fails (no
C++ compiler, say), the engine logs why and goes on decoding eagerly.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from actors.core.step import SchedulerOutput
from actors.worker.cuda_graphs import padded_size
from actors.worker.input_batch import InputBatch, PaddedDecode, PendingTokens
from actors.worker.loader import checkpoint_kv_scales
from kernels.attention import AttentionMetadata
from kernels.linear import rows

log = logging.getLogger("shoal.runner")

MIN_ROWS = MIN_BLOCKS = 2  # below these torch.compile would specialise a second graph
# Eager decode steps the compiled step could have run, in seconds, before it is loaded mid-run:
# it saves 10-25% of such steps and its load takes ~3 s (a ski-rental rule: load once the
# eager steps have cost about what the load does). An idle engine loads it at once.
SWAP_AFTER_S = 20.0
# ... and before a busy engine starts its compile job: the job takes ~4% of the engine's steps
# while it runs (under SCHED_IDLE; docs/benchmarks.md), so a run shorter than this (an offline
# batch, say) never pays for a compile it would not live to use. An idle engine starts it at
# once. SHOAL_COMPILE_AFTER_S sets it (0: at start).
COMPILE_AFTER_S = 10.0
FORMAT = "shoal-compiled-decode-2"  # bump when the artifact's contents change meaning
# Token rows a step with chunks may have past --max-num-seqs, in buckets of MIXED_BUCKET: room
# for the prompt chunk the pacer gives a step beside its decodes (~70-200 tokens on 2 cores).
MIXED_ROWS, MIXED_BUCKET = 512, 32
# The last position a compiled prompt chunk may reach: each of its tokens reads its whole
# context as a decode row, 10-15% slower than prefill attention's shared read (a 128-token chunk
# on a Qwen2.5-0.5B layer, 2 cores: 11.5 against 10.3 ms at 2,048 positions), which at 24
# layers is about what the compiled step saves.
MAX_CHUNK_CONTEXT = 2048
REPO = Path(__file__).resolve().parents[2]
# The code a compiled step runs: the models and the kernels they call.
TRACED_SOURCES = ("actors/models", "kernels", "actors/worker/compiled_decode.py")
KERNEL_SWITCHES = ("SHOAL_NATIVE_KERNELS", "SHOAL_ONEDNN_LINEAR", "SHOAL_CPU_ATTENTION")


class CompiledDecode:
    """The compiled model of one runner; `run` takes the steps `compilable` accepts."""

    def __init__(self, fn, *, sizes: list[int], block_size: int):
        """sizes: the decode steps' row buckets (up to --max-num-seqs); the mixed steps' follow."""
        self.fn = fn  # (ids, positions, meta, logit index) -> logits, from `load`
        self.sizes = bucket_sizes(sizes)
        self.block_size = block_size
        self.replays = 0  # steps that ran compiled (the progress line's graph=True)

    def can_run(self, output) -> bool:
        return compilable(output, self.sizes[-1])

    def run(self, output, batch: InputBatch, pending: PendingTokens | None = None) -> torch.Tensor | None:
        """Logits of the step's output.logit_rows (the LM head is part of the graph); `pending`
        fills the input ids the previous step sampled."""
        tokens = sum(len(r.token_ids) for r in output.rows)
        width = max(MIN_BLOCKS, -(-max(r.start + len(r.token_ids) for r in output.rows) // self.block_size))
        padded = batch.padded_decode(output, padded_size(tokens, self.sizes), width)
        if pending is not None:
            pending.apply(padded.input_ids)
        wanted = len(output.logit_rows)
        logits = self.fn(*step_inputs(padded, self.block_size, logit_index(output.logit_rows, tokens, self.sizes)))
        self.replays += 1
        return logits[:wanted] if wanted else None  # (a prompt chunk's middle: nothing sampled)


def bucket_sizes(decode_sizes: list[int]) -> list[int]:
    """Row buckets: the decode steps' (at least MIN_ROWS), then multiples of MIXED_BUCKET up to
    MIXED_ROWS past the largest for steps with chunks."""
    sizes = {max(MIN_ROWS, s) for s in decode_sizes}
    top = max(sizes)
    return sorted(sizes | set(range(top // MIXED_BUCKET * MIXED_BUCKET + MIXED_BUCKET, top + MIXED_ROWS + 1,
                                    MIXED_BUCKET)))


def logit_index(rows: list[int], tokens: int, sizes: list[int]) -> torch.Tensor:
    """The token rows whose logits the graph computes, padded with row 0 to a bucket size (the
    head's kernels stay few), as an int64 tensor: all of them for a decode step."""
    size = padded_size(max(MIN_ROWS, len(rows)), sizes)
    if len(rows) == tokens:
        return torch.arange(size)
    index = torch.zeros(size, dtype=torch.long)
    index[:len(rows)] = torch.tensor(rows)
    return index


def compilable(output, max_rows: int) -> bool:
    """A step the compiled graph takes: 2 to max_rows token rows (input_batch.padded_decode),
    each a one-token decode or a token of a speculative verify chunk (every token sampled
    from), or else a step with decoding rows whose prompt chunks end within MAX_CHUNK_CONTEXT
    positions. A step of prompts alone runs eagerly: no stream waits on it between tokens. So
    does a step with a prompt's log-probs (/loglikelihood, echo): as decode rows its chunk's
    attention rounds otherwise than prefill's (~1e-5 in float32, ~0.05 nats in bfloat16), and its
    answer would change once the compiled step is loaded."""
    tokens = sum(len(r.token_ids) for r in output.rows)
    if not MIN_ROWS <= tokens <= max_rows or output.prompt_logprobs:
        return False
    if len(output.logit_rows) == tokens:  # decodes, verify chunks
        return True
    return output.num_decodes > 0 and all(
        r.start + len(r.token_ids) <= MAX_CHUNK_CONTEXT for r in output.rows[output.num_decodes:])


class PendingCompile:
    """The compiled step before it is in use: to compile (`spec`: its job not started yet), its
    job running (`job`), or its artifact on disk. The runner decodes eagerly meanwhile and counts
    what the compiled step would have taken (`eager_seconds`) to choose when starting the job
    and loading the step pay."""

    def __init__(self, path: Path, spec=None, start_after_s: float = COMPILE_AFTER_S):
        self.path, self.spec = path, spec  # spec: the model to compile, until its job starts
        self.start_after_s = start_after_s  # eager decode seconds before a busy engine starts the job
        self.job = None  # actors.worker.compile_job.BackgroundCompile
        self.eager_seconds = 0.0
        self.failure: str | None = None  # why there is no artifact, once the job has ended

    def ready(self) -> bool:
        """The job has ended (or there was none to run): the artifact, or `failure`, is there."""
        if self.spec is not None:
            return False
        if self.job is not None:
            if not self.job.done():
                return False
            self.failure = self.job.failure()
            if self.failure is None:
                log.info("compiled decode: compiled in the background in %.1f s", self.job.seconds)
            self.job = None
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self.job is not None:
            self.job.wait(timeout)


def step_inputs(p: PaddedDecode, block_size: int, logit_index: torch.Tensor):
    meta = AttentionMetadata(slot_mapping=p.slots, num_decode_tokens=p.size, block_size=block_size,
                             decode_block_tables=p.block_tables, decode_context_lens=p.context_lens)
    return p.input_ids, p.positions, meta, logit_index


def padding_inputs(batch: InputBatch, block_size: int):
    """Two padding rows on the spare block: what the graph is traced and checked on."""
    return step_inputs(batch.padded_decode(SchedulerOutput([], 0, []), MIN_ROWS, MIN_BLOCKS), block_size,
                       torch.arange(MIN_ROWS))


def _decode(model):
    # A closure over the model: saved as external data, so the artifact holds no weights.
    return lambda ids, positions, meta, logit_index: model.compute_logits(rows(model(ids, positions, meta), logit_index))


def _configure() -> None:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as shape_config

    inductor_config.compile_threads = 1  # compile in this process: no worker pool left behind
    # Sizes that happen to be equal when compiling (2 padding rows, the KV pool's K/V axis)
    # must not become one symbol, or the first real batch recompiles.
    shape_config.use_duck_shape = False
    # Float attributes (norm eps, embedding scales) as constants: symbolic floats made dynamo
    # trace the whole model twice (a restart in tensorifying them).
    dynamo_config.specialize_float = True
    # Round to bfloat16 / float16 after every op as eager does: without it inductor keeps float32
    # between fused ops, and a real model's outlier activations (the first token's, SmolLM2's in
    # bfloat16) then part from eager's logits by 8 of 28 and fail the load check. With it the
    # step equals eager bit for bit (docs/benchmarks.md: no slower).
    inductor_config.emulate_precision_casts = True


@torch.inference_mode()
def compile_to(model, batch: InputBatch, block_size: int, path: Path) -> None:
    """Trace and compile the decode step on padding rows and save it at `path` (atomically)."""
    _configure()
    # No guards saved: the runner makes every input the traced way (padded_decode), and
    # rebuilding dynamo's guards took ~2 s of every load.
    fn = torch.compile(_decode(model), dynamic=True, fullgraph=True,
                       options={"guard_filter_fn": lambda guards: [False] * len(guards)}).aot_compile(
        (padding_inputs(batch, block_size), {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    fn.save_compiled_function(str(path), external_data={"model": model})


@torch.inference_mode()
def load(model, batch: InputBatch, block_size: int, path: Path):
    """The saved step, bound to this model; checked against the eager model on padding rows.
    Raises if it can't be loaded or disagrees."""
    _configure()
    with open(path, "rb") as f:
        fn = torch.compiler.load_compiled_function(f, external_data={"model": model})
    inputs = padding_inputs(batch, block_size)
    got, want = fn(*inputs), _decode(model)(*inputs)
    error = (got.float() - want.float()).abs().max().item()
    if not error <= 1e-2 * want.float().abs().max().item() + 1e-4:
        raise ValueError(f"the compiled step's logits differ from the eager model's by {error:.3g}")
    return fn


def artifact_path(spec, kernels, block_size: int) -> Path:
    """Where this model's compiled step is kept: named by a hash of everything it depends on."""
    h = hashlib.sha256()
    parts = [FORMAT, torch.__version__, _cpu(), json.dumps(spec.hf_config, sort_keys=True, default=str),
             str(spec.dtype), str(spec.weight_dtype), spec.quantization, spec.max_model_len, block_size, kernels.attention,
             kernels.linear, [os.environ.get(k) for k in KERNEL_SWITCHES]]
    if spec.checkpoint_layers_only:  # an int8 checkpoint's layers alone (not the head) are 8-bit
        parts.append("checkpoint-layers-only")
    if spec.kv_cache_dtype is not None:  # (parts unchanged for a float cache: its artifacts stay valid)
        parts += [str(spec.kv_cache_dtype), sorted(checkpoint_kv_scales(spec.path).items())]
    h.update(repr(parts).encode())
    for name in TRACED_SOURCES:
        root = REPO / name
        for file in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            h.update(file.read_bytes())
    cache = Path(os.environ.get("SHOAL_COMPILE_CACHE") or Path.home() / ".cache" / "shoal" / "compiled")
    return cache / f"decode-{h.hexdigest()[:24]}.bin"


def _cpu() -> str:
    """This CPU's model and instruction sets (inductor's C++ targets them)."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return torch.backends.cpu.get_cpu_capability()
    return "\n".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))


def timed_load(model, batch: InputBatch, block_size: int, path: Path, sizes: list[int]) -> CompiledDecode:
    start = time.perf_counter()
    decode = CompiledDecode(load(model, batch, block_size, path), sizes=sizes, block_size=block_size)
    log.info("compiled decode ready: loaded %s in %.1f s", path.name, time.perf_counter() - start)
    return decode
