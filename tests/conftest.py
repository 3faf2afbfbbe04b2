import os
import sys
from pathlib import Path

# `python -m pytest` without -P puts the working directory first on sys.path, where the checkout's folders
# (kernels/, tools/, ...) would shadow installed packages of those names (Hugging Face's `kernels`, which
# transformers imports): take it off before anything else imports.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

# Tests start engines again (LocalCluster.restart) while their own threads are inside gRPC calls: with gRPC's fork
# handlers on, such a fork can abort the child before it execs (an absl mutex check in the handlers); read by gRPC
# when it initializes, so set before anything imports it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "2")))
# Every Python the tests start runs in safe-path mode: its working directory (often the checkout root, whose
# folders are named kernels/, tools/, ...) never goes first on sys.path to shadow an installed package.
os.environ["PYTHONSAFEPATH"] = "1"


@pytest.fixture(scope="session")
def model_dir():
    """The converted default model (converted once into the user cache if missing)."""
    from tandem.tools.prepare_model import prepare_model

    return prepare_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def model_config(model_dir):
    from tandem.shared.config import ModelConfig

    return ModelConfig.from_dir(model_dir)


# marker -> the variable that opts in to it: suites too slow for every `make test` (.ci/run runs them after it,
# while the whole run stays well inside its limit)
OPT_IN_MARKERS = {"docker": "TANDEM_TEST_DOCKER", "heavy": "TANDEM_TEST_HEAVY"}


def pytest_collection_modifyitems(config, items):
    """Tests marked docker (an image build and a compose cluster, many minutes) run only with TANDEM_TEST_DOCKER=1,
    tests marked heavy (load tests, benchmarks run end to end, long fuzzing) only with TANDEM_TEST_HEAVY=1."""
    for marker, variable in OPT_IN_MARKERS.items():
        if os.environ.get(variable) == "1":
            continue
        skipped = [item for item in items if item.get_closest_marker(marker)]
        if skipped:
            config.hook.pytest_deselected(items=skipped)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]
