"""The cluster files parse, and the RayService embeds serve_configs/prod.yaml as it is."""
import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_rayservice_embeds_prod_yaml():
    spec = importlib.util.spec_from_file_location("render", ROOT / "cluster" / "render_rayservice.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    on_disk = (ROOT / "cluster" / "rayservice.yaml").read_text()
    assert on_disk == render.render(), "run cluster/render_rayservice.py after editing prod.yaml"
    service = yaml.safe_load(on_disk)
    assert service["kind"] == "RayService"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve_config == yaml.safe_load((ROOT / "serve_configs" / "prod.yaml").read_text())
    assert serve_config["applications"][0]["import_path"] == "app.serving.builder:build_app"


def test_launcher_and_prometheus_configs_parse():
    launcher = yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text())
    assert launcher["provider"]["type"] == "local" and launcher["setup_commands"]
    prometheus = yaml.safe_load((ROOT / "cluster" / "prometheus.yml").read_text())
    assert prometheus["scrape_configs"]
