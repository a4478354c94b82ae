"""A tiny random SmolVLM-family model (Idefics3: SigLIP, pixel shuffle, Llama decoder) made
with transformers: Lifeline's engine, fed images through its own processor and tower, must
give transformers' logits and greedy continuations, chunked or not, batched or alone, and
its prefix cache must tell two images apart."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from lifeline import LLM, SamplingParams
from lifeline.media.images import DecodedImage, pixel_hash
from lifeline.media.prepare import ImagePreparer

transformers = pytest.importorskip("transformers")

VOCAB = 300
IMAGE, FAKE, GLOBAL, NEWLINE = 299, 298, 297, 10
SPECIALS = {"<image>": IMAGE, "<fake_token_around_image>": FAKE, "<global-img>": GLOBAL,
            **{f"<row_{r + 1}_col_{c + 1}>": 200 + 6 * r + c for r in range(6) for c in range(6)}}


def _encode(text: str) -> list[int]:
    assert set(text) == {"\n"}, text  # the placeholders' only text
    return [NEWLINE] * len(text)


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(0)
    config = Idefics3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
        text_config={"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
                     "rope_theta": 10000.0, "model_type": "llama"},
        scale_factor=2, image_token_id=IMAGE)
    model = Idefics3ForConditionalGeneration(config).float().eval()
    path = tmp_path_factory.mktemp("smolvlm")
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32},
        "do_image_splitting": True, "resample": 1, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "rescale_factor": 1 / 255}))
    return model, path


def _picture(width: int, height: int, seed: int) -> DecodedImage:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], -1) \
        + rng.integers(-40, 41, (height, width, 3))
    im = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    return DecodedImage(im, pixel_hash(im), "PNG", 0, "RGB")


def _prompt(preparer, pictures, text_lengths, seed=0, marker=IMAGE, specials=SPECIALS):
    """Text ids around one marker per picture, expanded; (ids, spans, pixel_values)."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for i, n in enumerate(text_lengths):
        ids.extend(int(t) for t in rng.integers(11, 190, n))
        if i < len(pictures):
            ids.append(marker)
    prepared = [preparer.prepare(p) for p in pictures]
    ids = preparer.expand_ids(ids, prepared, specials, _encode)
    spans = preparer.spans(ids, prepared)
    pixels = torch.cat([torch.from_numpy(p.processed.pixel_values) for p in prepared])
    return ids, spans, pixels


def _reference_logits(model, ids, pixels):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), pixel_values=pixels[None]).logits[0]


@pytest.mark.parametrize("chunk", [512, 24])
def test_logits_match_transformers_with_two_images_of_different_sizes(smolvlm, chunk):
    model, path = smolvlm
    llm = LLM(path, max_num_batched_tokens=chunk, block_size=4)
    preparer = ImagePreparer(llm.loaded.config.vision)
    ids, spans, pixels = _prompt(preparer, [_picture(90, 60, 1), _picture(30, 30, 2)],
                                 [7, 5, 9])
    # the longest edge goes to 96 first: 90×60 is a 2 × 3 grid of 32-px tiles, 30×30 one of
    # 3 × 3; each with its global image
    assert [s.frames for s in spans] == [7, 10]
    ours = llm.prompt_logits(ids, images=spans)
    ref = _reference_logits(model, ids, pixels)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_identical_to_transformers_batched_and_alone(smolvlm):
    model, path = smolvlm
    llm = LLM(path, max_num_batched_tokens=40, block_size=4)
    preparer = ImagePreparer(llm.loaded.config.vision)
    cases = [_prompt(preparer, [_picture(w, h, s)], [n, 4], seed=s)
             for w, h, s, n in ((64, 64, 3, 5), (20, 70, 4, 11), (100, 40, 5, 2))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": ids, "images": spans}
                            for ids, spans, _ in cases], params)
    for (ids, spans, pixels), result in zip(cases, batched):
        with torch.inference_mode():
            ref = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels[None],
                                 max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        assert result.token_ids == ref
        alone = llm.generate({"prompt_token_ids": ids, "images": spans}, params)[0]
        assert alone.token_ids == result.token_ids


def test_the_prefix_cache_and_the_encoder_cache_tell_images_apart(smolvlm):
    model, path = smolvlm
    llm = LLM(path, max_num_batched_tokens=512, block_size=4)
    preparer = ImagePreparer(llm.loaded.config.vision)
    params = SamplingParams(max_tokens=1, temperature=0)
    a = _prompt(preparer, [_picture(64, 64, 7)], [8, 6], seed=1)
    b = _prompt(preparer, [_picture(64, 64, 8)], [8, 6], seed=1)  # same text, other image
    assert a[0] == b[0]  # the token ids alone cannot tell them apart
    first = llm.generate({"prompt_token_ids": a[0], "images": a[1]}, params)[0]
    other = llm.generate({"prompt_token_ids": b[0], "images": b[1]}, params)[0]
    again = llm.generate({"prompt_token_ids": a[0], "images": a[1]}, params)[0]
    assert first.num_cached_tokens == 0
    image_start = a[1][0].offset
    assert other.num_cached_tokens <= image_start  # only the text before the image is shared
    assert again.num_cached_tokens > a[1][0].end - 4  # the image's blocks are reused
    cache = llm.engine.executor.encoder_cache
    assert cache.misses == 2 and len(cache.entries) == 2
    ref_b = _reference_logits(model, b[0], b[2])
    assert other.token_ids[0] == int(ref_b[-1].argmax())
    # the same image in a new prompt (another text) is not encoded again
    c = _prompt(preparer, [_picture(64, 64, 7)], [3, 2], seed=9)
    llm.generate({"prompt_token_ids": c[0], "images": c[1]}, params)
    assert cache.hits >= 1 and cache.misses == 2
    assert c[1][0].timings.get("encoder_cache_hit") == 1.0


