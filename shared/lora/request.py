"""LoRARequest: an adapter to load (vLLM's name), the name requests give for it and its PEFT directory."""
from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from tandem.shared.errors import InvalidRequestError

MAX_LORA_NAME_CHARS = 256
# Unicode categories a name may not hold: controls (NUL, ...), format characters (zero-width space and joiners,
# bidi marks, BOM) and surrogates (a lone one cannot be encoded as UTF-8: not in a protobuf string, nor in a log)
_REFUSED_CATEGORIES = ("Cc", "Cf", "Cs")


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: what requests name the adapter by (Request.lora_name); lora_path: a PEFT adapter directory
    (adapter_config.json + adapter_model.safetensors; the engine refuses a relative one, shared/lora/peft.py).
    InvalidRequestError on an empty or over-long name, one with whitespace, control or format (zero-width)
    characters or one that is not valid Unicode (a lone surrogate), or an empty path."""

    lora_name: str
    lora_path: str

    def __post_init__(self):
        name = self.lora_name
        if not isinstance(name, str) or not name or len(name) > MAX_LORA_NAME_CHARS or any(
                c.isspace() or unicodedata.category(c) in _REFUSED_CATEGORIES for c in name):
            raise InvalidRequestError(f"adapter name {name!r} must be 1-{MAX_LORA_NAME_CHARS} characters without "
                                      "whitespace, control or format (zero-width) characters, in valid Unicode")
        if not self.lora_path:
            raise InvalidRequestError(f"adapter {name!r}: its path is empty")

    @classmethod
    def parse(cls, module: str) -> LoRARequest:
        """"NAME=PATH" (a --lora-modules item) -> LoRARequest. InvalidRequestError without the "=" or a part."""
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise InvalidRequestError(f"--lora-modules takes NAME=PATH items, got {module!r}")
        return cls(name, path)
