"""Images through `lifeline serve`: a tiny random SmolVLM-family model (Idefics3) with a word
tokenizer, asked through the official `openai` client with `image_url` data URLs. Its prompt
tokens and greedy answer must be what transformers' own Idefics3Processor and model give for
the same chat text and image; the image's stages show in `timings`; a repeated image hits the
encoder cache and the prefix cache; bad images are 400s that leave the server serving."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from lifeline.bench.workloads import WORDS
from lifeline.engine.engine import EngineConfig
from lifeline.model.loader import load_model
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
            *[f"<row_{r + 1}_col_{c + 1}>" for r in range(6) for c in range(6)]]
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}"
            "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<image>"
            "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
WORD_LIST = list(dict.fromkeys(WORDS))[:200]


def _tokenizer(path):
    vocab = {"[UNK]": 0, "</s>": 1, "user:": 2, "assistant:": 3,
             **{w: i + 4 for i, w in enumerate(WORD_LIST)}}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(SPECIALS)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return vocab


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    path = tmp_path_factory.mktemp("vlm")
    vocab = _tokenizer(path)
    torch.manual_seed(0)
    config = Idefics3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
        text_config={"vocab_size": len(vocab), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
                     "rope_theta": 10000.0, "model_type": "llama"},
        scale_factor=2, image_token_id=vocab["<image>"])
    model = Idefics3ForConditionalGeneration(config).float().eval()
    model.save_pretrained(path)
    processor_config = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32},
                        "do_image_splitting": True, "resample": 1, "image_mean": [0.5] * 3,
                        "image_std": [0.5] * 3, "rescale_factor": 1 / 255}
    (path / "preprocessor_config.json").write_text(json.dumps(processor_config))
    (path / "template.jinja").write_text(TEMPLATE)
    server_config = ServerConfig(served_model_name="vlm", chat_template=path / "template.jinja",
                                 max_images=2,
                                 engine=EngineConfig(num_kv_blocks=512, block_size=4))
    with ServerThread(load_model(path), server_config) as srv:
        yield srv, model, path, processor_config


def _png(width, height, seed) -> tuple[bytes, Image.Image]:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], -1) \
        + rng.integers(-40, 41, (height, width, 3))
    im = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue(), im


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _reference(model, path, processor_config, text, images, max_new_tokens):
    """transformers' Idefics3Processor over our tokenizer files, then its model's greedy."""
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="</s>")
    processor = Idefics3Processor(Idefics3ImageProcessorPil(**processor_config), tok,
                                  image_seq_len=4)
    inputs = processor(text=text, images=[images], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(input_ids=inputs["input_ids"],
                             pixel_values=inputs["pixel_values"],
                             pixel_attention_mask=inputs["pixel_attention_mask"],
                             max_new_tokens=max_new_tokens, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist(), tok


def _ask(client, parts, max_tokens=6):
    return client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": parts}], max_tokens=max_tokens,
        temperature=0, extra_body={"ignore_eos": True})


def test_an_image_request_matches_transformers_processor_and_model(vlm):
    srv, model, path, processor_config = vlm
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    words = " ".join(WORD_LIST[3:9])
    data_a, im_a = _png(70, 40, 1)
    data_b, im_b = _png(30, 50, 2)
    parts = [{"type": "text", "text": words},
             {"type": "image_url", "image_url": {"url": _url(data_a)}},
             {"type": "text", "text": " " + WORD_LIST[11]},
             {"type": "image_url", "image_url": {"url": _url(data_b)}}]
    got = _ask(client, parts)
    text = f"user: {words}<image> {WORD_LIST[11]}<image>\nassistant:"
    ids, ref, tok = _reference(model, path, processor_config, text, [im_a, im_b], 6)
    assert got.usage.prompt_tokens == len(ids)
    assert got.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)


def test_the_image_stages_are_timed_and_a_repeated_image_is_not_encoded_again(vlm):
    srv, *_ = vlm
    data, _ = _png(60, 60, 5)
    body = {"model": "vlm", "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": WORD_LIST[20]},
                                     {"type": "image_url", "image_url": {"url": _url(data)}}]}]}
    first = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    images = first["timings"]["images"]
    assert images["count"] == 1 and images["frames"] == 5 and images["tokens"] == 20
    assert images["decode_ms"] > 0 and images["preprocess_ms"] > 0
    assert images["encode_ms"] > 0 and images["encoder_cache_hits"] == 0
    assert images["splice_ms"] > 0 and images["fetch_ms"] == 0
    assert first["usage"]["prompt_tokens"] > 20
    anatomy = first["timings"]["prompt_anatomy"]
    assert anatomy["images"] == 4 * (2 + 4) + (3 + 4)  # 2 × 2 tiles (marker, tag, 4 image
    # tokens) and the global image (marker, tag, 4, marker)
    assert anatomy["total"] == first["usage"]["prompt_tokens"]
    assert sum(v for k, v in anatomy.items() if k != "total") == anatomy["total"]
    # the same request again: the prefix cache holds all of the image's tokens
    again = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert again["timings"]["images"]["prefix_cached"] == 1
    assert again["timings"]["images"]["encode_ms"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    # the same image after other text: its tokens are not cached, its embeddings are
    body["messages"][0]["content"][0]["text"] = WORD_LIST[21] + " " + WORD_LIST[22]
    moved = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert moved["timings"]["images"]["encoder_cache_hits"] == 1
    assert moved["timings"]["images"]["encode_ms"] == 0
    assert moved["usage"]["prompt_tokens_details"]["cached_tokens"] < 4
    metrics = httpx.get(srv.base_url + "/metrics", timeout=10).text
    assert 'lifeline:request_image_stage_seconds_count{model_name="vlm",stage="encode"}' in metrics
    assert 'lifeline:encoder_cache_hits_total{model_name="vlm"}' in metrics


@pytest.mark.parametrize("part,code", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "invalid_image"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                + base64.b64encode(b"not a png").decode()}},
     "unsupported_media_type"),
    ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}},
     "unsupported_image_url"),
    ({"type": "image_url", "image_url": {"url": "data:text/html;base64,PGI+"}},
     "unsupported_media_type"),
    ({"type": "image_url", "image_url": {"url": 5}}, "invalid_value"),  # the wrong type
])
def test_bad_images_are_400s_and_the_server_goes_on(vlm, part, code):
    srv, *_ = vlm
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=30, json={
        "model": "vlm", "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": WORD_LIST[1]},
                                                  part]}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"].endswith("image_url.url")
    assert set(error) >= {"message", "type", "param", "code"}
    ok = httpx.post(srv.base_url + "/v1/chat/completions", timeout=30, json={
        "model": "vlm", "max_tokens": 2, "messages": [{"role": "user",
                                                       "content": WORD_LIST[1]}]})
    assert ok.status_code == 200


def test_too_many_images_is_a_400(vlm):
    srv, *_ = vlm
    data, _ = _png(20, 20, 3)
    parts = [{"type": "image_url", "image_url": {"url": _url(data)}}] * 3
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=30, json={
        "model": "vlm", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and "at most 2 images" in r.json()["error"]["message"]


def test_the_bench_sends_synthetic_images(vlm):
    """`lifeline bench --images 1 --image-size 40x30` against the server: every request carries
    its own picture, and the server's usage counts the image's tokens."""
    import asyncio

    from lifeline.bench.run import BenchSettings, run_bench, synthetic_image_url

    srv, *_ = vlm
    assert synthetic_image_url(40, 30, 1) == synthetic_image_url(40, 30, 1)
    assert synthetic_image_url(40, 30, 1) != synthetic_image_url(40, 30, 2)
    r = asyncio.run(run_bench(BenchSettings(
        url=srv.base_url + "/v1", endpoint="chat", images=1, image_size="40x30", requests=3,
        input_tokens=8, output_tokens=3, tokenizer=None)))
    records = [x for x in r["requests"] if x["ok"]]
    assert len(records) == 3 and r["settings"]["images"] == 1
    for x in records:
        # 40 × 30 → 64 × 48 → 2 × 2 tiles of 32 and the whole image: 31 placeholder tokens
        assert x["usage_prompt_tokens"] >= x["expected_prompt_tokens"] + 31
        assert x["timings_raw"]["images"]["count"] == 1
    with pytest.raises(ValueError, match="--images needs --endpoint chat"):
        BenchSettings(url=srv.base_url, images=1)


def test_an_image_url_on_an_allowed_domain_is_still_refused_on_loopback(vlm):
    """--allowed-media-domains localhost: the name is allowed, its address (loopback) is not."""
    import dataclasses

    srv, model, path, _ = vlm
    config = dataclasses.replace(srv.config, allowed_media_domains=["localhost"])
    with ServerThread(load_model(path), config) as other:
        r = httpx.post(other.base_url + "/v1/chat/completions", timeout=30, json={
            "model": "vlm", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url",
                 "image_url": {"url": f"{other.base_url}/health".replace("127.0.0.1",
                                                                         "localhost")}}]}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "image_url_forbidden"


def test_the_dashboard_shows_an_image_requests_stages(vlm):
    """In Debian's chromium: the request's detail names its image stages, no console errors."""
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("the browser test needs Debian's chromium (apt-get install -y chromium)")
    srv, *_ = vlm
    data, _ = _png(50, 30, 9)
    answer = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "vlm", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": WORD_LIST[30]},
            {"type": "image_url", "image_url": {"url": _url(data)}}]}]}).json()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            problems = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
            page.goto(srv.base_url + "/dashboard")
            row = f'.row[data-request-id="{answer["id"]}"][data-state="finished"]'
            page.wait_for_selector(row, timeout=30000)
            page.click(f"{row} .id")
            note = page.locator(".stage-notes li", has_text="Images:")
            note.wait_for(timeout=30000)
            text = note.inner_text()
        finally:
            browser.close()
    assert "Images: 1 (" in text and "image tokens" in text and "encoder" in text
    assert problems == []
