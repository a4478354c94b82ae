"""The image processors of the vision families: an RGB image to the pixel values its encoder
reads, and the placeholder text its tokens take in the prompt.

Each follows its family's Hugging Face processor step for step (the Pillow backend:
`Idefics3ImageProcessorPil`, `Gemma3ImageProcessorPil`): the same resampling filter at each
resize, uint8 between resizes, rescale in float64 to float32, normalise in float32, so the
pixel values are the same (tests/test_media.py compares them).

- Idefics3 / SmolVLM: the longest edge to `size` (the shorter kept in ratio, rounded up to
  even), then up to multiples of the encoder's side; an image larger than one side is split
  into side × side tiles, read row by row, followed by the whole image at side × side (the
  global image); each tile is one sequence of `image_seq_len` tokens.
- Gemma 3: the whole image to side × side (896); with pan and scan, an elongated image also
  gives 2–`max_crops` crops along its long side, each its own 896 × 896 frame.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

LANCZOS, BILINEAR, BICUBIC = Image.Resampling.LANCZOS, Image.Resampling.BILINEAR, \
    Image.Resampling.BICUBIC
IMAGE_MAX_SIDE = 4096
"""Idefics3's cap on an image after the first resize (transformers' MAX_IMAGE_SIZE)."""


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    pixel_values: np.ndarray
    """[frames, 3, side, side] float32."""
    rows: int = 0
    cols: int = 0
    """Idefics3's tile grid (0 × 0: the global image only)."""
    crops: int = 0
    """Gemma 3's pan-and-scan crops after the whole image."""

    @property
    def frames(self) -> int:
        return int(self.pixel_values.shape[0])


def _chw(im: Image.Image) -> np.ndarray:
    return np.moveaxis(np.asarray(im, dtype=np.uint8), -1, 0)


def _resize(chw: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 CHW → uint8 CHW through Pillow, as transformers' `resize` for uint8 input."""
    im = Image.fromarray(np.ascontiguousarray(np.moveaxis(chw, 0, -1)))
    return _chw(im.resize((width, height), resample=resample))


def _normalize(frames: list[np.ndarray], scale: float, mean: np.ndarray,
               std: np.ndarray) -> np.ndarray:
    out = []
    for f in frames:
        x = (f.astype(np.float64) * scale).astype(np.float32)
        out.append((x - mean[:, None, None]) / std[:, None, None])
    return np.stack(out).astype(np.float32, copy=False)


@dataclass(frozen=True)
class Idefics3Processor:
    longest_edge: int = 4 * 364
    """`size.longest_edge`: the whole image's longest edge before tiling."""
    side: int = 364
    """`max_image_size.longest_edge`: the encoder's input side (one tile)."""
    image_seq_len: int = 169
    split: bool = True
    resample: int = LANCZOS
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_config(cls, config: dict[str, Any], *, image_seq_len: int) -> Idefics3Processor:
        """From a checkpoint's preprocessor_config.json."""
        return cls(longest_edge=int(config.get("size", {}).get("longest_edge", 4 * 364)),
                   side=int(config.get("max_image_size", {}).get("longest_edge", 364)),
                   image_seq_len=image_seq_len,
                   split=bool(config.get("do_image_splitting", True)),
                   resample=int(config.get("resample", LANCZOS)),
                   mean=tuple(config.get("image_mean", (0.5,) * 3)),
                   std=tuple(config.get("image_std", (0.5,) * 3)),
                   rescale_factor=float(config.get("rescale_factor", 1 / 255)))

    def __call__(self, image: Image.Image) -> ProcessedImage:
        x = _chw(image)
        h, w = _longest_to(x.shape[1], x.shape[2], self.longest_edge)
        x = _resize(x, h, w, self.resample)
        side = self.side
        rows = cols = 0
        if self.split:
            h, w = _multiples_of(x.shape[1], x.shape[2], side)
            x = _resize(x, h, w, self.resample)
            if h > side or w > side:
                rows, cols = (h - side) // side + 1, (w - side) // side + 1
                frames = [x[:, r * side:(r + 1) * side, c * side:(c + 1) * side]
                          for r in range(rows) for c in range(cols)]
                frames.append(_resize(x, side, side, self.resample))
            else:
                frames = [x]
        else:
            frames = [_resize(x, side, side, self.resample)]
        pixels = _normalize(frames, self.rescale_factor, np.asarray(self.mean, np.float32),
                            np.asarray(self.std, np.float32))
        return ProcessedImage(pixels, rows, cols)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of an image of this size without processing it."""
        h, w = _longest_to(height, width, self.longest_edge)
        if not self.split:
            return 0, 0
        h, w = _multiples_of(h, w, self.side)
        if h > self.side or w > self.side:
            return (h - self.side) // self.side + 1, (w - self.side) // self.side + 1
        return 0, 0

    def placeholder(self, rows: int, cols: int) -> str:
        """The image's text in the prompt, as Idefics3Processor writes it."""
        seq = "<image>" * self.image_seq_len
        whole = f"<fake_token_around_image><global-img>{seq}<fake_token_around_image>"
        if not rows and not cols:
            return whole
        text = ""
        for r in range(rows):
            for c in range(cols):
                text += f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{seq}"
            text += "\n"
        return text + "\n" + whole


def _longest_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest edge to `longest`, the other in ratio rounded up to even; then under
    IMAGE_MAX_SIDE (transformers' two `_resize_output_size_*` steps)."""
    ratio = width / height
    if width >= height:
        width = longest
        height = int(width / ratio)
        height += height % 2
    else:
        height = longest
        width = int(height * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > IMAGE_MAX_SIDE:
        width, height = IMAGE_MAX_SIDE, int(IMAGE_MAX_SIDE / ratio)
    elif height > width and height > IMAGE_MAX_SIDE:
        height, width = IMAGE_MAX_SIDE, int(IMAGE_MAX_SIDE * ratio)
    return max(height, 1), max(width, 1)


def _multiples_of(height: int, width: int, side: int) -> tuple[int, int]:
    ratio = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / ratio) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * ratio) / side) * side
    return height, width


