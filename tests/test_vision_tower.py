"""The vision towers (SigLIP + each family's projector) against transformers' own on tiny
random configs: the same checkpoint tensors in, the same image embeddings out, for frames
processed by our processors from real Pillow images of different sizes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lifeline.media.processors import Gemma3Processor, Idefics3Processor
from lifeline.model.vision import VisionConfig, VisionTower

transformers = pytest.importorskip("transformers")

TOL = {"atol": 2e-5, "rtol": 1e-4}


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], -1)
    noise = rng.integers(-30, 31, rgb.shape)
    return Image.fromarray(np.clip(rgb + noise, 0, 255).astype(np.uint8), "RGB")


def _vision_dict(**over) -> dict:
    cfg = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "image_size": 64, "patch_size": 8,
           "layer_norm_eps": 1e-6}
    cfg.update(over)
    return cfg


def _text_dict(**over) -> dict:
    cfg = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16}
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def idefics3():
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(0)
    config = Idefics3Config(vision_config=_vision_dict(), text_config=_text_dict(),
                            scale_factor=2, image_token_id=299)
    model = Idefics3ForConditionalGeneration(config).eval()
    tower = VisionTower("idefics3", VisionConfig.from_hf(_vision_dict()), 64, scale_factor=2)
    tower.load_hf_state(model.state_dict())
    return model, tower


@pytest.mark.parametrize("size", [(64, 64), (150, 90), (40, 300)])
def test_idefics3_image_features_equal_transformers(idefics3, size):
    model, tower = idefics3
    processed = Idefics3Processor(longest_edge=128, side=64, image_seq_len=16)(_image(*size, 1))
    pixels = torch.from_numpy(processed.pixel_values)
    with torch.inference_mode():
        ref = model.model.get_image_features(pixel_values=pixels[None]).pooler_output[0]
    ours = tower.encode(pixels)
    assert ours.shape == (processed.frames * 16, 64) == ref.shape
    torch.testing.assert_close(ours, ref, **TOL)


def test_idefics3_frames_encode_alone_as_in_a_batch(idefics3):
    """Two images' frames in one call equal each image's alone."""
    _, tower = idefics3
    p = Idefics3Processor(longest_edge=128, side=64, image_seq_len=16)
    a, b = (torch.from_numpy(p(_image(w, h, s)).pixel_values)
            for w, h, s in ((150, 90, 2), (64, 64, 3)))
    both = tower.encode(torch.cat([a, b]))
    torch.testing.assert_close(both, torch.cat([tower.encode(a), tower.encode(b)]), **TOL)


@pytest.fixture(scope="module")
def gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    vision = _vision_dict(image_size=64, patch_size=4)  # a 16 × 16 patch grid
    config = Gemma3Config(vision_config=vision,
                          text_config=_text_dict(sliding_window=16, query_pre_attn_scalar=16),
                          mm_tokens_per_image=16, image_token_index=299, boi_token_index=297,
                          eoi_token_index=298)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zeros: make it say something
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name:
                p.normal_(0, 0.5)
    tower = VisionTower("gemma3", VisionConfig.from_hf(vision), 64, tokens_per_image=16)
    tower.load_hf_state(model.state_dict())
    return model, tower


@pytest.mark.parametrize("size,pan", [((64, 64), False), ((200, 70), True), ((33, 120), True)])
def test_gemma3_image_features_equal_transformers(gemma3, size, pan):
    model, tower = gemma3
    processed = Gemma3Processor(side=64, image_seq_len=16, pan_and_scan=pan,
                                min_crop=16)(_image(*size, 4))
    pixels = torch.from_numpy(processed.pixel_values)
    with torch.inference_mode():
        ref = model.model.get_image_features(pixel_values=pixels).pooler_output
    ours = tower.encode(pixels)
    assert ours.shape == (processed.frames * 16, 64)
    assert ref.abs().max() > 1e-3
    torch.testing.assert_close(ours, ref.flatten(0, 1), **TOL)


def test_a_checkpoint_without_the_tower_is_refused():
    tower = VisionTower("idefics3", VisionConfig.from_hf(_vision_dict()), 64)
    with pytest.raises(ValueError, match="lacks"):
        tower.load_hf_state({})


def test_a_frame_of_the_wrong_side_is_refused(idefics3):
    _, tower = idefics3
    with pytest.raises(ValueError, match="64×64"):
        tower.encode(torch.zeros(1, 3, 32, 32))
