"""Linear-attention / Mamba hybrids: the config rules, the presets' bytes, the family's faults as
``check`` names them, ``pools``' notes and ledger, and the check's speed.  sglang's own objects
are compared in tests/integrations/test_sglang_linear_hybrid.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stagecache.runtime.cli.main import main
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.families import load_spec, spec_from_config
from stagecache.runtime.model.families.linear_hybrid import FAMILY

QWEN_TEXT = {"num_hidden_layers": 8, "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 256,
             "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out)


# -- config rules ------------------------------------------------------------------------------------

def test_qwen35_reads_text_config_and_the_interval_not_layer_types():
    text = {**QWEN_TEXT, "layer_types": ["full_attention"] * 8}  # sglang never reads it
    spec = spec_from_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text})
    assert spec.layer_kinds == ("mamba",) * 3 + ("attention",) + ("mamba",) * 3 + ("attention",)
    with pytest.raises(ConfigError, match="keeps its fields in 'text_config'"):
        spec_from_config({"architectures": ["Qwen3_5ForConditionalGeneration"], **QWEN_TEXT})


def test_presets_bytes_per_token_and_per_slot():
    qwen, nemo = load_spec("qwen3.5-0.8b"), load_spec("nemotron-h-8b")
    assert (qwen.attention_row_bytes, qwen.state_slot_bytes) == (2048, 1_085_440)
    assert (nemo.attention_row_bytes, nemo.state_slot_bytes) == (4096, 4_255_744)
    assert qwen.layer_kinds.count("attention") == 6 and qwen.layer_kinds.count("mamba") == 18
    assert [i for i, k in enumerate(nemo.layer_kinds) if k == "attention"] == [7, 18, 29, 40]
    assert nemo.layer_kinds.count("mamba") == 24 and nemo.layer_kinds.count("none") == 24


def test_nemotron_pattern_kimi_granite_falcon_lfm2_rules():
    nemo = spec_from_config({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M*-E",
                             "num_key_value_heads": 8, "mamba_num_heads": 8, "mamba_head_dim": 64,
                             "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4})
    assert nemo.layer_kinds == ("mamba", "attention", "none", "none") and nemo.num_layers == 4
    with pytest.raises(ConfigError, match=r"hybrid_override_pattern\[1\] = 'X' is not supported"):
        spec_from_config({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "MX"})
    kimi = spec_from_config({"architectures": ["KimiLinearForCausalLM"], "num_hidden_layers": 4,
                             "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                             "linear_attn_config": {"kda_layers": [1, 2, 4], "num_heads": 32, "head_dim": 128,
                                                    "short_conv_kernel_size": 4}})
    assert kimi.layer_kinds == ("mamba", "mamba", "attention", "mamba")  # 1-based KDA layers
    assert kimi.attention_row_bytes == (512 + 64) * 2  # MLA latent
    granite = spec_from_config({"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 12,
                                "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 4})
    assert [i for i, k in enumerate(granite.layer_kinds) if k == "attention"] == [5, 11]
    with pytest.raises(ConfigError, match="has no mamba layer"):
        spec_from_config({"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 2,
                          "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
                          "layer_types": ["attention", "attention"]})
    falcon = spec_from_config({"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 3, "hidden_size": 64,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4})
    assert falcon.layer_kinds == ("hybrid",) * 3
    lfm = spec_from_config({"architectures": ["Lfm2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 3,
                            "layer_types": ["conv", "full_attention"]})
    assert lfm.ssm_bytes == 0 and lfm.state_slot_bytes == 64 * 2 * 2  # conv window only


@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "FalconH1ForCausalLM", "Lfm2ForCausalLM"])
def test_architectures_sglang_does_not_split_are_refused_at_pp_above_1(capsys, tmp_path, arch):
    cfg = {"Qwen3NextForCausalLM": {"architectures": [arch], **QWEN_TEXT},
           "FalconH1ForCausalLM": {"architectures": [arch], "num_hidden_layers": 4, "hidden_size": 64,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4},
           "Lfm2ForCausalLM": {"architectures": [arch], "num_hidden_layers": 2, "hidden_size": 64,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 3,
                               "layer_types": ["conv", "full_attention"]}}[arch]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert FAMILY.refuses_pp(spec_from_config(cfg))
    for command in ("check", "pools"):
        code, out, err = run(capsys, command, "--model", str(path), "--pp-size", "2")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--pp-size 1" in err, err
    assert run(capsys, "check", "--model", str(path), "--pp-size", "1")[0] == 0


def test_bad_mamba_flags_are_one_line_exit_2(capsys):
    for flag, value in (("--max-mamba-cache-size", "0"), ("--mamba-full-memory-ratio", "-1")):
        assert main(["pools", "--model", "qwen3.5-0.8b", flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and len(err.strip().splitlines()) == 1, err


# -- faults, sglang's own failure, the partition hint -----------------------------------------------

FAULTS = {  # fault -> (model, pp, the pool every error names, words of its message)
    "global-attention": ("qwen3.5-0.8b", 2, "attention", "got 6 buffers for 3 local attention layers"),
    "unsplit-mamba": ("qwen3.5-0.8b", 2, "mamba", "got 18 buffers for 9 local Mamba layers"),
    "mamba-len-bound": ("nemotron-h-8b", 1, "mamba", "transfer as id None but the pool waits on id"),
    "mamba-transfer-ids": ("qwen3.5-0.8b", 2, "mamba", "transfer as id 12 but the pool waits on id 0"),
    "mamba-host-missing": ("nemotron-h-8b", 4, "mamba", "missing from the HiCache host set"),
}


def test_every_family_fault_is_tested():
    # unbounded-stage hits only stages without an attention layer: tests/plan/test_unbounded_stage.py
    assert sorted([*FAULTS, "unbounded-stage"]) == sorted(f.name for f in FAMILY.faults)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_check_names_each_fault_with_stage_pool_and_layers(capsys, fault):
    model, pp, pool, words = FAULTS[fault]
    assert run_json(capsys, "check", "--model", model, "--pp-size", str(pp))[0] == 0
    code, report = run_json(capsys, "check", "--model", model, "--pp-size", str(pp), "--fault", fault)
    assert code == 1
    errors = [e for s in report["stages"] for e in s["errors"]]
    assert errors and all(e["pool"] in (pool, "attention") for e in errors)
    assert any(words in e["message"] for e in errors if e["pool"] == pool), errors
    hit = {e["stage"] for e in errors}
    assert hit == ({1} if fault == "mamba-transfer-ids" else set(range(pp)))


def test_stage_without_attention_named_by_check_and_pools_suggests_a_partition(capsys):
    code, report = run_json(capsys, "check", "--model", "qwen3.5-0.8b", "--pp-size", "4", "--pp-partition", "3,7,7,7")
    assert code == 1
    [error] = [e for s in report["stages"] for e in s["errors"]]
    assert error["stage"] == 0 and "no attention layer" in error["message"] and "Errno 22" in error["message"]
    _, pools = run_json(capsys, "pools", "--model", "qwen3.5-0.8b", "--pp-size", "4", "--pp-partition", "3,7,7,7")
    assert pools["suggested_partition"] == [6, 6, 6, 6]
    code, report = run_json(capsys, "check", "--model", "nemotron-h-8b", "--pp-size", "8")
    assert code == 1 and [s["stage"] for s in report["stages"] if not s["ok"]] == [0, 2, 5, 7]
    _, pools = run_json(capsys, "pools", "--model", "nemotron-h-8b", "--pp-size", "8")
    assert pools["suggested_partition"] is None and len(pools["stage_problems"]) == 4


# -- pools: state per request, the ledger ----------------------------------------------------------

def test_pools_sizes_mamba_state_per_request_slot(capsys):
    _, small = run_json(capsys, "pools", "--model", "qwen3.5-0.8b", "--pp-size", "2", "--max-total-tokens", "65536",
                        "--max-mamba-cache-size", "40")
    _, large = run_json(capsys, "pools", "--model", "qwen3.5-0.8b", "--pp-size", "2", "--max-total-tokens", "524288",
                        "--max-mamba-cache-size", "40")
    for a, b in zip(small["stages"], large["stages"], strict=True):
        ma = next(p for p in a["pools"] if p["pool"] == "mamba")
        mb = next(p for p in b["pools"] if p["pool"] == "mamba")
        assert ma == mb  # tokens do not change the state
        assert ma["device_pages"] == 40 and ma["tensor_rows"] == 41  # + sglang's padding slot
        assert ma["device_bytes"] == 9 * 41 * 1_085_440 and ma["budget"] == "state"
    assert any("Mamba state is per request, not per token: 40 slots" in n for n in small["notes"])
    _, default = run_json(capsys, "pools", "--model", "qwen3.5-0.8b", "--pp-size", "2")
    assert any("stagecache's default of 5 per running request" in n for n in default["notes"])


def test_ledger_shows_the_state_each_stage_is_charged_and_strands(capsys):
    code, report = run_json(capsys, "pools", "--model", "qwen3.5-0.8b", "--pp-size", "4", "--mem-budget-gb", "6")
    assert code == 0
    caps = [s["capacity"] for s in report["stages"]]
    mamba = [next(p for p in s["pools"] if p["pool"] == "mamba") for s in report["stages"]]
    assert [m["buffers"] for m in mamba] == [5, 4, 5, 4]
    charged = {c["state_charged_bytes"] for c in caps}
    assert len(charged) == 1  # every stage is charged the state of the stage with the most Mamba layers
    slots = report["stages"][0]["state_slots"]
    assert charged == {(slots + 1) * 5 * 1_085_440}
    assert [c["state_stranded_bytes"] for c in caps] == [0, (slots + 1) * 1_085_440, 0, (slots + 1) * 1_085_440]
    assert report["deployment"]["state_stranded_bytes"] == 2 * (slots + 1) * 1_085_440
    code, text, _ = run(capsys, "pools", "--model", "qwen3.5-0.8b", "--pp-size", "4", "--mem-budget-gb", "6")
    assert "state charged" in text and "state stranded" in text


def test_bench_check_at_pp8_is_under_50ms(capsys):
    for model in ("qwen3.5-0.8b", "nemotron-h-8b"):
        assert main(["bench", "check", "--model", model, "--max-pp", "8", "--repeat", "20"]) == 0
        result = json.loads(capsys.readouterr().out)["results"][-1]
        assert result["pp_size"] == 8 and result["check_median_ms"] < 50, result


# -- serve and advise on the presets ----------------------------------------------------------------

def _serve(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", "--pp-size", "2", "--requests", "8",
                           "--rate", "0", "--no-dashboard", *extra], capture_output=True, text=True, timeout=300)


def test_serve_runs_a_linear_hybrid_and_refuses_its_faults():
    """Real stage processes: the attention KV pages move through the host tier and are verified
    byte for byte; the Mamba state stays on the device (stagecache's runtime pages its host tier)."""
    proc = _serve("--model", "nemotron-h-8b")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cache decisions identical on every stage" in proc.stdout
    proc = _serve("--model", "qwen3.5-0.8b", "--fault", "unsplit-mamba")
    assert proc.returncode == 1
    assert "got 18 buffers for 9 local Mamba layers" in proc.stdout + proc.stderr


def test_advise_notes_the_state_is_per_request(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1536, "output_length": 8,
                                         "hash_ids": [0, 1, 100 + i % 5]}) + "\n" for i in range(20)))
    code, report = run_json(capsys, "advise", "--trace", str(trace), "--model", "qwen3.5-0.8b", "--pp-size", "4",
                            "--mem-budget-gb", "6")
    assert code == 0
    assert any("Mamba state is per request, not per token" in n for n in report["notes"])
    assert report["deployment"]["state_stranded_bytes"] > 0
