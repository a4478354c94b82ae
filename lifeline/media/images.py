"""An image from a request's bytes, under limits: the formats accepted, the encoded size, the
pixels (read from the header before anything is decoded, so a decompression bomb costs a
header's parse), and malformed files: each refusal a `MediaError` that names the request
field, an HTTP 400.

The image is converted to RGB as Hugging Face's processors do (transparency composited onto
white) and identified by a hash of its pixels, so the same picture sent as PNG or as another
base64 spelling is the same image to the encoder cache and the prefix cache.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP")
"""What a request may send: the formats OpenAI's vision API accepts, less GIF."""
MIME = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?),", re.ASCII)


class MediaError(ValueError):
    """An image the server will not take (an HTTP 400); `param` names the request field."""

    def __init__(self, message: str, *, param: str = "messages", code: str = "invalid_image"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one image may cost before it is decoded."""

    max_bytes: int = 20 * 1024 * 1024
    """The encoded file (after base64), as OpenAI's 20 MB."""
    max_pixels: int = 33_177_600
    """Width × height, read from the header: 8K UHD (7,680 × 4,320). Pillow's own bomb
    threshold is 89 Mpx; the decoded RGB image here is at most ~100 MB."""
    max_side: int = 16_384
    max_images: int = 8
    """Images in one request."""


@dataclass(frozen=True, slots=True)
class DecodedImage:
    image: Image.Image
    """RGB."""
    hash: str
    """sha256 of the RGB pixels and the size: the image's identity in the caches."""
    format: str
    encoded_bytes: int
    original_mode: str

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        return self.image.size


def parse_data_url(url: str, *, param: str = "messages") -> tuple[str | None, bytes]:
    """(declared format or None, bytes) of a base64 `data:` URL."""
    match = _DATA_URL.match(url)
    if not match:
        raise MediaError("an image data URL is data:image/png|jpeg|webp;base64,<data>",
                         param=param)
    mime = (match["mime"] or "").lower()
    if mime and mime not in MIME:
        raise MediaError(f"an image data URL's type is one of {', '.join(sorted(MIME))}, "
                         f"not {mime[:40]!r}", param=param, code="unsupported_media_type")
    if "base64" not in match["params"].lower().split(";"):
        raise MediaError("an image data URL must be base64 (data:image/png;base64,...)",
                         param=param)
    payload = url[match.end():]
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("an image data URL's base64 is malformed", param=param) from None
    return MIME.get(mime), data


DECODED_BYTES_PER_PIXEL = 8
"""What decoding holds a pixel in, at most: Pillow's 4-byte pixel of the file's own image and
of its RGB conversion, both alive while it converts."""


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), *,
                 declared: str | None = None, param: str = "messages",
                 reserve: Callable[[int], None] | None = None) -> DecodedImage:
    """The RGB image in `data`, or a MediaError. `reserve(nbytes)` is told the memory decoding
    will take, read from the header, before any pixel is decoded (the server's image budget,
    which may refuse)."""
    if len(data) > limits.max_bytes:
        raise MediaError(f"an image is {len(data):,} bytes; the limit is "
                         f"{limits.max_bytes:,}", param=param, code="image_too_large")
    if not data:
        raise MediaError("an image is empty", param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = im.size  # the header only: nothing is decoded yet
            if width < 1 or height < 1:
                raise MediaError("an image has no pixels", param=param)
            if max(width, height) > limits.max_side or width * height > limits.max_pixels:
                raise MediaError(
                    f"an image is {width:,}×{height:,} pixels; the limits are "
                    f"{limits.max_pixels:,} pixels and {limits.max_side:,} a side",
                    param=param, code="image_too_large")
            fmt, mode = im.format or "?", im.mode
            if reserve is not None:
                reserve(width * height * DECODED_BYTES_PER_PIXEL)
            im.load()
            rgb = to_rgb(im)
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(f"an image's header claims more pixels than allowed ({str(e)[:120]}"
                         f"; the limit is {limits.max_pixels:,} pixels)", param=param,
                         code="image_too_large") from None
    except UnidentifiedImageError:
        raise MediaError(f"an image is not {', '.join(FORMATS)} (or its header is broken)",
                         param=param, code="unsupported_media_type") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt data
        raise MediaError(f"an image could not be decoded: {str(e)[:120]}", param=param) from None
    if declared and declared != fmt:
        raise MediaError(f"an image declared as {declared} is {fmt}", param=param,
                         code="unsupported_media_type")
    return DecodedImage(rgb, pixel_hash(rgb), fmt, len(data), mode)


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB as transformers' `convert_to_rgb`: an image with transparency (an alpha band or a
    palette's transparent index) is composited onto white."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def pixel_hash(im: Image.Image) -> str:
    h = hashlib.sha256()
    h.update(f"{im.mode}:{im.size[0]}x{im.size[1]}:".encode())
    h.update(im.tobytes())
    return h.hexdigest()
