"""Build a model from a GGUF file, a Hugging Face directory, or a config with dummy weights."""
from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from lifeline.model import registry
from lifeline.model.config import ModelConfig, config_from_gguf_header, config_from_hf
from lifeline.model.default import default_model_path, named_model_path
from lifeline.model.gguf_file import GGUFFile
from lifeline.model.gguf_rows import StoredTensor
from lifeline.model.presets import preset_config
from lifeline.model.registry import build_model
from lifeline.tokenizer import GGUFTokenizer, HFTokenizer
from lifeline.tokenizer.cache import cached_tokenizer, keep_tokenizer

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: object | None
    source: str
    weight_format: str
    vision: nn.Module | None = None
    """A vision-language model's tower (lifeline.model.vision.VisionTower)."""
    load_seconds: float | None = None
    """How long `load_model` took (read and dequantize), for the start-up's phases."""
    chat_template: str | None = None
    """A GGUF file's own chat template, "" where it has none; None: not read (another kind of
    checkpoint, whose template the server finds itself)."""


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 norm_offset: float = 0.0, lazy: Iterable[str] = ()) -> None:
    """Assign tensors by name; every parameter must be given exactly once (tied heads aside),
    but those named in `lazy`, left on the meta device (`load_gguf(lazy=True)`)."""
    lazy = set(lazy)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in weights:
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {tuple(params[name].shape)}")
        if norm_offset and name.endswith("norm.weight"):
            tensor = tensor + norm_offset
        _set_param(model, name, tensor)
    cfg: ModelConfig = model.config
    if cfg.tie_word_embeddings or (model.lm_head.weight.is_meta
                                   and "lm_head.weight" not in lazy):
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta and n not in lazy]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


LAZY_FORMATS = ("gguf", "gguf-int8")
"""The weight formats that compute from a GGUF file's blocks and need no float32 layers."""


def lazy_load_for(weights: str | None, device: str | None) -> bool:
    """Whether a model the engine will run in `weights` on `device` may load lazily
    (`load_gguf(lazy=True)`): the CPU's formats that read the file's blocks."""
    return weights in LAZY_FORMATS and (device or "cpu").partition(":")[0] == "cpu"


def materialize_weights(model: nn.Module) -> None:
    """Dequantize the weights a lazy load left in the file's blocks (`load_gguf(lazy=True)`),
    for a use that needs float32 layers; nothing where none are left."""
    lazy = getattr(model, "lazy_weights", None)
    if not lazy:
        return
    for name, stored in lazy.items():
        _set_param(model, name, stored.dequantized())
    if model.lm_head.weight.is_meta:  # tied to the embedding, which is loaded now
        model.lm_head.weight = model.embed_tokens.weight
    model.lazy_weights = {}


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, nn.Parameter(tensor.contiguous(), requires_grad=False))