@dataclass(frozen=True)
class Gemma3Processor:
    side: int = 896
    image_seq_len: int = 256
    resample: int = BILINEAR
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    pan_and_scan: bool = False
    min_crop: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2
    tokens: dict[str, str] = field(default_factory=lambda: {
        "boi": "<start_of_image>", "image": "<image_soft_token>", "eoi": "<end_of_image>"})

    @classmethod
    def from_config(cls, config: dict[str, Any], *, image_seq_len: int = 256) -> Gemma3Processor:
        size = config.get("size", {})
        return cls(side=int(size.get("height", 896)), image_seq_len=image_seq_len,
                   resample=int(config.get("resample", BILINEAR)),
                   mean=tuple(config.get("image_mean", (0.5,) * 3)),
                   std=tuple(config.get("image_std", (0.5,) * 3)),
                   rescale_factor=float(config.get("rescale_factor", 1 / 255)),
                   pan_and_scan=bool(config.get("do_pan_and_scan") or False),
                   min_crop=int(config.get("pan_and_scan_min_crop_size") or 256),
                   max_crops=int(config.get("pan_and_scan_max_num_crops") or 4),
                   min_ratio=float(config.get("pan_and_scan_min_ratio_to_activate") or 1.2))

    def __call__(self, image: Image.Image) -> ProcessedImage:
        x = _chw(image)
        crops = self._crops(x) if self.pan_and_scan else []
        frames = [_resize(f, self.side, self.side, self.resample) for f in [x, *crops]]
        pixels = _normalize(frames, self.rescale_factor, np.asarray(self.mean, np.float32),
                            np.asarray(self.std, np.float32))
        return ProcessedImage(pixels, crops=len(crops))

    def _crops(self, x: np.ndarray) -> list[np.ndarray]:
        """Pan and scan: crops along an elongated image's long side (transformers' rule)."""
        height, width = x.shape[1:]
        if width >= height:
            if width / height < self.min_ratio:
                return []
            n_w = min(int(math.floor(width / self.min_crop)), int(math.floor(width / height + 0.5)))
            n_w, n_h = min(self.max_crops, max(2, n_w)), 1
        else:
            if height / width < self.min_ratio:
                return []
            n_h = min(int(math.floor(height / self.min_crop)), int(math.floor(height / width + 0.5)))
            n_h, n_w = min(self.max_crops, max(2, n_h)), 1
        cw, ch = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
        if min(cw, ch) < self.min_crop:
            return []
        return [x[:, ph:ph + ch, pw:pw + cw]
                for ph, pw in itertools.product([ch * i for i in range(n_h)],
                                                [cw * i for i in range(n_w)])]

    def placeholder(self, crops: int = 0) -> str:
        """The image's text in the prompt, as Gemma3Processor writes it."""
        t = self.tokens
        whole = f"\n\n{t['boi']}{t['image'] * self.image_seq_len}{t['eoi']}\n\n"
        if not crops:
            return whole
        return (f"Here is the original image {whole} and here are some crops to help you see "
                "better " + " ".join([whole] * crops))
