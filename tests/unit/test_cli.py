"""The `tandem` command line: generate against a real RouterServer over a
FakeBackend; serve's configuration handling without starting Ray."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import pytest

from router.client import TandemClient, generate_sync
from router.config import ServeConfig
from tandem_cli import ray_auth, ray_init, serve
from tandem_cli.main import build_parser, main
from tests.fakes import FakeBackend, FakeTokenizer, RouterInThread

pytestmark = pytest.mark.unit


@pytest.fixture
def router():
    with RouterInThread(FakeBackend(tokenizer=FakeTokenizer())) as r:
        yield r


def test_generate_streams_text_and_prints_usage(router, capsys):
    code = main(["generate", "hi", "--target", router.address, "--max-tokens", "3"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == " alpha beta gamma\n"
    assert "[length] 2 prompt tokens (0 cached), 3 completion tokens" in err
    assert "TTFT 10.0 ms" in err and "decode decode-0" in err


def test_generate_passes_every_sampling_flag(router, capsys):
    argv = ["generate", "hi", "--target", router.address, "--timeout", "30"]
    argv += ["--max-tokens", "2", "--temperature", "0.5", "--top-p", "0.5", "--top-k", "7"]
    argv += ["--min-p", "0.1", "--repetition-penalty", "1.5", "--frequency-penalty", "0.5"]
    argv += ["--presence-penalty", "-0.5", "--seed", "7", "--stop", "a", "--stop", "b"]
    argv += ["--stop-token-id", "5", "--stop-token-id", "6", "--ignore-eos", "--logprobs", "2"]
    argv += ["--request-id", "cli-1", "--priority", "3"]
    assert main(argv) == 0
    inp = router.backend.inputs[-1]
    p = inp.params
    assert inp.request_id == "cli-1"
    assert inp.priority == 3
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (2, 0.5, 0.5, 7, 7)
    assert p.min_p == pytest.approx(0.1) and p.repetition_penalty == 1.5
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -0.5)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (["a", "b"], [5, 6], True, 2)
    err = capsys.readouterr().err
    assert "token 0: -0.250  (top 0: -0.250, 1: -1.500)" in err


def test_generate_token_id_prompt(router, capsys):
    assert main(["generate", "--prompt-token-ids", "1,2,3", "--target", router.address]) == 0
    assert router.backend.inputs[-1].prompt_token_ids == [1, 2, 3]
    assert "3 prompt tokens" in capsys.readouterr().err


def test_generate_reports_the_status_and_exits_1(router, capsys):
    code = main(["generate", "hi", "--target", router.address, "--temperature", "1000"])
    err = capsys.readouterr().err
    assert code == 1
    assert "INVALID_ARGUMENT" in err and "temperature" in err


def test_generate_without_a_server_exits_1(capsys):
    code = main(["generate", "hi", "--target", "127.0.0.1:1", "--timeout", "30"])
    assert code == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_generate_needs_exactly_one_prompt(capsys):
    assert main(["generate", "--target", "127.0.0.1:1"]) == 2
    assert "prompt" in capsys.readouterr().err


def test_generate_sync_helper(router):
    done = generate_sync(router.address, "hey", timeout_s=30, max_tokens=2)
    assert done.text == " alpha beta" and done.usage.prompt_tokens == 3


@pytest.fixture
def no_run(monkeypatch):
    """Replace serve.run: capture the config instead of starting Ray."""
    seen: list[ServeConfig] = []

    def fake_run(config: ServeConfig) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(serve, "run", fake_run)
    return seen


def test_serve_unknown_yaml_key_exits_2(tmp_path, capsys, no_run):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "pools:\n  prefill: 1\n  prefil_workers: 2\n  decode_resources:\n    gpus: 1\nenginee: {}\n"
    )
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err
    assert "pools.prefil_workers: Extra inputs are not permitted" in err
    assert "pools.decode_resources.gpus: Extra inputs are not permitted" in err
    assert "enginee: Extra inputs are not permitted" in err
    assert no_run == []


def test_serve_flat_yaml_of_old_names_the_sections(tmp_path, capsys, no_run):
    """A config written before the sections says where each key went."""
    old = tmp_path / "old.yaml"
    old.write_text("prefill: 2\nkv_lease_s: 60\nhost: 0.0.0.0\nretry_backoff_s: 1\n")
    assert main(["serve", "--config", str(old)]) == 2
    err = capsys.readouterr().err
    assert "the configuration is nested by section" in err
    assert "prefill is now pools.prefill" in err
    assert "kv_lease_s is now transfer.lease_s" in err
    assert "host is now server.host" in err
    assert "retry_backoff_s is no longer a setting" in err
    assert no_run == []


def test_serve_key_in_the_wrong_section_names_the_right_one(tmp_path, capsys, no_run):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  decode: 2\n  redis_url: redis://r\n  typo: 1\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "pools: not keys of this section: redis_url is now routing.redis_url" in err
    assert "typo is unknown" in err
    assert no_run == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--prefill", "0"], "pools: prefill must be >= 1 in disaggregated mode"),
        (["--mode", "colocated", "--prefill", "1"], "prefill must be 0 or unset in colocated"),
        (["--port", "70000"], "server.port: Input should be less than or equal to 65535"),
        (["--config", "/nonexistent/tandem.yaml"], "No such file"),
    ],
)
def test_serve_bad_values_exit_2(argv, expected, capsys, no_run):
    assert main(["serve", *argv]) == 2
    assert expected in capsys.readouterr().err
    assert no_run == []


def test_serve_flags_override_yaml(tmp_path, no_run):
    cfg = tmp_path / "tandem.yaml"
    cfg.write_text(
        "pools: {prefill: 2, decode: 3}\nserver: {port: 6000}\n"
        "limits: {grace_period_s: 5}\nengine: {block_size: 32}\n"
    )
    assert main(["serve", "--config", str(cfg), "--decode", "4", "--grace-period", "1.5"]) == 0
    (config,) = no_run
    pools = config.pools
    assert (pools.prefill, pools.decode, config.server.port) == (2, 4, 6000)  # YAML unless flagged
    assert (config.limits.grace_period_s, config.engine.block_size) == (1.5, 32)
    assert config.server.host == "127.0.0.1" and pools.mode == "disaggregated"  # defaults


def test_serve_flags_alone():
    argv = ["serve", "--mode", "colocated", "--model", "/m", "--port", "0"]
    args = build_parser().parse_args(argv)
    config = serve.config_from_args(args)
    assert (config.pools.mode, config.engine.model, config.server.port) == ("colocated", "/m", 0)
    assert config.pools.prefill == 0  # colocated: no prefill pool


def test_init_ray_sizes_a_loopback_cluster(monkeypatch):
    import ray

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    config = ServeConfig(
        pools={
            "prefill": 2,
            "decode": 3,
            "decode_resources": {"num_cpus": 2, "resources": {"decode": 1}},
        }
    )
    assert ray_init.init_ray(config) is True
    (kw,) = calls
    assert kw["_node_ip_address"] == ray_init.LOCAL_RAY_NODE_IP
    assert kw["num_cpus"] == max(os.cpu_count() or 1, 8)
    assert kw["resources"] == {"decode": 3.0}
    assert kw["include_dashboard"] is False
    assert kw["_system_config"] == {"worker_niceness": 0}  # not Ray's 15 (worker_niceness)
    assert os.environ["RAY_AUTH_MODE"] == "token"  # a fresh token for the local cluster
    assert len(os.environ["RAY_AUTH_TOKEN"]) == 64
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    ray_init.init_ray(config.updated(pools={"ray_address": "10.0.0.1:6379"}))
    assert calls[-1] == {"address": "10.0.0.1:6379"}
    assert "RAY_AUTH_TOKEN" not in os.environ  # a joined cluster's token is configured


def test_init_ray_refuses_to_turn_ray_token_auth_off(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init without token auth"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE=disabled"):
        ray_init.init_ray(ServeConfig())


def test_a_configured_ray_token_is_kept():
    environ = {"RAY_AUTH_TOKEN_PATH": "/run/secrets/ray-token"}
    ray_auth.enable(local=True, environ=environ)
    assert environ == {"RAY_AUTH_TOKEN_PATH": "/run/secrets/ray-token", "RAY_AUTH_MODE": "token"}


def test_serve_runs_until_sigterm_then_drains(capsys):
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        config = ServeConfig(server={"port": 0}, limits={"grace_period_s": 5})
        stop = asyncio.Event()  # set by SIGTERM; set again below so a failure cannot hang
        serving = asyncio.create_task(serve.serve(config, backend=backend, stop=stop))
        try:
            await backend.wait_for(lambda b: b.started)
            line = capsys.readouterr().out
            assert "tandem: serving the default model on 127.0.0.1:" in line
            assert "(prefill 1, decode 1, disaggregated)" in line
            address = re.search(r"on (\S+) ", line).group(1)
            async with TandemClient(address, timeout_s=30) as client:
                done = await client.complete("ok", max_tokens=2)
            assert done.finish_reason == "length"
            os.kill(os.getpid(), signal.SIGTERM)
            await backend.wait_for(lambda b: b.shut_down)
        finally:
            stop.set()
            await serving
        assert "SIGTERM, draining" in capsys.readouterr().err

    asyncio.run(body())


def _secret_file(tmp_path, name: str, mode: int):
    path = tmp_path / name
    path.write_text("a secret\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("setting", ["api_keys_file", "admin_keys_file"])
def test_serve_refuses_a_keys_file_others_can_read(tmp_path, capsys, no_run, setting):
    keys = _secret_file(tmp_path, "keys", 0o644)
    cfg = tmp_path / "tandem.yaml"
    cfg.write_text(f"security:\n  {setting}: {keys}\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"security.{setting} {keys} is readable by group or others (mode 0644)" in err
    assert no_run == []


def test_serve_refuses_a_ray_token_file_others_can_read(tmp_path, capsys, no_run, monkeypatch):
    token = _secret_file(tmp_path, "ray_auth_token", 0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert main(["serve"]) == 2
    assert "RAY_AUTH_TOKEN_PATH" in capsys.readouterr().err and no_run == []
    with pytest.raises(ValueError, match=r"RAY_AUTH_TOKEN_PATH .*\(mode 0644\)"):
        ray_auth.enable(local=False, environ={"RAY_AUTH_TOKEN_PATH": str(token)})
    token.chmod(0o600)
    environ = {"RAY_AUTH_TOKEN_PATH": str(token)}
    ray_auth.enable(local=False, environ=environ)
    assert environ["RAY_AUTH_MODE"] == "token"
