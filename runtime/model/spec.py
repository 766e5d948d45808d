"""DeepSeek-V4 model spec: the few config.json fields that decide the KV-cache layout.

A spec is built from a real Hugging Face ``config.json`` (a preset name or a
path).  Everything is validated here, at the boundary, so later code can trust
the spec: unknown ratios, wrong list lengths and non-positive sizes are
``ConfigError`` with the field, index and value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..bounded_io import path_kind, read_bounded_text
from ..errors import ConfigError
from .hf_cache import config_path, is_repo_id

#: Compress ratios DeepSeek V4 uses: 0 = SWA only, 4 = C4 (+indexer, state), 128 = C128.
SUPPORTED_RATIOS = (0, 4, 128)

PRESETS = {
    "deepseek-v4-flash": "deepseek-v4-flash.json",
    "tiny-v4": "tiny-v4.json",
}


@dataclass(frozen=True)
class ModelSpec:
    """What the KV cache needs to know about a DeepSeek-V4-style model."""

    name: str
    num_layers: int
    compress_ratios: tuple[int, ...]  # one per PP layer (the MTP placeholder dropped)
    sliding_window: int
    head_dim: int
    qk_rope_head_dim: int
    index_head_dim: int
    num_nextn_predict_layers: int = 0

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "compress_ratios": list(self.compress_ratios),
            "sliding_window": self.sliding_window,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "index_head_dim": self.index_head_dim,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }


#: Upper bounds of the sizes a config may give (far above any real model; a value past one is a
#: typo or an attack, and would overflow a later size computation or allocation).
MAX_LAYERS = 4096
MAX_DIM = 1 << 16
MAX_SLIDING_WINDOW = 1 << 20
MAX_MTP_LAYERS = 64


def _shown(value: Any) -> str:
    """A value as an error shows it: ``repr``, cut to 60 characters."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else \
        f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


