"""Reading a model's ``config.json``: a preset name, a file or folder, or a Hub repo id.

The file is user input from anywhere, so it is read bounded (``MAX_CONFIG_BYTES``: never the
whole of a huge file or an endless stream), strict UTF-8, nesting checked before parsing, and
every failure is one ``ConfigError`` line naming the file.  Presets are the real configs in
``presets/`` (one per model family, plus small ones for demos and tests): ``stagecache pools
--model NAME`` takes a preset's file name without ``.json``.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from ..bounded_io import path_kind, read_bounded_text
from ..errors import ConfigError
from .hf_cache import config_path, is_repo_id

#: A model config.json is a few KB; a file past these limits is not a model config.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
#: A backslash and the character it escapes (inside a JSON string; outside one JSON is invalid).
_ESCAPE = re.compile(r"\\.", re.DOTALL)


def _presets() -> dict[str, str]:
    folder = resources.files("stagecache.runtime.model").joinpath("presets")
    return {Path(f.name).stem: f.name for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".json")}


#: Preset name -> file in ``presets/``, in name order.
PRESETS: dict[str, str] = _presets()


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
    """A config file's text, bounded to ``MAX_CONFIG_BYTES``, strict UTF-8; every failure is a
    one-line ``ConfigError``."""
    return read_bounded_text(path, MAX_CONFIG_BYTES, f"model config {str(path)!r}",
                             "a Hugging Face config.json (a few KB of JSON)")


def preset_text(name: str) -> str:
    """The ``config.json`` text of preset ``name`` (a file of this package: trusted), as published."""
    return resources.files("stagecache.runtime.model").joinpath("presets", PRESETS[name]).read_text()


def preset_config(name: str) -> dict[str, Any]:
    """The parsed config of preset ``name``."""
    return json.loads(preset_text(name))


def load_config(model: str) -> tuple[dict[str, Any], str]:
    """The parsed config of a preset name or a config.json path (file or its directory), and its
    name; size, depth, encoding and JSON errors are ``ConfigError`` naming the file."""
    if not model.strip():
        raise ConfigError(f"--model is empty; expected a preset ({', '.join(PRESETS)}) or a path to a "
                          "Hugging Face config.json")
    if model in PRESETS:
        return preset_config(model), model
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
