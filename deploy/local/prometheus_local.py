"""Prometheus for the local stack: deploy/prometheus/prometheus.yml with the stack's ports put in,
and the command line that serves it."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

CONFIG = Path(__file__).resolve().parents[1] / "prometheus" / "prometheus.yml"


def write_config(path: Path, ports: dict[str, int]) -> Path:
    """The config with each job scraping 127.0.0.1:<port> (its labels kept); jobs without a
    port (services the stack does not run) are left out so they do not show as down."""
    config = yaml.safe_load(CONFIG.read_text())
    config["scrape_configs"] = [
        {
            **job,
            "static_configs": [
                {**job["static_configs"][0], "targets": [f"127.0.0.1:{ports[job['job_name']]}"]}
            ],
        }
        for job in config["scrape_configs"]
        if job["job_name"] in ports
    ]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def argv(run_dir: Path, port: int, ports: dict[str, int]) -> list[str]:
    """`prometheus` serving on 127.0.0.1:<port> with its data under run_dir."""
    (run_dir / "prometheus").mkdir(parents=True, exist_ok=True)
    config = write_config(run_dir / "prometheus.yml", ports)
    return [
        shutil.which("prometheus") or "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={run_dir / 'prometheus'}",
        "--storage.tsdb.retention.time=2d",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
