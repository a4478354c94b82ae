"""The model registry (lifeline/model/registry.py): each family's declared contract is what its
model does, and the model package imports cleanly, part by part."""
import dataclasses
import subprocess
import sys

import pytest
import torch

from lifeline.model import registry
from lifeline.model.config import ModelConfig
from lifeline.model.presets import PRESETS, preset_config

_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


class _RecordingConfig(ModelConfig):
    """A config that notes which of its fields are read."""

    __slots__ = ("seen",)

    def __getattribute__(self, name):
        if name in _FIELDS:
            object.__getattribute__(self, "seen").add(name)
        return object.__getattribute__(self, name)


def _recording(cfg: ModelConfig) -> _RecordingConfig:
    rec = _RecordingConfig.__new__(_RecordingConfig)
    for name in _FIELDS:
        object.__setattr__(rec, name, getattr(cfg, name))
    rec.seen = set()
    return rec


def test_each_family_reads_exactly_the_config_fields_it_declares():
    """Built from every preset of the family, as it is and with every layer sliding (on the
    meta device), a family's model reads the fields its `reads` names, all and no other."""
    buildable = [f for f in registry.families() if f.buildable]
    seen: dict[str, set[str]] = {f.name: set() for f in buildable}
    for name in PRESETS:
        preset = preset_config(name)
        if not registry.family(preset.architecture).buildable:
            continue  # shapes for the planner (DeepSeek's MLA): no model reads them
        sliding = dataclasses.replace(preset, sliding_window=preset.sliding_window or 64,
                                      layer_types=["sliding"] * preset.num_layers)
        for cfg in map(_recording, (preset, sliding)):
            family = registry.family(cfg.architecture)
            cfg.seen.clear()
            with torch.device("meta"):
                family.model()(cfg)
            seen[family.name] |= cfg.seen
    for family in registry.families():
        assert family.reads <= _FIELDS, family.name
    for family in buildable:
        assert seen[family.name] == family.reads, family.name


def test_every_registered_architecture_builds_its_familys_model():
    for family in registry.families():
        for architecture in family.architectures:
            cfg = ModelConfig(architecture, vocab_size=64, hidden_size=32, num_layers=2,
                              num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
            if not family.buildable:
                with pytest.raises(ValueError, match=f"no model for the {family.name} family"):
                    registry.build_model(cfg)
                continue
            model = registry.build_model(cfg)
            assert type(model) is family.model(), architecture
            assert registry.family_of(model) is family
            assert cfg.family == family.name


def test_an_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*qwen3"):
        registry.family("gpt2")


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("module", ["lifeline.model.loader", "lifeline.model.presets"])
def test_loader_and_presets_each_import_alone(module):
    _run(f"import {module}")


def test_configs_presets_and_the_registry_need_no_torch():
    out = _run("import sys; sys.modules['torch'] = None\n"
               "from lifeline.model import registry\n"
               "from lifeline.model.presets import preset_config\n"
               "cfg = preset_config('gemma-3-270m')\n"
               "print(cfg.family, cfg.num_params(), registry.family(cfg.architecture).compiles)")
    assert out.split() == ["gemma3", str(preset_config("gemma-3-270m").num_params()), "True"]


def test_model_families_import_no_compile_module():
    out = _run("import sys\n"
               "import lifeline.model.gemma3, lifeline.model.llama, lifeline.model.moe\n"
               "print('lifeline.model.compiled' in sys.modules)")
    assert out.strip() == "False"
