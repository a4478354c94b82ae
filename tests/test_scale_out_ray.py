"""Engine replicas on Ray Serve behind the gateway (docs/scale-out.md), on a local Ray instance:
two replicas of a tiny random Llama (built here with transformers, with a word-level tokenizer
so that every token is text), the real `openai` client against the gateway on loopback. One
replica is killed while requests stream and wait on it: the one whose answer had begun ends
with an error event, the ones still waiting for their first token are retried on the live
replica and answered once, and new requests go to the live replicas only. Ray is shut down at
the end with none of its processes left behind."""
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import openai
import pytest

from lifeline.cli import main
from lifeline.gateway.config import ConfigError, parse_config

try:
    with warnings.catch_warnings():  # Ray Serve's pydantic models use deprecated Field keywords
        warnings.simplefilter("ignore", DeprecationWarning)
        import ray
        from ray import serve

    from lifeline.gateway.ray_serve import DEPLOYMENT, app_name, deployment_options
    from lifeline.gateway.testing import GatewayThread
except ImportError as exc:
    ray = None
    print(f"tests/test_scale_out_ray.py: Ray Serve cannot be imported ({exc}): its tests skip")
needs_ray = pytest.mark.skipif(ray is None, reason="Ray Serve is not installed (pip install "
                               "'lifeline[ray]')")

VOCAB = 320
PROMPT = [5, 6, 7, 8]
SHORT = 8
"""Tokens a short request asks for (ignore_eos: always exactly these many)."""


def _tiny_model(path: Path):
    """A random two-layer Llama and a tokenizer whose token i is the word `w<i>`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=VOCAB, max_position_embeddings=8192, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    return model, tokenizer


def _config(model_dir: Path) -> str:
    return f"""
[health]
interval_s = 0.5

[circuit_breaker]
failures = 2                 # a replica's death must not open it (Ray replaces the replica)

[backends.tiny]
kind = "ray"
model = "{model_dir}"
served_model_name = "tiny"
num_cpus = 0.5
max_ongoing_requests = 3     # one running in the engine, two waiting there for their turn
[backends.tiny.autoscaling]
min_replicas = 2
max_replicas = 3
target_ongoing_requests = 100    # reaches Ray; never asks for a third replica here
[backends.tiny.engine]
weights = "fp32"
compile = false
max_num_seqs = 1
kv_cache_memory_bytes = "16MiB"

[models.tiny]
backends = ["tiny"]
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model, tokenizer = _tiny_model(path)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance for this module; afterwards, none of its processes may remain.
    On a loaded 2-core machine Ray's raylet gave up waiting for its dashboard agent to start
    (`WaitForDashboardAgentPorts`) and the instance never came up: the test gives its agents
    longer to register (the raylet reads the limit from its environment)."""
    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
             log_to_driver=False, namespace="lifeline")
    session = Path(ray._private.worker._global_node.get_session_dir_path()).name
    yield
    serve.shutdown()
    ray.shutdown()
    left = _processes_of(session)
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _processes_of(session)
    assert not left, f"Ray processes left running: {left}"


def _processes_of(session: str) -> list[str]:
    """Processes whose command line names this Ray session (its raylet, GCS, workers)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if session in cmdline and int(pid) != os.getpid():
            out.append(f"{pid}: {cmdline[:120]}")
    return out


@pytest.fixture(scope="module")
def gateway(cluster, tiny):
    with GatewayThread(parse_config(_config(tiny[0]), ".toml")) as gw:
        deadline = time.monotonic() + 600
        while httpx.get(gw.base_url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the Ray replicas did not become ready"
            time.sleep(0.2)
        yield gw


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers' greedy continuation of PROMPT, as text."""
    import torch

    _, model, tokenizer = tiny
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=SHORT, do_sample=False,
                             min_new_tokens=SHORT)
    return tokenizer.decode(out[0, len(PROMPT):].tolist())


def _short(client, stream: bool) -> dict:
    """One short greedy request; what it was answered (the routing record included)."""
    extra = {"ignore_eos": True}
    if not stream:
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=SHORT,
                                        temperature=0, extra_body=extra)
        return {"text": out.choices[0].text, "finish": out.choices[0].finish_reason,
                "tokens": out.usage.completion_tokens, "routing": out.model_extra["routing"]}
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=PROMPT, max_tokens=SHORT, temperature=0, stream=True,
        extra_body=extra, stream_options={"include_usage": True})
    chunks = list(raw.parse())
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    return {"text": "".join(c.choices[0].text for c in chunks if c.choices),
            "finish": finishes[0] if len(finishes) == 1 else finishes,
            "tokens": next(c.usage.completion_tokens for c in chunks if c.usage),
            "routing": chunks[-1].model_extra["routing"],
            "replica": raw.headers.get("x-lifeline-replica")}


def _served_by(answer: dict) -> str:
    served = [a for a in answer["routing"]["attempts"] if a["outcome"] == "served"]
    assert len(served) == 1, answer["routing"]["attempts"]
    return served[0]["replica"]


