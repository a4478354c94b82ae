"""Two tenants behind one gateway, for the tests that hold tenants apart wherever a request is
served (tests/test_server_tenants.py: a local engine in the gateway's process;
tests/test_scale_out_ray.py: a Ray replica): a tiny random SmolVLM-family model (Idefics3) with
a word tokenizer, so that both caches a tenant could learn from are in play, the prefix cache
and the encoder (image) cache. `check_tenants_and_options` is what must hold there, with the
server options `TENANT_OPTIONS` names given to that backend."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from lifeline.bench.workloads import WORDS

KEYS = {"a": "tenant-key-a", "b": "tenant-key-b"}
ADMIN = "tenant-admin-key"
WORD_LIST = list(dict.fromkeys(WORDS))[:200]
SPECIALS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
            *[f"<row_{r + 1}_col_{c + 1}>" for r in range(6) for c in range(6)]]
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}"
            "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<image>"
            "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TENANT_OPTIONS = {"max_images": 1, "max_image_pixels": 2000,
                  "allowed_media_domains": ["localhost"], "default_max_tokens": 3,
                  "rate_limit_rpm": 16}
"""What the backend under test is given (as flags of `lifeline serve --ray`, or as keys of the
gateway file): each must take effect there."""


def tiny_vlm(path: Path) -> Path:
    """A random two-layer Idefics3 at `path` with its word tokenizer, image processor settings
    and chat template (`path / "template.jinja"`): a 40 x 40 image is 5 frames of 4 tokens."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
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
    torch.manual_seed(0)
    config = Idefics3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
        text_config={"vocab_size": len(vocab), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
                     "rope_theta": 10000.0, "model_type": "llama"},
        scale_factor=2, image_token_id=vocab["<image>"])
    Idefics3ForConditionalGeneration(config).float().eval().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32},
        "do_image_splitting": True, "resample": 1, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "rescale_factor": 1 / 255}))
    (path / "template.jinja").write_text(TEMPLATE)
    return path


def image_url(width: int, height: int, seed: int) -> str:
    """A noisy gradient as a PNG data: URL."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], -1) \
        + rng.integers(-40, 41, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Tenants:
    """Requests of tenants a and b (and the admin) to one gateway, counted per tenant."""

    def __init__(self, base_url: str, model: str):
        self.base, self.model = base_url, model
        self.sent = {"a": 0, "b": 0}

    def headers(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {ADMIN if who == 'admin' else KEYS[who]}"}

    def chat(self, who: str, words: list[str], images: list[str], **extra: Any
             ) -> httpx.Response:
        parts = [{"type": "text", "text": " ".join(words)},
                 *({"type": "image_url", "image_url": {"url": u}} for u in images)]
        body = {"model": self.model, "temperature": 0, "ignore_eos": True, "max_tokens": 2,
                "messages": [{"role": "user", "content": parts}], **extra}
        self.sent[who] += 1
        return httpx.post(self.base + "/v1/chat/completions", headers=self.headers(who),
                          timeout=180, json={k: v for k, v in body.items() if v is not None})

    def seen(self, who: str, words: list[str], images: list[str], **extra: Any
             ) -> tuple[int, dict[str, Any]]:
        """(cached prompt tokens, the backend's `timings.images`) of one answered request."""
        r = self.chat(who, words, images, **extra)
        assert r.status_code == 200, r.text
        body = r.json()
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        return cached, body["timings"]["backend"]["timings"]["images"]

    def decisions(self, who: str) -> list[dict[str, Any]]:
        r = httpx.get(self.base + "/gateway/decisions?limit=256", headers=self.headers(who),
                      timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["data"]


def check_tenants_and_options(base_url: str, model: str, model_dir: Path) -> None:
    """Through the gateway at `base_url`, serving the tiny VLM at `model_dir` as `model` with
    `salt_cache_by_api_key` and TENANT_OPTIONS: each tenant hits its own prefix-cache blocks and
    image embeddings and never the other's (not even by guessing a salt); each sees only its
    own decisions and no debug view; every option given took effect."""
    t = Tenants(base_url, model)
    img = image_url(40, 40, 7)
    words = WORD_LIST[3:11]
    cached, images = t.seen("a", words, [img])
    assert cached == 0 and images["encode_ms"] > 0 and images["encoder_cache_hits"] == 0
    cached, images = t.seen("a", words, [img])
    assert cached >= 16 and images["encode_ms"] == 0, "tenant a hits its own blocks"
    cached, images = t.seen("b", words, [img])
    assert cached == 0, "tenant b learned that tenant a sent this prompt"
    assert images["encoder_cache_hits"] == 0 and images["encode_ms"] > 0, \
        "tenant b learned that tenant a sent this image"
    cached, images = t.seen("b", WORD_LIST[20:24], [img])
    assert images["encoder_cache_hits"] == 1 and images["encode_ms"] == 0, \
        "tenant b reuses its own image embeddings"
    cached, images = t.seen("b", words, [img], cache_salt="guess")
    assert cached == 0 and images["encoder_cache_hits"] == 0
    cached, _ = t.seen("a", WORD_LIST[40:44], [img], cache_salt="x" * 1024)
    assert cached == 0

    # the backend's options took effect there
    two = t.chat("a", words, [img, img])
    assert two.status_code == 400 and "at most 1 images" in two.json()["error"]["message"]
    large = t.chat("a", words, [image_url(60, 60, 8)])  # 3,600 pixels, over 2,000
    assert large.status_code == 400 and large.json()["error"]["code"] == "image_too_large"
    fetched = t.chat("a", words, ["http://localhost:9/cat.png"])  # allowed, but loopback
    assert fetched.status_code == 400, fetched.text
    assert fetched.json()["error"]["code"] == "image_url_forbidden"
    unbounded = t.chat("a", words, [], max_tokens=None)
    assert unbounded.json()["usage"]["completion_tokens"] == 3  # default_max_tokens
    bad_salt = t.chat("b", words, [], cache_salt="")
    assert bad_salt.status_code == 400 and bad_salt.json()["error"]["param"] == "cache_salt"
    t.sent["b"] -= 1  # refused by the gateway itself: no decision

    # each tenant sees its own decisions, the admin everyone's; no tenant sees debug views
    mine = {who: t.decisions(who) for who in ("a", "b")}
    assert {who: len(rows) for who, rows in mine.items()} == t.sent
    assert len(t.decisions("admin")) == sum(t.sent.values())
    for who in ("a", "b"):
        r = httpx.get(base_url + "/debug/requests", headers=t.headers(who), timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = httpx.get(base_url + "/debug/requests", headers=t.headers("admin"), timeout=30)
    assert r.json().get("error", {}).get("code") != "admin_key_required"

    # the cards show no path and no key
    cards = httpx.get(base_url + "/v1/models", headers=t.headers("a"), timeout=30).text
    for secret in (str(model_dir), *KEYS.values(), ADMIN):
        assert secret not in cards

    # the gateway's request limit per key (last: it refuses what follows)
    limit = TENANT_OPTIONS["rate_limit_rpm"]
    statuses = [httpx.post(base_url + "/tokenize", headers=t.headers("b"), timeout=30,
                           json={"model": model, "prompt": "w"}).status_code
                for _ in range(limit + 1)]
    assert 429 in statuses and statuses.index(429) >= limit - t.sent["b"], statuses
    assert set(statuses[:statuses.index(429)]) == {200}, statuses
