"""A vision model read the way transformers saves it.

Tiny random SmolVLM-family (Idefics3) and Gemma 3 models whose processors transformers' own
`save_pretrained` wrote (transformers 5: the image processor's settings nested in
processor_config.json), and the same directories in the other layout, written by hand from
them (the older one many hub checkpoints ship: a flat preprocessor_config.json beside a
processor_config.json holding the processor's own settings). From either, Lifeline must give
the prompts, pixels and answers of transformers' processor (loaded by `AutoProcessor` from the
same directory) and its `generate`: alone, batched and from the prefix cache. A directory with
neither file, or with settings Lifeline does not understand, is refused at load.

Content given as a list of text parts reaches a template that loops over parts (SmolVLM's own
template) as transformers hands it over, not joined into a string it shows as nothing."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from lifeline import LLM, SamplingParams
from lifeline.engine.engine import EngineConfig
from lifeline.media.prepare import ImagePreparer
from lifeline.model.config import config_from_hf
from lifeline.model.loader import load_model
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread
from tests.test_server_vision import WORD_LIST, _png, _tokenizer, _url
from tests.test_vlm_reference import (
    G_BOI,
    G_EOI,
    G_IMAGE,
    G_SPECIALS,
    VOCAB,
    _picture,
    _prompt,
)

transformers = pytest.importorskip("transformers")

SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
"""HuggingFaceTB/SmolVLM-256M-Instruct's chat template: it loops over every message's parts."""
KV_BYTES = 16 << 20


def _other_layout(saved: Path, dest: Path) -> Path:
    """A copy of `saved` with its image processor's settings in the layout transformers did
    not write: flat in preprocessor_config.json if they were nested, nested if flat."""
    shutil.copytree(saved, dest)
    processor_file, flat_file = dest / "processor_config.json", dest / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
    if "image_processor" in processor:
        settings = processor.pop("image_processor")
        flat_file.write_text(json.dumps({**settings,
                                         "processor_class": processor["processor_class"]}))
    else:
        settings = json.loads(flat_file.read_text())
        flat_file.unlink()
        processor["image_processor"] = {k: v for k, v in settings.items()
                                        if k != "processor_class"}
    processor_file.write_text(json.dumps(processor))
    return dest


def _layouts(saved: Path, tmp: Path) -> dict[str, Path]:
    nested = "image_processor" in json.loads((saved / "processor_config.json").read_text())
    other = _other_layout(saved, tmp / "other")
    return {"nested": saved, "flat": other} if nested else {"nested": other, "flat": saved}


# --- SmolVLM (Idefics3) behind the server ------------------------------------------------------

@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tmp = tmp_path_factory.mktemp("smolvlm-layouts")
    (tmp / "tok").mkdir()
    vocab = _tokenizer(tmp / "tok")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp / "tok" / "tokenizer.json"),
                                  eos_token="</s>")
    # none of them the class's defaults: read wrongly, the tiles, the prompt and the pixels differ
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64},
                                       max_image_size={"longest_edge": 32}, resample=2,
                                       image_mean=[0.3, 0.5, 0.7], image_std=[0.6, 0.4, 0.5])
    processor = Idefics3Processor(images, tok, image_seq_len=4, chat_template=SMOLVLM_TEMPLATE)
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
    saved = tmp / "saved"
    processor.save_pretrained(saved)
    model.save_pretrained(saved)
    return model, _layouts(saved, tmp)


def _server(path: Path) -> ServerThread:
    return ServerThread(load_model(path), ServerConfig(
        served_model_name="vlm", max_images=2,
        engine=EngineConfig(kv_cache_memory_bytes=KV_BYTES, block_size=4)))


def _smolvlm_reference(model, path, messages, images, max_new_tokens=6):
    """transformers' processor as `AutoProcessor` reads it from `path`, then `generate`."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    if images:
        inputs = processor(text=text, images=[images], return_tensors="pt")
        extra = {"pixel_values": inputs["pixel_values"],
                 "pixel_attention_mask": inputs["pixel_attention_mask"]}
    else:
        inputs, extra = processor.tokenizer(text, return_tensors="pt"), {}
    with torch.inference_mode():
        out = model.generate(input_ids=inputs["input_ids"], max_new_tokens=max_new_tokens,
                             do_sample=False, **extra)
    ids = inputs["input_ids"][0].tolist()
    return ids, processor.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def _chat(srv, messages, max_tokens=6):
    body = {"model": "vlm", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(srv, messages):
    r = httpx.post(srv.base_url + "/tokenize", json={"model": "vlm", "messages": messages},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_a_smolvlm_saved_either_way_answers_as_transformers(smolvlm, layout):
    model, paths = smolvlm
    path = paths[layout]
    cases = []
    for seed, (width, height), words in ((1, (70, 40), WORD_LIST[3:8]),
                                         (2, (30, 50), WORD_LIST[12:15])):
        data, image = _png(width, height, seed)
        ours = [{"role": "user", "content": [
            {"type": "text", "text": " ".join(words)},
            {"type": "image_url", "image_url": {"url": _url(data)}}]}]
        theirs = [{"role": "user", "content": [{"type": "text", "text": " ".join(words)},
                                               {"type": "image"}]}]
        cases.append((ours, *_smolvlm_reference(model, path, theirs, [image])))
    with _server(path) as srv:
        for messages, ids, answer in cases:
            assert _tokens(srv, messages) == ids
            alone = _chat(srv, messages)
            assert alone["usage"]["prompt_tokens"] == len(ids)
            assert alone["choices"][0]["message"]["content"] == answer
        with ThreadPoolExecutor(len(cases)) as pool:
            batched = list(pool.map(lambda case: _chat(srv, case[0]), cases))
        for (_, ids, answer), got in zip(cases, batched):
            assert got["choices"][0]["message"]["content"] == answer
        again = _chat(srv, cases[0][0])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(cases[0][1]) - 4
        assert again["choices"][0]["message"]["content"] == cases[0][2]


def test_content_given_as_parts_reaches_a_template_that_loops_over_parts(smolvlm):
    """A system message and a user message as lists of text parts, under SmolVLM's template:
    the prompt and answer transformers gives (joined into strings, the template showed them as
    nothing); a repeat is served from the prefix cache."""
    model, paths = smolvlm
    system = [{"type": "text", "text": " ".join(WORD_LIST[40:46])}]
    user = [{"type": "text", "text": " ".join(WORD_LIST[50:53])},
            {"type": "text", "text": " " + WORD_LIST[60]}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    ids, answer = _smolvlm_reference(model, paths["nested"], messages, [])
    with _server(paths["nested"]) as srv:
        assert _tokens(srv, messages) == ids
        got = _chat(srv, messages)
        assert got["usage"]["prompt_tokens"] == len(ids)
        assert got["choices"][0]["message"]["content"] == answer
        again = _chat(srv, messages)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) - 4
        assert again["choices"][0]["message"]["content"] == answer


# --- Gemma 3 through the engine ---------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    tmp = tmp_path_factory.mktemp("gemma3-layouts")
    specials = {**G_SPECIALS, "<bos>": 2, "<eos>": 1}
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, **specials}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(specials))
    backend.save(str(tmp / "tokenizer.json"))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp / "tokenizer.json"), bos_token="<bos>", eos_token="<eos>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, resample=3,
                                     image_mean=[0.2, 0.4, 0.6], image_std=[0.7, 0.5, 0.3])
    processor = Gemma3Processor(images, tok, image_seq_length=16)
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
    saved = tmp / "saved"
    processor.save_pretrained(saved)
    model.save_pretrained(saved)
    for file in ("tokenizer.json", "tokenizer_config.json"):  # the engine reads ids only
        (saved / file).unlink(missing_ok=True)
    return model, _layouts(saved, tmp)


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_a_gemma3_saved_either_way_sees_images_as_transformers(gemma3, layout):
    from transformers import AutoImageProcessor

    model, paths = gemma3
    theirs = AutoImageProcessor.from_pretrained(paths[layout])
    llm = LLM(paths[layout], max_num_batched_tokens=20, block_size=4,
              kv_cache_memory_bytes=KV_BYTES)
    preparer = ImagePreparer(llm.loaded.config.vision)
    cases = [_prompt(preparer, [_picture(w, h, s)], [n, 3], seed=s, marker=G_BOI,
                     specials=G_SPECIALS) for w, h, s, n in ((32, 32, 3, 5), (70, 20, 4, 10))]
    for (w, h, s), (_, _, pixels) in zip(((32, 32, 3), (70, 20, 4)), cases):
        ref = theirs(_picture(w, h, s).image, return_tensors="np")["pixel_values"]
        np.testing.assert_array_equal(pixels.numpy(), ref)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    refs = []
    for ids, _, pixels in cases:
        ids_t = torch.tensor([ids])
        with torch.inference_mode():
            refs.append(model.generate(input_ids=ids_t, pixel_values=pixels,
                                       token_type_ids=(ids_t == G_IMAGE).long(),
                                       max_new_tokens=6, do_sample=False)[0, len(ids):].tolist())
    batched = llm.generate([{"prompt_token_ids": ids, "images": spans}
                            for ids, spans, _ in cases], params)
    assert [r.token_ids for r in batched] == refs
    for (ids, spans, _), ref in zip(cases, refs):
        alone = llm.generate({"prompt_token_ids": ids, "images": spans}, params)[0]
        assert alone.token_ids == ref
        assert alone.num_cached_tokens > 0  # the batched run left the prompt in the cache


