"""Vision towers: a SigLIP encoder and each family's projector into the language model's
embedding space. An image's frames (lifeline.media.processors) go in, one row per image token
comes out, in the order the prompt's placeholder lays them.

- Idefics3 / SmolVLM: SigLIP at the tile's side, then the connector: pixel shuffle (each
  `scale_factor` × `scale_factor` block of patches becomes one token of that many times the
  width) and a linear projection without bias.
- Gemma 3: SigLIP at 896 px, then the multimodal projector: average pooling of the patch grid
  down to `tokens_per_image` (256), a Gemma RMSNorm (x · (1 + w)) and a matrix product.

The processors give every frame at the encoder's full side (Idefics3 tiles are exactly one
side; Gemma 3 resizes to it), so the position ids are the patches' own and no patch is padding.
Parameter names are Hugging Face's, below the prefix each family's checkpoints use
(`VISION_PREFIXES`), so a checkpoint's tensors load by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionConfig:
        return cls(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                   num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                   image_size=cfg["image_size"], patch_size=cfg["patch_size"],
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-6),
                   num_channels=cfg.get("num_channels", 3),
                   hidden_act=cfg.get("hidden_act", "gelu_pytorch_tanh"))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    def params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h
        return (self.num_channels * self.patch_size ** 2 * h + h + self.num_patches * h
                + self.num_layers * layer + 2 * h)


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"vision activation {name!r} is not supported")


class SiglipAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.q_proj, self.k_proj = nn.Linear(h, h), nn.Linear(h, h)
        self.v_proj, self.out_proj = nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(o.transpose(1, 2).reshape(b, n, h))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _act(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size,
                                         stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight[: x.shape[1]]


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_layers))


class SiglipVisionModel(nn.Module):
    """`vision_model` in HF's naming: embeddings → encoder → post_layernorm."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        side = self.config.image_size
        if pixels.shape[-2:] != (side, side):
            raise ValueError(f"frames are {side}×{side}, not {tuple(pixels.shape[-2:])}")
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Idefics3Connector(nn.Module):
    def __init__(self, vision: VisionConfig, text_hidden: int, scale_factor: int):
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision.hidden_size * scale_factor ** 2,
                                                  text_hidden, bias=False)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[frames, n, d] → [frames, n / s², d · s²], as Idefics3's (rows of s patches folded
        into the width, then s such rows)."""
        b, n, d = x.shape
        s, side = self.scale_factor, math.isqrt(n)
        x = x.view(b, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(b, n // (s * s), d * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(x))


class Gemma3Projector(nn.Module):
    def __init__(self, vision: VisionConfig, text_hidden: int, tokens_per_image: int):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, text_hidden))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(vision.hidden_size))
        self.eps = vision.layer_norm_eps
        self.patches = vision.patches_per_side
        self.kernel = self.patches // math.isqrt(tokens_per_image)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.patches, self.patches)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        h = pooled.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(pooled)
        return torch.matmul(h, self.mm_input_projection_weight).type_as(x)


class VisionTower(nn.Module):
    """Encoder + projector: `encode(frames)` → [frames × tokens per frame, text hidden]."""

    def __init__(self, family: str, vision: VisionConfig, text_hidden: int, *,
                 scale_factor: int = 2, tokens_per_image: int = 256):
        super().__init__()
        self.family = family
        self.vision_model = SiglipVisionModel(vision)
        if family == "idefics3":
            self.projector: nn.Module = Idefics3Connector(vision, text_hidden, scale_factor)
            self.tokens_per_frame = vision.num_patches // scale_factor ** 2
        elif family == "gemma3":
            self.projector = Gemma3Projector(vision, text_hidden, tokens_per_image)
            self.tokens_per_frame = tokens_per_image
        else:
            raise ValueError(f"no vision tower for {family!r}")

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Timed as two stages by the caller if it wants them apart: see `encode_stages`."""
        return self.projector(self.vision_model(pixels)).flatten(0, 1)

    @torch.inference_mode()
    def encode_stages(self, pixels: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """(embeddings, encoder seconds, projector seconds)."""
        import time

        t0 = time.perf_counter()
        hidden = self.vision_model(pixels)
        t1 = time.perf_counter()
        out = self.projector(hidden).flatten(0, 1)
        return out, t1 - t0, time.perf_counter() - t1

    def load_hf_state(self, state: dict[str, torch.Tensor], family_prefixes=None) -> None:
        """Load a checkpoint's vision tensors (HF names); every parameter must be found."""
        prefixes = family_prefixes or VISION_PREFIXES[self.family]
        own = {}
        for name, tensor in state.items():
            for hf, mine in prefixes:
                if name.startswith(hf):
                    own[mine + name[len(hf):]] = tensor
                    break
        missing = set(self.state_dict()) - set(own)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} vision tensors, e.g. "
                             f"{sorted(missing)[:3]}")
        self.load_state_dict({k: v for k, v in own.items() if k in self.state_dict()})


VISION_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    # (checkpoint prefix, ours), the first that matches; transformers ≥ 4.52 puts the towers
    # under `model.`, and v5 drops SigLIP's `vision_model.` inside Gemma 3's tower
    "idefics3": (("model.vision_model.", "vision_model."), ("model.connector.", "projector."),
                 ("vision_model.", "vision_model."), ("connector.", "projector.")),
    "gemma3": (("model.vision_tower.vision_model.", "vision_model."),
               ("vision_tower.vision_model.", "vision_model."),
               ("model.vision_tower.", "vision_model."), ("vision_tower.", "vision_model."),
               ("model.multi_modal_projector.", "projector."),
               ("multi_modal_projector.", "projector.")),
}
