"""Runs one engine step on this rank's shard of the model: the batch's tensors, the forward,
and on rank 0 the sampling.

It owns this rank's weights, KV pool (allocated once at start-up) and input batch (the live
sequences' block tables, actors/worker/input_batch.py). A step arrives as a SchedulerOutput
(actors/core/step.py): the block-table changes, then plain rows in the order the attention
kernels want, decodes first. Every rank applies the changes and builds its tensors from the
same rows; rank 0 also samples (actors/worker/sampler.py). Which attention, linear and decode
kernels run was decided once at start (actors/worker/kernel_choice.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import torch

from actors.config import EngineConfig
from actors.core.step import RunnerOutput, SchedulerOutput
from actors.distributed.parallel import layout
from actors.distributed.pipeline import Heads, MicroBatch, last_stage_outputs, run_stage
from actors.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from actors.models.lora import attach_lora, load_adapter, lora_batch
from actors.worker import compiled_decode, memory_profile
from actors.worker.compile_job import BackgroundCompile
from actors.worker.compiled_decode import (COMPILE_AFTER_S, MIXED_ROWS, SWAP_AFTER_S, CompiledDecode, PendingCompile,
                                           compilable)
from actors.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from actors.worker.expert_balancer import ExpertBalancer
from actors.worker.input_batch import InputBatch, PendingTokens, pending_tokens
from actors.worker.kernel_choice import choose, device_type
from actors.worker.kv_pool import bind_kv_cache, bind_states, kv_bytes_per_token, state_bytes, state_dtypes
from actors.worker.loader import build_model
from actors.worker.model_spec import ModelSpec
from actors.worker.process_tuning import keep_freed_memory, release_freed_memory
from actors.worker.sampler import Sampler
from kernels import flash_attention, linear
from kernels.env import flag

log = logging.getLogger("shoal.runner")


def pick_device(config: EngineConfig) -> torch.device:
    """cpu, or this process's GPU: Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned the
    rank's actor, so that GPU is always index 0 here."""
    name = device_type(config)
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    if name == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device(name)


def compile_after_s() -> float:
    """Eager decode seconds before a busy engine starts its compile job (COMPILE_AFTER_S)."""
    try:
        return float(os.environ.get("SHOAL_COMPILE_AFTER_S", COMPILE_AFTER_S))
    except ValueError:
        return COMPILE_AFTER_S


