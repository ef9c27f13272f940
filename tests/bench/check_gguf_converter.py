"""Off-suite check: GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py, not
tests/gguf_checkpoint.py's imitation of it) read back by shoal to transformers' greedy tokens on
the checkpoint they were made from. llama.cpp is not a dependency of shoal; its source comes
with llama-cpp-python's sdist (../shared/MACHINE-NOTES.md):

    pip download --no-binary :all: --no-deps llama-cpp-python -d /tmp/lc && tar xzf /tmp/lc/*.tar.gz -C /tmp/lc
    pip install --target /tmp/lc/deps sentencepiece     # (its Llama vocabulary path imports it)
    .venv/bin/python tests/bench/check_gguf_converter.py --llama-cpp /tmp/lc/llama_cpp_python-*/vendor/llama.cpp \\
        --deps /tmp/lc/deps [--families gpt_oss,deepseek_v3,...]

Each family's tiny test checkpoint (tests/checkpoints.py; gpt-oss also in MXFP4, which the
converter repacks into ggml's MXFP4 blocks) is converted in float32 in a subprocess, with the
test vocabulary's pre-tokenizer named gpt2 (the converter knows vocabularies by hash) and GLM's
vocabulary read as plain BPE (the test one has no [gMASK]). Prints one line a family.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
os.environ.setdefault("SHOAL_EAGER_DECODE", "1")

from checkpoints import make_checkpoint, mxfp4_copy  # noqa: E402
from harmony_checkpoint import make_harmony_checkpoint  # noqa: E402
from oracle import hf_greedy  # noqa: E402
from test_engine import GREEDY, prompts_of  # noqa: E402

FAMILIES = {  # family -> tests/checkpoints.py overrides
    "gpt_oss": dict(swiglu_limit=7.0),  # (llama.cpp's SwiGLU limit is the release's)
    "gpt_oss_mxfp4": dict(swiglu_limit=7.0),
    "mixtral": {}, "deepseek_v3": {}, "deepseek_v2": {}, "glm4_moe": {}, "granite": {},
    "smollm3": dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]),  # (llama.cpp's NoPE pattern)
    "olmo2": {}, "qwen3_moe": {}, "llama": {},
    "qwen3_vl": {}, "qwen3_vl_moe": {},  # (the converter writes their language model; vision goes to --mmproj)
}
CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py", *{deps!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt2"
base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", "f32"]
convert_hf_to_gguf.main()
"""


def checkpoint(family: str, root: Path) -> Path:
    if family.startswith("gpt_oss"):
        path = make_harmony_checkpoint(root / "gpt_oss", **FAMILIES[family])
        return mxfp4_copy(path, root / "gpt_oss_mxfp4") if family.endswith("mxfp4") else path
    return make_checkpoint(root / family, family, **FAMILIES[family])


def check(family: str, root: Path, src: Path, deps: list[str]) -> str:
    from actors.engine.llm import LLM

    model = checkpoint(family, root)
    out = root / f"{family}.gguf"
    run = subprocess.run([sys.executable, "-c", CONVERT.format(src=str(src), deps=deps, model=str(model),
                                                                out=str(out))],
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        return f"conversion failed: {run.stderr.strip().splitlines()[-1][:200]}"
    llm = LLM(str(out), dtype="float32", num_kv_blocks=64)
    try:
        prompts = prompts_of([5, 19])
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    return "greedy tokens equal transformers'" if got == want else f"DIFFER: {got} != {want}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--deps", action="append", default=[], help="a folder with the converter's extra imports")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SHOAL_GGUF_CACHE"] = str(Path(tmp) / "converted")
        for family in args.families.split(","):
            print(f"{family}: {check(family, Path(tmp), args.llama_cpp, args.deps)}", flush=True)


if __name__ == "__main__":
    main()