# -- without Ray ------------------------------------------------------------------------


def test_serve_and_the_gateway_import_no_ray():
    code = ("import sys, lifeline.cli, lifeline.gateway.app, lifeline.server.app; "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_the_extra_ray_is_refused_with_how_to_install_it(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(["serve", "--ray", "--replicas", "2", "--no-huge-pages"]) == 2
    assert "--ray needs Ray Serve: pip install 'lifeline[ray]'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"backends.r.kind: a ray backend needs Ray Serve"):
        parse_config('[backends.r]\nkind = "ray"\n[models.m]\nbackends = ["r"]\n', ".toml")
    assert main(["serve", "--replicas", "2", "--no-huge-pages"]) == 2
    assert "--replicas need --ray" in capsys.readouterr().err


# -- the file ---------------------------------------------------------------------------


@needs_ray
def test_ray_backend_keys_are_checked_and_reach_the_deployment(tmp_path):
    config = parse_config(_config(tmp_path), ".toml")
    options = deployment_options(config.backends["tiny"])
    assert options["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 3,
                                             "target_ongoing_requests": 100.0}
    assert "num_replicas" not in options
    assert options["max_ongoing_requests"] == 3
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    router = options["request_router_config"]
    assert router.request_router_class == "lifeline.gateway.ray_router.LifelineRequestRouter"
    assert router.request_router_kwargs == {"policy": "least_outstanding", "load_factor": 1.25}

    fixed = parse_config('[backends.r]\nkind = "ray"\nreplicas = 4\n'
                         '[models.m]\nbackends = ["r"]\n', ".toml")
    assert deployment_options(fixed.backends["r"])["num_replicas"] == 4
    assert deployment_options(fixed.backends["r"])["max_ongoing_requests"] == 64
    bad = {
        'replicas = 2\n[backends.r.autoscaling]\nmax_replicas = 3':
            "backends.r.replicas: give either `replicas` or `autoscaling`",
        '[backends.r.autoscaling]\nmin_replicas = 3\nmax_replicas = 2':
            "backends.r.autoscaling.min_replicas: 3 is above max_replicas (2)",
        '[backends.r.autoscaling]\ntarget = 3':
            "backends.r.autoscaling.target: unknown key",
        'router_policy = "fastest"': "backends.r.router_policy: expected one of",
        'base_url = "http://x/v1"': "backends.r.base_url: a ray backend has no base_url",
    }
    for keys, message in bad.items():
        text = f'[backends.r]\nkind = "ray"\n{keys}\n[models.m]\nbackends = ["r"]\n'
        if keys.startswith("["):
            text = f'[backends.r]\nkind = "ray"\n[models.m]\nbackends = ["r"]\n{keys}\n'
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_config(text, ".toml")
    with pytest.raises(ConfigError, match="ray.adress: unknown key"):
        parse_config('[ray]\nadress = "x"\n[backends.r]\nkind = "ray"\n'
                     '[models.m]\nbackends = ["r"]\n', ".toml")


# -- on Ray -----------------------------------------------------------------------------


@needs_ray
def test_autoscaling_settings_reach_ray_serve(gateway):
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    deployment = details["applications"][app_name("tiny")]["deployments"][DEPLOYMENT]
    scaling = deployment["deployment_config"]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"],
            scaling["target_ongoing_requests"]) == (2, 3, 100.0)
    assert deployment["deployment_config"]["max_ongoing_requests"] == 3
    status = httpx.get(gateway.base_url + "/gateway/backends").json()["tiny"]
    assert status["kind"] == "ray" and status["ray"]["replicas"].get("RUNNING") == 2


@needs_ray
def test_two_replicas_answer_as_transformers_does(client, reference):
    answers = [_short(client, stream) for stream in (True, False, True, False)]
    for answer in answers:
        assert (answer["text"], answer["finish"], answer["tokens"]) == (reference, "length",
                                                                         SHORT)
    replicas = {_served_by(a) for a in answers}
    assert len(replicas) == 2, "sequential requests alternate between two idle replicas"
    # The replica choice was Ray's router running Lifeline's policy, and the record says so.
    attempt = answers[0]["routing"]["attempts"][0]
    assert answers[0]["replica"] == attempt["replica"]
    router = attempt["ray_router"]
    assert router["policy"] == "least_outstanding"
    assert {c["replica"] for c in router["candidates"]} == replicas
    assert router["routed_to"] == attempt["replica"]


def _ongoing(replica: str) -> int:
    """Requests the replica's actor holds (Ray Serve's own count, as its router probes it)."""
    return ray.get(_actor(replica).get_num_ongoing_requests.remote())


def _actor(replica: str):
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].endswith(f"#{replica}")]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@needs_ray
def test_a_replica_killed_mid_run(gateway, client, reference):
    """Each replica runs one long stream and holds two short requests waiting behind it; one
    replica is killed. Its long stream ends with the error event after its first tokens; its
    two waiting requests are retried on the live replica and answered once, in full; new
    requests are served by live replicas only."""
    hang_up = threading.Event()
    victim: list[str] = []

    def long_stream(out: dict, begun: threading.Event) -> dict:
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=PROMPT, max_tokens=6000, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        out.update(replica=raw.headers.get("x-lifeline-replica"), tokens=0, error=None)
        stream = raw.parse()
        try:
            for _ in stream:
                out["tokens"] += 1
                if out["tokens"] == 1:
                    begun.set()
                if hang_up.is_set() and out["replica"] not in victim:
                    break  # the survivor's: the client hangs up, the requests behind it run
        except openai.APIError as exc:
            out["error"] = exc.body
        finally:
            stream.close()
        return out

    with cf.ThreadPoolExecutor(8) as pool:
        # One after the other: the second is routed once the first runs on its replica, so
        # least-outstanding sends it to the other (sent at once, both could find two idle
        # replicas and go to the same one: make test met that once under load).
        states: list[dict] = [{}, {}]
        longs = []
        for state in states:
            begun = threading.Event()
            longs.append(pool.submit(long_stream, state, begun))
            assert begun.wait(60), "a long stream's first token"
        replicas = sorted(state["replica"] for state in states)
        assert len(set(replicas)) == 2, "one long stream on each replica"
        shorts = [pool.submit(_short, client, s) for s in (True, False, True, False)]
        _wait_for(lambda: all(_ongoing(r) == 3 for r in replicas),
                  "three requests on each replica")
        victim.append(replicas[0])
        ray.kill(_actor(victim[0]), no_restart=True)
        killed = next(f for f, st in zip(longs, states) if st["replica"] == victim[0])
        killed = killed.result(120)
        hang_up.set()
        answers = [f.result(120) for f in shorts]
        survived = next(f for f in longs if f.result(120)["replica"] != victim[0]).result()
        after = [_short(client, s) for s in (True, False, True, False)]

    assert killed["tokens"] >= 1 and killed["error"]["code"] == "backend_failed_mid_stream"
    assert survived["error"] is None and survived["tokens"] >= 1
    retried = 0
    for answer in [*answers, *after]:
        assert (answer["text"], answer["finish"], answer["tokens"]) == (reference, "length",
                                                                         SHORT)
        assert _served_by(answer) != victim[0]
        attempts = answer["routing"]["attempts"]
        if len(attempts) > 1:
            assert [(a["replica"], a["outcome"]) for a in attempts[:-1]] == [
                (victim[0], "replica_died")]
            retried += 1
    assert retried == 2, "the two requests waiting on the killed replica were retried"
    status = httpx.get(gateway.base_url + "/gateway/backends").json()["tiny"]
    assert status["circuit"] == "closed" and status["circuit_opened"] == 0
    metrics = httpx.get(gateway.base_url + "/metrics").text
    assert 'lifeline:gateway_backend_errors_total{backend="tiny",kind="replica_died"} 3.0' \
        in metrics


