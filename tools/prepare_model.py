"""Convert the packaged GGUF default model once into an HF-format directory (``tandem prepare-model``).

transformers can read the GGUF (``gguf_file=``) but dequantizes to float and refuses ``save_pretrained``, so we
write the HF-format directory ourselves: ``model.safetensors`` + ``config.json`` + ``generation_config.json`` +
tokenizer files. Services then load that directory in about a second.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from tandem.shared.model_files import DEFAULT_MODEL_NAME, default_model_dir, is_model_dir, packaged_gguf_path


def prepare_model(out_dir: Path | None = None, force: bool = False) -> Path:
    """Convert the packaged GGUF into an HF-format directory once; return the directory.

    Writes into a temporary sibling and renames it into place, so an interrupted conversion never leaves a
    half-written model that later loads. Takes about 30 s (mostly the tokenizer conversion).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds to import; only conversion needs it

    out_dir = Path(out_dir) if out_dir else default_model_dir()
    if is_model_dir(out_dir) and not force:
        return out_dir
    gguf = packaged_gguf_path()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    steps = tqdm(total=4, desc=f"prepare-model {DEFAULT_MODEL_NAME}", unit="step")
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    steps.update()
    steps.set_postfix_str("weights")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("safetensors")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    steps.update()
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights we wrote are plain fp32
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(tmp / "generation_config.json")
    steps.update()
    steps.close()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def float_model_dir(arg: str | None) -> Path:
    """A tool's --model: the float model directory it names, else the prepared default model.

    Raises ValueError for a blank name."""
    if arg is not None and not arg.strip():
        raise ValueError("--model must name a model directory (omit it for the packaged model)")
    return Path(arg) if arg is not None else prepare_model()
