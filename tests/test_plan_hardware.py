"""The planner's inputs: the hardware catalog (every entry sourced, dense peaks that hang
together), `this-cpu` from its calibration file, and the model a plan is for, from a preset, a
config.json transformers wrote or a GGUF file's header, against transformers, the gguf library
and the shipped Gemma 3 270M."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from lifeline.model.default import default_model_path
from lifeline.model.presets import preset_config
from lifeline.plan.hardware import (
    CATALOG, DTYPES, GIB, Efficiency, Hardware, calibration_path, catalog_table, get_hardware,
    hardware_from_dict, hardware_to_dict, save_calibrated)
from lifeline.plan.models import load_plan_model, read_gguf_header

REQUIRED = {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l40s",
            "rtx-4090", "mi300x"}
SHAPE = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
         "intermediate_size", "sliding_window", "layer_types", "tie_word_embeddings",
         "max_position", "rope_theta", "rope_local_theta", "query_pre_attn_scalar",
         "hidden_act", "qk_norm", "attention_bias", "num_experts")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFELINE_CACHE", str(tmp_path))
    return tmp_path


def test_the_catalog_has_every_device_the_planner_names():
    assert REQUIRED <= set(CATALOG)
    assert all(key == hw.id == hw.id.lower() for key, hw in CATALOG.items())


@pytest.mark.parametrize("hw_id", sorted(CATALOG))
def test_every_entry_has_sources_a_dated_price_and_dense_peaks_in_order(hw_id):
    hw = CATALOG[hw_id]
    assert hw.kind == "gpu" and hw.name and hw.interconnect and hw.sources
    assert all(isinstance(s, str) and s for s in hw.sources)
    assert hw.price_per_hour > 0 and hw.price_source
    assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])", hw.price_date)
    assert set(hw.flops) <= set(DTYPES) and {"fp32", "bf16", "int8"} <= set(hw.flops)
    assert all(v > 0 for v in hw.flops.values())
    # Narrower inputs never compute slower: fp32 (TF32) <= bf16 <= fp8, int8 <= int4.
    assert hw.flops["fp32"] <= hw.flops["bf16"] <= hw.flops.get("fp8", hw.flops["bf16"])
    assert hw.flops["bf16"] <= hw.flops["int8"] <= hw.flops.get("int4", hw.flops["int8"])
    assert hw.memory_bandwidth > 0 and hw.memory_bytes > 0 and hw.interconnect_bandwidth > 0
    eff = hw.efficiency
    assert eff.source.startswith(("published", "assumed"))  # where the shares come from
    assert all(0 < x <= 1 for x in (eff.gemm, eff.memory, eff.attention,
                                    *eff.gemm_by_dtype.values()))


def test_peaks_hang_together_across_the_catalog():
    """Same silicon, same compute; units as datasheets mean them. Dense, not sparse: H100 SXM
    bf16 is under 1 PFLOP/s, B200's (2.25) under 2.5."""
    c = CATALOG
    assert c["a100-40gb"].flops == c["a100-80gb"].flops
    assert c["h200"].flops == c["h100-sxm"].flops
    assert c["h200"].memory_bandwidth > c["h100-sxm"].memory_bandwidth
    assert c["h100-sxm"].flops["bf16"] < 1e15 and c["b200"].flops["bf16"] < 2.5e15
    assert "fp8" not in c["a100-80gb"].flops and "int4" not in c["h100-sxm"].flops
    assert c["h100-sxm"].memory_bytes == 80 * GIB
    assert c["h100-sxm"].memory_bandwidth == 3.35e12
    assert c["h100-sxm"].interconnect_bandwidth == 450e9  # NVLink 4: 900 GB/s both ways
    assert c["b200"].interconnect_bandwidth == 2 * c["h200"].interconnect_bandwidth
    pcie = [c[i].interconnect_bandwidth for i in ("l40s", "rtx-4090", "h100-pcie")]
    assert pcie == [32e9, 32e9, 64e9]


