"""The serve config by section: old flat keys say where they went, sections
are built and updated from dicts, each check lives on its section, and every
`tandem serve` flag sets a real field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.config import (
    RENAMED_KEYS,
    SECTIONS,
    PoolsSection,
    ServeConfig,
    describe_errors,
)
from tandem_cli.main import build_parser
from tandem_cli.serve import SERVE_FLAGS, SLO_FLAG_KEYS

pytestmark = pytest.mark.unit

# Every key of the flat configuration before it had sections, and its place now.
OLD_KEYS = {
    "model": "engine.model",
    "tokenizer": "engine.tokenizer",
    "load_format": "engine.load_format",
    "dtype": "engine.dtype",
    "cuda_graphs": "engine.cuda_graphs",
    "cpu_kernels": "engine.cpu_kernels",
    "greedy_screen": "engine.greedy_screen",
    "block_size": "engine.block_size",
    "kv_cache_memory_mb": "engine.kv_cache_memory_mb",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "max_num_seqs": "engine.max_num_seqs",
    "max_model_len": "engine.max_model_len",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "mode": "pools.mode",
    "prefill": "pools.prefill",
    "decode": "pools.decode",
    "prefill_resources": "pools.prefill_resources",
    "decode_resources": "pools.decode_resources",
    "ray_address": "pools.ray_address",
    "batch_scheduling": "pools.batch_scheduling",
    "worker_niceness": "pools.worker_niceness",
    "cpu_binding": "pools.cpu_binding",
    "worker_check_interval_s": "pools.worker_check_interval_s",
    "worker_max_restarts": "pools.worker_max_restarts",
    "worker_recovery_timeout_s": "pools.worker_recovery_timeout_s",
    "host": "server.host",
    "port": "server.port",
    "http_port": "server.http_port",
    "http_host": "server.http_host",
    "served_model_name": "server.served_model_name",
    "chat_template": "server.chat_template",
    "log_format": "server.log_format",
    "max_queued_requests": "limits.max_queued_requests",
    "request_timeout_s": "limits.request_timeout_s",
    "grace_period_s": "limits.grace_period_s",
    "max_message_mb": "limits.max_message_mb",
    "routing_policy": "routing.policy",
    "redis_url": "routing.redis_url",
    "prefix_routing": "routing.prefix_routing",
    "local_prefill_tokens": "routing.local_prefill_tokens",
    "kv_transfer_dtype": "transfer.dtype",
    "kv_lease_s": "transfer.lease_s",
    "kv_transfer_timeout_s": "transfer.timeout_s",
    "kv_max_message_mb": "transfer.max_message_mb",
    "local_output_streams": "transfer.local_output_streams",
    "speculative_method": "speculative.method",
    "num_speculative_tokens": "speculative.num_speculative_tokens",
    "speculative_ngram_min": "speculative.ngram_min",
    "speculative_ngram_max": "speculative.ngram_max",
    "draft_model": "speculative.draft_model",
    "api_keys": "security.api_keys",
    "api_keys_file": "security.api_keys_file",
    "tls_cert": "security.tls_cert",
    "tls_key": "security.tls_key",
    "cluster_tls_cert": "security.cluster_tls_cert",
    "cluster_tls_key": "security.cluster_tls_key",
    "cluster_tls_ca": "security.cluster_tls_ca",
    "cluster_tls_server_name": "security.cluster_tls_server_name",
    "cluster_secret": "security.cluster_secret",
    "max_attempts": "tuning.max_attempts",
    "stall_check_s": "tuning.stall_check_s",
    "health_timeout_s": "tuning.health_timeout_s",
    "load_weight_blocks": "tuning.load_weight_blocks",
    "pull_min_blocks": "tuning.pull_min_blocks",
}
REMOVED = {"retry_backoff_s": "RETRY_BACKOFF_S", "retry_backoff_max_s": "RETRY_BACKOFF_MAX_S"}


def _field_exists(path: str) -> bool:
    """``section.key``, or deeper into a section's nested model (``section.key.field``)."""
    section, *keys = path.split(".")
    model = SECTIONS.get(section)
    for key in keys:
        if model is None or key not in getattr(model, "model_fields", {}):
            return False
        model = model.model_fields[key].annotation
    return True


def _errors(**data) -> list[str]:
    with pytest.raises(ValidationError) as info:
        ServeConfig.model_validate(data)
    return describe_errors(info.value)


@pytest.mark.parametrize(("old", "new"), sorted(OLD_KEYS.items()))
def test_an_old_flat_key_names_the_section_it_moved_to(old, new):
    assert _field_exists(new)
    (error,) = _errors(**{old: None})
    assert error.startswith("(top level): the configuration is nested by section")
    assert f"{old} is now {new}" in error


@pytest.mark.parametrize(("old", "constant"), sorted(REMOVED.items()))
def test_a_removed_key_says_it_is_no_longer_a_setting(old, constant):
    (error,) = _errors(**{old: 1})
    assert f"{old} is no longer a setting (router/failover.py, {constant})" in error
    import router.failover

    assert hasattr(router.failover, constant)


