"""Every environment entry the compose files give a service is a setting that service reads (its --help names the
variable), so a typo cannot pass unnoticed where the Docker test does not run."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
FILES = ["docker-compose.yml", "deploy/docker/compose.host-network.yml"]


@pytest.mark.parametrize("service", ["gateway", "prefill", "decode"])
def test_compose_environment_names_real_flags(service):
    names = set()
    for path in FILES:
        names |= set((yaml.safe_load((REPO / path).read_text())["services"][service].get("environment") or {}))
    assert names
    help_text = subprocess.run([sys.executable, "-m", f"tandem.services.{service}", "--help"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    help_text = " ".join(help_text.split())  # argparse wraps lines
    assert not [n for n in names if f"${n}" not in help_text], f"not a setting of {service}"