def init_dummy_weights(model: nn.Module, seed: int = 0, device: str | None = None) -> None:
    """Random weights of the right shapes, for performance work. With a GPU `device`, drawn
    there in bfloat16 (an 8B model's 16 GB in a second, where float32 on the CPU takes
    minutes): the same seed gives other values than on the CPU."""
    device = torch.device(device or "cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        if name.endswith("norm.weight"):
            tensor = torch.ones(param.shape, dtype=dtype, device=device)
        else:
            tensor = torch.randn(param.shape, generator=gen, dtype=dtype, device=device) * 0.02
        _set_param(model, name, tensor)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def gguf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m or m.group(2) not in _GGUF_LAYER_NAMES and m.group(2) != "ffn_norm":
        raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
    layer, kind, suffix = m.groups()
    return f"layers.{layer}.{_GGUF_LAYER_NAMES.get(kind, kind)}.{suffix}"


def _gguf_weights(gf, cfg: ModelConfig, skip: frozenset[str] = frozenset()
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    ffn_norm = registry.family(cfg.architecture).gguf_ffn_norm
    for gguf_name in gf.tensor_names:
        if gguf_name.startswith("rope_freqs"):
            continue
        name = gguf_tensor_name(gguf_name).replace("ffn_norm", ffn_norm)
        if name in skip:
            continue
        tensor = gf.load(gguf_name)
        if cfg.architecture == "llama" and re.search(r"attn_[qk]\.weight", gguf_name):
            heads = cfg.num_heads if "attn_q" in gguf_name else cfg.num_kv_heads
            tensor = _unpermute_rope(tensor, heads)
        yield name, tensor


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves Llama q/k rows for its RoPE; undo it for NEOX layout."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(
        w.shape)


def _stored_tensors(gf: GGUFFile, cfg: ModelConfig) -> dict[str, StoredTensor]:
    """Every 2-D tensor the GGUF kernels can read as stored, by our parameter names: a weight
    format may then drop their float32 copies (lifeline.model.gguf_rows). Views of the memory
    map: nothing is read until used."""
    ffn_norm = registry.family(cfg.architecture).gguf_ffn_norm
    stored = {}
    for gguf_name in gf.tensor_names:
        if gguf_name.startswith("rope_freqs") or not gguf_name.endswith(".weight"):
            continue
        tensor = StoredTensor.from_file(*gf.raw(gguf_name))
        if tensor is None:
            continue
        if cfg.architecture == "llama" and re.search(r"attn_[qk]\.weight", gguf_name):
            heads = cfg.num_heads if "attn_q" in gguf_name else cfg.num_kv_heads
            order = _unpermute_rope(torch.arange(tensor.raw.shape[0]), heads)
            tensor = StoredTensor(tensor.raw, tensor.qtype, tensor.cols, order)
        stored[gguf_tensor_name(gguf_name).replace("ffn_norm", ffn_norm)] = tensor
    return stored


def load_gguf(path: str | Path, dummy: bool = False, device: str | None = None,
              lazy: bool = False) -> LoadedModel:
    """`device`: where dummy weights are drawn (`init_dummy_weights`); real ones are
    dequantized on the CPU, and the engine places them. `lazy`: the layers' weights, the
    embedding and the head that the GGUF kernels read are not dequantized here but left on
    the meta device
    (`model.lazy_weights`, name -> stored tensor), for a weight format that computes from the
    file's blocks (`gguf`, `gguf-int8`, which dequantizes a layer only to quantize it to int8,
    lifeline.model.weight_format); any other use calls `materialize_weights` first (the
    engine does). The read of a 2-core start: 0.7 s of SmolLM2's 1.5, ~2 s of Gemma 3's
    (and Gemma 3's 671 MB float32 vocabulary, which only the int8 head's quantization reads)."""
    tokenizer = cached_tokenizer(path)  # a start after the first: 0.25 s, not 1.5 (Gemma 3)
    gf = GGUFFile(path, skip_tokenizer=tokenizer is not None)
    cfg = config_from_gguf_header(gf.metadata, {n: gf.tensor_shape(n) for n in gf.tensor_names})
    if not dummy:
        gf.check()  # an unsupported type or a cut file fails here, before any weight is read
    if tokenizer is None:
        tokenizer = GGUFTokenizer.from_gguf_reader(gf.reader)
        keep_tokenizer(path, tokenizer)
        gf.drop_tokenizer_fields()  # ~0.7 GB of parsed vocabulary arrays on Gemma 3: not held
    model = build_model(cfg)
    if dummy:
        init_dummy_weights(model, device=device)
    else:
        stored = _stored_tensors(gf, cfg)
        skip = frozenset(n for n in stored if lazy and (
            n.startswith("layers.") or n in ("embed_tokens.weight", "lm_head.weight")))
        load_weights(model, _gguf_weights(gf, cfg, skip), lazy=skip)
        model.stored_tensors = stored
        model.lazy_weights = {n: stored[n] for n in skip}
        gf.release_pages()
    types = sorted({gf.tensor_type(n).name for n in gf.tensor_names})
    template = gf.metadata.get("tokenizer.chat_template")
    return LoadedModel(model.eval(), cfg, tokenizer, str(path), "gguf:" + "+".join(types),
                       chat_template=template if isinstance(template, str) else "")


def _hf_weights(path: Path, vision: dict[str, torch.Tensor] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors, named as ours; a vision-language checkpoint's vision
    tensors go to `vision` (by their own names) instead."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        for name, tensor in load_file(file).items():
            if vision is not None and _VISION_NAME.match(name):
                vision[name] = tensor.float()
                continue
            name = re.sub(r"^(language_model\.)?(model\.)?(language_model\.|text_model\.)?",
                          "", name)
            yield name, tensor.float()


_VISION_NAME = re.compile(r"^(model\.)?(vision_model|vision_tower|connector|multi_modal_projector)\.")


def load_hf(path: str | Path, dummy: bool = False, device: str | None = None
            ) -> LoadedModel:
    path = Path(path)
    cfg = config_from_hf(path)
    model = build_model(cfg)
    tower = build_vision(cfg) if cfg.vision else None
    if dummy:  # a tower keeps torch's own random initialisation
        init_dummy_weights(model, device=device)
    else:
        vision: dict[str, torch.Tensor] | None = {} if tower is not None else None
        weights = _hf_weights(path, vision)
        if hasattr(model, "convert_hf_weights"):
            weights = model.convert_hf_weights(weights)
        load_weights(model, weights, registry.family(cfg.architecture).norm_offset)
        if tower is not None:
            tower.load_hf_state(vision)
    tokenizer = HFTokenizer(path) if (path / "tokenizer.json").exists() else None
    return LoadedModel(model.eval(), cfg, tokenizer, str(path), "safetensors",
                       tower.eval() if tower is not None else None)


def build_vision(cfg: ModelConfig) -> nn.Module:
    """The vision tower `cfg.vision` describes (its weights random until loaded)."""
    from lifeline.model.vision import VisionConfig, VisionTower

    spec = cfg.vision
    return VisionTower(spec.family, VisionConfig.from_hf(spec.vision), cfg.hidden_size,
                       scale_factor=spec.scale_factor, tokens_per_image=spec.tokens_per_image)


def load_preset(name: str, seed: int = 0, device: str | None = None) -> LoadedModel:
    """A preset architecture (lifeline/model/presets.py) with random weights, no tokenizer;
    drawn on `device` (`init_dummy_weights`)."""
    cfg = preset_config(name)
    model = build_model(cfg)
    init_dummy_weights(model, seed, device)
    tower = build_vision(cfg).eval() if cfg.vision else None  # torch's random initialisation
    return LoadedModel(model.eval(), cfg, None, f"preset:{name}", "dummy-f32", tower)


def attach_tokenizer(loaded: LoadedModel, path: str | Path) -> None:
    """Gives a model (a preset's random weights) the tokenizer at `path`, which must name
    every token the model can produce."""
    from lifeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size < loaded.config.vocab_size:
        raise ValueError(f"the tokenizer {path} has {tokenizer.vocab_size} tokens, fewer than "
                         f"the model's {loaded.config.vocab_size}")
    loaded.tokenizer = tokenizer


def load_model(path: str | Path | None = None, dummy: bool = False,
               device: str | None = None, lazy: bool = False) -> LoadedModel:
    """A GGUF file, a Hugging Face directory, `preset:NAME` (random weights), or a model's name
    (lifeline.model.default.NAMED_MODELS: `gemma-3-270m`, `smollm2-135m-instruct`). `device`:
    where random weights are drawn (the device the engine will run on). `lazy`: a GGUF file's
    layer weights left in its blocks until a weight format needs them (`load_gguf`; where
    `lazy_load_for` says so)."""
    start = time.perf_counter()
    loaded = _load_model(path, dummy, device, lazy)
    loaded.load_seconds = time.perf_counter() - start
    return loaded


def _load_model(path: str | Path | None, dummy: bool, device: str | None,
                lazy: bool = False) -> LoadedModel:
    if isinstance(path, str) and path.startswith("preset:"):
        return load_preset(path.removeprefix("preset:"), device=device)
    if path is None:
        path = default_model_path()
    elif isinstance(path, str) and not Path(path).exists():
        path = named_model_path(path) or path
    path = Path(path)
    if path.is_dir():
        return load_hf(path, dummy, device)
    if path.suffix == ".gguf" or path.is_file():
        return load_gguf(path, dummy, device, lazy=lazy)
    raise FileNotFoundError(f"no model at {path}: expected a .gguf file or a Hugging Face directory")
