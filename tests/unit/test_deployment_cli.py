"""`tandem serve --deployment NAME [--attach]` and `tandem down`: flag parsing,
the deployment's state file (permissions, a stale file), how serve reaches the
named deployment's local Ray cluster and how down stops it, without Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from router.config import ServeConfig
from tandem_cli import cluster_state, down_cmd, local_cluster, ray_init, serve
from tandem_cli.cluster_state import ClusterState
from tandem_cli.main import build_parser, main

pytestmark = pytest.mark.unit

TOKEN = "ab" * 32


@pytest.fixture(autouse=True)
def state_home(tmp_path, monkeypatch):
    home = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    return home


def _state(name="prod", pid=None, token=TOKEN, temp_dir="/nonexistent/tdm-ray-x"):
    return ClusterState(name, "127.0.0.2:45678", "127.0.0.2", pid or _dead_pid(), temp_dir, token)


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


# ---- flags ----


def test_serve_deployment_flags_set_the_deployment_section(monkeypatch):
    monkeypatch.setattr(serve, "ServeConfig", ServeConfig)
    args = build_parser().parse_args(["serve", "--deployment", "prod", "--attach", "--port", "0"])
    assert (args.deployment, args.attach) == ("prod", True)
    config = serve.config_from_args(args)
    assert (config.deployment.name, config.deployment.attach) == ("prod", True)
    unnamed = serve.config_from_args(build_parser().parse_args(["serve"]))
    assert (unnamed.deployment.name, unnamed.deployment.attach) == (None, False)


def test_serve_refuses_a_deployment_name_that_cannot_name_a_file(monkeypatch, capsys):
    monkeypatch.setattr(serve, "ServeConfig", ServeConfig)
    assert main(["serve", "--deployment", "../etc"]) == 2
    assert "deployment.name" in capsys.readouterr().err


def test_down_flags():
    args = build_parser().parse_args(["down", "--deployment", "prod"])
    assert (args.deployment, args.ray_address, args.drain_timeout) == ("prod", None, 30.0)
    args = build_parser().parse_args(
        ["down", "--deployment", "p", "--ray-address", "10.0.0.1:6380", "--drain-timeout", "5"]
    )
    assert (args.ray_address, args.drain_timeout) == ("10.0.0.1:6380", 5.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["down"])  # the name is required


# ---- the state file ----


def test_state_file_is_private_and_round_trips(state_home):
    state = _state()
    path = cluster_state.write(state)
    assert path == state_home / "tandem" / "deployments" / "prod.json"
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    assert cluster_state.read("prod") == state
    assert TOKEN not in repr(state)
    assert cluster_state.read("other") is None
    cluster_state.remove("prod")
    assert cluster_state.read("prod") is None


def test_a_state_file_others_can_read_is_refused():
    path = cluster_state.write(_state())
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by group or others"):
        cluster_state.read("prod")


def test_an_open_state_directory_is_refused(state_home):
    directory = state_home / "tandem" / "deployments"
    directory.mkdir(parents=True)
    os.chmod(directory, 0o755)
    with pytest.raises(ValueError, match="chmod 700"):
        cluster_state.write(_state())


def test_a_broken_or_foreign_state_file_is_an_error_not_a_cluster():
    path = cluster_state.write(_state())
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a deployment state file"):
        cluster_state.read("prod")
    path.write_text(json.dumps({**json.loads(json.dumps(_state().__dict__)), "deployment": "x"}))
    with pytest.raises(ValueError, match="records deployment 'x'"):
        cluster_state.read("prod")


@pytest.mark.parametrize("name", ["", "../x", "a/b", "a b"])
def test_a_name_that_is_not_a_file_name_is_refused(name):
    with pytest.raises(ValueError, match="deployment name"):
        cluster_state.state_path(name)


def test_a_live_process_that_is_not_ray_start_is_no_cluster():
    assert not local_cluster.is_running(_state(pid=os.getpid()))


def test_a_stale_state_file_is_forgotten(tmp_path):
    temp_dir = tmp_path / "tdm-ray-old"
    temp_dir.mkdir()
    cluster_state.write(_state(temp_dir=str(temp_dir)))
    assert local_cluster.find("prod") is None
    assert cluster_state.read("prod") is None and not temp_dir.exists()


def test_ensure_replaces_a_stale_state_file(monkeypatch):
    cluster_state.write(_state())
    fresh = _state(pid=os.getpid(), token="cd" * 32)
    started = []
    monkeypatch.setattr(local_cluster, "_start", lambda name, spec: started.append(spec) or fresh)
    spec = local_cluster.ClusterSpec(num_cpus=2, node_ip="127.0.0.2")
    assert local_cluster.ensure("prod", spec) == (fresh, True)
    assert started == [spec] and cluster_state.read("prod") == fresh
    # A running one is found, not started again.
    monkeypatch.setattr(local_cluster, "is_gone", lambda state: state != fresh)
    monkeypatch.setattr(local_cluster, "_answers", lambda address, timeout_s=2.0: True)
    assert local_cluster.ensure("prod", spec) == (fresh, False)
    assert len(started) == 1


def test_ray_start_arguments_keep_off_fixed_ports_and_the_dashboard():
    spec = local_cluster.ClusterSpec(
        num_cpus=3,
        resources={"decode": 2.0},
        system_config={"worker_niceness": 0},
        node_ip="127.0.0.2",
    )
    args = local_cluster._start_args(spec, 45678, "/tmp/tdm-ray-x")
    assert args[1:4] == ["start", "--head", "--block"]
    flags = _flags(args[2:])
    assert flags["--port"] == "45678" and flags["--node-ip-address"] == "127.0.0.2"
    assert flags["--num-cpus"] == "3" and json.loads(flags["--resources"]) == {"decode": 2.0}
    assert json.loads(flags["--system-config"]) == {"worker_niceness": 0}
    assert flags["--include-dashboard"] == "false" and "--disable-usage-stats" in flags
    assert "--head" in flags and "--block" in flags
    ports = [int(v) for k, v in flags.items() if k.endswith("-port") and v is not None]
    assert len(ports) == 7 and local_cluster.REDIS_PORT not in ports
    assert TOKEN not in " ".join(args)  # the token is in the environment, never argv


def _flags(args: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs, ``--switch`` to None."""
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) else None
            flags[arg] = None if value is None or value.startswith("--") else value
    return flags


