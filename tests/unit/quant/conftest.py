"""Fixtures for the quantization tests: a tiny random Llama (fast, exact checks) and the real default model with
its fp32 reference log-probabilities on the shipped evaluation text (quality checks)."""
import pytest
import torch

torch.set_num_threads(1)

EVAL_POSITIONS = 512  # the CLI report uses >= 2,000; tests keep runs short
EVAL_SEQ_LEN = 256


@pytest.fixture
def make_tiny_llama():
    """Factory: a random HF LlamaForCausalLM with GQA (4 query heads, 2 kv heads, head_dim 16) in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(hidden=64, intermediate=96, layers=2, seed=0):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=hidden // 4, max_position_embeddings=256, tie_word_embeddings=True)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():  # non-trivial norms, so folding AWQ scales into them is exercised
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
        return model

    return make


@pytest.fixture(scope="session")
def model_dir():
    from tandem.shared.model_files import default_model_dir, is_model_dir

    path = default_model_dir()
    if not is_model_dir(path):
        pytest.skip(f"default model not converted at {path} (run the model preparation first)")
    return path


@pytest.fixture(scope="session")
def eval_reference(model_dir):
    """(windows [B, T] token ids of tools/data/quant_eval.txt, fp32 log-probs per window)."""
    from tandem.tools.evaluation import EVAL_TEXT, eval_windows, load_hf_model, reference_logprobs, text_token_ids

    windows = eval_windows(text_token_ids(model_dir, EVAL_TEXT), EVAL_SEQ_LEN, EVAL_POSITIONS)
    return windows, reference_logprobs(load_hf_model(model_dir), windows)


@pytest.fixture(scope="session")
def calib_ids(model_dir):
    from tandem.tools.evaluation import CALIBRATION_TEXT, text_token_ids

    return text_token_ids(model_dir, CALIBRATION_TEXT)[:1024]
