"""actors/worker/process_tuning.py: an engine's process keeps its start-up heap out of Python's
collector and keeps the memory its steps free (glibc)."""
import gc
import platform

import pytest

from actors.engine.llm import LLM
from actors.worker.process_tuning import keep_freed_memory


def test_an_engine_freezes_its_start_up_heap(llama_ckpt):
    gc.unfreeze()
    LLM(str(llama_ckpt), num_kv_blocks=16)
    assert gc.get_freeze_count() > 50_000  # torch, transformers, the model: never walked again
    assert gc.get_count()[2] == 0  # and the collector starts from an empty oldest generation


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_malloc_thresholds():
    assert keep_freed_memory() is True
