"""Engine settings: one dataclass, filled by the CLI, YAML configs or Python callers."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

SPECULATIVE_METHODS = ("ngram", "draft_model")
QUANTIZATIONS = ("int8", "fp8", "w8a8_int8")  # kernels/quantization.py
# --quantization values that name a checkpoint's own format (vLLM's spellings, its Marlin
# kernels' names too) -> the quant_method its config must have: checked, then loaded as usual
CHECKPOINT_FORMATS = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                      "compressed-tensors": "compressed-tensors", "fbgemm_fp8": "fbgemm_fp8",
                      "modelopt": "modelopt", "modelopt_fp4": "modelopt", "mxfp4": "mxfp4", "gguf": "gguf"}
# On 2 CPU cores a decode step of 64 rows on the bench model takes ~50 ms: 75 ms leaves room
# for ~85 prompt tokens a step, and chunk gaps stayed near 100 ms at p99 (docs/benchmarks.md).
DEFAULT_CPU_ITL_TARGET_MS = 75.0
STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # --mamba-cache-dtype / --mamba-ssm-cache-dtype
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's / SGLang's spellings; fp8 means e4m3 (kernels/kv_quant.py)

# vLLM options whose only meaning in shoal is its own way: the values that ask for it, and why
# another is refused
VLLM_FIXED = {
    "load_format": (("auto", "safetensors", "pt", "gguf"),
                    "shoal reads the checkpoint's own files (safetensors, .bin, GGUF): auto, safetensors, pt or gguf"),
    "tokenizer_mode": (("auto", "hf"), "shoal loads transformers' tokenizer for the checkpoint (auto or hf)"),
    "enable_chunked_prefill": ((True,), "shoal always chunks prompts (--max-num-batched-tokens sets a step's budget)"),
    "distributed_executor_backend": (("ray",), "shoal's shards are Ray actors (ray)"),
    "cpu_offload_gb": ((0, 0.0), "shoal keeps the weights on the device (0)"),
}

# The engine options' other spellings (vLLM's, SGLang's), by canonical name. app/config.py adds
# the serving options' to make the one table the CLI, YAML files and SHOAL_* variables read;
# `LLM(**options)` reads these (vLLM's `LLM(model=..., tensor_parallel_size=..., enforce_eager=...)`).
ENGINE_ALIASES: dict[str, tuple[str, ...]] = {
    "model_path": ("model", "model_name_or_path"),
    "tokenizer": ("tokenizer_path",),  # (SGLang's)
    "num_kv_blocks": ("num_gpu_blocks_override",),
    "gpu_memory_utilization": ("mem_fraction_static",),
    "max_num_batched_tokens": ("chunked_prefill_size", "max_prefill_tokens"),
    "max_model_len": ("context_length",),  # (SGLang's)
    "seed": ("random_seed",),  # (SGLang's)
    "scheduling_policy": ("schedule_policy",),  # (SGLang's; of its policies shoal has fcfs)
    "max_num_seqs": ("max_running_prompts", "max_running_requests"),
    "attn_backend": ("attention_backend",),
    "tp_size": ("tensor_parallel_size", "tp"),
    "pp_size": ("pipeline_parallel_size", "pp"),
    "enable_expert_parallel": ("enable_ep",),
    "ep_size": ("expert_parallel_size", "ep"),
    "num_redundant_experts": ("ep_num_redundant_experts",),
    "eplb_step_interval": ("eplb_rebalance_num_iterations",),
    "eager_decode": ("enforce_eager", "disable_cuda_graph"),
    "mamba_ssm_cache_dtype": ("mamba_ssm_dtype",),
}
# Spellings of a boolean option that mean its opposite: SGLang's `disable_radix_cache` turns
# prefix caching off.
NEGATED_ALIASES: dict[str, tuple[str, ...]] = {
    "enable_prefix_caching": ("disable_radix_cache",),
    "async_scheduling": ("disable_overlap_schedule",),
    "eager_decode": ("enable_torch_compile",),  # (SGLang's: compiled decode is shoal's default)
}
# Other spellings of values, by option: `bf16` means bfloat16.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "dtype": {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
              "fp32": "float32"},
}


def engine_options(options: dict) -> dict:
    """Python keyword options under their canonical names (`tensor_parallel_size` -> tp_size,
    `disable_radix_cache=True` -> enable_prefix_caching=False); other names pass as they are
    (EngineConfig refuses unknown ones). TypeError where two spellings name one option."""
    spellings = {alias: (name, False) for name, aliases in ENGINE_ALIASES.items() for alias in aliases}
    spellings.update({alias: (name, True) for name, aliases in NEGATED_ALIASES.items() for alias in aliases})
    out, given = {}, {}
    for key, value in options.items():
        name, negated = spellings.get(key, (key, False))
        if name in out:
            raise TypeError(f"{given[name]!r} and {key!r} both set the option {name}")
        given[name] = key
        if negated:
            value = not value
        elif isinstance(value, str) and name in VALUE_ALIASES:
            value = VALUE_ALIASES[name].get(value, value)
        out[name] = value
    return out


@dataclass
class EngineConfig:
    model_path: str | None = None  # None: the bundled demo model
    tokenizer: str | None = None  # vLLM's --tokenizer: another checkpoint's tokenizer; None: model_path's
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # int8 | fp8 | w8a8_int8: 8-bit linear layers, online (kernels/quantization.py); or the
    # checkpoint's own format by name (CHECKPOINT_FORMATS)
    quantization: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    # KV cache
    block_size: int | None = None  # None: 16, or 256 where the flash backend is flash-attn (its paged minimum)
    num_kv_blocks: int | None = None  # overrides the memory-based size
    kv_cache_memory: float | None = None  # GiB; overrides the memory-based size
    kv_cache_fraction: float = 0.3  # CPU: this fraction of the available RAM holds the KV cache
    # CUDA (vLLM's meaning): this fraction of the device's total memory is this rank's for weights,
    # activations (measured by a profiling forward), CUDA graphs and the KV cache, which gets the rest.
    gpu_memory_utilization: float = 0.9
    # auto: K/V cached in the model's dtype; fp8 / fp8_e4m3: one byte per element, float8 e4m3
    # with one K and one V scale per layer (the checkpoint's k_scale / v_scale, else 1.0)
    kv_cache_dtype: str = "auto"
    # Hybrid models' per-sequence states (actors/models/hybrid.py), vLLM's names: the convolutions'
    # (and, unless mamba_ssm_cache_dtype says otherwise, the recurrent states') dtype; auto: the
    # model's for the convolutions, the checkpoint's mamba_ssm_cache_dtype or float32 for the states
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # Scheduling
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # While streams decode, prompt chunks are sized so a step takes about this long
    # (actors/core/step_times.py). None: 75 ms on CPU, off on CUDA; 0: off (the full token budget)
    itl_target_ms: float | None = None
    scheduling_policy: str = "fcfs"  # fcfs | priority
    max_queued_requests: int | None = 256  # requests waiting to start; over it, new ones get 429. None: no limit
    # Compute
    attn_backend: str = "auto"  # auto (CUDA: flash where it can run, else triton; CPU: native) | native | flash | triton
    # Decode-only steps as CUDA graphs (one per batch-size bucket, padded inputs) or, on CPU,
    # through torch.compile (one dynamic-shape graph: actors/worker/compiled_decode.py).
    eager_decode: bool = False  # True: neither (vLLM's --enforce-eager); so does SHOAL_EAGER_DECODE=1
    cuda_graph_sizes: list[int] | None = None  # vLLM's meaning: None, one max size N, or the exact sizes
    max_seq_len_to_capture: int = 8192  # decodes with a longer context run eagerly
    # Process a step's outputs while the next step runs on the GPU (vLLM's --async-scheduling,
    # SGLang's overlap scheduler): outputs leave one step later. None: on where the device is CUDA.
    async_scheduling: bool | None = None
    num_threads: int | None = None  # rank 0's torch threads; None: the CPUs Ray gave it (Serve) or torch's default
    # Parallel layout: tp x pp ranks per model instance; rank 0 lives in the scheduler process
    tp_size: int = 1
    pp_size: int = 1
    pp_layer_split: str | None = None  # layers per stage, e.g. "5,3"; None: even
    placement_strategy: str | None = None  # None: STRICT_PACK if it fits one node, else PACK
    shard_cpus: float = 1.0  # CPUs reserved per shard (rank)
    shard_gpus: float | None = None  # GPUs per rank; None: 1 on CUDA, 0 on CPU (actors/executor/placement.py)
    # Seconds for shards to start and join, and for one step's collectives; never the idle wait.
    dist_timeout: float = 120.0
    watchdog_timeout: float = 300.0  # seconds one step may take before the engine is declared dead; 0: off
    # Mixture of experts: expert parallelism splits the experts over each stage's TP group
    enable_expert_parallel: bool = False
    ep_size: int | None = None  # SGLang's spelling: must equal tp_size (implies expert parallelism)
    num_redundant_experts: int = 0  # extra expert slots that hold copies of the hottest experts
    eplb_window_size: int = 1000  # forward steps of routed-token counts kept for stats and re-planning
    eplb_step_interval: int = 0  # re-plan the expert placement every N steps; 0: never
    # LoRA adapters (vLLM's names): slots are allocated at start-up on every rank
    enable_lora: bool = False  # implied by lora_modules; needed to load adapters at run time
    lora_modules: list[str] | None = None  # "name=path" adapters registered at start
    max_loras: int = 1  # adapter slots: adapters in one batch (more registered ones take turns, LRU)
    max_lora_rank: int = 16  # the largest adapter rank the slots hold
    # Speculative decoding, vLLM's JSON: {"method": "ngram", "num_speculative_tokens": 3,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": PATH, "num_speculative_tokens":
    # 3} (a draft model; actors/core/speculation.py). None: off
    speculative_config: dict | None = None  # (or its JSON text)
    # Metrics: histogram bucket bounds in seconds ("0.05,0.1,0.5" or a list); None: defaults
    metrics_ttft_buckets: list[float] | None = None  # time to first token
    metrics_itl_buckets: list[float] | None = None  # inter-token latency
    metrics_e2e_buckets: list[float] | None = None  # end-to-end request latency
    # vLLM's options for what shoal always does one way (VLLM_FIXED): a vLLM command line or
    # LLM(...) call runs unchanged; asking for another way is refused in one line.
    trust_remote_code: bool = False  # a tokenizer's own code (transformers' trust_remote_code)
    load_format: str = "auto"  # auto | safetensors | pt | gguf: the checkpoint's files decide
    tokenizer_mode: str = "auto"  # auto | hf: transformers' tokenizer
    enable_chunked_prefill: bool = True
    distributed_executor_backend: str = "ray"
    cpu_offload_gb: float = 0.0
    swap_space: float = 4.0  # GiB of CPU swap a preempted request may use: none is (it is recomputed)

    def __post_init__(self):
        # Bucket options may come as "0.1,0.5" (CLI, environment): lists from here on, so
        # nothing changes the config after validation.
        for name in ("metrics_ttft_buckets", "metrics_itl_buckets", "metrics_e2e_buckets"):
            setattr(self, name, check_buckets(name, getattr(self, name)))
        if isinstance(self.speculative_config, str) and self.speculative_config.strip():  # JSON text
            try:
                self.speculative_config = json.loads(self.speculative_config)
            except ValueError:
                raise ValueError(f"--speculative-config must be a JSON object, got "
                                 f"{self.speculative_config!r}") from None
        if isinstance(self.lora_modules, str):  # "a=/x,b=/y" from an environment variable
            self.lora_modules = [m.strip() for m in self.lora_modules.split(",") if m.strip()]
        if self.lora_modules:
            self.enable_lora = True
        if isinstance(self.cuda_graph_sizes, (str, int)):  # "1,2,4" / 8 from the environment or YAML
            self.cuda_graph_sizes = str(self.cuda_graph_sizes).split(",")
        if self.cuda_graph_sizes is not None:
            try:
                self.cuda_graph_sizes = [int(str(x).strip()) for x in self.cuda_graph_sizes if str(x).strip()]
            except ValueError:
                raise ValueError(f"--cuda-graph-sizes takes batch sizes (integers), "
                                 f"got {self.cuda_graph_sizes!r}") from None

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config parsed (None: off)."""
        return SpeculativeConfig.parse(self.speculative_config)

    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as {name: path}: each "name=path" or vLLM's JSON {"name", "path"}."""
        out = {}
        for item in self.lora_modules or []:
            if isinstance(item, dict):
                name, path = item.get("name"), item.get("path")
            elif item.lstrip().startswith("{"):
                spec = json.loads(item)
                name, path = spec.get("name"), spec.get("path")
            else:
                name, _, path = item.partition("=")
            if not name or not path:
                raise ValueError(f"--lora-modules entries are name=path, got {item!r}")
            out[name.strip()] = path.strip()
        return out

    def itl_target_seconds(self, device_type: str) -> float:
        """--itl-target-ms resolved for a device: 0.0 when off."""
        if self.itl_target_ms is None:
            return DEFAULT_CPU_ITL_TARGET_MS / 1e3 if device_type == "cpu" else 0.0
        return self.itl_target_ms / 1e3

    @property
    def expert_parallel(self) -> bool:
        return self.tp_size > 1 and (self.enable_expert_parallel or (self.ep_size or 1) > 1)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS, *CHECKPOINT_FORMATS):
            raise ValueError(f"--quantization must be one of {', '.join((*QUANTIZATIONS, *CHECKPOINT_FORMATS))}, "
                             f"got {self.quantization!r}")
        for option in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(self, option) not in STATE_DTYPES:
                raise ValueError(f"--{option.replace('_', '-')} must be one of {', '.join(STATE_DTYPES)}, "
                                 f"got {getattr(self, option)!r}")
        for option, (allowed, why) in VLLM_FIXED.items():
            if getattr(self, option) not in allowed:
                raise ValueError(f"--{option.replace('_', '-')} {getattr(self, option)!r}: {why}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.attn_backend not in ("auto", "native", "flash", "triton"):
            raise ValueError(f"--attn-backend must be auto, native, flash or triton, got {self.attn_backend!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "num_threads", "max_queued_requests", "max_seq_len_to_capture"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.itl_target_ms is not None and self.itl_target_ms < 0:
            raise ValueError(f"--itl-target-ms must be >= 0 (0: off), got {self.itl_target_ms}")
        if self.watchdog_timeout < 0:
            raise ValueError(f"--watchdog-timeout must be >= 0 (0: off), got {self.watchdog_timeout}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"--kv-cache-fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be a positive number of GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1):
            raise ValueError(f"--cuda-graph-sizes must be positive batch sizes, got {self.cuda_graph_sizes}")
        if self.max_num_batched_tokens < (self.block_size or 16):
            raise ValueError("--max-num-batched-tokens must be at least --block-size")
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("--tp-size and --pp-size must be at least 1")
        if self.placement_strategy not in (None, "STRICT_PACK", "PACK", "STRICT_SPREAD", "SPREAD"):
            raise ValueError("--placement-strategy must be STRICT_PACK, PACK, STRICT_SPREAD or SPREAD")
        if self.shard_cpus <= 0 or (self.shard_gpus or 0) < 0 or self.dist_timeout <= 0:
            raise ValueError("--shard-cpus and --dist-timeout must be positive, --shard-gpus >= 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("--num-kv-blocks must be at least 2")
        self._validate_experts()
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        self.lora_module_paths()
        self.speculative  # noqa: B018 - raises on a bad --speculative-config

    def _validate_experts(self) -> None:
        if self.ep_size is not None and self.ep_size not in (1, self.tp_size):
            raise ValueError(f"--ep-size {self.ep_size} must equal --tp-size {self.tp_size}: "
                             f"the experts are split over each stage's tensor-parallel group")
        if self.num_redundant_experts < 0 or self.eplb_step_interval < 0 or self.eplb_window_size < 1:
            raise ValueError("--num-redundant-experts and --eplb-step-interval must be >= 0, "
                             "--eplb-window-size >= 1")
        if (self.num_redundant_experts or self.eplb_step_interval) and not self.expert_parallel:
            raise ValueError("--num-redundant-experts and --eplb-step-interval need expert parallelism "
                             "(--enable-expert-parallel with --tp-size > 1)")


@dataclass
class SpeculativeConfig:
    """--speculative-config, in vLLM's JSON spelling."""
    method: str = "ngram"  # ngram | draft_model (implied by `model`)
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # More running sequences than this: no row proposes (None: the default for the device).
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model's checkpoint (it shares the target's tokenizer)
    draft_tensor_parallel_size: int = 1  # the draft runs unsharded beside rank 0

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """The option's dict (EngineConfig turns JSON text into one); None or {}: off."""
        if not value:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r}")
        value = dict(value)
        if value.get("model") and "method" not in value:  # vLLM infers the method from the model
            value["method"] = "draft_model"
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        config = cls(**value)
        config._check()
        return config

    def _check(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("--speculative-config: the method draft_model needs \"model\", the draft's checkpoint")
        if self.method == "ngram" and self.model:
            raise ValueError("--speculative-config: \"model\" is for a draft model (method draft_model), not ngram")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError("--speculative-config: draft_tensor_parallel_size must be 1 (the draft runs "
                             "unsharded beside rank 0)")
        # vLLM's defaults: one bound given sets the other; none gives 5 and 5.
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        self.prompt_lookup_min = lo if lo is not None else (hi if hi is not None else 5)
        self.prompt_lookup_max = hi if hi is not None else self.prompt_lookup_min
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"is above prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("--speculative-config: disable_by_batch_size must be at least 1")


def check_buckets(name: str, value) -> list[float] | None:
    """A bucket option as a sorted list of positive floats (accepts "0.1,0.5" too)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    flag, shown = "--" + name.replace("_", "-"), ",".join(str(v).strip() for v in items)
    try:
        bounds = [float(v) for v in items if str(v).strip()]
    except ValueError:
        raise ValueError(f"{flag} must be numbers, got {shown!r}") from None
    if not bounds or bounds[0] <= 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{flag} must be increasing positive numbers, got {shown!r}")
    return bounds
