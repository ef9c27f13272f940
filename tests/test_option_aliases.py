"""One alias table (app/config.py ALIASES) for every option spelling: whatever `shoal serve`
takes on the command line means the same option in `build_app` / `serve run` args, a YAML
file and SHOAL_* variables. Fast: parsers and load_config only, no Ray, no model."""
from __future__ import annotations

import argparse

import pytest
import yaml

from app.cli.engine_args import SINGLE_DASH, option_flags
from app.cli.main import build_parser
from app.cli.serve import ACTIONS
from app.config import (
    ALIASES, NEGATED_ALIASES, VALUE_ALIASES, ConfigError, canonical, load_config, option_types,
)

# Per option with aliases: a value other than the default, and the options it needs beside it
# to pass validation (expert options need expert parallelism). Every table entry needs one.
SAMPLES = {
    "model_path": ("ckpt/dir", {}),
    "tokenizer": ("tok/dir", {}),
    "max_top_logprobs": (5, {}),
    "max_model_len": (256, {}),
    "seed": (7, {}),
    "scheduling_policy": ("priority", {}),
    "num_kv_blocks": (64, {}),
    "gpu_memory_utilization": (0.5, {}),
    "max_num_batched_tokens": (64, {}),
    "max_num_seqs": (4, {}),
    "attn_backend": ("native", {}),  # the serving default is flash
    "tp_size": (2, {}),
    "pp_size": (2, {}),
    "enable_expert_parallel": (True, {"tp_size": 2}),
    "ep_size": (2, {"tp_size": 2}),
    "num_redundant_experts": (1, {"tp_size": 2, "enable_expert_parallel": True}),
    "eplb_step_interval": (5, {"tp_size": 2, "enable_expert_parallel": True}),
    "num_replicas": (3, {}),
    "eager_decode": (True, {}),
    "mamba_ssm_cache_dtype": ("bfloat16", {}),
}
ALIAS_CASES = [(name, alias) for name, aliases in ALIASES.items() for alias in aliases]


def cli_words(flag: str, value) -> list[str]:
    return [flag] if value is True else [flag, str(value)]


def from_cli(argv: list[str]):
    """What `shoal serve ARGV` would run with (serve_command's own path to load_config)."""
    args = build_parser().parse_args(["serve", *argv])
    return load_config({k: v for k, v in vars(args).items() if k not in ACTIONS}, environ={})


def from_sources(spelling: str, value, context: dict, tmp_path) -> list:
    """The same option through build_app args, a YAML file, and SHOAL_* variables."""
    options = {**context, spelling: value}
    path = tmp_path / "options.yaml"
    path.write_text(yaml.safe_dump(options))
    env = {f"SHOAL_{k.upper()}": str(v) for k, v in options.items()}
    return [load_config(dict(options), environ={}), load_config({"config": str(path)}, environ={}),
            load_config({}, environ=env)]


def test_every_aliased_option_has_a_sample():
    assert set(SAMPLES) == set(ALIASES)


def test_aliases_are_not_option_names_and_not_ambiguous():
    spellings = [a for aliases in (*ALIASES.values(), *NEGATED_ALIASES.values()) for a in aliases]
    assert len(spellings) == len(set(spellings))
    assert not set(spellings) & set(option_types())
    assert set(ALIASES) | set(NEGATED_ALIASES) <= set(option_types())


@pytest.mark.parametrize("name, alias", ALIAS_CASES)
def test_alias_means_the_same_option_everywhere(name, alias, tmp_path):
    value, context = SAMPLES[name]
    default = load_config(dict(context), environ={}).flat()[name]
    assert value != default
    context_argv = [w for k, v in context.items() for w in cli_words(option_flags(k)[0], v)]
    flags = [f"--{alias.replace('_', '-')}"] + ([f"-{alias}"] if alias in SINGLE_DASH else [])
    configs = [from_cli([*context_argv, *cli_words(flag, value)]) for flag in flags]
    configs += from_sources(alias, value, context, tmp_path)
    assert canonical(alias) == name
    assert [c.flat()[name] for c in configs] == [value] * len(configs)


@pytest.mark.parametrize("name, alias", [(n, a) for n, aliases in NEGATED_ALIASES.items()
                                         for a in aliases])
def test_negated_alias_turns_the_option_off(name, alias, tmp_path):
    assert from_cli([f"--{alias.replace('_', '-')}"]).flat()[name] is False
    assert [c.flat()[name] for c in from_sources(alias, True, {}, tmp_path)] == [False] * 3
    assert load_config({alias: False}, environ={}).flat()[name] is True


@pytest.mark.parametrize("alias, value", [(a, v) for aliases in VALUE_ALIASES.values()
                                          for a, v in aliases.items()])
def test_dtype_spellings_work_everywhere(alias, value, tmp_path):
    assert from_cli(["--dtype", alias]).engine.dtype == value
    assert [c.engine.dtype for c in from_sources("dtype", alias, {}, tmp_path)] == [value] * 3


def test_every_command_line_spelling_is_in_the_table():
    """No spelling lives only in argparse: each is the option's name, argparse's --no-NAME,
    or an alias from the table (which YAML and SHOAL_* then accept too)."""
    known = option_types()
    parsers = build_parser()._subparsers._group_actions[0].choices
    for command in ("serve", "run-batch"):
        for action in parsers[command]._actions:
            if action.dest not in known:
                continue
            table = {*ALIASES.get(action.dest, ()), *NEGATED_ALIASES.get(action.dest, ())}
            for flag in action.option_strings:
                spelling = flag.lstrip("-").replace("-", "_")
                if spelling == action.dest or (isinstance(action, argparse.BooleanOptionalAction)
                                               and flag.startswith("--no-")):
                    continue
                assert spelling in table, f"{command} {flag} is not in app/config.py ALIASES"


VLLM_COMMAND_LINE = ("--model ckpt/dir --tokenizer tok/dir --trust-remote-code --load-format safetensors "
                     "--tokenizer-mode auto --enable-chunked-prefill --distributed-executor-backend ray "
                     "--cpu-offload-gb 0 --swap-space 8 --disable-log-requests --disable-log-stats "
                     "--max-logprobs 5 --chat-template {{messages}} --gpu-memory-utilization 0.8").split()


def test_a_vllm_command_line_runs_unchanged():
    """The options vLLM users carry in their command lines: what shoal does (tokenizer,
    trust_remote_code, the logs, max_logprobs, chat template) takes effect; those naming what it
    always does are accepted at that value."""
    config = from_cli(VLLM_COMMAND_LINE)
    assert (config.engine.tokenizer, config.server.tokenizer) == ("tok/dir", "tok/dir")
    assert config.engine.trust_remote_code and config.server.trust_remote_code
    assert config.server.disable_log_requests and config.server.max_top_logprobs == 5
    assert config.server.chat_template == "{{messages}}" and config.engine.swap_space == 8


@pytest.mark.parametrize("words, message", [
    ("--no-enable-chunked-prefill", "--enable-chunked-prefill False: shoal always chunks prompts"),
    ("--cpu-offload-gb 4", "--cpu-offload-gb 4.0: shoal keeps the weights on the device"),
])
def test_a_vllm_option_asking_for_what_shoal_does_not_do_is_refused(words, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        from_cli(words.split())
    with pytest.raises((ConfigError, ValueError), match="--load-format 'dummy'"):
        load_config({"load_format": "dummy"}, environ={})


def test_unknown_spelling_is_still_refused():
    with pytest.raises(ConfigError, match="unknown option 'gpu_memory_utilisation'"):
        load_config({"gpu_memory_utilisation": 0.5}, environ={})
