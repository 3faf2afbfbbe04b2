"""LoRARequest: an adapter to load (vLLM's name), the name requests give for it and its PEFT directory."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.shared.errors import InvalidRequestError

MAX_LORA_NAME_CHARS = 256


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: what requests name the adapter by (Request.lora_name); lora_path: a PEFT adapter directory
    (adapter_config.json + adapter_model.safetensors). InvalidRequestError on an empty or over-long name, one with
    whitespace, or an empty path."""

    lora_name: str
    lora_path: str

    def __post_init__(self):
        name = self.lora_name
        if not name or len(name) > MAX_LORA_NAME_CHARS or any(c.isspace() for c in name):
            raise InvalidRequestError(f"adapter name {name!r} must be 1-{MAX_LORA_NAME_CHARS} characters without "
                                      "whitespace")
        if not self.lora_path:
            raise InvalidRequestError(f"adapter {name!r}: its path is empty")

    @classmethod
    def parse(cls, module: str) -> LoRARequest:
        """"NAME=PATH" (a --lora-modules item) -> LoRARequest. InvalidRequestError without the "=" or a part."""
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise InvalidRequestError(f"--lora-modules takes NAME=PATH items, got {module!r}")
        return cls(name, path)