class ModelRunner:
    """This rank's shard of the model and of the KV pool. Rank 0 also samples."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, rank: int = 0, num_blocks: int | None = None,
                 draft_block_bytes: int = 0):
        """num_blocks: the pool size rank 0 chose (the other ranks must match it);
        draft_block_bytes: rank 0 with a draft model, whose pool has as many blocks as this one."""
        self.draft_block_bytes = draft_block_bytes
        self.config = config
        self.device = pick_device(config)
        self.dtype = spec.dtype
        self.kv_dtype = spec.kv_dtype  # the KV pool's: dtype, or float8 e4m3 (--kv-cache-dtype fp8)
        self.p = layout(config, spec.layer_split, rank)
        self.p.device = self.device  # tensors that cross ranks live here
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cuda":  # what this rank may use is measured against this
            self.free_at_start, self.total_memory = torch.cuda.mem_get_info()
        else:
            keep_freed_memory()  # no page faults on every step's activations (actors/worker/process_tuning.py)
        self.args, self.hf_config = spec.args, spec.hf_config
        self.max_model_len = spec.max_model_len
        phase = time.perf_counter()
        self.startup: dict[str, float] = {}  # seconds per start-up phase, for the executor's log line
        self.model = build_model(spec.path, spec.hf_config, spec.dtype, self.device, spec.max_model_len, self.p,
                                 spec.weight_dtype, quantization=spec.quantization,
                                 checkpoint_layers_only=spec.checkpoint_layers_only)
        self.experts = None  # MoE models: expert load recording and placement re-planning
        if self.args.moe is not None:
            self.experts = ExpertBalancer(self.model, config.eplb_window_size, config.eplb_step_interval, spec.path)
        # Adapter slots (actors/models/lora.py), allocated before the KV pool is sized.
        self.lora_layers = attach_lora(self.model, config.max_loras, config.max_lora_rank) \
            if config.enable_lora else None
        phase = self._phase("weights", phase)
        self.kernels = choose(config, spec, self.device, self.p.world_size, lora=bool(self.lora_layers))
        if self.kernels.packs_weights:
            linear.prepack([m.weight for m in self.model.modules()
                            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))
                            and getattr(m, "int4", None) is None],
                           config.max_num_seqs,
                           embeddings=[m.weight for m in self.model.modules() if isinstance(m, VocabParallelEmbedding)])
        if self.device.type == "cpu":
            release_freed_memory()
        self.block_size = spec.block_size
        # Linear-attention layers' states, one per input-batch row, before the KV pool is sized
        self.recurrent = self.args.linear_attn is not None
        if self.recurrent:
            self._bind_states()
        self.flash_ops = flash_attention.load(spec.flash_library) if spec.attn_backend == "flash" else None
        self.triton = spec.attn_backend == "triton"
        self.graph_sizes = capture_sizes(config.cuda_graph_sizes, config.max_num_seqs)
        self.graphs: DecodeGraphs | CompiledDecode | None = None  # decode-only steps
        self.pending_compile: PendingCompile | None = None  # compiled decode not yet in use
        phase = self._phase("kernels", phase)
        self.num_blocks = num_blocks or self._num_kv_blocks(spec.max_model_len)
        self._allocate_kv_cache()
        if num_blocks and self.device.type == "cuda":  # a shard rank with rank 0's pool size
            memory_profile.check_pool_fits(self)
        # Graphs and compiled decode pad onto the spare block past the pool.
        spare = self.num_blocks if self.kernels.decode != "eager" else 0
        self.batch = InputBatch(config.max_num_seqs, max(2, -(-spec.max_model_len // self.block_size)),
                                self.block_size, pad_block=spare, recurrent=self.recurrent)
        phase = self._phase("KV", phase)
        if self.kernels.decode == "cuda-graphs":
            self._capture_graphs()
        elif self.kernels.decode == "compiled":
            self._compile_decode(spec)
        self._phase("decode", phase)
        if self.experts is not None:  # the memory profile's forward routed padding, not load
            self.experts.load.clear()
        log.info("rank %d %s", rank, self.kernels.describe())
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.device.type == "cuda"
        self.sampler = Sampler(self.args.vocab_size, config.max_num_seqs, spec.eos_ids, self.device,
                               defer=self.async_scheduling) if rank == 0 else None

    # ---- start-up -------------------------------------------------------------------
    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.startup[name] = now - since
        return now

    def describe_startup(self) -> str:
        """The phases in one phrase, e.g. "weights 2.1 s, kernels 0.3 s, KV 0.0 s, decode 0.0 s
        (compiling in the background)"."""
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.startup.items())
        pending = self.pending_compile
        state = (f"compiled in the background once idle or after {pending.start_after_s:g} s of eager decode"
                 if pending and pending.spec else "compiling in the background" if pending and pending.job else
                 "compiled step on disk, loaded when it pays" if pending else self.kernels.decode)
        return f"{phases} ({state})"

    def block_bytes(self) -> int:
        """Bytes of one KV block on this rank (its layers, its KV heads), with the draft
        model's block beside it (the pools are sized together)."""
        return kv_bytes_per_token(self.model, self.kv_dtype) * self.block_size + self.draft_block_bytes

    def _bind_states(self) -> None:
        """A state per sequence the engine may run at once: refused where they would take over half
        of what the GPU has free (each can be tens of MiB), not found out of memory."""
        rows, dtypes = self.config.max_num_seqs, state_dtypes(self.config, self.dtype, self.hf_config)
        need = state_bytes(self.model, rows, dtypes)
        if self.device.type == "cuda" and need > torch.cuda.mem_get_info()[0] // 2:
            raise ValueError(f"the linear-attention state of --max-num-seqs {rows} sequences needs "
                             f"{need / 2**30:.1f} GiB, over half the GPU memory free; lower --max-num-seqs")
        bind_states(self.model, rows, dtypes, self.device)
        log.info("linear-attention state: %d sequences, %.1f MiB (convolutions %s, states %s)", rows, need / 2**20,
                 *(str(dtypes[k]).removeprefix("torch.") for k in ("conv", "ssm")))

    def _num_kv_blocks(self, max_model_len: int) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if self.block_bytes() == 0:  # no layer keeps K/V (Mamba): blocks cost nothing, the scheduler counts them
            return c.max_num_seqs * (-(-max_model_len // self.block_size))
        if c.kv_cache_memory is not None:
            return max(2, int(c.kv_cache_memory * 2**30) // self.block_bytes())
        useful = c.max_num_seqs * (-(-max_model_len // self.block_size))  # more is never used
        if self.device.type == "cuda":
            return memory_profile.gpu_kv_blocks(self, useful)
        budget = int(_available_memory(self.device) * c.kv_cache_fraction)
        return max(2, min(budget // self.block_bytes(), useful))

    def _allocate_kv_cache(self) -> None:
        # With CUDA graphs or compiled decode one spare block past the pool takes the padding
        # rows' writes.
        self.bind_kv_cache(self.num_blocks + (self.kernels.decode != "eager"))
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)", self.num_blocks, self.block_size,
                 self.kv_cache.numel() * self.kv_dtype.itemsize / 2**20, str(self.kv_dtype).removeprefix("torch."))

    def bind_kv_cache(self, blocks: int | None) -> None:
        """A zeroed pool of `blocks` blocks as every layer's cache (None: drop it)."""
        self.kv_cache = bind_kv_cache(self.model, blocks, self.block_size, self.kv_dtype, self.device)

    def _capture_graphs(self) -> None:
        """Decode graphs, each captured once its batch size recurs (actors/worker/cuda_graphs.py)."""
        if self.experts is not None:
            self.experts.hold_graph_rows(self.graph_sizes[-1], self.device)
        self.graphs = DecodeGraphs(
            self.model, self.graph_sizes, self.batch, block_size=self.block_size,
            max_seq_len=min(self.config.max_seq_len_to_capture, self.max_model_len),
            hidden_size=self.args.hidden_size, dtype=self.dtype, device=self.device,
            flash_ops=self.flash_ops, triton=self.triton,
            around_capture=self.experts.paused if self.experts is not None else contextlib.nullcontext)

    def _compile_decode(self, spec: ModelSpec) -> None:
        """Decode eagerly until the compiled step pays for its compile and its load
        (actors/worker/compiled_decode.py): its job starts when the engine is first idle, or
        once eager steps have cost COMPILE_AFTER_S."""
        path = compiled_decode.artifact_path(spec, self.kernels, self.block_size)
        self.pending_compile = PendingCompile(path, None if path.exists() else spec, compile_after_s())
        if self.pending_compile.start_after_s <= 0:
            self._start_compiling()
        if flag("SHOAL_COMPILE_WAIT", False):  # benchmarks of the compiled step
            self.finish_compiling()

    def _start_compiling(self) -> None:
        pending = self.pending_compile
        if pending is None or pending.spec is None:
            return
        spec, pending.spec = pending.spec, None
        try:
            pending.job = BackgroundCompile(self.config, spec, self.block_size, pending.path)
        except OSError as e:  # a read-only cache, say
            self.pending_compile = None
            self._decode_eagerly(f"no compile job ({e})")

    def finish_compiling(self, timeout: float | None = None) -> None:
        """Compile (if not started yet), wait for the compiled step and swap it in now (tests,
        SHOAL_COMPILE_WAIT=1)."""
        self._start_compiling()
        if self.pending_compile is not None:
            self.pending_compile.wait(timeout)
            self._swap_in_compiled()

    def idle(self) -> None:
        """The engine has had nothing to do for a while: a good moment to start compiling the
        decode step or to load it, or to capture a decode bucket's CUDA graph."""
        if isinstance(self.graphs, DecodeGraphs):
            self.graphs.capture_next()
        self._start_compiling()
        self._swap_in_compiled()

    def _eager_decode_took(self, seconds: float) -> None:
        """A decode step the compiled one could have run took `seconds` eagerly."""
        pending = self.pending_compile
        pending.eager_seconds += seconds
        if pending.eager_seconds >= pending.start_after_s:
            self._start_compiling()
        if pending.eager_seconds >= SWAP_AFTER_S:
            self._swap_in_compiled()

    def _swap_in_compiled(self) -> None:
        pending = self.pending_compile
        if pending is None or not pending.ready():
            return
        self.pending_compile = None
        if pending.failure is None:
            # The capture sizes stop at the last multiple of 8: every batch up to --max-num-seqs runs compiled.
            sizes = [*self.graph_sizes, self.config.max_num_seqs]
            try:
                self.graphs = compiled_decode.timed_load(self.model, self.batch, self.block_size, pending.path, sizes)
                return
            except Exception as e:  # noqa: BLE001 - stale or broken: the next start compiles it again
                pending.path.unlink(missing_ok=True)
                pending.failure = f"its artifact did not load ({type(e).__name__}: {str(e)[:300]})"
        self._decode_eagerly(f"compiling failed ({pending.failure})")

    def _decode_eagerly(self, why: str) -> None:
        self.graphs, self.kernels = None, dataclasses.replace(self.kernels, decode="eager", decode_off=why)
        log.warning("compiled decode off: %s", why)

    @property
    def graphs_off(self) -> str | None:
        """Why decode steps run eagerly (None: as CUDA graphs, or compiled on CPU)."""
        return self.kernels.decode_off

    @property
    def graph_replays(self) -> int:
        """Decode steps run as CUDA graphs or compiled so far (0 where there are none)."""
        return self.graphs.replays if self.graphs is not None else 0

    def padded_rows(self, rows: int) -> int:
        """The token rows a step of `rows` computes: the compiled step's bucket where it pads
        (a step with decoding rows; CUDA graphs take decode-only steps, which are not paced)."""
        if isinstance(self.graphs, CompiledDecode):
            return padded_size(rows, self.graphs.sizes) or rows
        return rows

    # ---- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, previous: RunnerOutput | None = None) -> RunnerOutput:
        """Rank 0: the step on every rank (the executor has broadcast it), then sampling.
        previous: the step before, when this one was scheduled before its tokens were read
        (async scheduling, one rank): its placeholders' input ids come from its device tokens."""
        pending = pending_tokens(output, previous.sampled) if previous is not None else None
        logits, pooled = self.forward(output, pending)
        result = self.sampler(output.seqs, logits)
        if pooled is not None:
            sums = pooled.tolist()  # one device read for the step's embedding requests
            result.pooled = [sums[s.pool_span] if s.pool_span >= 0 else None for s in output.seqs]
        return result

    @torch.inference_mode()
    def forward(self, output: SchedulerOutput, pending: PendingTokens | None = None) -> Heads:
        """This rank's part of the step; rank 0 gets the logits of output.logit_rows and the
        sums of output.pool_spans, in order. The shard ranks run this for every step rank 0
        broadcasts."""
        self.batch.update(output)
        self.load_adapters(output)
        if self.p.world_size > 1:
            return self._pipeline(output)
        if self.lora_layers:
            self.model.lora_state.batch = self.lora_batch(output)
        # (a step that pools needs the hidden states, which a compiled graph does not return)
        if self.graphs is not None and not output.pool_spans and self.graphs.can_run(output):
            if isinstance(self.graphs, CompiledDecode):  # its graph ends with the LM head
                return self.graphs.run(output, self.batch, pending), None
            hidden = self.graphs.run(output, self.batch, pending)
            if self.experts is not None:
                self.experts.record_graph_rows(len(output.rows))
        else:
            timed = self.pending_compile is not None and compilable(output, self.config.max_num_seqs + MIXED_ROWS)
            start = time.perf_counter() if timed else 0.0
            hidden = self.model(*self.prepare(output, pending))
            if timed:
                self._eager_decode_took(time.perf_counter() - start)
        return last_stage_outputs(self.model, hidden, output.logit_rows, output.pool_spans)

    def _pipeline(self, output: SchedulerOutput) -> Heads:
        """A multi-rank step: micro-batches through this rank's pipeline stage."""
        micro = [MicroBatch(*self.prepare(part), part.logit_rows, self.lora_batch(part), part.pool_spans)
                 for part in output.split(self.p.pp_size)]
        heads = run_stage(self.model, self.p, micro, self.args.hidden_size, self.args.vocab_size, self.dtype)
        return _joined([logits for logits, _ in heads]), _joined([pooled for _, pooled in heads])

    def prepare(self, output: SchedulerOutput, pending: PendingTokens | None = None):
        """input ids, positions and attention metadata of the step's rows."""
        return self.batch.prepare(output, self.device, self.flash_ops, self.triton, pending)

    def expert_stats(self) -> dict | None:
        return self.experts.stats() if self.experts else None

    def load_adapters(self, output: SchedulerOutput) -> None:
        """Read the adapters the scheduler put into slots this step (every rank does)."""
        for slot, ref in output.lora_loads:
            load_adapter(self.model, self.lora_layers, slot, ref.path)
            log.info("LoRA adapter %s loaded into slot %d", ref.name, slot)

    def lora_batch(self, output: SchedulerOutput):
        """The step's token rows grouped by adapter slot, or None (no LoRA, or no row uses one)."""
        if not self.lora_layers or all(r.lora_slot < 0 for r in output.rows):
            return None  # a base-model step skips the per-token grouping
        slots = [r.lora_slot for r in output.rows for _ in r.token_ids]
        return lora_batch(slots, self.config.max_loras, self.dtype, self.device)


def _joined(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The micro-batches' rows in one tensor (None: none had any)."""
    parts = [x for x in parts if x is not None]
    return torch.cat(parts) if parts else None


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
