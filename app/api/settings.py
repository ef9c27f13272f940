"""HTTP-side server settings: what the API layer needs beyond the engine's EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.protocol.generation_defaults import CHOICES as GENERATION_CONFIG_CHOICES
from app.protocol.reasoning import reasoning_parser_name
from app.protocol.tool_parsers import tool_format

DEMO_MODEL_NAME = "shoal-demo"  # the bundled model's name (as `shoal run-batch` calls it)


@dataclass
class ServerSettings:
    model_path: str | None = None  # None: the bundled demo model
    tokenizer: str | None = None  # None: the checkpoint's own (vLLM's --tokenizer: another checkpoint's)
    # vLLM's / SGLang's --chat-template: a file, or the template itself, in place of the
    # tokenizer's (read once at start: replicas on other nodes get the text)
    chat_template: str | None = None
    trust_remote_code: bool = False  # (the engine's too) a tokenizer's own code may run
    disable_log_requests: bool = False  # vLLM's: the line each request logs goes to DEBUG
    disable_log_stats: bool = False  # vLLM's, accepted: shoal logs no periodic stats (--decode-progress-interval-s)
    served_model_name: str | None = None  # None: the checkpoint directory's name
    api_key: str | None = None  # None: no authentication
    allowed_origins: list[str] = field(default_factory=list)  # empty: CORS off
    default_max_tokens: int = 1024  # budget for requests that set none (capped by the context)
    disable_thinking: bool = False  # pass enable_thinking=False to chat templates
    log_requests: int = 0  # 0: one line per request; 1: + sampling params; 2: + text (cut); 3: all
    max_model_len: int | None = None  # None: taken from the engine client by `attach`
    # None: the model's (app/protocol/model_parsers.py, applied by `attach`), else for tool calls
    # the chat template's markup and for reasoning no split; "none": no reasoning split.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False  # vLLM's flag, accepted: tool_choice "auto" is always on
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1 | harmony (gpt-oss) | gemma4 | none
    # auto: sampling fields a request leaves unset take the model's generation_config.json
    # values (app/protocol/generation_defaults.py); vllm: the server's defaults only
    generation_config: str = "auto"
    # Request limits (app/api/limits.py): over one, a 400 naming the field (the body: 413).
    max_request_bytes: int = 16 * 2**20  # request body size
    max_n: int = 32  # n and best_of
    max_prompts: int = 256  # prompts in one /v1/completions, /v1/embeddings, /generate or /loglikelihood
    max_messages: int = 1024  # messages in one chat
    max_input_chars: int = 1_000_000  # characters of prompt or message text in one request
    max_logit_bias: int = 1024  # logit_bias entries
    max_top_logprobs: int = 20  # alternatives per token (top_logprobs; completions' logprobs)
    max_tokens_cap: int | None = None  # largest max_tokens; None: the model's context length
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters in one stop string
    max_tools: int = 128  # tools in one chat
    max_tool_schema_bytes: int = 65536  # one tool's parameter schema, as JSON

    def __post_init__(self):
        if not self.served_model_name:
            self.served_model_name = default_model_name(self.model_path)
        if isinstance(self.allowed_origins, str):  # "a,b" from an environment variable or flag
            self.allowed_origins = [o.strip() for o in self.allowed_origins.split(",") if o.strip()]
        self.allowed_origins = list(self.allowed_origins or [])
        if self.generation_config not in GENERATION_CONFIG_CHOICES:
            raise ValueError(f"--generation-config must be one of {', '.join(GENERATION_CONFIG_CHOICES)}, "
                             f"got {self.generation_config!r}")
        self.chat_template = chat_template_text(self.chat_template)
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be positive, got {self.default_max_tokens}")
        for name in ("max_request_bytes", "max_n", "max_prompts", "max_messages", "max_input_chars",
                     "max_stop_chars", "max_tool_schema_bytes", "max_tokens_cap"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        for name in ("max_logit_bias", "max_top_logprobs", "max_stop", "max_tools"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        check_parsers(self.tool_call_parser, self.reasoning_parser)

    def model_names(self) -> set[str]:
        """Names a request's `model` may use: the served name, or the path it was loaded from."""
        return {n for n in (self.served_model_name, self.model_path) if n}


def check_parsers(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Unknown parser names fail at start-up, with the choices, not on the first request."""
    for flag, check, name in (("--tool-call-parser", tool_format, tool_call_parser),
                              ("--reasoning-parser", reasoning_parser_name, reasoning_parser)):
        try:
            check(name)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None


def chat_template_text(value: str | None) -> str | None:
    """--chat-template's template: a file's text, or the value itself where it is a Jinja
    template (vLLM reads both); ValueError (one line) for anything else."""
    if value is None or "{%" in value or "{{" in value:
        return value
    try:
        return Path(value).expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template: cannot read {value} ({exc.strerror}); give a template file "
                         "or the template itself") from None


def default_model_name(model_path: str | None) -> str:
    return Path(model_path).name if model_path else DEMO_MODEL_NAME
