"""Runs one engine step on the model: builds the batch tensors, runs the forward, samples.

It owns this rank's weights and KV pool (allocated once at start-up). The step arrives as a
SchedulerOutput (actors/core/scheduler.py): plain rows in the order the attention kernels want,
decodes first. Every rank builds its tensors from the same rows; rank 0 also samples.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from actors.config import EngineConfig
from actors.core.step import ScheduledSeq, SchedulerOutput, StepRow
from actors.core.structured import bitmask_width, fill_bitmasks
from actors.distributed.parallel import layout
from actors.distributed.pipeline import MicroBatch, run_stage
from actors.models.lora import attach_lora, load_adapter, lora_batch
from actors.worker import memory_profile
from actors.worker.compiled_decode import CompiledDecode, eager_by_environment
from actors.worker.cuda_graphs import DecodeGraphs, capture_sizes, graphs_off_reason
from actors.worker.expert_balancer import ExpertBalancer
from actors.worker.loader import build_model
from actors.worker.model_spec import ModelSpec
from actors.worker.process_tuning import keep_freed_memory
from kernels import flash_attention, native
from kernels.attention import AttentionMetadata
from kernels.sampling import SamplingBatch, sample, token_logprobs

log = logging.getLogger("shoal.runner")


@dataclass
class RunnerOutput:
    """Per scheduled sequence, in the SchedulerOutput's order."""
    tokens: list[int | None]  # the sampled token (None: a chunk in the middle of its prompt)
    logprobs: list[dict | None]  # {chosen: lp, alternatives...} when the request asked
    prompt_logprobs: list[list | None]  # per prompt position its chunk predicts


