"""Model spec: presets, real config.json parsing and boundary validation."""

from __future__ import annotations

import json

import pytest
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.families import load_spec, spec_from_config
from stagecache.runtime.model.families.deepseek_v4 import check_page_size

SHARED_FLASH = "runtime/presets/deepseek-v4-flash.json"


def _cfg(**over):
    cfg = {"num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4], "sliding_window": 128,
           "head_dim": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
    cfg.update(over)
    return cfg


def test_flash_preset_matches_published_config():
    spec = load_spec("deepseek-v4-flash")
    assert spec.num_layers == 43
    assert len(spec.compress_ratios) == 43  # the MTP placeholder is not a PP layer
    assert spec.compress_ratios[:2] == (0, 0)
    assert spec.compress_ratios[2:42] == (4, 128) * 20
    assert spec.compress_ratios[42] == 4
    assert spec.sliding_window == 128 and spec.num_nextn_predict_layers == 1
    table = spec.family.kind_table(spec, 256)
    assert table["swa"].row_bytes == 584  # 448 fp8 nope + 64 bf16 rope + 7 scales + 1 pad
    assert table["indexer"].row_bytes == 132  # 128 fp8 + one fp32 scale


def test_tiny_preset_and_path_load_the_same_way(tmp_path):
    tiny = load_spec("tiny-v4")
    assert tiny.num_layers == 12 and set(tiny.compress_ratios) == {0, 4, 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_cfg()))
    assert load_spec(str(path)).compress_ratios == (0, 4, 128, 4)
    assert load_spec(str(tmp_path)).num_layers == 4  # a model folder works too


def test_compress_ratios_may_have_one_extra_mtp_entry():
    assert spec_from_config(_cfg(compress_ratios=[0, 4, 128, 4, 0])).compress_ratios == (0, 4, 128, 4)
    with pytest.raises(ConfigError, match="has 3 entries"):
        spec_from_config(_cfg(compress_ratios=[0, 4, 128]))
    with pytest.raises(ConfigError, match="has 6 entries"):
        spec_from_config(_cfg(compress_ratios=[0] * 6))


def test_unsupported_ratio_names_index_and_value():
    with pytest.raises(ConfigError, match=r"compress_ratios\[2\] = 16 is not supported"):
        spec_from_config(_cfg(compress_ratios=[0, 4, 16, 4]))


@pytest.mark.parametrize("field,value", [
    ("num_hidden_layers", 0), ("head_dim", -1), ("sliding_window", "128"), ("index_head_dim", None),
])
def test_bad_fields_are_named(field, value):
    with pytest.raises(ConfigError, match=field):
        spec_from_config(_cfg(**{field: value}))


def test_missing_field_and_bad_files(tmp_path):
    cfg = _cfg()
    del cfg["head_dim"]
    with pytest.raises(ConfigError, match="missing required field 'head_dim'"):
        spec_from_config(cfg)
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        load_spec("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_spec(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        load_spec(str(tmp_path / "missing.json"))


def test_page_size_must_hold_whole_compressed_tokens():
    spec = load_spec("deepseek-v4-flash")
    assert check_page_size(spec, 256) == 256
    with pytest.raises(ConfigError, match="multiple of 128"):
        check_page_size(spec, 64)
    with pytest.raises(ConfigError, match="positive"):
        check_page_size(spec, 0)