def test_a_dtype_without_a_peak_computes_in_the_next_wider_one():
    a100, h100 = CATALOG["a100-80gb"], CATALOG["h100-sxm"]
    assert a100.peak_flops("fp8") == a100.flops["bf16"]
    assert h100.peak_flops("int4") == h100.flops["int8"]
    assert CATALOG["rtx-4090"].peak_flops("int4") == CATALOG["rtx-4090"].flops["int4"]


def test_hardware_ids_are_case_insensitive_and_an_unknown_one_lists_the_known():
    assert get_hardware(" H100-SXM ") is CATALOG["h100-sxm"]
    with pytest.raises(ValueError, match=r"unknown hardware 'tpu-v5'; known: a100-40gb.*"
                                         r"h100-sxm.*mi300x, this-cpu"):
        get_hardware("tpu-v5")


def test_this_cpu_before_calibration_says_to_calibrate(cache):
    assert calibration_path() == cache / "plan" / "this-cpu.json"
    with pytest.raises(ValueError, match="run `lifeline plan calibrate`"):
        get_hardware("this-cpu")
    assert [r["id"] for r in catalog_table()] == list(CATALOG)


def _this_cpu() -> Hardware:
    return Hardware("this-cpu", "2 cores of a shared CPU", "cpu", {"fp32": 1.5e11, "bf16": 4e10},
                    2.1e10, 24 * GIB, 1e10, "none", 0.05, "a guess", "2026-12",
                    ("lifeline plan calibrate",),
                    Efficiency(0.6, 0.7, 0.3, 2e-3, 5e-3, "microbenchmarks"), 0.0)


def test_a_calibrated_cpu_is_saved_loaded_and_listed(cache):
    path = save_calibrated(_this_cpu())
    assert path == calibration_path() and not list(path.parent.glob("*.partial"))
    assert get_hardware("this-cpu") == _this_cpu()
    row = catalog_table()[-1]
    assert row["id"] == "this-cpu" and row["bf16_tflops"] == 0.04 and row["fp8_tflops"] is None
    elsewhere = save_calibrated(_this_cpu(), cache / "other" / "cpu.json")
    assert json.loads(elsewhere.read_text()) == json.loads(path.read_text())


@pytest.mark.parametrize("hw_id", sorted(CATALOG))
def test_every_entry_round_trips_through_json(hw_id):
    hw = CATALOG[hw_id]
    assert hardware_from_dict(json.loads(json.dumps(hardware_to_dict(hw)))) == hw


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(tflops=1), r"unknown hardware fields \['tflops'\]"),
    (lambda d: d.pop("memory_bandwidth"), r"missing hardware fields \['memory_bandwidth'\]"),
    (lambda d: d["flops"].update(fp4=1e15), "flops must name some of"),
    (lambda d: d.update(memory_bytes=0), "must be positive"),
    (lambda d: d["efficiency"].update(speed=2), r"unknown efficiency fields \['speed'\]"),
])
def test_a_bad_hardware_description_is_refused(change, message):
    data = hardware_to_dict(_this_cpu())
    change(data)
    with pytest.raises(ValueError, match=message):
        hardware_from_dict(data)


def test_a_corrupt_calibration_file_says_to_calibrate_again(cache):
    calibration_path().parent.mkdir(parents=True)
    calibration_path().write_text('{"id": "this-cpu"')
    with pytest.raises(ValueError, match="this-cpu.json: .*rerun `lifeline plan calibrate`"):
        get_hardware("this-cpu")


def test_the_listing_has_a_row_per_device_with_its_price_and_source():
    rows = catalog_table()
    assert [r["id"] for r in rows][:len(CATALOG)] == list(CATALOG)
    h100 = next(r for r in rows if r["id"] == "h100-sxm")
    assert (h100["bf16_tflops"], h100["fp8_tflops"], h100["memory_gb_s"],
            h100["memory_gib"]) == (989.4, 1978.9, 3350, 80)
    assert h100["price_source"].endswith(f"({CATALOG['h100-sxm'].price_date})")
    assert next(r for r in rows if r["id"] == "a100-80gb")["fp8_tflops"] is None


