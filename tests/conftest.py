import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def model_dir():
    """The converted default model (converted once into the user cache if missing)."""
    from tools.prepare_model import prepare_model

    return prepare_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def model_config(model_dir):
    from shared.config import ModelConfig

    return ModelConfig.from_dir(model_dir)
