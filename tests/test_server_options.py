"""A server option means the same wherever it is given: to `lifeline serve`, to `lifeline serve
--ray` (the gateway in front of Ray replicas) or to a local backend of a gateway file. Each takes
effect there (the gateway applies its own, a backend's server the rest) or stops the start with
what to do instead; none is dropped on the way. The model card shows no path on the server's
disk and no key. What the options do once given is held end to end by
tests/test_server_tenants.py (a local backend) and tests/test_scale_out_ray.py (Ray replicas)."""
import dataclasses
import importlib.util
import json

import httpx
import pytest

from lifeline.cli import NOT_WITH_RAY, build_parser, main, ray_gateway_config
from lifeline.engine.engine import EngineConfig
from lifeline.gateway.backends import engine_server_config
from lifeline.gateway.config import (
    BACKEND_KEYS_OF_A_SERVER,
    BACKEND_OPTIONS,
    GATEWAY_OPTIONS,
    NOT_AT_THE_GATEWAY,
    NOT_IN_A_BACKEND,
    ConfigError,
    parse_config,
)
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread

FLAG_VALUES = {"rate_limit_tpm": ["100"], "otlp_endpoint": ["http://127.0.0.1:4318"],
               "allowed_origins": ["*"], "allowed_methods": ["GET"],
               "allowed_headers": ["x-a"], "allow_credentials": [],
               "enable_fault_injection": [], "tokenizer": ["tok.json"]}
"""A value for each flag `--ray` refuses."""
TABLE_VALUES = {"api_keys": '["k"]', "admin_key": '"boss"', "protect_metrics": "true",
                "rate_limit_rpm": "5", "rate_limit_tpm": "5", "max_body_bytes": "1024",
                "shutdown_timeout": "3", "salt_cache_by_api_key": "true",
                "enable_fault_injection": "true", "otlp_endpoint": '"http://h:4318"',
                "allowed_origins": '["*"]', "allowed_methods": '["GET"]',
                "allowed_headers": '["x-a"]', "allow_credentials": "true"}
"""A value for each key a backend's `server` table refuses."""


def _backend_file(key: str, value: str) -> str:
    return f'[backends.l]\n[backends.l.server]\n{key} = {value}\n[models.m]\nbackends = ["l"]\n'


