"""Write cluster/rayservice.yaml: a KubeRay RayService whose serveConfigV2 is prod.yaml.

    .venv/bin/python cluster/render_rayservice.py

Run it after editing serve_configs/prod.yaml (tests/test_cluster_files.py checks they agree).
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "cluster" / "rayservice.template.yaml"
OUT = ROOT / "cluster" / "rayservice.yaml"


def render() -> str:
    prod = (ROOT / "serve_configs" / "prod.yaml").read_text()
    embedded = "".join(f"    {line}\n" if line.strip() else "\n" for line in prod.splitlines())
    return TEMPLATE.read_text().replace("    # SERVE_CONFIG\n", embedded)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