def test_a_preset_is_its_config():
    assert load_plan_model("deepseek-v3") == preset_config("deepseek-v3")


def test_a_transformers_config_json_by_directory_or_file(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                     max_position_embeddings=2048, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "tiny-llama")
    by_dir = load_plan_model(str(tmp_path / "tiny-llama"))
    assert load_plan_model(str(tmp_path / "tiny-llama" / "config.json")) == by_dir
    assert (by_dir.name, by_dir.architecture, by_dir.num_kv_heads, by_dir.head_dim) == (
        "tiny-llama", "llama", 2, 32)
    with torch.device("meta"):
        reference = LlamaForCausalLM(hf)
    assert by_dir.num_params() == sum(p.numel() for p in reference.parameters())


def test_the_shipped_gguf_header_is_the_gemma_3_270m_preset():
    gguf, preset = load_plan_model(str(default_model_path())), preset_config("gemma-3-270m")
    assert {f: getattr(gguf, f) for f in SHAPE} == {f: getattr(preset, f) for f in SHAPE}
    assert gguf.family == preset.family == "gemma3"
    assert gguf.num_params() == preset.num_params() == 268_098_176


def test_the_header_reader_agrees_with_the_gguf_library(tmp_path):
    from gguf import GGUFReader, GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float64("llama.rope.freq_base", 500000.0)
    writer.add_bool("llama.use_parallel_residual", True)
    writer.add_int64("general.offset", -7)
    writer.add_string("general.name", "tiny ✓")
    writer.add_array("general.tags", ["a", "bb"])
    writer.add_array("llama.sizes", [1, 2, 3])
    writer.add_token_list(["<s>", "hello", "world"])
    writer.add_token_scores([0.0, -1.0, -2.0])
    writer.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), dtype=np.float16))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    metadata, shapes = read_gguf_header(path)
    reader = GGUFReader(str(path))
    expected = {k: f.contents() for k, f in reader.fields.items()
                if not k.startswith(("GGUF.", "tokenizer."))}
    assert metadata == expected and metadata["general.name"] == "tiny ✓"
    assert shapes == {t.name: tuple(int(n) for n in reversed(t.shape.tolist()))
                      for t in reader.tensors} == {"token_embd.weight": (3, 8),
                                                   "blk.0.attn_q.weight": (8, 8)}


def test_the_planner_reads_models_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from lifeline.plan.models import load_plan_model\n"
            "from lifeline.plan.hardware import get_hardware\n"
            f"cfg = load_plan_model({str(default_model_path())!r})\n"
            "print(cfg.num_params(), load_plan_model('deepseek-v3').num_params(),"
            " get_hardware('h200').memory_bandwidth)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["268098176", str(preset_config("deepseek-v3").num_params()),
                                   "4800000000000.0"]


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "nothing-here", "no model '.*nothing-here': give a preset"),
    (lambda d: d, "has no config.json"),
    (lambda d: _write(d / "notes.txt", "hi"), "give a preset"),
    (lambda d: _write(d / "config.json", '{"model_type": "llama"}'),
     "not a Hugging Face model config"),
    (lambda d: _write(d / "fake.gguf", "GGUF"), "truncated or corrupt GGUF header"),
    (lambda d: _write(d / "other.gguf", "ggml"), "not a GGUF file"),
    (lambda d: _write(d / "config.json", json.dumps(_phi3())), "unsupported architecture 'phi3'"),
])
def test_anything_else_is_a_clear_error(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        load_plan_model(str(make(tmp_path)))


def _write(path, text):
    path.write_text(text)
    return path


def _phi3() -> dict:
    return {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
            "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 8192}

