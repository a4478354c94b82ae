"""Images: decoding under limits, and the image processors against transformers' own (the
Pillow backend) on real images made here with Pillow in several sizes and modes."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from lifeline.media.images import ImageLimits, MediaError, decode_image, parse_data_url
from lifeline.media.processors import Gemma3Processor, Idefics3Processor

transformers = pytest.importorskip("transformers")
from transformers.models.gemma3.image_processing_pil_gemma3 import (  # noqa: E402
    Gemma3ImageProcessorPil)
from transformers.models.idefics3.image_processing_pil_idefics3 import (  # noqa: E402
    Idefics3ImageProcessorPil)


def _picture(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    """A picture with edges and gradients (resampling filters differ on those), in `mode`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)),
                    ((x // 7 + y // 5) % 2) * 200], axis=-1).astype(np.int64)
    rgb = np.clip(rgb + rng.integers(-20, 21, rgb.shape), 0, 255).astype(np.uint8)
    im = Image.fromarray(rgb, "RGB")
    if mode == "RGBA":
        alpha = ((x + y) * 255 // max(width + height - 2, 1)).astype(np.uint8)
        im = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    elif mode == "P-transparent":
        im = im.quantize(colors=64)
        im.info["transparency"] = 3
    elif mode != "RGB":
        im = im.convert(mode)
    return im


def _encode(im: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    save = {"lossless": True} if fmt == "WEBP" else {"quality": 90} if fmt == "JPEG" else {}
    if fmt == "PNG" and "transparency" in im.info:
        save["transparency"] = im.info["transparency"]
    im.save(buf, format=fmt, **save)
    return buf.getvalue()


CASES = [  # (width, height, mode, format)
    (300, 200, "RGB", "PNG"),
    (97, 401, "RGBA", "PNG"),
    (640, 480, "L", "JPEG"),
    (128, 128, "P", "PNG"),
    (211, 90, "P-transparent", "PNG"),
    (50, 700, "RGB", "WEBP"),
    (1, 1, "RGB", "PNG"),
]


@pytest.mark.parametrize("width,height,mode,fmt", CASES)
def test_idefics3_pixels_equal_transformers(width, height, mode, fmt):
    data = _encode(_picture(width, height, mode), fmt)
    ours = Idefics3Processor(longest_edge=192, side=64, image_seq_len=4)
    theirs = Idefics3ImageProcessorPil(size={"longest_edge": 192},
                                       max_image_size={"longest_edge": 64})
    got = ours(decode_image(data).image)
    ref = theirs(Image.open(io.BytesIO(data)), return_row_col_info=True)
    expected = np.asarray(ref["pixel_values"])[0]
    assert got.pixel_values.shape == expected.shape
    np.testing.assert_array_equal(got.pixel_values, expected)
    assert (got.rows, got.cols) == (ref["rows"][0][0], ref["cols"][0][0])
    assert ours.grid(width, height) == (got.rows, got.cols)
    n, rows, cols = theirs.get_number_of_image_patches(height, width)
    assert (rows, cols) == (got.rows, got.cols) and n == (got.frames if rows else 0)


def test_idefics3_at_smolvlm_sizes_and_without_splitting():
    """SmolVLM-256M's own preprocessor settings (2,048 longest edge, 512 tiles), and the
    no-splitting path."""
    data = _encode(_picture(1000, 700, "RGB", seed=3), "PNG")
    config = {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512},
              "do_image_splitting": True, "resample": 1, "image_mean": [0.5] * 3,
              "image_std": [0.5] * 3, "rescale_factor": 1 / 255}
    ours = Idefics3Processor.from_config(config, image_seq_len=64)
    ref = Idefics3ImageProcessorPil(**config)(Image.open(io.BytesIO(data)),
                                             return_row_col_info=True)
    got = ours(decode_image(data).image)
    assert (got.rows, got.cols) == (3, 4) == (ref["rows"][0][0], ref["cols"][0][0])
    np.testing.assert_array_equal(got.pixel_values, np.asarray(ref["pixel_values"])[0])
    flat = Idefics3Processor.from_config({**config, "do_image_splitting": False},
                                         image_seq_len=64)
    ref = Idefics3ImageProcessorPil(**{**config, "do_image_splitting": False})(
        Image.open(io.BytesIO(data)))
    np.testing.assert_array_equal(flat(decode_image(data).image).pixel_values,
                                  np.asarray(ref["pixel_values"])[0])


def test_idefics3_placeholder_matches_the_processor_text():
    p = Idefics3Processor(image_seq_len=2)
    assert p.placeholder(0, 0) == ("<fake_token_around_image><global-img><image><image>"
                                   "<fake_token_around_image>")
    text = p.placeholder(1, 2)
    assert text.startswith("<fake_token_around_image><row_1_col_1><image><image>"
                           "<fake_token_around_image><row_1_col_2><image><image>\n\n")
    assert text.count("<image>") == 6


@pytest.mark.parametrize("width,height,mode,fmt", CASES)
@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_gemma3_pixels_equal_transformers(width, height, mode, fmt, pan_and_scan):
    data = _encode(_picture(width, height, mode), fmt)
    settings = {"size": {"height": 224, "width": 224}, "do_pan_and_scan": pan_and_scan,
                "pan_and_scan_min_crop_size": 32, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}
    ours = Gemma3Processor.from_config(settings)
    ref = Gemma3ImageProcessorPil(**settings)(Image.open(io.BytesIO(data)))
    got = ours(decode_image(data).image)
    np.testing.assert_array_equal(got.pixel_values, np.asarray(ref["pixel_values"]))
    assert got.crops == int(np.asarray(ref["num_crops"]).reshape(-1)[0])
    if pan_and_scan and max(width, height) / min(width, height) >= 2:
        assert got.crops >= 2


def test_gemma3_at_its_own_size():
    data = _encode(_picture(1200, 500, "RGB", seed=5), "JPEG")
    ref = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})(
        Image.open(io.BytesIO(data)))
    got = Gemma3Processor()(decode_image(data).image)
    assert got.pixel_values.shape == (1, 3, 896, 896)
    np.testing.assert_array_equal(got.pixel_values, np.asarray(ref["pixel_values"]))
    assert Gemma3Processor().placeholder().count("<image_soft_token>") == 256


# --- decoding under limits --------------------------------------------------------------------

def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1×1 PNG whose header claims width × height (a decompression bomb's header)."""
    data = bytearray(_encode(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG"))
    ihdr = data[12:29]  # type + 13 bytes of fields
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def test_a_decompression_bomb_is_refused_from_its_header():
    with pytest.raises(MediaError) as e:
        decode_image(_png_claiming(40_000, 40_000))
    assert e.value.code == "image_too_large" and "pixels" in str(e.value)
    with pytest.raises(MediaError):
        decode_image(_png_claiming(300, 300), ImageLimits(max_pixels=200 * 200))
    with pytest.raises(MediaError):
        decode_image(_png_claiming(20_000, 2), ImageLimits(max_side=16_384))


@pytest.mark.parametrize("data,code", [
    (b"", "invalid_image"),
    (b"hello, not an image", "unsupported_media_type"),
    (_encode(Image.new("RGB", (64, 64)), "PNG")[:60], "invalid_image"),
    (_encode(Image.new("RGB", (64, 64)), "GIF"), "unsupported_media_type"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "unsupported_media_type"),  # a broken header
])
def test_malformed_images_are_media_errors(data, code):
    with pytest.raises(MediaError) as e:
        decode_image(data)
    assert e.value.code == code


def test_too_many_bytes_is_refused_before_parsing():
    with pytest.raises(MediaError) as e:
        decode_image(b"\x00" * 2_000, ImageLimits(max_bytes=1_000))
    assert e.value.code == "image_too_large"


def test_data_urls():
    png = _encode(_picture(20, 10, "RGB"), "PNG")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    declared, data = parse_data_url(url)
    assert declared == "PNG" and data == png
    assert decode_image(data, declared=declared).size == (20, 10)
    for bad in ("data:image/png;base64,@@@@", "data:text/html;base64,AAAA",
                "data:image/png,rawbytes", "http://example.com/x.png"):
        with pytest.raises(MediaError):
            parse_data_url(bad)
    with pytest.raises(MediaError):  # a JPEG declared as PNG
        decode_image(_encode(_picture(20, 10, "RGB"), "JPEG"), declared="PNG")


def test_the_pixel_hash_names_the_picture_not_its_file():
    im = _picture(40, 30, "RGB", seed=1)
    png, webp = decode_image(_encode(im, "PNG")), decode_image(_encode(im, "WEBP"))
    assert png.hash == webp.hash
    other = decode_image(_encode(_picture(40, 30, "RGB", seed=2), "PNG"))
    assert other.hash != png.hash
    # RGBA over white: the hash is of what the model sees
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    assert decode_image(_encode(rgba, "PNG")).hash == \
        decode_image(_encode(Image.new("RGB", (8, 8), (255, 255, 255)), "PNG")).hash
