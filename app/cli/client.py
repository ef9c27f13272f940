"""What the client commands (`shoal chat`, `complete`, `bench serve`) share: the server URL,
the API key, the model name, and an OpenAI client built from them.

No torch, no engine here: these commands talk HTTP and should start in a blink.
"""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_URL = "http://127.0.0.1:8000/v1"


def add_client_args(parser: argparse.ArgumentParser, url_default: str | None = DEFAULT_URL) -> None:
    parser.add_argument("--url", default=url_default,
                        help=f"the server's OpenAI base URL (default {DEFAULT_URL}; /v1 is added "
                             "when missing)")
    parser.add_argument("--api-key", default=None,
                        help="bearer key (default: $SHOAL_API_KEY, then $OPENAI_API_KEY)")
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="model to ask for (default: the first one /v1/models lists)")


def base_url(url: str) -> str:
    """`http://host:8000`, `.../`, `.../v1` all mean the same server: end in /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def api_key(args: argparse.Namespace) -> str:
    # The openai client refuses an empty key; a server without auth ignores whatever we send.
    return args.api_key or os.environ.get("SHOAL_API_KEY") or os.environ.get("OPENAI_API_KEY") \
        or "EMPTY"


def openai_client(url: str, key: str):
    import openai
    return openai.OpenAI(base_url=base_url(url), api_key=key, max_retries=0)


def model_name(client, wanted: str | None) -> str:
    """`wanted`, or the first model the server lists (vLLM's `chat` does the same)."""
    if wanted:
        return wanted
    models = client.models.list().data
    if not models:
        raise RuntimeError("the server lists no models")
    return models[0].id


def fail(command: str, exc: BaseException) -> int:
    """One line on stderr for the errors a user can act on (server down, bad key, bad value)."""
    import openai
    if isinstance(exc, openai.APIConnectionError):
        why = f"cannot reach the server ({exc.__cause__ or exc})"
    elif isinstance(exc, openai.APIStatusError):
        why = f"the server answered {exc.status_code}: {error_message(exc)}"
    else:
        why = str(exc)
    print(f"shoal {command}: error: {why}", file=sys.stderr)
    return 1


def error_message(exc) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body)
    return error.get("message") if isinstance(error, dict) and error.get("message") else exc.message
