"""QuantConfig: which weight-only format a model's linear layers use, and the string that names it."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from tandem.kernels.int4_format import INT4_GROUP_SIZES

INT8_GROUP_SIZES = (32, 64)  # must divide every K of the model (576 and 1536 here)

# llmint8: LLM.int8()'s decomposition for weights (Dettmers et al. 2022): the input channels whose calibration
# activations pass a threshold keep float weight columns, the rest is INT8 per output channel (outliers.py).
METHODS = ("rtn", "gptq", "awq", "gguf", "llmint8")
# Formats one linear of a mixed-precision checkpoint may take ("float": the model's float dtype, fp32 or bf16).
LINEAR_FORMAT_RE = re.compile(r"float|int8|int4-g(\d+)")
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
        layer_formats: mixed precision: (canonical linear name, linear format) pairs, sorted by name, for the
            linears that leave the base format (bits, group_size) for "float", "int8" or "int4-gG"
            (sensitivity.py chooses them); () when every linear has the base format.
    Raises:
        ValueError: on an unsupported combination.
    """

    bits: int | None = None
    group_size: int | None = None
    method: str | None = None
    gguf_type: str | None = None
    layer_formats: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.bits is None:
            if (self.group_size, self.method, self.gguf_type) != (None, None, None) or self.layer_formats:
                raise ValueError("an unquantized QuantConfig takes no group_size, method, gguf_type or layer_formats")
            return
        for _, fmt in self.layer_formats:
            parse_linear_format(fmt)
        if list(self.layer_formats) != sorted(dict(self.layer_formats).items()):
            raise ValueError("layer_formats must be (name, format) pairs sorted by name, each name once")
        if self.layer_formats and self.method not in ("rtn", "gptq"):
            raise ValueError(f"mixed precision takes method rtn or gptq, not {self.method}")
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
        if self.method == "llmint8" and (self.bits, self.group_size) != (8, None):
            raise ValueError("llmint8 is INT8 per output channel: bits 8, no group_size")
        if self.bits == 8 and self.group_size is not None and self.method != "gguf":
            if self.method != "rtn" or self.group_size not in INT8_GROUP_SIZES:
                raise ValueError(f"int8 is per output channel (group_size None), or RTN per group of "
                                 f"{INT8_GROUP_SIZES}; got {self.method} with group_size {self.group_size}")

    @property
    def weight_format(self) -> str:
        """Short name for model ids and block-hash extra keys: "fp32", "int8", "int8-gptq", "int4-g128-awq",
        "gguf-q4_1", "int8-llmint8"; a mixed checkpoint appends "-mix" and 8 hex digits of its layer map's
        SHA-256 ("int4-g128-rtn-mix3f09a1c2"), so two layer maps never share a model id."""
        if self.layer_formats:
            digest = hashlib.sha256(json.dumps(self.layer_formats).encode()).hexdigest()[:8]
            return f"{self.base_format}-mix{digest}"
        return self.base_format

    @property
    def base_format(self) -> str:
        """weight_format without the mixed-precision suffix."""
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
        if self.layer_formats:
            out["layer_formats"] = dict(self.layer_formats)
        return out

    @property
    def base_linear_format(self) -> str:
        """The format of every linear layer_formats does not name: "int8", "int8-gG" or "int4-gG"."""
        return f"int{self.bits}" + ("" if self.group_size is None else f"-g{self.group_size}")

    def linear_format(self, name: str) -> str:
        """The format of canonical linear `name`: its layer_formats entry, else base_linear_format."""
        return dict(self.layer_formats).get(name, self.base_linear_format)

    @classmethod
    def from_json(cls, data: dict) -> QuantConfig:
        """Inverse of to_json; raises ValueError for a quant_method other than "tandem"."""
        if data.get("quant_method") != "tandem":
            raise ValueError(f"not a tandem quantization_config: quant_method={data.get('quant_method')!r}")
        layer_formats = data.get("layer_formats") or {}
        if not isinstance(layer_formats, dict):
            raise ValueError("quantization_config.layer_formats must be an object {linear name: format}")
        return cls(bits=data.get("bits"), group_size=data.get("group_size"), method=data.get("method"),
                   gguf_type=data.get("gguf_type"), layer_formats=tuple(sorted(layer_formats.items())))


def parse_linear_format(fmt: str) -> tuple[int | None, int | None]:
    """"float" -> (None, None); "int8" -> (8, None); "int4-g128" -> (4, 128). ValueError for anything else."""
    match = LINEAR_FORMAT_RE.fullmatch(fmt) if isinstance(fmt, str) else None
    if match is None:
        raise ValueError(f"a linear's format is float, int8 or int4-gG; got {fmt!r}")
    if fmt == "float":
        return None, None
    if fmt == "int8":
        return 8, None
    group_size = int(match.group(1))
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {fmt!r}")
    return 4, group_size
