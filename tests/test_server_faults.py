"""Failures a user of `lifeline serve` can meet, seen from outside: a step that raises fails
only the request that made it raise (a 500, or an error event mid-stream) while the requests
beside it finish; a request past `--request-timeout` ends; a request with no `max_tokens` gets
the server's default; a model that cannot be loaded makes `lifeline serve` say why and exit
non-zero."""
import concurrent.futures as cf
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType as T

from lifeline.engine.engine import EngineConfig
from lifeline.model.default import default_model_path
from lifeline.model.gguf_reader import GGUFReader
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread, free_port

MODEL = "gemma-3-270m"
FAULT = {"X-Lifeline-Fault": "step"}


@pytest.fixture(scope="module")
def server(loaded):
    config = ServerConfig(enable_fault_injection=True, default_max_tokens=6,
                          engine=EngineConfig(kv_cache_memory_bytes=256 << 20))
    with ServerThread(loaded, config) as srv:
        yield srv


def _chat(base: str, headers: dict | None = None, stream: bool = False, **body) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}],
               "temperature": 0, "stream": stream, **body}
    return httpx.post(base + "/v1/chat/completions", json=payload, headers=headers or {},
                      timeout=120)


def _stream_events(response: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _held_blocks(server: ServerThread) -> int:
    kv = server.engine.block_manager
    return sum(g.num_blocks - g.num_free_blocks for g in kv.groups)


def test_a_faulty_request_gets_a_500_and_the_requests_beside_it_finish(server):
    base = server.base_url
    before = httpx.get(base + "/health").json()["step_errors"]["count"]
    with cf.ThreadPoolExecutor(6) as pool:
        good = [pool.submit(_chat, base, None, True, max_tokens=24, ignore_eos=True)
                for _ in range(4)]
        time.sleep(0.3)  # the good ones are decoding when the faulty one joins them
        bad_stream = pool.submit(_chat, base, FAULT, True, max_tokens=24)
        bad_plain = pool.submit(_chat, base, FAULT, False, max_tokens=24)
        for f in good:
            events = _stream_events(f.result())
            assert not any("error" in e for e in events)
            finish = [c["finish_reason"] for e in events for c in e["choices"]
                      if c["finish_reason"]]
            assert finish == ["length"]
        plain = bad_plain.result()
        assert plain.status_code == 500
        error = plain.json()["error"]
        assert error["code"] == "engine_error" and error["type"] == "server_error"
        assert "Traceback" not in error["message"] and "InjectedFault" not in error["message"]
        events = _stream_events(bad_stream.result())
        assert events[-1]["error"]["code"] == "engine_error"
    health = httpx.get(base + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    errors = health.json()["step_errors"]
    assert errors["count"] > before and errors["last_error"] == "InjectedFault"
    assert _held_blocks(server) == 0
    after = _chat(base, max_tokens=4)  # and the engine serves on
    assert after.status_code == 200


def test_the_fault_header_is_ignored_unless_fault_injection_is_on(loaded):
    config = ServerConfig(engine=EngineConfig(kv_cache_memory_bytes=64 << 20))
    with ServerThread(loaded, config) as srv:
        assert _chat(srv.base_url, FAULT, max_tokens=3).status_code == 200


def test_a_request_without_max_tokens_gets_the_server_default(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Write a long story about the sea."}],
        extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_request_timeout_ends_a_base_model_chat_that_never_stops(loaded):
    config = ServerConfig(request_timeout=1.0, default_max_tokens=100_000,
                          engine=EngineConfig(kv_cache_memory_bytes=64 << 20))
    with ServerThread(loaded, config) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        start = time.monotonic()
        out = client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "Tell me everything."}], extra_body={"ignore_eos": True})
        elapsed = time.monotonic() - start
        assert out.choices[0].finish_reason == "length"
        assert 0 < out.usage.completion_tokens
        assert elapsed < 30  # a generous bound: without the timeout it would run for hours
        assert _held_blocks(srv) == 0


def test_models_endpoint_reports_the_context_clamped_to_the_kv_cache(loaded):
    config = ServerConfig(engine=EngineConfig(kv_cache_memory_bytes=4 << 20))
    with ServerThread(loaded, config) as srv:
        card = httpx.get(srv.base_url + "/v1/models").json()["data"][0]
        kv = srv.engine.block_manager
        assert card["max_model_len"] == min(g.capacity_tokens() for g in kv.groups)
        assert card["max_model_len"] < card["context_length"]
        assert card["max_model_len_limited_by"] == "kv_cache"


def _serve_until_exit(model: str, timeout: float = 180) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "lifeline.cli", "serve", "--model", model, "--port",
         str(free_port()), "--no-compile"], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc.returncode, proc.stdout + proc.stderr


def _copy_with_unsupported_tensor(dst) -> None:
    """The default model with its first Q4_K tensor relabelled Q2_K. The tensor's info record
    (name, dimension count, dimensions, type) is found in the header by its bytes, so the
    type field is known without gguf-py's reader (~9 s on Gemma 3's vocabulary, twice)."""
    src = default_model_path()
    shutil.copyfile(src, dst)
    tensor = next(t for t in GGUFReader(str(src)).tensors if t.tensor_type == T.Q4_K)
    name = tensor.name.encode()
    dims = [int(d) for d in tensor.shape]
    record = struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
    with open(dst, "r+b") as f:
        header = f.read(tensor.data_offset)
        assert header.count(record) == 1
        where = header.index(record) + len(record)
        f.seek(where)
        assert struct.unpack("<I", f.read(4))[0] == T.Q4_K
        f.seek(where)
        f.write(struct.pack("<I", T.Q2_K))  # fewer bytes than the data: still a valid file
    assert next(t for t in GGUFReader(str(dst)).tensors
                if t.name == tensor.name).tensor_type == T.Q2_K


@pytest.mark.parametrize("case", ["missing", "corrupt", "unsupported"])
def test_serve_exits_non_zero_and_says_why_when_the_model_cannot_be_loaded(tmp_path, case):
    path = tmp_path / "model.gguf"
    if case == "corrupt":
        path.write_bytes(b"GGUF" + os.urandom(4096))
    elif case == "unsupported":
        _copy_with_unsupported_tensor(path)
    code, output = _serve_until_exit(str(path))
    assert code != 0
    assert "cannot load the model" in output
    expected = {"missing": "No such file", "corrupt": "", "unsupported": "Q2_K"}[case]
    assert expected in output