def _positive_int(cfg: dict[str, Any], key: str, source: str, high: int) -> int:
    if key not in cfg:
        raise ConfigError(f"{source}: missing required field {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= high:
        raise ConfigError(f"{source}: field {key!r} must be a positive integer <= {high}, "
                          f"got {_shown(value)}")
    return value


def spec_from_config(cfg: dict[str, Any], name: str = "custom") -> ModelSpec:
    """Validate a parsed config.json and build a ``ModelSpec``."""
    source = f"model config {name!r}"
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    num_layers = _positive_int(cfg, "num_hidden_layers", source, MAX_LAYERS)
    mtp = cfg.get("num_nextn_predict_layers", 0)
    if isinstance(mtp, bool) or not isinstance(mtp, int) or not 0 <= mtp <= MAX_MTP_LAYERS:
        raise ConfigError(f"{source}: 'num_nextn_predict_layers' must be an integer >= 0 and "
                          f"<= {MAX_MTP_LAYERS}, got {_shown(mtp)}")
    ratios = cfg.get("compress_ratios")
    if not isinstance(ratios, list) or not ratios:
        raise ConfigError(f"{source}: 'compress_ratios' must be a non-empty list, got {_shown(ratios)}")
    if len(ratios) not in (num_layers, num_layers + 1):
        raise ConfigError(
            f"{source}: 'compress_ratios' has {len(ratios)} entries; expected "
            f"num_hidden_layers={num_layers} or {num_layers + 1} (with the MTP placeholder)"
        )
    for i, r in enumerate(ratios):
        # type(r) is int: True and 4.0 compare equal to 1 and 4 but are not ratios
        if type(r) is not int or r not in SUPPORTED_RATIOS:
            raise ConfigError(
                f"{source}: compress_ratios[{i}] = {_shown(r)} is not supported "
                f"(supported: the integers {', '.join(map(str, SUPPORTED_RATIOS))})"
            )
    head_dim = _positive_int(cfg, "head_dim", source, MAX_DIM)
    rope = _positive_int(cfg, "qk_rope_head_dim", source, MAX_DIM)
    if rope >= head_dim:
        raise ConfigError(f"{source}: qk_rope_head_dim ({rope}) must be < head_dim ({head_dim})")
    return ModelSpec(
        name=name,
        num_layers=num_layers,
        compress_ratios=tuple(ratios[:num_layers]),
        sliding_window=_positive_int(cfg, "sliding_window", source, MAX_SLIDING_WINDOW),
        head_dim=head_dim,
        qk_rope_head_dim=rope,
        index_head_dim=_positive_int(cfg, "index_head_dim", source, MAX_DIM),
        num_nextn_predict_layers=mtp,
    )


#: A DeepSeek-V4 config.json is a few KB; a file past these limits is not a model config.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
#: A backslash and the character it escapes (inside a JSON string; outside one JSON is invalid).
_ESCAPE = re.compile(r"\\.", re.DOTALL)


def json_depth(text: str) -> int:
    """Deepest nesting of arrays/objects in JSON ``text`` (strings skipped), without parsing it.

    Linear whatever the text holds, and vectorized: escapes are removed first (each match is
    two characters, nothing is retried), then a quote count's parity says which bytes lie in
    a string, and the running sum of the brackets outside strings is the depth.  (A regex
    that matches whole strings restarts at every unclosed quote: quadratic on ``"\\"\\"...``.)
    """
    import numpy as np

    data = np.frombuffer(_ESCAPE.sub("", text).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    if data.size == 0:
        return 0
    outside = (np.cumsum(data == ord('"')) & 1) == 0  # a closing quote counts as outside: no bracket
    step = ((data == ord("[")) | (data == ord("{"))).astype(np.int32)
    step -= (data == ord("]")) | (data == ord("}"))
    step *= outside
    return max(0, int(np.cumsum(step).max()))


def read_config_text(path: Path) -> str:
    """A config file's text, bounded to ``MAX_CONFIG_BYTES`` (never the whole of a huge file or
    an endless stream), strict UTF-8; every failure is a one-line ``ConfigError``."""
    return read_bounded_text(path, MAX_CONFIG_BYTES, f"model config {str(path)!r}",
                             "a Hugging Face config.json (a few KB of JSON)")


def load_config(model: str) -> tuple[dict[str, Any], str]:
    """The parsed config of a preset name or a config.json path (file or its directory), and its
    name; size, depth, encoding and JSON errors are ``ConfigError`` naming the file."""
    if not model.strip():
        raise ConfigError(f"--model is empty; expected a preset ({', '.join(PRESETS)}) or a path to a "
                          "Hugging Face config.json")
    if model in PRESETS:
        text = resources.files("stagecache.runtime.model").joinpath("presets", PRESETS[model]).read_text()
        return json.loads(text), model
    path = Path(model)
    kind = path_kind(path, f"model config {model!r}")
    if kind is None and is_repo_id(model):  # deepseek-ai/DeepSeek-V4-Flash: the local HF cache
        path, kind = config_path(model), "file"
    if not path.suffix == ".json" and kind is None:
        raise ConfigError(
            f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) and no such config file"
        )
    if kind == "dir":
        path = path / "config.json"
    text = read_config_text(path)
    depth = json_depth(text)
    if depth > MAX_CONFIG_DEPTH:
        raise ConfigError(f"model config {str(path)!r} nests {depth} levels deep; expected at most "
                          f"{MAX_CONFIG_DEPTH} (a Hugging Face config.json)")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"model config {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise ConfigError(f"model config {str(path)!r}: {str(exc).split(';')[0]}; expected a "
                          "Hugging Face config.json") from None
    return cfg, str(path)


def load_spec(model: str) -> ModelSpec:
    """A preset name (``deepseek-v4-flash``, ``tiny-v4``), a path to a config.json, or a Hugging
    Face repo id whose config.json is in the local cache (``model.hf_cache``)."""
    cfg, name = load_config(model)
    return spec_from_config(cfg, name=name)