# ---- serve reaches the named deployment's cluster ----


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append({"shutdown": True}))
    return calls


def test_a_named_deployment_joins_its_own_local_cluster_with_its_token(monkeypatch, fake_ray):
    state = _state()
    specs = []
    monkeypatch.setattr(
        local_cluster, "ensure", lambda n, spec: specs.append((n, spec)) or (state, True)
    )
    config = ServeConfig(deployment={"name": "prod"}, pools={"decode": 2})
    assert ray_init.init_ray(config) is True
    ((name, spec),) = specs
    assert name == "prod" and spec.node_ip == ray_init.LOCAL_RAY_NODE_IP
    assert fake_ray == [{"address": state.address, "_node_ip_address": state.node_ip}]
    assert os.environ["RAY_AUTH_TOKEN"] == TOKEN and os.environ["RAY_AUTH_MODE"] == "token"


def test_attach_never_starts_a_cluster(monkeypatch, fake_ray):
    monkeypatch.setattr(local_cluster, "ensure", lambda *a: pytest.fail("started a cluster"))
    config = ServeConfig(deployment={"name": "prod", "attach": True})
    with pytest.raises(RuntimeError, match="no local Ray cluster of deployment 'prod'"):
        ray_init.init_ray(config)
    assert fake_ray == []


def test_a_named_deployment_on_the_users_cluster_starts_nothing(monkeypatch, fake_ray):
    monkeypatch.setattr(local_cluster, "ensure", lambda *a: pytest.fail("started a cluster"))
    config = ServeConfig(deployment={"name": "prod"}, pools={"ray_address": "10.0.0.1:6380"})
    ray_init.init_ray(config)
    assert fake_ray == [{"address": "10.0.0.1:6380"}]


# ---- down ----


