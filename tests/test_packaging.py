"""A wheel built from the checkout carries everything `shoal serve` needs with no flags: the
bundled model, the C++ kernel sources, the chat page; and an installed wheel serves it."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
from serving import free_port, loopback_env, stop_process, wait_process_ready

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the checkout's files (tracked, or new and not ignored), so no
    build/ left from an earlier build can slip files into it."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out)], check=True, timeout=600, cwd=out)
    (built,) = out.glob("shoal-*.whl")
    return built


def test_the_wheel_carries_the_bundled_model_and_the_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"actors/demo_model/{f}" for f in MODEL_FILES} <= names
    assert {f"kernels/csrc/{f}.cpp" for f in ("paged_attention", "panel_linear", "bf16_linear", "int8_linear")} <= names
    assert "kernels/csrc/bf16_tile.h" in names  # (included by two of them)
    assert "app/api/web/chat.html" in names  # the chat page at GET /
    assert not any(n.startswith("app/demo/") for n in names)  # the training code runs from a checkout
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.slow
def test_an_installed_wheel_serves_the_bundled_model(wheel, tmp_path):
    """`shoal serve` with no flags, run from the installed wheel (not this checkout), answers."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    env = loopback_env(PYTHONPATH=str(site))
    where = subprocess.run([sys.executable, "-c", "import actors, app; print(actors.__file__, app.__file__)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_process_ready(url, proc, log)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is 17 + 25?"}], "temperature": 0, "max_tokens": 200})
        assert r.status_code == 200, r.text
        assert "42" in r.json()["choices"][0]["message"]["content"], r.json()
        assert r.json()["model"] == "shoal-demo"
    finally:
        code, left = stop_process(proc)
    assert code == 0 and not left, log.read_text()[-3000:]
