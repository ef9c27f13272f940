"""Shared test set-up: offline Hugging Face, 2 torch threads, tiny checkpoints on demand."""
import os
import sys

# Nothing may come from the hub: checkpoints are built locally (tests/checkpoints.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no fork warnings / deadlocks with Ray
# Every Ray socket on 127.0.0.1, and no token auth for the local test clusters (MACHINE-NOTES).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Engines decode eagerly unless a test asks for the compiled path (tests/test_compiled_decode.py):
# compiling costs ~20-40 s per engine start on these 2 cores. Ray workers and `shoal serve`
# subprocesses inherit it.
os.environ.setdefault("SHOAL_EAGER_DECODE", "1")

import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)  # the machine has 2 cores; be explicit rather than rely on defaults
# Without CUDA, Triton kernels run through Triton's interpreter (tests/test_triton_attention.py).
# Triton reads the variable once, at its import, which must come after this line.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Let tests in sub-folders `import checkpoints` / `import oracle`.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoints import make_checkpoint  # noqa: E402

from app.demo.yielding import mark_test_run  # noqa: E402


def pytest_sessionstart(session):
    # A demo-model training run (make demo-model) pauses while this marker exists.
    session.config._shoal_marker = mark_test_run()
    # Compiled decode steps (actors/worker/compiled_decode.py) go to a folder of this run's
    # own, so every run compiles what it tests; `shoal serve` subprocesses inherit it.
    session.config._shoal_compiled = os.environ["SHOAL_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="shoal-compiled-")
    # So do the tokenizer classes AutoTokenizer chose (actors/worker/checkpoint_files.py).
    session.config._shoal_tokenizers = os.environ["SHOAL_TOKENIZER_CACHE"] = tempfile.mkdtemp(prefix="shoal-tokenizers-")
    # And the directories made from GGUF files (actors/worker/gguf_checkpoint.py).
    session.config._shoal_gguf = os.environ["SHOAL_GGUF_CACHE"] = tempfile.mkdtemp(prefix="shoal-gguf-")


def pytest_sessionfinish(session, exitstatus):
    session.config._shoal_marker.unlink(missing_ok=True)
    shutil.rmtree(session.config._shoal_compiled, ignore_errors=True)
    shutil.rmtree(session.config._shoal_tokenizers, ignore_errors=True)
    shutil.rmtree(session.config._shoal_gguf, ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """`factory(arch="llama", **overrides) -> Path`; one build per distinct argument set."""
    root = tmp_path_factory.mktemp("checkpoints")
    built = {}

    def factory(arch="llama", **overrides):
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in built:
            name = f"{arch}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            built[key] = make_checkpoint(root / name, arch, **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def llama_ckpt(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def qwen2_ckpt(checkpoint_factory):
    return checkpoint_factory("qwen2")


@pytest.fixture(scope="session")
def qwen3_ckpt(checkpoint_factory):
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="session")
def adapters(checkpoint_factory, tmp_path_factory):
    """`adapters(arch) -> (base checkpoint, {"a": dir, "b": dir})`: two random PEFT LoRA
    adapters (tests/lora_adapters.py). "a" adapts every projection (r 8, alpha 16), "b" only
    q/v/down with rsLoRA (r 4, alpha 8)."""
    from lora_adapters import make_adapter
    built = {}

    def get(arch="llama"):
        if arch not in built:
            base = checkpoint_factory(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            built[arch] = base, {
                "a": make_adapter(base, root / "a", seed=1),
                "b": make_adapter(base, root / "b", targets=("q_proj", "v_proj", "down_proj"),
                                  r=4, alpha=8, seed=2, rslora=True),
            }
        return built[arch]
    return get


@pytest.fixture(autouse=True)
def float32_by_default_on_gpu(request, monkeypatch):
    """On a CUDA machine `--dtype auto` means bfloat16; the parity tests compare with
    transformers in float32, so outside tests marked `gpu` auto keeps float32 there
    (in this process: Serve tests' scheduler actors resolve it themselves)."""
    if torch.cuda.is_available() and request.node.get_closest_marker("gpu") is None:
        from actors.worker import model_spec
        monkeypatch.setattr(model_spec, "gpu_auto_dtype", lambda hf: torch.float32)