@pytest.fixture
def fake_down(monkeypatch):
    """router.deployment's down(name, drain_timeout_s), recorded."""
    calls: list[tuple] = []

    def down(name, drain_timeout_s):
        calls.append(("down", name, drain_timeout_s))
        if name == "broken":
            raise RuntimeError("a worker did not drain")
        return ["decode-0", "prefill-0"]

    monkeypatch.setitem(sys.modules, "router.deployment", types.SimpleNamespace(down=down))
    return calls


def test_down_drains_the_pools_then_stops_the_local_cluster(
    monkeypatch, fake_ray, fake_down, capsys
):
    state = _state()
    cluster_state.write(state)
    monkeypatch.setattr(local_cluster, "is_running", lambda s: s == state)
    monkeypatch.setattr(local_cluster, "stop", lambda name: fake_down.append(("stop", name)))
    assert main(["down", "--deployment", "prod", "--drain-timeout", "7"]) == 0
    assert fake_down == [("down", "prod", 7.0), ("stop", "prod")]
    assert fake_ray[0]["address"] == state.address and fake_ray[-1] == {"shutdown": True}
    assert os.environ["RAY_AUTH_TOKEN"] == TOKEN
    assert "removed 2 workers" in capsys.readouterr().out


def test_down_on_the_users_cluster_leaves_it_running(monkeypatch, fake_ray, fake_down):
    cluster_state.write(_state())  # not this cluster's: --ray-address wins
    monkeypatch.setattr(local_cluster, "is_running", lambda s: pytest.fail("looked at it"))
    monkeypatch.setattr(local_cluster, "stop", lambda name: pytest.fail("stopped a cluster"))
    assert main(["down", "--deployment", "prod", "--ray-address", "10.0.0.1:6380"]) == 0
    assert fake_ray[0]["address"] == "10.0.0.1:6380"
    assert fake_down == [("down", "prod", down_cmd.DEFAULT_DRAIN_TIMEOUT_S)]


def test_down_without_a_cluster_says_where_it_looked(fake_ray, fake_down, capsys):
    assert main(["down", "--deployment", "prod"]) == 1
    err = capsys.readouterr().err
    assert "no local Ray cluster of deployment 'prod'" in err and "--ray-address" in err
    assert fake_ray == [] and fake_down == []


def test_down_stops_the_local_cluster_even_when_the_drain_fails(
    monkeypatch, fake_ray, fake_down, capsys
):
    cluster_state.write(_state("broken"))
    monkeypatch.setattr(local_cluster, "is_running", lambda s: True)
    monkeypatch.setattr(local_cluster, "stop", lambda name: fake_down.append(("stop", name)))
    assert main(["down", "--deployment", "broken"]) == 1
    assert fake_down[-1] == ("stop", "broken")
    assert "a worker did not drain" in capsys.readouterr().err


def test_down_refuses_a_negative_drain_timeout(fake_down, capsys):
    assert main(["down", "--deployment", "prod", "--drain-timeout", "-1"]) == 2
    assert "--drain-timeout" in capsys.readouterr().err and fake_down == []


def test_down_of_a_cluster_that_is_gone_cleans_up_without_draining(fake_ray, fake_down, capsys):
    cluster_state.write(_state())  # its ray start exited long ago
    assert main(["down", "--deployment", "prod"]) == 0
    assert fake_down == [] and fake_ray == []  # nothing to connect to, nothing to drain
    assert cluster_state.read("prod") is None
    assert "was not running" in capsys.readouterr().out


def test_a_live_cluster_that_does_not_answer_is_an_error_never_stopped(monkeypatch):
    cluster_state.write(_state())
    monkeypatch.setattr(local_cluster, "_is_ray_start", lambda pid: True)
    monkeypatch.setattr(local_cluster, "_answers", lambda address, timeout_s=2.0: False)
    monkeypatch.setattr(local_cluster, "ANSWER_WAIT_S", 0.0)
    monkeypatch.setattr(local_cluster, "_start", lambda *a: pytest.fail("started another"))
    spec = local_cluster.ClusterSpec(num_cpus=1)
    with pytest.raises(RuntimeError, match=r"does not answer at 127\.0\.0\.2:45678"):
        local_cluster.ensure("prod", spec)
    with pytest.raises(RuntimeError, match="tandem down --deployment prod"):
        local_cluster.find("prod")
    assert cluster_state.read("prod") is not None  # left for tandem down
