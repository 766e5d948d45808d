"""SWA hybrids: which cache sglang 0.5.23 gives each layer, read from config.json (no sglang here;
tests/integrations/test_sglang_swa_hybrid.py compares the same specs with sglang's ModelConfig)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from stagecache.runtime.cli.main import main
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.families import load_spec, spec_from_config
from stagecache.runtime.model.families.swa_hybrid import FAMILY, SwaHybridSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "swa_hybrid"
PRESET = Path(__file__).resolve().parents[2] / "runtime" / "model" / "presets" / "gpt-oss-20b.json"


def config(name: str) -> dict:
    path = PRESET if name == "gpt-oss-20b" else DATA / f"{name}.json"
    return json.loads(path.read_text())


def test_gpt_oss_preset_reads_layer_types():
    spec = load_spec("gpt-oss-20b")
    assert isinstance(spec, SwaHybridSpec) and spec.family is FAMILY
    assert spec.layer_kinds == ("swa", "full") * 12
    assert (spec.full.token_bytes, spec.swa.token_bytes) == (2048, 2048)  # 8 KV heads x (64 + 64) x bf16
    assert FAMILY.swa_floor_tokens(spec) == 127  # gpt-oss: sliding_window - 1


def test_gemma4_full_shape_is_global_and_last_layer_full():
    spec = spec_from_config(config("gemma-4"), "g4")
    kinds = spec.layer_kinds
    assert [i for i, k in enumerate(kinds) if k == "full"] == [5, 11, 17, 23, 29]  # every 6th (default)
    assert (spec.full.heads, spec.full.head_dim, spec.swa.heads, spec.swa.head_dim) == (4, 512, 16, 256)
    cfg = config("gemma-4")
    cfg["text_config"]["layer_types"] = ["sliding_attention"] * 30  # the last one is forced to full
    assert spec_from_config(cfg, "g4").layer_kinds[-1] == "full"
    cfg["text_config"]["attention_k_eq_v"] = False  # the global KV heads apply only with k == v
    assert spec_from_config(cfg, "g4").full.heads == 16


def test_mimo_v2_reads_hybrid_layer_pattern_and_its_swa_shape():
    spec = spec_from_config(config("mimo-v2-flash"), "mimo")
    assert [i for i, k in enumerate(spec.layer_kinds) if k == "full"] == [0, 5, 11, 17, 23, 29, 35, 41, 47]
    assert (spec.full.heads, spec.full.head_dim, spec.full.v_head_dim) == (4, 192, 128)
    assert (spec.swa.heads, spec.swa.head_dim, spec.swa.v_head_dim) == (8, 192, 128)
    assert spec.full.token_bytes == 4 * (192 + 128) * 2


def test_step3p5_is_one_mha_pool_under_hicache_and_its_layer_types_are_cut():
    cfg = config("step-3.5-flash")
    cfg["layer_types"] = cfg["layer_types"] + ["sliding_attention"] * 3  # MTP entries beyond the layers
    spec = spec_from_config(cfg, "step")
    assert set(spec.layer_kinds) == {"kv"} and spec.num_layers == 45
    assert "HiCache" in spec.plain_reason and FAMILY.swa_floor_tokens(spec) == 0


@pytest.mark.parametrize(("arch", "words"), [("Gemma2ForCausalLM", "Gemma2ForCausalLM"),
                                             ("Gemma3ForCausalLM", "Gemma3ForCausalLM"),
                                             ("Llama4ForConditionalGeneration", "Llama-4")])
def test_architectures_sglang_does_not_split_refuse_pp_in_one_line(tmp_path, capsys, arch, words):
    cfg = {"architectures": [arch], "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 64, "sliding_window": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["check", "--model", str(path), "--pp-size", "1"]) == 0
    capsys.readouterr()
    assert main(["check", "--model", str(path), "--pp-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "--pp-size 1" in err
    spec = load_spec(str(path))
    assert FAMILY.refuses_pp(spec) is not None


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: c.update(layer_types=c["layer_types"][:-1]), "'layer_types' has 23 entries; expected num_hidden_layers=24"),
    (lambda c: c["layer_types"].__setitem__(3, "chunked_attention"), "layer_types[3] = 'chunked_attention' is not supported"),
    (lambda c: c.update(layer_types=["full_attention"] * 24), "no sliding-window layer"),
    (lambda c: c.update(num_key_value_heads=0), "'num_key_value_heads' must be a positive integer"),
    (lambda c: c.pop("sliding_window"), "missing required field 'sliding_window'"),
])
def test_a_bad_config_is_one_line_naming_the_field(edit, message):
    cfg = copy.deepcopy(config("gpt-oss-20b"))
    edit(cfg)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spec_from_config(cfg, "bad")


def test_mimo_pattern_values_are_checked():
    cfg = config("mimo-v2-flash")
    cfg["hybrid_layer_pattern"][2] = 2
    with pytest.raises(ConfigError, match=r"hybrid_layer_pattern\[2\] = 2 is not supported"):
        spec_from_config(cfg, "mimo")


def test_layer_map_ids_sub_pool_and_global_transfer_ids():
    from stagecache.runtime.model.layer_map import build_layout

    layout = build_layout(load_spec("gpt-oss-20b"), 2)
    s1 = layout.stages[1]
    assert [(e.kind, e.sub_pool_id, e.transfer_id, e.wait_id) for e in s1.layers[:4]] == [
        ("swa", 0, 12, 12), ("full", 0, 13, 13), ("swa", 1, 14, 14), ("full", 1, 15, 15)]
    assert s1.expected_buffers() == {"swa": 6, "full": 6, "kv": 0}
    assert s1.pool_index("full", 23) == 5


def test_stage_problems_and_the_suggested_partition():
    from stagecache.runtime.model.layer_map import number_layers, partition_without_problems

    spec = load_spec("gpt-oss-20b")
    assert FAMILY.stage_problems(number_layers(spec, 1, 1, 2))[0].startswith("no sliding-window layer in [1, 2)")
    assert FAMILY.stage_problems(number_layers(spec, 0, 0, 1), 1) == []
    assert "page_size == 1 (got 16)" in FAMILY.stage_problems(number_layers(spec, 0, 0, 1), 16)[0]
    part = partition_without_problems(spec, 3, page_size=16)
    assert part == (8, 8, 8)


def test_check_at_pp8_is_well_under_50_ms():
    """``check`` of the preset at pp 8 (the whole plan built and validated), median of 20 runs
    (measured 0.8 ms on 2 cores; the bound leaves room for a loaded machine)."""
    from stagecache.runtime.bench.check import run_bench

    rows = run_bench("gpt-oss-20b", None, 8, 20, [])["results"]
    pp8 = next(r for r in rows if r["pp_size"] == 8)
    assert pp8["check_median_ms"] < 50.0


@pytest.mark.parametrize(("argv", "words"), [
    (["check", "--tp-size", "2"], "--tp-size 2: gpt-oss-20b: SWA hybrids are modelled at one TP rank"),
    (["pools", "--hicache-size-gb", "4"], "--hicache-size: a host size in bytes is not modelled for SWA hybrids"),
])
def test_what_is_not_modelled_is_refused_in_one_line(capsys, argv, words):
    assert main([*argv, "--model", "gpt-oss-20b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err