def pick_device(name: str) -> torch.device:
    """cpu, or this process's GPU: Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned the
    rank's actor, so that GPU is always index 0 here."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    if name == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device(name)


class ModelRunner:
    """This rank's shard of the model and of the KV pool. Rank 0 also samples."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, rank: int = 0, num_blocks: int | None = None):
        """num_blocks: the pool size rank 0 chose (the other ranks must match it)."""
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = spec.dtype
        self.eos_ids = spec.eos_ids
        self.p = layout(config, spec.layer_split, rank)
        self.p.device = self.device  # tensors that cross ranks live here
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cuda":  # what this rank may use is measured against this
            self.free_at_start, self.total_memory = torch.cuda.mem_get_info()
        else:
            keep_freed_memory()  # no page faults on every step's activations (actors/worker/process_tuning.py)
        self.args = spec.args
        self.max_model_len = spec.max_model_len
        self.model = build_model(spec.path, spec.hf_config, spec.dtype, self.device, spec.max_model_len, self.p,
                                 spec.weight_dtype)
        self.experts = None  # MoE models: expert load recording and placement re-planning
        if self.args.moe is not None:
            self.experts = ExpertBalancer(self.model, config.eplb_window_size, config.eplb_step_interval, spec.path)
        # Adapter slots (actors/models/lora.py), allocated before the KV pool is sized.
        self.lora_layers = attach_lora(self.model, config.max_loras, config.max_lora_rank) \
            if config.enable_lora else None
        self.block_size = spec.block_size
        self.flash_ops = flash_attention.load(spec.flash_library) if spec.attn_backend == "flash" else None
        self.graphs_off = graphs_off_reason(
            device_type=self.device.type, eager_decode=config.eager_decode or eager_by_environment(),
            world_size=self.p.world_size,
            lora=bool(self.lora_layers), moe=self.args.moe is not None)
        self.graph_sizes = capture_sizes(config.cuda_graph_sizes, config.max_num_seqs)
        self.graphs: DecodeGraphs | CompiledDecode | None = None  # decode-only steps
        self.num_blocks = num_blocks or self._num_kv_blocks(spec.max_model_len)
        self._allocate_kv_cache()
        if num_blocks and self.device.type == "cuda":  # a shard rank with rank 0's pool size
            memory_profile.check_pool_fits(self)
        if self.device.type == "cpu":  # build the CPU kernel now (before compiling decode with
            native.paged_decode_attention_op()  # it), not on the first request
        if self.graphs_off is not None:
            log.info("%s off: %s", "CUDA graphs" if self.device.type == "cuda" else "compiled decode",
                     self.graphs_off)
        elif self.device.type == "cuda":
            self._capture_graphs()
        else:
            self._compile_decode()
        # Grammar masks of one step's constrained rows, filled in place (nothing grows per step).
        self.bitmask = torch.zeros(config.max_num_seqs, bitmask_width(self.args.vocab_size),
                                   dtype=torch.int32)

    # ---- start-up -------------------------------------------------------------------
    def block_bytes(self) -> int:
        """Bytes of one KV block on this rank (its layers, its KV heads)."""
        per_token = 2 * self._local_kv_heads() * self.args.head_dim * self.dtype.itemsize
        return per_token * len(self.model.model.layers) * self.block_size

    def _local_kv_heads(self) -> int:
        return self.model.model.layers[0].self_attn.kvh if len(self.model.model.layers) else 0

    def _num_kv_blocks(self, max_model_len: int) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
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
        self.bind_kv_cache(self.num_blocks + (self.graphs_off is None))
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                 self.kv_cache.numel() * self.dtype.itemsize / 2**20)

    def bind_kv_cache(self, blocks: int | None) -> None:
        """A zeroed pool of `blocks` blocks as every layer's cache (None: drop it)."""
        layers = self.model.model.layers
        self.kv_cache = None if blocks is None else torch.zeros(
            len(layers), 2, blocks * self.block_size, self._local_kv_heads(), self.args.head_dim,
            dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            attn.k_cache, attn.v_cache = (None, None) if blocks is None else (self.kv_cache[i, 0], self.kv_cache[i, 1])

    def _capture_graphs(self) -> None:
        self.graphs = DecodeGraphs(
            self.model, self.graph_sizes, block_size=self.block_size,
            max_seq_len=min(self.config.max_seq_len_to_capture, self.max_model_len),
            spare_block=self.num_blocks, hidden_size=self.args.hidden_size, dtype=self.dtype,
            device=self.device, flash_ops=self.flash_ops)
        before = torch.cuda.mem_get_info()[0]
        self.graphs.capture()
        log.info("CUDA graphs took %.0f MiB", (before - torch.cuda.mem_get_info()[0]) / 2**20)

    def _compile_decode(self) -> None:
        # The capture sizes stop at the last multiple of 8: every batch up to --max-num-seqs runs compiled.
        sizes = [*self.graph_sizes, self.config.max_num_seqs]
        self.graphs = CompiledDecode(self.model, sizes=sizes, block_size=self.block_size, spare_block=self.num_blocks)
        try:
            self.graphs.compile()
        except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler: decode eagerly
            self.graphs, self.graphs_off = None, f"compiling failed ({type(e).__name__}: {str(e)[:300]})"
            log.warning("compiled decode off: %s", self.graphs_off)

    @property
    def graph_replays(self) -> int:
        """Decode steps run as CUDA graphs or compiled so far (0 where there are none)."""
        return self.graphs.replays if self.graphs is not None else 0

    # ---- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        return self._sample(output.seqs, self._forward(output))

    def _forward(self, output: SchedulerOutput) -> torch.Tensor | None:
        """Logits of output.logit_rows, in order."""
        if self.p.world_size == 1:
            self.load_adapters(output)
            if self.lora_layers:
                self.model.lora_state.batch = self.lora_batch(output)
            if isinstance(self.graphs, CompiledDecode) and self.graphs.can_run(output):
                return _rows(self.graphs.run(output), output.logit_rows)  # its graph ends with the LM head
            if self.graphs is not None and self.graphs.can_run(output):
                hidden = self.graphs.run(output)
            else:
                hidden = self.model(*self.prepare(output))
            return self.model.compute_logits(hidden[output.logit_rows]) if output.logit_rows else None
        return self.run_stage(output)  # the executor has broadcast the step to the other ranks

    @torch.inference_mode()
    def run_stage(self, output: SchedulerOutput) -> torch.Tensor | None:
        """This rank's share of a multi-rank step; rank 0 gets the logits back."""
        self.load_adapters(output)
        micro = [MicroBatch(*self.prepare(part), part.logit_rows, self.lora_batch(part))
                 for part in output.split(self.p.pp_size)]
        parts = run_stage(self.model, self.p, micro, self.args.hidden_size, self.args.vocab_size, self.dtype)
        parts = [x for x in parts if x is not None]
        return torch.cat(parts) if parts else None

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

    def prepare(self, output: SchedulerOutput):
        """input ids, positions and attention metadata of the step's rows."""
        ids, pos, slot_mapping = [], [], []
        bs = self.block_size
        for r in output.rows:
            end = r.start + len(r.token_ids)
            ids.extend(r.token_ids)
            pos.extend(range(r.start, end))
            slot_mapping.extend(r.block_table[p // bs] * bs + p % bs for p in range(r.start, end))
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slot_mapping, device=dev),
                                 num_decode_tokens=output.num_decodes, block_size=bs)
        if self.flash_ops is not None:
            meta.flash = flash_attention.build_metadata(
                [len(r.token_ids) for r in output.rows], [r.start + len(r.token_ids) for r in output.rows],
                [r.block_table for r in output.rows], output.num_decodes, bs, dev, self.flash_ops)
            return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta
        decodes, prefills = output.rows[:output.num_decodes], output.rows[output.num_decodes:]
        if decodes:
            ctx = torch.tensor([r.start + 1 for r in decodes], dtype=torch.int32)
            table = self._block_tables(decodes, int(ctx.max()))
            meta.decode_block_tables, meta.decode_context_lens = table.to(dev), ctx.to(dev)
        if prefills:
            self._prepare_prefills(meta, prefills, offset=len(decodes))
        return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta

    def _block_tables(self, rows: list[StepRow], length: int) -> torch.Tensor:
        """[B, blocks covering `length` keys] (padding points at block 0, masked)."""
        nblocks = -(-length // self.block_size)
        tables = [r.block_table[:nblocks] for r in rows]
        return torch.tensor([t + [0] * (nblocks - len(t)) for t in tables], dtype=torch.long)

    def _prepare_prefills(self, meta: AttentionMetadata, rows: list[StepRow], offset: int):
        """Each chunk's (first token row, tokens, first position) and its blocks."""
        chunks, row = [], offset
        for r in rows:
            chunks.append((row, len(r.token_ids), r.start))
            row += len(r.token_ids)
        meta.prefill_chunks = chunks
        length = max(r.start + len(r.token_ids) for r in rows)
        meta.prefill_block_tables = self._block_tables(rows, length).to(self.device)

    def _sample(self, seqs: list[ScheduledSeq], logits: torch.Tensor | None) -> RunnerOutput:
        n = len(seqs)
        out = RunnerOutput([None] * n, [None] * n, [None] * n)
        for i, s in enumerate(seqs):
            if s.prompt_logprobs:
                out.prompt_logprobs[i] = self._prompt_logprobs(s, logits[s.logits])
        sampling = [i for i, s in enumerate(seqs) if s.samples]
        if not sampling:
            return out
        samples = [seqs[i].seq for i in sampling]
        last = _rows(logits, [seqs[i].logits.stop - 1 for i in sampling])
        chosen = sample(last, self._sampling_batch(samples, last.shape[-1]))
        if any(sq.params.logprobs is not None for sq in samples):
            k = max((sq.params.logprobs or 0) for sq in samples)
            lp, top = _logprob_lists(*token_logprobs(last, chosen, k))
        tokens = chosen.tolist()  # one device read, not one per row (a sync each on a GPU)
        for row, (i, sq) in enumerate(zip(sampling, samples)):
            out.tokens[i] = tokens[row]
            if sq.params.logprobs is not None:
                out.logprobs[i] = _lp_dict(tokens[row], lp[row], top[row], sq.params.logprobs)
        return out

    def _prompt_logprobs(self, s: ScheduledSeq, logits: torch.Tensor) -> list:
        """Log-probs of the prompt tokens this chunk predicts (position p predicts token p+1)."""
        seq, k = s.seq, s.seq.params.prompt_logprobs
        targets = [seq.token_ids[p + 1] for p in range(s.start, s.start + s.num_tokens)
                   if p + 1 < seq.num_prompt_tokens]
        if not targets:
            return []
        rows = logits[:len(targets)]
        lp, top = _logprob_lists(*token_logprobs(rows, torch.tensor(targets, device=rows.device), k))
        return [_lp_dict(t, lp[r], top[r], k) for r, t in enumerate(targets)]

    def _sampling_batch(self, seqs, vocab: int) -> SamplingBatch:
        params = [s.params for s in seqs]
        dev = self.device
        f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)  # noqa: E731
        b = SamplingBatch(temperature=f([p.temperature for p in params]),
                          all_greedy=all(p.temperature == 0 for p in params))
        b.generators = [s.generator for s in seqs] if any(s.generator for s in seqs) else None
        if any(p.top_p < 1 for p in params):
            b.top_p = f([p.top_p for p in params])
        if any(p.top_k > 0 for p in params):
            # (a top_k past the vocabulary keeps every token, and must not overflow int64)
            b.top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=dev)
        if any(p.min_p > 0 for p in params):
            b.min_p = f([p.min_p for p in params])
        self._penalties(b, seqs, vocab)
        b.bias = self._bias(seqs, vocab)
        self._grammar_masks(b, seqs)
        return b

    def _grammar_masks(self, b: SamplingBatch, seqs) -> None:
        """Allowed-token bitmasks for the rows under a grammar; other rows stay free."""
        rows = [row for row, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return
        masks = self.bitmask[:len(seqs)]  # row r for batch row r; free rows are never read
        fill_bitmasks([seqs[row].matcher for row in rows], masks, rows)
        b.allowed, b.allowed_rows = masks, rows

    def _penalties(self, b: SamplingBatch, seqs, vocab: int) -> None:
        params = [s.params for s in seqs]
        dev = self.device
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            counts = torch.zeros(len(seqs), vocab, device=dev)
            for row, s in enumerate(seqs):
                out = s.output_token_ids
                if out:
                    counts[row].index_add_(0, torch.tensor(out, device=dev), torch.ones(len(out), device=dev))
            b.output_counts = counts
            b.presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            b.frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=dev)
            for row, s in enumerate(seqs):
                seen[row, torch.tensor(s.token_ids, device=dev)] = True
            b.seen = seen
            b.repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)

    def _bias(self, seqs, vocab: int) -> torch.Tensor | None:
        """Logit bias and min_tokens bans, as one additive [B, V] tensor."""
        rows = [(row, s) for row, s in enumerate(seqs)
                if s.params.logit_bias or s.num_output_tokens < s.params.min_tokens]
        if not rows:
            return None
        bias = torch.zeros(len(seqs), vocab, device=self.device)
        for row, s in rows:
            p = s.params
            for tok, value in (p.logit_bias or {}).items():
                if 0 <= int(tok) < vocab:
                    bias[row, int(tok)] += float(value)
            # A grammar decides alone when its output ends (banning its only allowed token,
            # the stop token, would leave nothing to sample).
            if s.num_output_tokens < p.min_tokens and s.matcher is None:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
                bias[row, [t for t in banned if 0 <= t < vocab]] = float("-inf")
        return bias


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for increasing row indices: x itself when they are all of its rows (a decode
    step's logits, ~1 MB copied twice a step otherwise)."""
    return x if len(rows) == len(x) else x[rows]


def _logprob_lists(chosen_lp: torch.Tensor, top_ids: torch.Tensor | None, top_lp: torch.Tensor | None):
    """token_logprobs' tensors as Python lists, read off the device once: [B] floats and, per
    row, the top-k (id, log-prob) pairs."""
    lp = chosen_lp.tolist()
    if top_ids is None:
        return lp, [()] * len(lp)
    return lp, [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist())]


def _lp_dict(chosen: int, chosen_lp: float, top: list[tuple[int, float]], k: int) -> dict:
    d = {chosen: chosen_lp}
    for token, value in top[:k]:
        d.setdefault(token, value)
    return d


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
