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

Settings are a checkpoint's image-processor dictionary (`image_processor` in
processor_config.json, or preprocessor_config.json: lifeline.model.config reads either). A null
value takes the family's default, as in transformers; a key Lifeline does not know, or a value it
cannot follow (`do_resize: false`, a non-square Gemma 3 size), raises `ValueError` rather than
being ignored, since an image processed other than the checkpoint says gives other answers.
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


_COMMON_KEYS = frozenset({"do_convert_rgb", "do_resize", "size", "resample", "do_rescale",
                          "rescale_factor", "do_normalize", "image_mean", "image_std"})
_INERT_KEYS = frozenset({"image_processor_type", "processor_class", "image_seq_len",
                         "image_seq_length", "do_pad", "return_row_col_info",
                         "default_to_square", "video_sampling"})
"""Keys that change nothing in one image's pixels: names, the processor's own token count
(checked against the model where the config is read), padding to a batch's largest image
(each image here is processed alone) and SmolVLM's video settings."""
IDEFICS3_KEYS = _COMMON_KEYS | {"do_image_splitting", "max_image_size"}
GEMMA3_KEYS = _COMMON_KEYS | {"do_pan_and_scan", "pan_and_scan_min_crop_size",
                              "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate"}


def _given(config: dict[str, Any], known: frozenset[str], family: str) -> dict[str, Any]:
    """The settings without nulls; unknown keys and switches Lifeline cannot turn off are
    refused."""
    given = {k: v for k, v in config.items() if v is not None}
    unknown = sorted(set(given) - known - _INERT_KEYS)
    if unknown:
        raise ValueError(f"{family} image processor settings Lifeline does not understand: "
                         f"{', '.join(unknown)}")
    for key in ("do_convert_rgb", "do_resize"):
        if _flag(given, key, True) is False:
            raise ValueError(f"{family} image processor setting {key}: false is not supported")
    return given


def _flag(given: dict[str, Any], key: str, default: bool) -> bool:
    value = given.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"image processor setting {key} must be true or false; got {value!r}")
    return value


def _edge(given: dict[str, Any], key: str, default: int) -> int:
    """`{"longest_edge": n}` (Idefics3's `size` and `max_image_size`)."""
    value = given.get(key, {"longest_edge": default})
    edge = value.get("longest_edge") if isinstance(value, dict) else None
    if not isinstance(edge, int) or isinstance(edge, bool) or edge <= 0 or len(value) != 1:
        raise ValueError(f"image processor setting {key} must be {{\"longest_edge\": n}}; "
                         f"got {value!r}")
    return edge


def _resample(given: dict[str, Any], default: int) -> int:
    value = given.get("resample", default)
    if not isinstance(value, int) or isinstance(value, bool) or value not in range(6):
        raise ValueError(f"image processor setting resample must be a Pillow filter (0–5); "
                         f"got {value!r}")
    return value


def _scaling(given: dict[str, Any]) -> dict[str, Any]:
    """Rescale factor, mean and std; `do_rescale` / `do_normalize` false as their identity."""
    factor = given.get("rescale_factor", 1 / 255) if _flag(given, "do_rescale", True) else 1.0
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise ValueError(f"image processor setting rescale_factor must be a number; "
                         f"got {factor!r}")
    if not _flag(given, "do_normalize", True):
        return {"rescale_factor": float(factor), "mean": (0.0,) * 3, "std": (1.0,) * 3}
    return {"rescale_factor": float(factor), "mean": _channels(given, "image_mean"),
            "std": _channels(given, "image_std")}


def _channels(given: dict[str, Any], key: str) -> tuple[float, ...]:
    value = given.get(key, 0.5)
    values = [value] * 3 if isinstance(value, (int, float)) else value
    if (not isinstance(values, list | tuple) or len(values) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        raise ValueError(f"image processor setting {key} must be a number or three; "
                         f"got {value!r}")
    return tuple(float(v) for v in values)


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
        """From a checkpoint's image-processor settings (see the module's note)."""
        given = _given(config, IDEFICS3_KEYS, "Idefics3")
        return cls(longest_edge=_edge(given, "size", 4 * 364),
                   side=_edge(given, "max_image_size", 364), image_seq_len=image_seq_len,
                   split=_flag(given, "do_image_splitting", True),
                   resample=_resample(given, LANCZOS), **_scaling(given))

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
        """From a checkpoint's image-processor settings (see the module's note)."""
        given = _given(config, GEMMA3_KEYS, "Gemma 3")
        size = given.get("size", {"height": 896, "width": 896})
        side = size.get("height") if isinstance(size, dict) else None
        if (not isinstance(side, int) or side <= 0
                or size != {"height": side, "width": side}):
            raise ValueError(f"Gemma 3 image processor setting size must be a square "
                             f"{{\"height\": n, \"width\": n}}; got {size!r}")
        return cls(side=side, image_seq_len=image_seq_len, resample=_resample(given, BILINEAR),
                   **_scaling(given), pan_and_scan=_flag(given, "do_pan_and_scan", False),
                   min_crop=int(given.get("pan_and_scan_min_crop_size", 256)),
                   max_crops=int(given.get("pan_and_scan_max_num_crops", 4)),
                   min_ratio=float(given.get("pan_and_scan_min_ratio_to_activate", 1.2)))

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