def test_a_key_in_the_wrong_section_names_its_section():
    (error,) = _errors(pools={"decode": 2, "lease_s": 5, "kv_lease_s": 5, "nope": 1})
    assert error.startswith("pools: not keys of this section:")
    assert "lease_s is now transfer.lease_s; kv_lease_s is now transfer.lease_s" in error
    assert "nope is unknown" in error
    (error,) = _errors(engine={"max_message_mb": 8})
    assert "max_message_mb is now limits.max_message_mb" in error
    # A key no section knows keeps pydantic's own message.
    assert _errors(limits={"nope": 1}) == ["limits.nope: Extra inputs are not permitted"]


def test_sections_take_dicts_and_updates_keep_the_rest():
    config = ServeConfig(pools={"prefill": 2}, engine={"kv_cache_memory_mb": 32})
    updated = config.updated(pools={"decode": 3}, limits={"grace_period_s": 1})
    assert (updated.pools.prefill, updated.pools.decode) == (2, 3)
    assert updated.engine.kv_cache_memory_mb == 32 and updated.limits.grace_period_s == 1
    assert (config.pools.decode, config.limits.grace_period_s) == (1, 30)  # unchanged
    with pytest.raises(ValidationError, match="prefill must be >= 1"):
        config.updated(pools={"prefill": 0})
    with pytest.raises(ValidationError, match="lease_s"):
        config.updated(transfer={"lease_s": 0})


def test_load_sets_dotted_overrides_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pools: {prefill: 2, decode: 3}\nserver: {port: 7000}\n")
    config = ServeConfig.load(path, {"pools.decode": 4, "server.port": None, "engine.model": "/m"})
    assert (config.pools.prefill, config.pools.decode, config.server.port) == (2, 4, 7000)
    assert config.engine.model == "/m"
    path.write_text("pools: 2\n")
    with pytest.raises(ValueError, match="pools: expected a mapping"):
        ServeConfig.load(path, {"pools.decode": 4})


def test_colocated_pools_have_no_prefill_workers():
    assert ServeConfig(pools={"mode": "colocated"}).pools.prefill == 0
    assert ServeConfig(pools={"mode": "colocated", "prefill": 0}).pools.prefill == 0
    assert _errors(pools={"mode": "colocated", "prefill": 2}) == [
        "pools: prefill must be 0 or unset in colocated mode"
    ]
    assert _errors(pools={"prefill": 0}) == ["pools: prefill must be >= 1 in disaggregated mode"]


@pytest.mark.parametrize(
    ("mode", "prefill", "decode", "error"),
    [
        ("disaggregated", 0, None, "prefill must be >= 1 in disaggregated mode"),
        ("disaggregated", None, 0, "decode: Input should be greater than or equal to 1"),
        ("colocated", 2, None, "prefill must be 0 or unset in colocated mode"),
        ("colocated", None, 0, "decode: Input should be greater than or equal to 1"),
    ],
)
def test_resizing_is_checked_as_the_config_is(mode, prefill, decode, error):
    """RayBackend.scale (the Admin service's Scale) asks PoolsSection.resized."""
    pools = PoolsSection(mode=mode)
    with pytest.raises(ValueError) as info:
        pools.resized(prefill, decode)
    assert str(info.value) == error
    assert pools.resized(None, 5).decode == 5
    assert pools.resized(0 if mode == "colocated" else 3, None).prefill == (
        0 if mode == "colocated" else 3
    )


def test_every_serve_flag_sets_a_field_of_a_section():
    parser = build_parser()
    (subparsers,) = parser._subparsers._group_actions
    dests = {a.dest for a in subparsers.choices["serve"]._actions} - {"help", "config"}
    assert dests == set(SERVE_FLAGS) | {"slo"}  # --slo sets SLO_FLAG_KEYS
    assert all(_field_exists(path) for path in SERVE_FLAGS.values())
    assert all(_field_exists(path) for path in SLO_FLAG_KEYS.values())


def test_field_names_repeat_across_sections_only_where_documented():
    """A key's name is its own but for max_message_mb (limits: the router's
    API; transfer: the internal endpoints) and dtype (engine: weights and KV
    cache; transfer: KV on the wire), whose old flat keys RENAMED_KEYS maps."""
    seen: dict[str, list[str]] = {}
    for name, section in SECTIONS.items():
        for key in section.model_fields:
            seen.setdefault(key, []).append(name)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {
        "dtype": ["engine", "transfer"],
        "max_message_mb": ["limits", "transfer"],
    }
    assert RENAMED_KEYS["dtype"] == "engine.dtype"
    assert RENAMED_KEYS["max_message_mb"] == "limits.max_message_mb"


def test_routing_policies_are_the_ones_the_router_has():
    from typing import get_args

    from router.config import RoutingSection
    from router.policies import POLICIES

    assert set(get_args(RoutingSection.model_fields["policy"].annotation)) == set(POLICIES)


def test_slo_and_autoscale_flags_set_the_autoscale_section():
    args = build_parser().parse_args(["serve", "--autoscale", "--slo", "ttft_ms=250,tpot_ms=40"])
    from tandem_cli.serve import config_from_args

    config = config_from_args(args)
    assert config.autoscale.enabled
    assert (config.autoscale.ttft_ms, config.autoscale.tpot_ms) == (250.0, 40.0)


def test_autoscale_bounds_are_checked():
    (error,) = _errors(autoscale={"min_decode": 4, "max_decode": 2})
    assert "min_decode (4) is above max_decode (2)" in error
