"""QuantConfig: which weight-only format a model's linear layers use, and the string that names it."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.int4_format import INT4_GROUP_SIZES

INT8_GROUP_SIZES = (32, 64)  # must divide every K of the model (576 and 1536 here)

METHODS = ("rtn", "gptq", "awq", "gguf")
GGUF_TYPES = ("q4_0", "q4_1", "q8_0")


@dataclass(frozen=True)
class QuantConfig:
    """A weight-only quantization format.

    Attributes:
        bits: 4 or 8; None for an unquantized (float) model.
        group_size: input channels per scale (INT4: 32/64/128; INT8: None = per output channel, or 32 for
            GGUF Q8_0); None when bits is None.
        method: "rtn", "gptq", "awq" or "gguf" (how the codes were chosen; loaded HF AWQ/GPTQ checkpoints
            report "awq"/"gptq"); None when bits is None.
        gguf_type: "q4_0", "q4_1" or "q8_0" for method "gguf", else None.
    Raises:
        ValueError: on an unsupported combination.
    """

    bits: int | None = None
    group_size: int | None = None
    method: str | None = None
    gguf_type: str | None = None

    def __post_init__(self):
        if self.bits is None:
            if self.group_size is not None or self.method is not None or self.gguf_type is not None:
                raise ValueError("an unquantized QuantConfig takes no group_size, method or gguf_type")
            return
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if (self.method == "gguf") != (self.gguf_type is not None):
            raise ValueError("gguf_type is required for method 'gguf' and only for it")
        if self.gguf_type is not None and self.gguf_type not in GGUF_TYPES:
            raise ValueError(f"gguf_type must be one of {GGUF_TYPES}, got {self.gguf_type!r}")
        if self.bits == 4 and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        if self.bits == 8 and self.group_size is not None and self.method != "gguf":
            if self.method != "rtn" or self.group_size not in INT8_GROUP_SIZES:
                raise ValueError(f"int8 is per output channel (group_size None), or RTN per group of "
                                 f"{INT8_GROUP_SIZES}; got {self.method} with group_size {self.group_size}")

    @property
    def weight_format(self) -> str:
        """Short name for model ids and block-hash extra keys: "fp32", "int8", "int8-gptq", "int4-g128-awq",
        "gguf-q4_1"."""
        if self.bits is None:
            return "fp32"
        if self.method == "gguf":
            return f"gguf-{self.gguf_type}"
        if self.bits == 8:
            base = "int8" if self.group_size is None else f"int8-g{self.group_size}"
        else:
            base = f"int4-g{self.group_size}"
        return base if self.method == "rtn" and self.bits == 8 else f"{base}-{self.method}"

    def to_json(self) -> dict:
        """The "quantization_config" entry of a tandem checkpoint's config.json."""
        out = {"quant_method": "tandem", "bits": self.bits, "group_size": self.group_size, "method": self.method}
        if self.gguf_type is not None:
            out["gguf_type"] = self.gguf_type
        return out

    @classmethod
    def from_json(cls, data: dict) -> QuantConfig:
        """Inverse of to_json; raises ValueError for a quant_method other than "tandem"."""
        if data.get("quant_method") != "tandem":
            raise ValueError(f"not a tandem quantization_config: quant_method={data.get('quant_method')!r}")
        return cls(bits=data.get("bits"), group_size=data.get("group_size"), method=data.get("method"),
                   gguf_type=data.get("gguf_type"))
