"""Secrets in the serve config: a cluster secret always exists (generated at
start when none is configured, the same for every worker of the router), the
Redis password comes from the file or the environment, and neither shows in
a repr or a dump."""

from __future__ import annotations

import pytest

from block_index import IndexSettings
from router.config import ServeConfig

pytestmark = pytest.mark.unit


def test_without_a_configured_secret_the_router_generates_one_for_all_its_workers():
    config = ServeConfig()
    first, again = config.transfer_config().security, config.transfer_config().security
    assert len(first.secret) == 32 and first.secret == again.secret
    assert ServeConfig().transfer_config().security.secret != first.secret  # per start
    # What holds the generated secret never shows it.
    for text in (repr(config.transfer_config()), repr(config.security.cluster_security())):
        assert first.secret.hex() not in text and repr(first.secret) not in text


def test_a_configured_secret_is_used_as_given_and_never_shown(monkeypatch):
    monkeypatch.setenv("TANDEM_CLUSTER_SECRET", "from the environment")
    config = ServeConfig.load(None)
    assert config.transfer_config().security.secret == b"from the environment"
    shown = (repr(config), str(config), config.model_dump_json(), str(config.model_dump()))
    shown += (repr(config.transfer_config()),)
    assert all("from the environment" not in text for text in shown)


def test_the_redis_password_comes_from_the_environment_and_stays_hidden(monkeypatch):
    monkeypatch.setenv("TANDEM_REDIS_PASSWORD", "hunter2-redis")
    config = ServeConfig.load(None, {"routing.redis_url": "redis://r:6379/0"})
    assert config.routing.redis_password_value() == "hunter2-redis"
    assert "hunter2-redis" not in repr(config) and "hunter2-redis" not in config.model_dump_json()
    settings = IndexSettings(redis_url="redis://r:6379/0", redis_password="hunter2-redis")
    assert "hunter2-redis" not in repr(settings)


def test_the_file_wins_over_the_environment_for_the_redis_password(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_REDIS_PASSWORD", "from-env")
    path = tmp_path / "serve.yaml"
    path.write_text("routing: {redis_password: from-file}\n")
    assert ServeConfig.load(path).routing.redis_password_value() == "from-file"
