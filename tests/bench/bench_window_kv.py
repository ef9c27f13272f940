"""KV blocks a sliding-window model holds on a long generation: 4 sequences of 20 prompt + 1,500
generated tokens on a tiny Mistral with a window of 64, blocks of 16, in a pool of 80 blocks
(without giving blocks back they would need 4 x 95 = 380). Prints the peak number of blocks in
use, the blocks given back, and preemptions.

    .venv/bin/python tests/bench/bench_window_kv.py
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoints import make_checkpoint  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402

ROWS, PROMPT, NEW, WINDOW, BLOCK, POOL = 4, 20, 1500, 64, 16, 80


def main():
    path = make_checkpoint(Path(tempfile.mkdtemp()) / "mistral", "mistral", sliding_window=WINDOW,
                           max_position_embeddings=2048)
    llm = LLM(str(path), num_kv_blocks=POOL, block_size=BLOCK, max_num_seqs=ROWS, eager_decode=True)
    engine, peak = llm.engine, 0
    update = engine.scheduler.update

    def tracked(output, tokens):
        nonlocal peak
        update(output, tokens)
        peak = max(peak, engine.blocks.num_blocks - engine.blocks.num_free_blocks)

    engine.scheduler.update = tracked
    outs = llm.generate([[1 + i] * PROMPT for i in range(ROWS)],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == NEW for o in outs)
    need = ROWS * -(-(PROMPT + NEW) // BLOCK)
    print(f"{ROWS} sequences of {PROMPT}+{NEW} tokens, window {WINDOW}, blocks of {BLOCK}: peak {peak} blocks "
          f"held of a {POOL}-block pool (without giving blocks back: {need}); "
          f"{engine.scheduler.released_blocks} given back, {engine.scheduler.num_preemptions} preemptions")


if __name__ == "__main__":
    main()
