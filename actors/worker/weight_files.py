"""A checkpoint's weight files, read lazily: safetensors, or PyTorch's `pytorch_model*.bin`
where a checkpoint has only those (older releases and fine-tunes; vLLM's `--load-format auto`
reads them too).

`open_weights(file)` answers as safetensors' `safe_open` does (keys, get_slice with
get_shape / get_dtype / slicing, get_tensor), so the loader reads both alike. A .bin file is
opened with `torch.load(mmap=True, weights_only=True)`: no pickled code runs, and a tensor's
bytes are read from disk only when it is sliced.
"""
from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path

import torch
from safetensors import safe_open

from actors.worker import gguf_checkpoint

# torch dtypes by safetensors' names for them (what get_dtype answers)
_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: a GGUF file's directory's link to it (gguf_checkpoint), its
    safetensors (by their index where there is one), else its PyTorch .bin files (likewise)."""
    if (path / gguf_checkpoint.TENSORS_FILE).exists():  # a GGUF file's directory
        return [path / gguf_checkpoint.LINK_NAME]
    for index, pattern in (("model.safetensors.index.json", "*.safetensors"),
                           ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        if (path / index).exists():
            names = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            return [path / n for n in names]
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"no weights in {path}: expected *.safetensors or pytorch_model*.bin files")


# An image-text checkpoint's language model under the names a text checkpoint gives it, in the
# layout transformers 4 writes (`language_model.model.`) and the one of 5 (`model.language_model.`);
# its vision tower and projector are not read (actors/models/args.py IMAGE_TEXT_ARCHS).
TEXT_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                 "model.language_model.": "model."}
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                  "visual.", "model.visual.", "vision_model.", "model.vision_model.",  # (Llama 4's: vision_model)
                  # Gemma 4's vision projector and its E models' audio tower and projector
                  "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def text_name(name: str) -> str | None:
    """A tensor's name as the text model reads it; None for an image part's."""
    if name.startswith(IMAGE_PREFIXES):
        return None
    for prefix, text in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name


@contextlib.contextmanager
def open_weights(file: Path):
    """The file's tensors, as safetensors' `safe_open(file, framework="pt")` gives them (an
    image-text checkpoint's text model's, under a text checkpoint's names: `text_name`)."""
    with _open(file) as f:
        keys = list(f.keys())
        names = {text_name(n): n for n in keys}
        names.pop(None, None)
        yield f if len(names) == len(keys) and all(a == b for a, b in names.items()) else _Renamed(f, names)


class _Renamed:
    """A weight file under other names (text name -> the file's)."""

    def __init__(self, f, names: dict[str, str]):
        self.f, self.names = f, names

    def keys(self) -> list[str]:
        return list(self.names)

    def get_slice(self, name: str):
        return self.f.get_slice(self.names[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.f.get_tensor(self.names[name])


@contextlib.contextmanager
def _open(file: Path):
    if file.suffix == ".gguf":
        yield gguf_checkpoint.GgufWeights(file)
        return
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt") as f:
            yield f
        return
    try:
        try:
            tensors = torch.load(str(file), map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be mapped
            tensors = torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # it pickles more than tensors: never run its code
        raise ValueError(f"{file} holds more than tensors ({str(exc).splitlines()[0]}); "
                         "convert it to safetensors") from None
    if not isinstance(tensors, dict):
        raise ValueError(f"{file} holds a {type(tensors).__name__}, not a dict of tensors")
    yield _TorchFile(tensors)


class _TorchFile:
    def __init__(self, tensors: dict):
        self.tensors = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, name: str) -> "_Slice":
        return _Slice(self.tensors[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name].clone()  # its own memory, as safetensors' is (not the file's map)


class _Slice:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return _NAMES.get(self.tensor.dtype, str(self.tensor.dtype))

    def __getitem__(self, key) -> torch.Tensor:
        return self.tensor[key].clone()
