"""One structured line per HTTP request (logfmt: key=value pairs), written by the middleware.

`EngineSummary` collects what the engine requests behind one HTTP request did (tokens, time
to first token, finish reasons, which replicas ran them) from the outputs the route sees;
the middleware adds method, path, status and total time, e.g.

    request request_id=req-1f.. method=POST path=/v1/chat/completions status=200
        total_ms=412.3 prompt_tokens=12 generation_tokens=24 ttft_ms=31.0 queue_ms=0.4
        finish_reason=length replica=a1b2c3

Bodies (prompts, outputs) are separate lines, only with --log-requests 2 or more
(request_context.py).
"""
from __future__ import annotations

import json


def logfmt(fields: dict) -> str:
    """key=value pairs; values with spaces, quotes or '=' are JSON-quoted."""
    parts = []
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, float):
            text = f"{value:.1f}"
        else:
            text = str(value)
            if not text or any(c in text for c in ' "=\n\t'):
                text = json.dumps(text, ensure_ascii=False)
        parts.append(f"{key}={text}")
    return " ".join(parts)


class EngineSummary:
    def __init__(self):
        self.prompts: set[int] = set()  # prompt indexes already counted
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finish_reasons: dict[str, None] = {}  # ordered set
        self.replicas: dict[str, None] = {}
        self.ttft: float | None = None  # the earliest engine TTFT among the prompts
        self.queue_time: float | None = None  # the longest queue time

    def add(self, batch: dict) -> None:
        """A batch of outputs by prompt index: deltas (streams) or cumulative ones (complete),
        each token seen once either way."""
        for index, output in batch.items():
            if index not in self.prompts:
                self.prompts.add(index)
                self.prompt_tokens += len(output.prompt_token_ids)
            for out in output.outputs:
                self.generation_tokens += len(out.token_ids)
                if out.finish_reason:
                    self.finish_reasons[out.finish_reason] = None
            if output.metrics is not None:
                self._add_timing(output.metrics)

    def _add_timing(self, m) -> None:
        self.replicas[m.replica] = None
        if m.ttft is not None:
            self.ttft = m.ttft if self.ttft is None else min(self.ttft, m.ttft)
        self.queue_time = max(self.queue_time or 0.0, m.queue_time)

    def fields(self) -> dict:
        if not self.prompts:
            return {}
        return {"prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                "ttft_ms": _ms(self.ttft), "queue_ms": _ms(self.queue_time),
                "finish_reason": ",".join(self.finish_reasons) or None,
                "replica": ",".join(self.replicas) or None}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds
