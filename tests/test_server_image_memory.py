"""What an image request holds, through `lifeline serve` on loopback with a tiny random
SmolVLM-family model (tests/test_server_vision.py builds the same): its decoded pictures and
frames are freed once they are used, nothing of them is left once it has ended, and the
images of queued requests are held to the server's image budget (503 with Retry-After over
it, 400 for a request that could never fit), the server answering all along."""
from __future__ import annotations

import gc
import json
import threading
import weakref

import httpx
import pytest
import torch

from lifeline.engine.engine import EngineConfig
from lifeline.model.loader import load_model
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread
from tests.test_server_vision import TEMPLATE, WORD_LIST, _png, _tokenizer, _url

transformers = pytest.importorskip("transformers")

TILE = 32
PROCESSOR = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": TILE},
             "do_image_splitting": True, "resample": 1, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "rescale_factor": 1 / 255}
FRAME_BYTES = 3 * TILE * TILE * 4
"""One float32 frame."""


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    path = tmp_path_factory.mktemp("vlm")
    vocab = _tokenizer(path)
    torch.manual_seed(0)
    config = Idefics3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": TILE, "patch_size": 8},
        text_config={"vocab_size": len(vocab), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 8192,
                     "rope_theta": 10000.0, "model_type": "llama"},
        scale_factor=2, image_token_id=vocab["<image>"])
    Idefics3ForConditionalGeneration(config).float().eval().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (path / "template.jinja").write_text(TEMPLATE)
    return path


def _server(path, **options) -> ServerThread:
    engine = EngineConfig(kv_cache_memory_bytes=16 << 20, block_size=4,
                          max_num_seqs=options.pop("max_num_seqs", 8))
    config = ServerConfig(served_model_name="vlm", chat_template=path / "template.jinja",
                          max_images=2, engine=engine, **options)
    return ServerThread(load_model(path), config)


def _chat(images, text=WORD_LIST[3], max_tokens=3, **extra):
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": _url(data)}} for data in images]
    return {"model": "vlm", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": parts}], **extra}


class _Watch:
    """Weak references to every decoded picture the server's image preparer is given and every
    frames array it makes: it prepares as before, and the test sees what is still alive."""

    def __init__(self, prepare):
        self.prepare = prepare
        self.pictures: list[weakref.ref] = []
        self.frames: list[weakref.ref] = []

    def __call__(self, decoded, *args):
        out = self.prepare(decoded, *args)
        self.pictures.append(weakref.ref(decoded.image))
        self.frames.append(weakref.ref(out.processed.pixel_values))
        return out

    def alive(self) -> tuple[int, int]:
        gc.collect()
        return (sum(r() is not None for r in self.pictures),
                sum(r() is not None for r in self.frames))


def test_nothing_of_a_finished_image_request_stays_referenced(vlm_dir):
    """A two-image request and a streamed one, then a few text requests: none of their decoded
    pictures nor frames is alive (the encoder cache keeps embeddings only), and the image
    budget holds nothing."""
    with _server(vlm_dir) as srv:
        chat = srv.state.chat
        watch = chat.preparer.prepare = _Watch(chat.preparer.prepare)
        url = srv.base_url + "/v1/chat/completions"
        (a, _), (b, _) = _png(70, 40, 1), _png(30, 50, 2)
        r = httpx.post(url, json=_chat([a, b]), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["timings"]["images"]["count"] == 2
        assert len(watch.frames) == 2 and watch.pictures[0]() is None  # gone once processed
        (c, _) = _png(50, 30, 7)
        with httpx.stream("POST", url, json=_chat([c], stream=True), timeout=60) as streamed:
            assert streamed.status_code == 200
            assert "data: [DONE]" in list(streamed.iter_lines())
        for i in range(3):
            r = httpx.post(url, timeout=60, json={
                "model": "vlm", "max_tokens": 2,
                "messages": [{"role": "user", "content": WORD_LIST[5 + i]}]})
            assert r.status_code == 200
        assert watch.alive() == (0, 0)
        assert chat.image_budget.used == 0
        # the same pictures again: their embeddings come from the encoder cache (bounded,
        # embeddings only), and the request leaves nothing either
        again = httpx.post(url, json=_chat([a, b], text=WORD_LIST[9]), timeout=60).json()
        assert again["timings"]["images"]["encoder_cache_hits"] == 2
        assert watch.alive() == (0, 0) and chat.image_budget.used == 0


def test_queued_images_beyond_the_budget_get_503_and_the_server_goes_on(vlm_dir):
    """One slot in the engine, taken by a long stream: an image request waits in the queue
    holding its frames (its decoded picture already freed). With a budget that fits one such
    request, a second gets 503 with Retry-After (OpenAI error JSON), an image that could never
    fit gets 400, the server answers /health throughout; once the stream ends the queued
    request is answered, its charge is gone and the second one goes through."""
    data, _ = _png(60, 60, 5)  # 64 × 64: 2 × 2 tiles and the whole image, 5 frames
    held = 5 * FRAME_BYTES + len(data)
    budget = held + 60 * 60 * 8 // 2  # the next picture's decoding does not fit beside it
    with _server(vlm_dir, max_num_seqs=1, max_queued_image_bytes=budget) as srv:
        chat = srv.state.chat
        watch = chat.preparer.prepare = _Watch(chat.preparer.prepare)
        url = srv.base_url + "/v1/chat/completions"
        with httpx.stream("POST", url, timeout=60, json={
                "model": "vlm", "max_tokens": 8000, "stream": True, "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": WORD_LIST[2]}]}) as long:
            lines = long.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            queued: dict = {}
            waiter = threading.Thread(target=lambda: queued.update(
                r=httpx.post(url, json=_chat([data]), timeout=120)))
            waiter.start()
            while chat.image_budget.used < held and waiter.is_alive():
                threading.Event().wait(0.01)
            assert chat.image_budget.used == held  # queued behind the stream, not encoded
            assert watch.alive() == (0, 1)

            refused = httpx.post(url, json=_chat([data], text=WORD_LIST[4]), timeout=30)
            assert refused.status_code == 503, refused.text
            assert float(refused.headers["retry-after"]) > 0
            error = refused.json()["error"]
            assert error["code"] == "image_budget_full"
            assert set(error) >= {"message", "type", "param", "code"}

            huge, _ = _png(200, 200, 6)  # its decoding alone is over the budget
            never = httpx.post(url, json=_chat([huge]), timeout=30)
            assert never.status_code == 400 and never.json()["error"]["code"] == \
                "images_too_large"
            assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
            assert waiter.is_alive() and chat.image_budget.used == held
        waiter.join(120)  # the stream closed: its request is aborted, the queued one runs
        assert queued["r"].status_code == 200, queued["r"].text
        assert chat.image_budget.used == 0
        retried = httpx.post(url, json=_chat([data], text=WORD_LIST[4]), timeout=60)
        assert retried.status_code == 200, retried.text
