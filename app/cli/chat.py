"""`shoal chat` and `shoal complete`: talk to a server from the terminal, tokens as they come.

Both use the official openai client against `--url`. `shoal chat --model-path DIR` first
starts the API in this process (`embedded_api`) and then talks to that, so a remote and a
local model go through the same code. Ctrl-C during an answer stops it (closing the stream
aborts the request on the server) and keeps the conversation going.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

from app.cli.client import DEFAULT_URL, add_client_args, api_key, fail, model_name, openai_client
from app.cli.engine_args import add_engine_args, engine_config_or_exit

BANNER = "shoal chat: 'clear' starts a new conversation, 'quit' or 'exit' ends it"


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-t", "--temperature", type=float, default=None,
                        help="sampling temperature, 0 for greedy (default: the server's)")
    parser.add_argument("-k", "--top-k", type=int, default=None,
                        help="top-k sampling (default: off)")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="most tokens per answer (default: the server's)")


def add_chat_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "chat", allow_abbrev=False, help="chat with a model in the terminal",
        description="Interactive chat with streaming answers, against a running server "
                    "(--url) or a model loaded in this process (--model-path).")
    add_client_args(parser, url_default=None)
    parser.add_argument("-p", "--prompt", "-q", "--quick", dest="prompt", metavar="MESSAGE",
                        help="send one message, print the answer and exit")
    parser.add_argument("-s", "--system", "--system-prompt", dest="system", metavar="TEXT",
                        help="system prompt kept at the start of the conversation")
    add_sampling_args(parser)
    add_engine_args(parser)  # --model-path DIR and the engine options for the embedded engine
    parser.set_defaults(handler=chat_command)


def add_complete_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "complete", allow_abbrev=False, help="stream text completions from a running server",
        description="Complete a prompt (-q) or each line typed on standard input, streaming "
                    "the text from /v1/completions.")
    add_client_args(parser)
    parser.add_argument("-q", "--quick", "-p", "--prompt", dest="prompt", metavar="PROMPT",
                        help="complete one prompt and exit")
    add_sampling_args(parser)
    parser.set_defaults(handler=complete_command)


def sampling_options(args: argparse.Namespace) -> dict:
    """Only what the user set, so the server's defaults apply to the rest."""
    options = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    options = {k: v for k, v in options.items() if v is not None}
    if args.top_k is not None:  # a vLLM extra: the openai client passes it through extra_body
        options["extra_body"] = {"top_k": args.top_k}
    return options


# --------------------------------------------------------------------------- chat

@contextlib.contextmanager
def chat_server(args: argparse.Namespace):
    """The base URL to talk to: --url as given, or an embedded server for --model-path."""
    has_model = getattr(args, "model_path", None) is not None
    if has_model and args.url:
        sys.exit("shoal chat: error: give --url or --model-path, not both")
    if not has_model:
        yield args.url or DEFAULT_URL
        return
    config = engine_config_or_exit(args)
    print(f"loading {config.model_path} ...", file=sys.stderr, flush=True)
    with embedded_api(config) as url:
        yield url


@contextlib.contextmanager
def embedded_api(config):
    """Load the model of `config` (an EngineConfig), serve the API on loopback; yield the URL."""
    from app.api.app import ApiHost
    from app.api.embedded import serve_in_thread
    from app.api.engine_client import LocalEngineClient
    from app.api.settings import ServerSettings

    settings = ServerSettings(model_path=config.model_path)
    client = LocalEngineClient(config)
    try:
        app = ApiHost(settings).attach(client)
        with serve_in_thread(app) as url:
            yield url
    finally:
        client.shutdown()


def chat_command(args: argparse.Namespace) -> int:
    with chat_server(args) as url:
        client = openai_client(url, api_key(args))
        try:
            session = ChatSession(client, model_name(client, args.model_name), args.system,
                                  sampling_options(args))
            if args.prompt is not None:
                session.ask(args.prompt)
                return 0
            return chat_loop(session)
        except Exception as exc:
            return fail("chat", exc)


class ChatSession:
    """The conversation so far; `ask` streams one answer to stdout and keeps both turns."""

    def __init__(self, client, model: str, system: str | None, options: dict):
        self.client, self.model, self.system, self.options = client, model, system, options
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str) -> str:
        self.messages.append({"role": "user", "content": text})
        try:
            answer = stream_text(self.client.chat.completions.create(
                model=self.model, messages=self.messages, stream=True, **self.options), chat=True)
        except Exception:
            self.messages.pop()  # a failed turn leaves no half conversation behind
            raise
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def chat_loop(session: ChatSession) -> int:
    print(BANNER, flush=True)
    while True:
        try:
            line = input("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.lower() in ("quit", "exit"):
            return 0
        if line.lower() == "clear":
            session.clear()
            print("(conversation cleared)", flush=True)
        elif line:
            print("\nAssistant: ", end="", flush=True)
            try:
                session.ask(line)
            except Exception as exc:  # one failed turn (too long, server restarting) isn't the end
                print()
                fail("chat", exc)


def stream_text(stream, chat: bool) -> str:
    """Print each delta as it arrives; Ctrl-C closes the stream (the server aborts the request).
    Reasoning (servers with --reasoning-parser send it apart) is shown dimmed, not returned."""
    parts = []
    dim, plain = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    try:
        for chunk in stream:
            if not chunk.choices:
                continue  # the usage chunk
            choice = chunk.choices[0]
            if chat and getattr(choice.delta, "reasoning_content", None):
                print(f"{dim}{choice.delta.reasoning_content}{plain}", end="", flush=True)
            text = (choice.delta.content if chat else choice.text) or ""
            parts.append(text)
            print(text, end="", flush=True)
    except KeyboardInterrupt:
        print(" [stopped]", end="")
    finally:
        stream.close()
        print(flush=True)
    return "".join(parts)


# --------------------------------------------------------------------------- complete

def complete_command(args: argparse.Namespace) -> int:
    client = openai_client(args.url, api_key(args))
    try:
        model = model_name(client, args.model_name)
        prompts = [args.prompt] if args.prompt is not None else stdin_prompts()
        for prompt in prompts:
            stream_text(client.completions.create(model=model, prompt=prompt, stream=True,
                                                  **sampling_options(args)), chat=False)
        return 0
    except Exception as exc:
        return fail("complete", exc)


def stdin_prompts():
    while True:
        try:
            line = input("Prompt: ")
        except (EOFError, KeyboardInterrupt):
            return
        if line.strip():
            yield line