# --- refused at load ----------------------------------------------------------------------------

def _copy_without_processor(paths, tmp_path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(paths["nested"], dest)
    for file in ("processor_config.json", "preprocessor_config.json"):
        (dest / file).unlink(missing_ok=True)
    return dest


def test_a_vision_model_without_its_processor_settings_is_refused(smolvlm, tmp_path):
    _, paths = smolvlm
    bare = _copy_without_processor(paths, tmp_path)
    with pytest.raises(ValueError, match="processor_config.json .* preprocessor_config.json"):
        config_from_hf(bare)
    # processor_config.json with only the processor's own settings is not enough either
    (bare / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    with pytest.raises(ValueError, match="neither is there"):
        load_model(bare)


@pytest.mark.parametrize("change,message", [
    ({"do_resize": False}, "do_resize: false"),
    ({"crop_pct": 0.9}, "does not understand: crop_pct"),
    ({"size": {"height": 64, "width": 64}}, "size must be"),
    ({"max_image_size": {"longest_edge": 16}}, "16 px frames; the vision encoder reads 32"),
    ({"image_mean": [0.5, 0.5]}, "image_mean must be"),
])
@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_settings_lifeline_does_not_understand_are_refused(smolvlm, tmp_path, layout, change,
                                                           message):
    _, paths = smolvlm
    dest = tmp_path / "model"
    shutil.copytree(paths[layout], dest)
    file = dest / ("processor_config.json" if layout == "nested" else "preprocessor_config.json")
    config = json.loads(file.read_text())
    settings = config["image_processor"] if layout == "nested" else config
    settings.update(change)
    file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        config_from_hf(dest)


def test_a_processor_token_count_other_than_the_models_is_refused(smolvlm, tmp_path):
    _, paths = smolvlm
    dest = tmp_path / "model"
    shutil.copytree(paths["nested"], dest)
    file = dest / "processor_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "image_seq_len": 9}))
    with pytest.raises(ValueError, match="image_seq_len is 9; the model gives each frame 4"):
        config_from_hf(dest)
