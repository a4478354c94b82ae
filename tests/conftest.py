"""Fixtures every module may use. The default model is loaded once for the whole run: the
modules that only read it (float32 weights, no compile) share it instead of each holding a copy
of its own. A module that starts a server defines `server` (its own configuration); `http` and
`client` then talk to that server."""
import atexit
import ctypes
import ctypes.util
import gc
import os
import shutil
import tempfile

import httpx
import openai
import pytest

from lifeline.model.loader import load_model
from tests.reference.gguf_views import use_plain_views

# Compiled graphs (lifeline.model.compiled) are cached in a directory of this run's own, which
# the servers the tests start inherit: the run shares them, and leaves nothing behind.
os.environ["LIFELINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="lifeline-test-cache-")
atexit.register(shutil.rmtree, os.environ["LIFELINE_CACHE_DIR"], True)
# `lifeline serve` started by a test compiles before /ready (tests/test_background_compile.py
# tests the background compile): a test's two requests never straddle the switch to compiled.
os.environ["LIFELINE_COMPILE_IN_BACKGROUND"] = "0"
# gguf-py's reader (the references', transformers' GGUF tokenizer's) parses a third as slowly
use_plain_views()


@pytest.fixture(scope="module", autouse=True)
def _release_the_module():
    """After each module, what its fixtures held (servers, engines, models caught in reference
    cycles) is collected and glibc's free heap handed back, so the next module in the same
    process starts from what the session really holds."""
    yield
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        ctypes.CDLL(libc).malloc_trim(0)


@pytest.fixture(scope="session")
def default_model():
    return load_model()


@pytest.fixture(scope="session")
def gemma3_reference():
    """transformers' Gemma 3 in float32 holding the default model's weights (the reference the
    engine and every weight format are held to), built once."""
    from lifeline.model.default import default_model_path
    from tests.reference.gemma3_hf import build_reference_gemma3

    model, _ = build_reference_gemma3(default_model_path())
    return model


@pytest.fixture(scope="session")
def hf_gemma_tokenizer():
    """transformers' tokenizer of the default model, built from its GGUF once for the run (the
    conversion reads the 262,144-token vocabulary through gguf-py: 35-39 s beside the other half
    of make test, once per module that asked before)."""
    from transformers import AutoTokenizer

    from lifeline.model.default import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


@pytest.fixture(scope="module")
def http(server):
    # idle connections dropped after 1 s, before uvicorn closes its end (5 s): a module's
    # tests reuse this client minutes apart, and a request sent on a connection the server is
    # closing met "Connection reset by peer" (test_wrong_method_is_an_openai_405, 2026-12-06)
    with httpx.Client(base_url=server.base_url, timeout=600,
                      limits=httpx.Limits(keepalive_expiry=1.0)) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI client, without retries (a retry would hide a server's error)."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=600,
                         max_retries=0)