def test_images_on_a_text_model_are_refused(tmp_path):
    from tests.test_models_hf import tiny_model

    class Factory:
        def mktemp(self, name):
            return tmp_path

    _, _, path = tiny_model("llama", Factory())
    llm = LLM(path)
    smol = _picture(10, 10, 1)
    from lifeline.media.inputs import ImageSpan

    with pytest.raises(ValueError, match="takes no images"):
        llm.engine.add_request([1, 2, 3], images=[ImageSpan(smol.hash, (1,))])


# --- Gemma 3: SigLIP at its side, pooled to 16 tokens; the image's tokens attend both ways --

G_IMAGE, G_BOI, G_EOI = 299, 297, 298
G_SPECIALS = {"<image_soft_token>": G_IMAGE, "<start_of_image>": G_BOI,
              "<end_of_image>": G_EOI}


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 4},
        text_config={"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 3, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
                     "layer_types": ["sliding_attention", "sliding_attention",
                                     "full_attention"],
                     "query_pre_attn_scalar": 16, "max_position_embeddings": 1024},
        mm_tokens_per_image=16, image_token_index=G_IMAGE, boi_token_index=G_BOI,
        eoi_token_index=G_EOI)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name or "norm" in name:
                torch.nn.init.normal_(p, std=0.3)
    path = tmp_path_factory.mktemp("gemma3vlm")
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"height": 32, "width": 32}, "resample": 2, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "rescale_factor": 1 / 255}))
    return model, path


def _gemma_prompt(preparer, pictures, text_lengths, seed=0):
    return _prompt(preparer, pictures, text_lengths, seed, marker=G_BOI, specials=G_SPECIALS)


def _gemma_reference(model, ids, pixels):
    ids_t = torch.tensor([ids])
    with torch.inference_mode():
        return model(input_ids=ids_t, pixel_values=pixels,
                     token_type_ids=(ids_t == G_IMAGE).long()).logits[0]


@pytest.mark.parametrize("chunk", [512, 12])
def test_gemma3_logits_match_transformers_with_images_seen_both_ways(gemma3_vlm, chunk):
    """A 12-token budget would split each 16-token image: the scheduler keeps each image in
    one chunk (over the budget), as the both-ways mask needs."""
    model, path = gemma3_vlm
    llm = LLM(path, max_num_batched_tokens=chunk, block_size=4)
    assert llm.engine.scheduler.config.whole_images
    preparer = ImagePreparer(llm.loaded.config.vision)
    ids, spans, pixels = _gemma_prompt(preparer, [_picture(50, 40, 1), _picture(30, 90, 2)],
                                       [6, 9, 4])
    assert [s.num_embeds for s in spans] == [16, 16]
    ours = llm.prompt_logits(ids, images=spans)
    ref = _gemma_reference(model, ids, pixels)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    causal = llm.engine.executor.runner.both_ways
    assert causal  # and the mask matters: without it the logits differ
    llm.engine.executor.runner.both_ways = False
    try:
        plain = llm.prompt_logits(ids, images=spans)
    finally:
        llm.engine.executor.runner.both_ways = True
    assert (plain - ref).abs().max() > 1e-3


def test_gemma3_greedy_identical_to_transformers(gemma3_vlm):
    model, path = gemma3_vlm
    llm = LLM(path, max_num_batched_tokens=20, block_size=4)
    preparer = ImagePreparer(llm.loaded.config.vision)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cases = [_gemma_prompt(preparer, [_picture(w, h, s)], [n, 3], seed=s)
             for w, h, s, n in ((32, 32, 3, 5), (70, 20, 4, 10))]
    batched = llm.generate([{"prompt_token_ids": ids, "images": spans}
                            for ids, spans, _ in cases], params)
    for (ids, spans, pixels), result in zip(cases, batched):
        ids_t = torch.tensor([ids])
        with torch.inference_mode():
            ref = model.generate(input_ids=ids_t, pixel_values=pixels,
                                 token_type_ids=(ids_t == G_IMAGE).long(),
                                 max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
        assert result.token_ids == ref


def test_the_encoder_budget_spreads_images_over_steps(smolvlm):
    """Two requests with a 40-token image each (10 frames × 4) and a 48-token encoder budget:
    the first step encodes one image and takes the second request's text only up to its
    image; the outputs are those of a roomy budget."""
    model, path = smolvlm
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outputs = []
    for budget in (None, 48):
        probe = LLM(path, max_num_batched_tokens=512, block_size=4,
                    max_num_encoder_tokens=budget)
        preparer = ImagePreparer(probe.loaded.config.vision)
        cases = [_prompt(preparer, [_picture(40, 40, s)], [6, 3], seed=s) for s in (11, 12)]
        assert [c[1][0].num_embeds for c in cases] == [40, 40]
        for ids, spans, _ in cases:
            probe.engine.add_request(ids, params, images=spans)
        first = probe.engine.scheduler.schedule(0.0)
        second = first.scheduled[1]
        if budget:
            assert first.encoder_tokens == 40
            assert second.start + second.num_new_tokens == cases[1][1][0].offset
        else:
            assert first.encoder_tokens == 80
            assert second.num_new_tokens == len(cases[1][0])
        llm = LLM(path, max_num_batched_tokens=512, block_size=4,
                  max_num_encoder_tokens=budget)
        got = llm.generate([{"prompt_token_ids": ids, "images": spans}
                            for ids, spans, _ in cases], params)
        outputs.append([g.token_ids for g in got])
    assert outputs[0] == outputs[1]