def test_every_server_option_is_placed_at_the_gateway_or_its_backends_or_refused(
        monkeypatch, capsys):
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    places = [set(BACKEND_OPTIONS), set(NOT_IN_A_BACKEND), set(GATEWAY_OPTIONS),
              set(BACKEND_KEYS_OF_A_SERVER)]
    assert set().union(*places) == fields, "a server option that says nowhere where it applies"
    assert not set(BACKEND_OPTIONS) & set(NOT_IN_A_BACKEND)

    # a backend's server table refuses what the gateway applies, or cannot, and says why
    for key, why in NOT_IN_A_BACKEND.items():
        with pytest.raises(ConfigError) as info:
            parse_config(_backend_file(key, TABLE_VALUES[key]), ".toml", "gw.toml")
        assert str(info.value) == f"gw.toml: backends.l.server.{key}: {why}"
    for key, why in NOT_AT_THE_GATEWAY.items():
        with pytest.raises(ConfigError) as info:
            parse_config(f'[server]\n{key} = "5"\n[backends.a]\nbase_url = "http://h/v1"\n'
                         '[models.m]\nbackends = ["a"]\n', ".toml", "gw.toml")
        assert str(info.value) == f"gw.toml: server.{key}: {why}"

    # ... and takes the rest to the backend's server, its body limit above the gateway's
    values = {"chat_template": '"t.jinja"', "allow_request_chat_template": "true",
              "reasoning_parser": '"think"', "tool_call_parser": '"hermes"',
              "max_queued_requests": "7", "request_timeout": "9", "default_max_tokens": "11",
              "max_n": "3", "sampling_defaults": "{ temperature = 0.5 }",
              "allowed_media_domains": '["images.example.com"]', "media_fetch_timeout_s": "4",
              "max_images": "2", "max_image_bytes": '"1MiB"', "max_image_pixels": "4096",
              "max_queued_image_bytes": '"64MiB"'}
    assert set(values) == set(BACKEND_OPTIONS)
    text = "[server]\nmax_body_bytes = \"1MiB\"\n[backends.l]\n[backends.l.server]\n" + \
        "".join(f"{k} = {v}\n" for k, v in values.items()) + '[models.m]\nbackends = ["l"]\n'
    spec = parse_config(text, ".toml").backends["l"]
    server = engine_server_config(spec, "m")
    assert (server.max_images, server.max_image_bytes, server.max_image_pixels) == (
        2, 1 << 20, 4096)
    assert server.allowed_media_domains == ["images.example.com"]
    assert server.sampling_defaults == {"temperature": 0.5} and server.max_n == 3
    assert server.max_body_bytes == 2 << 20

    # `lifeline serve --ray`: the gateway's options at the gateway, the rest in every replica
    args = build_parser().parse_args([
        "serve", "--ray", "--model", "m.gguf", "--api-key", "k", "--admin-key", "boss",
        "--protect-metrics", "--rate-limit-rpm", "5", "--salt-cache-by-api-key",
        "--shutdown-timeout", "3", "--max-images", "2", "--max-image-bytes", "1MiB",
        "--max-image-pixels", "4096", "--max-queued-image-bytes", "64MiB",
        "--allowed-media-domains", "images.example.com",
        "--sampling-defaults", '{"temperature": 0.5}', "--default-max-tokens", "11",
        "--request-timeout", "9", "--max-queued-requests", "7", "--reasoning-parser", "think",
        "--tool-call-parser", "hermes", "--chat-template", "t.jinja",
        "--allow-request-chat-template"])
    config = ray_gateway_config(args)
    config.check()
    assert (config.api_keys, config.admin_key, config.protect_metrics, config.rate_limit_rpm,
            config.salt_cache_by_api_key, config.shutdown_timeout) == (
        ["k"], "boss", True, 5, True, 3.0)
    replica = engine_server_config(config.backends["ray"], "m")
    flagged = set(BACKEND_OPTIONS) - {"max_n", "media_fetch_timeout_s"}  # no flags of theirs
    assert {k: getattr(replica, k) for k in flagged} == {k: getattr(server, k) for k in flagged}
    assert replica.max_body_bytes == 16 << 20  # twice the gateway's default
    assert (replica.admin_key, replica.api_keys, replica.salt_cache_by_api_key) == (
        None, [], False), "the gateway's options stay at the gateway"

    # ... and stops at start on a flag that means nothing there, saying why
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if Ray were installed
                        lambda name, *a: object() if name == "ray" else real(name, *a))
    assert set(FLAG_VALUES) == set(NOT_WITH_RAY)
    for key, why in NOT_WITH_RAY.items():
        flag = "--" + key.replace("_", "-")
        assert main(["serve", "--ray", "--no-huge-pages", flag, *FLAG_VALUES[key]]) == 2
        assert f"{flag} cannot be combined with --ray: {why}" in capsys.readouterr().err
    assert main(["serve", "--ray", "--no-huge-pages", "--salt-cache-by-api-key"]) == 2
    assert "salt_cache_by_api_key needs API keys" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs API keys"):
        ServerConfig(salt_cache_by_api_key=True)


def test_the_model_card_shows_no_path_and_no_key(loaded):
    config = ServerConfig(api_keys=["card-key"], admin_key="card-admin",
                          engine=EngineConfig(kv_cache_memory_bytes=64 << 20))
    with ServerThread(loaded, config) as srv:
        headers = {"authorization": "Bearer card-key"}
        listed = httpx.get(srv.base_url + "/v1/models", headers=headers, timeout=30)
        card = httpx.get(srv.base_url + "/v1/models/gemma-3-270m", headers=headers, timeout=30)
    assert listed.status_code == card.status_code == 200
    assert card.json()["root"] == card.json()["id"] == "gemma-3-270m"
    text = listed.text + card.text
    for secret in (loaded.source, "card-key", "card-admin", "/root", "/tmp", ".gguf"):
        assert secret not in text, secret
    assert json.loads(listed.text)["data"][0] == card.json()
