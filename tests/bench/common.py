"""Shared set-up for the benchmark scripts: the ~20M-parameter Llama-style random checkpoint."""
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints import make_checkpoint  # noqa: E402

BENCH_MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                   intermediate_size=1024, vocab_size=8000, max_position_embeddings=1024)


def bench_checkpoint(root: str = "/tmp/shoal-bench") -> Path:
    path = Path(root) / "llama-20m"
    if not (path / "config.json").exists():
        make_checkpoint(path, "llama", init_std=0.05, **BENCH_MODEL)
    return path


def workload(n: int = 64, lo: int = 32, hi: int = 256, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    """n prompts of random token ids with lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