# -- tenants and options on Ray ------------------------------------------------------------


@needs_ray
def test_serve_ray_flags_take_effect_and_keep_tenants_apart_on_a_replica(cluster, tmp_path):
    """`lifeline serve --ray` with a vision model on one replica, given the options
    tests/test_server_tenants.py gives a local backend (as flags here): the gateway's own
    (keys, the admin key, the salt by key, the request limit) hold at the gateway, the rest
    (image limits, media domains, default max_tokens) in the replica; tenants share neither
    prefix-cache blocks nor image embeddings on it."""
    from lifeline.cli import build_parser, ray_gateway_config
    from tests.tenants import ADMIN, KEYS, TENANT_OPTIONS, check_tenants_and_options, tiny_vlm

    path = tiny_vlm(tmp_path / "vlm")
    o = TENANT_OPTIONS
    args = build_parser().parse_args([
        "serve", "--ray", "--model", str(path), "--served-model-name", "vlm",
        "--chat-template", str(path / "template.jinja"), "--weights", "fp32", "--no-compile",
        "--kv-cache-memory-bytes", "16MiB", "--replica-cpus", "0.5",
        *(f for key in KEYS.values() for f in ("--api-key", key)), "--admin-key", ADMIN,
        "--salt-cache-by-api-key", "--rate-limit-rpm", str(o["rate_limit_rpm"]),
        "--max-images", str(o["max_images"]), "--max-image-pixels", str(o["max_image_pixels"]),
        "--allowed-media-domains", *o["allowed_media_domains"],
        "--default-max-tokens", str(o["default_max_tokens"])])
    with GatewayThread(ray_gateway_config(args)) as gw:
        deadline = time.monotonic() + 600
        while httpx.get(gw.base_url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the Ray replica did not become ready"
            time.sleep(0.2)
        check_tenants_and_options(gw.base_url, "vlm", path)
