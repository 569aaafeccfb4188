"""infra/: every YAML parses, the example deployment config is a valid
ServeConfig, the resources its pools are pinned to exist on the node
types of the Ray cluster YAML and the KubeRay manifests, and what the
Docker images install from the build context is complete."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest
import yaml

from router.config import ServeConfig

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
SERVE_CONFIG = INFRA / "deploy" / "serve-config.yaml"


def _docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _by_kind(kind: str) -> list[dict]:
    return [d for p in INFRA.rglob("*.yaml") for d in _docs(p) if d.get("kind") == kind]


def _pinned(config: ServeConfig) -> dict[str, set[str]]:
    return {
        "prefill": set(config.pools.prefill_resources.resources),
        "decode": set(config.pools.decode_resources.resources),
    }


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_parses_to_mappings(path):
    docs = _docs(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs)


def test_example_serve_config_validates_and_pins_pools_apart():
    config = ServeConfig.load(SERVE_CONFIG)
    pools = config.pools
    assert pools.mode == "disaggregated"
    pinned = _pinned(config)
    assert pinned["prefill"] and pinned["decode"]
    assert pinned["prefill"].isdisjoint(pinned["decode"])  # on different node types
    assert pools.prefill_resources.num_gpus == pools.decode_resources.num_gpus == 1


def test_configmap_carries_the_example_serve_config():
    (configmap,) = _by_kind("ConfigMap")
    embedded = yaml.safe_load(configmap["data"]["serve-config.yaml"])
    assert embedded == yaml.safe_load(SERVE_CONFIG.read_text())
    ServeConfig.model_validate(embedded)


def test_ray_up_node_types_offer_the_pinned_resources():
    cluster = yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    config = ServeConfig.load(SERVE_CONFIG)
    for role, wanted in _pinned(config).items():
        hosts = [n for n, t in types.items() if wanted <= set(t.get("resources", {}))]
        assert hosts, f"no node type offers the {role} pool's resources {wanted}"
        assert all(types[n]["resources"].get("GPU", 0) >= 1 for n in hosts)
    # Ray's GCS must not take Redis's port on the head.
    assert any("--port=6380" in c for c in cluster["head_start_ray_commands"])


def test_kuberay_groups_offer_the_pinned_resources_and_the_router_is_a_service():
    (ray_cluster,) = _by_kind("RayCluster")
    groups = ray_cluster["spec"]["workerGroupSpecs"]
    offered = {}
    for group in groups:
        # KubeRay takes the resources flag as a quoted JSON string.
        raw = group["rayStartParams"]["resources"]
        offered[group["groupName"]] = set(json.loads(json.loads(raw)))
    config = ServeConfig.load(SERVE_CONFIG)
    for role, wanted in _pinned(config).items():
        assert any(wanted <= names for names in offered.values()), role
    services = {s["metadata"]["name"]: s for s in _by_kind("Service")}
    router = services["tandem-router"]
    assert router["spec"]["selector"]["ray.io/node-type"] == "head"
    assert router["spec"]["ports"][0]["port"] == config.server.port
    assert services["tandem-redis"]["spec"]["ports"][0]["port"] == 6379
    assert config.routing.redis_url == "redis://tandem-redis:6379/0"


# ---- closed by default: Ray token auth, secrets, network policy, probes ----

SECRET_ENVS = {"RAY_AUTH_TOKEN", "TANDEM_CLUSTER_SECRET", "TANDEM_REDIS_PASSWORD", "REDIS_PASSWORD"}


def _ray_containers(ray_cluster: dict) -> list[dict]:
    specs = [ray_cluster["spec"]["headGroupSpec"]]
    specs += ray_cluster["spec"]["workerGroupSpecs"]
    return [c for spec in specs for c in spec["template"]["spec"]["containers"]]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _from_secret(entry: dict) -> bool:
    """Set from a Secret, never written in the manifest."""
    return "value" not in entry and "secretKeyRef" in entry.get("valueFrom", {})


def test_ray_up_runs_token_auth_with_the_token_from_a_file_and_no_open_dashboard():
    text = (INFRA / "ray" / "cluster.yaml").read_text()
    cluster = yaml.safe_load(text)
    starts = cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    ray_starts = [c for c in starts if "ray start" in c]
    assert len(ray_starts) == 2
    for command in ray_starts:
        assert "RAY_AUTH_MODE=token" in command and "RAY_AUTH_TOKEN_PATH=" in command
    assert "--env RAY_AUTH_MODE=token" in cluster["docker"]["run_options"]
    assert "0.0.0.0" not in text  # no dashboard (or anything) on every interface
    assert "RAY_AUTH_TOKEN=" not in text  # the token is never inline
    token_dir = next(k for k in cluster["file_mounts"] if k.endswith("secrets"))
    local = REPO / cluster["file_mounts"][token_dir]
    assert (local / ".gitignore").read_text().splitlines()[1] == "*"  # never committed
    assert "infra/ray/secrets" in (REPO / ".dockerignore").read_text()  # nor in an image


def test_every_kuberay_ray_container_has_token_auth_from_the_secret():
    (ray_cluster,) = _by_kind("RayCluster")
    head_params = ray_cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert head_params.get("dashboard-host", "127.0.0.1") == "127.0.0.1"
    containers = _ray_containers(ray_cluster)
    assert len(containers) >= 4  # head, router, prefill, decode
    for container in containers:
        env = _env(container)
        assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
        assert _from_secret(env["RAY_AUTH_TOKEN"]), container["name"]
    for deployment in _by_kind("Deployment"):
        containers += deployment["spec"]["template"]["spec"]["containers"]
    for container in containers:
        for name, entry in _env(container).items():
            if name in SECRET_ENVS:
                assert _from_secret(entry), f"{container['name']}: {name} written inline"


RAY_TLS_ENVS = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def test_ray_up_runs_ray_on_tls_with_the_files_it_mounts_and_a_private_token_recipe():
    """Ray's traffic carries the actors' arguments (the cluster secret among
    them): every node starts Ray with TLS, its files from the secrets folder."""
    text = (INFRA / "ray" / "cluster.yaml").read_text()
    cluster = yaml.safe_load(text)
    secrets_dir = next(k for k in cluster["file_mounts"] if k.endswith("secrets"))
    options = cluster["docker"]["run_options"]
    assert "--env RAY_USE_TLS=1" in options
    starts = cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    for command in [c for c in starts if "ray start" in c]:
        assert "RAY_USE_TLS=1" in command
        for name in RAY_TLS_ENVS:
            (path,) = [w.split("=", 1)[1] for w in command.split() if w.startswith(name + "=")]
            assert path.startswith(secrets_dir + "/"), (name, path)
            assert f"--env {name}={path}" in options  # the router's process sees it too
    # The recipes make the secret files unreadable to others from the start.
    recipes = [line for line in text.splitlines() if "token_hex" in line or "openssl" in line]
    assert recipes and all("umask 077" in line for line in recipes)


def test_every_kuberay_ray_container_runs_ray_on_tls_with_certs_from_a_secret():
    (ray_cluster,) = _by_kind("RayCluster")
    specs = [ray_cluster["spec"]["headGroupSpec"], *ray_cluster["spec"]["workerGroupSpecs"]]
    for spec in specs:
        pod = spec["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            env = _env(container)
            assert env["RAY_USE_TLS"]["value"] == "1", container["name"]
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            for name in RAY_TLS_ENVS:
                path = env[name]["value"]
                (mount,) = [m for p, m in mounts.items() if path.startswith(p.rstrip("/") + "/")]
                secret = volumes[mount["name"]]["secret"]
                assert secret["secretName"] and mount["readOnly"], (container["name"], name)
                assert secret["defaultMode"] & 0o077 == 0  # the key readable by its owner only


def test_the_router_gets_its_secrets_and_a_liveness_probe():
    (ray_cluster,) = _by_kind("RayCluster")
    head = ray_cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    (router,) = [c for c in head if c["name"] == "router"]
    env = _env(router)
    assert _from_secret(env["TANDEM_CLUSTER_SECRET"])
    assert _from_secret(env["TANDEM_REDIS_PASSWORD"])
    port = ServeConfig.load(SERVE_CONFIG).server.port
    assert router["livenessProbe"]["grpc"]["port"] == port
    assert router["readinessProbe"]["grpc"]["port"] == port


def _head_pod() -> dict:
    (ray_cluster,) = _by_kind("RayCluster")
    return ray_cluster["spec"]["headGroupSpec"]["template"]["spec"]


def _probe_window_s(probe: dict) -> int:
    """How long a probe may fail before the kubelet acts (Kubernetes' defaults)."""
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_the_router_is_probed_for_liveness_only_once_it_has_started():
    """Health is NOT_SERVING while the pools start (router/service.py): a
    startup probe holds the liveness probe off for as long as a cold start
    may take, so that it restarts a router that stopped answering, never one
    still loading the model."""
    (router,) = [c for c in _head_pod()["containers"] if c["name"] == "router"]
    port = ServeConfig.load(SERVE_CONFIG).server.port
    startup, liveness = router["startupProbe"], router["livenessProbe"]
    assert startup["grpc"]["port"] == liveness["grpc"]["port"] == port
    assert _probe_window_s(startup) >= 15 * 60  # a big model's cold start
    assert _probe_window_s(liveness) <= 60  # a hung router goes within a minute
    assert "initialDelaySeconds" not in liveness  # the startup probe does that job


def test_the_pod_gives_the_router_its_whole_drain_and_ray_outlives_it():
    """terminationGracePeriodSeconds covers limits.grace_period_s (the drain
    on SIGTERM) and the ray-head's preStop, which keeps Ray (the workers'
    GCS) up until the router has drained."""
    pod = _head_pod()
    grace = ServeConfig.load(SERVE_CONFIG).limits.grace_period_s
    termination = pod["terminationGracePeriodSeconds"]
    containers = {c["name"]: c for c in pod["containers"]}
    command = containers["ray-head"]["lifecycle"]["preStop"]["exec"]["command"]
    (sleep_s,) = [int(w) for w in command[-1].split() if w.isdigit()]
    assert command[-1] == f"sleep {sleep_s}"
    assert grace < sleep_s < termination
    script = " ".join(containers["router"]["args"])
    assert "exec tandem serve" in script  # the router gets SIGTERM itself, not a shell


def test_the_kuberay_router_serves_a_named_deployment():
    """A restarted router container attaches to the running pools (detached
    workers of a named deployment) rather than starting them cold."""
    (router,) = [c for c in _head_pod()["containers"] if c["name"] == "router"]
    words = " ".join(router["args"]).split()
    name = words[words.index("--deployment") + 1]
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", name)
    assert "--attach" not in words  # the first router starts the pools


def test_redis_asks_for_the_password_from_the_secret_and_never_on_its_command_line():
    (redis,) = [d for d in _by_kind("Deployment") if d["metadata"]["name"] == "tandem-redis"]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert _from_secret(_env(container)["REDIS_PASSWORD"])
    script = " ".join(container["args"])
    assert "requirepass" in script and "redis-server -" in script  # config on stdin
    assert "--requirepass" not in script
    assert "livenessProbe" in container
    probe = " ".join(container["readinessProbe"]["exec"]["command"])
    assert "REDISCLI_AUTH" in probe  # an unauthenticated PING gets NOAUTH


def _labels_of_pods() -> list[dict[str, str]]:
    (ray_cluster,) = _by_kind("RayCluster")
    specs = [ray_cluster["spec"]["headGroupSpec"], *ray_cluster["spec"]["workerGroupSpecs"]]
    specs += [d["spec"] for d in _by_kind("Deployment")]
    return [spec["template"]["metadata"]["labels"] for spec in specs]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_network_policies_admit_only_the_deployments_pods_to_internal_ports():
    policies = _by_kind("NetworkPolicy")
    own = {"app.kubernetes.io/name": "tandem"}
    port = ServeConfig.load(SERVE_CONFIG).server.port
    for labels in _labels_of_pods():  # every pod is under some policy (default deny)
        assert any(_selects(p["spec"]["podSelector"], labels) for p in policies), labels
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        for rule in spec["ingress"]:
            sources = rule.get("from")
            if sources:  # from pods only, and only the deployment's own
                assert all(set(s) == {"podSelector"} for s in sources), policy
                assert all(_selects(s["podSelector"], own) for s in sources), policy
                continue
            # Open to any source: the router's public gRPC port on router pods only.
            assert [p["port"] for p in rule["ports"]] == [port], policy
            selector = spec["podSelector"]["matchLabels"]
            assert selector.get("app.kubernetes.io/component") == "router", policy
    listed = yaml.safe_load((INFRA / "kuberay" / "kustomization.yaml").read_text())
    assert "networkpolicy.yaml" in listed["resources"]


def test_the_example_config_fixes_the_internal_port_range():
    config = ServeConfig.load(SERVE_CONFIG)
    low, high = config.transfer.port_range
    assert high - low + 1 >= 3 * 8  # three listeners for each of up to 8 workers a node


def _docker_context(dest: Path) -> Path:
    """A copy of the repository as `docker build .` sends it: without what
    .dockerignore names (a name at the top, or ``**/name`` at any depth)."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]

    def ignored(rel: PurePosixPath) -> bool:
        for pattern in patterns:
            if pattern.startswith("**/"):
                if fnmatch.fnmatch(rel.name, pattern[3:]):
                    return True
            elif fnmatch.fnmatch(str(rel), pattern.rstrip("/")):
                return True
        return False

    def skip(directory: str, names: list[str]) -> set[str]:
        base = PurePosixPath(Path(directory).relative_to(REPO).as_posix())
        return {n for n in names if ignored(base / n)}

    shutil.copytree(REPO, dest, ignore=skip, symlinks=True)
    return dest


@pytest.mark.slow
def test_the_docker_build_context_installs_every_module_and_the_kernel_source(tmp_path):
    """The images COPY the build context and `pip install --no-deps .` it: built
    as a wheel here, it must hold every module of the repository's packages,
    the kernel source engine.kernels compiles at run time, and the `tandem`
    command the images run."""
    from engine.kernels import build

    not_installed = {"tests", "bench", "build"}  # build/: a local build's leftovers
    modules = {
        rel.as_posix()
        for rel in (p.relative_to(REPO) for p in REPO.glob("*/**/*.py"))
        if rel.parts[0] not in not_installed and not rel.parts[0].startswith(".")
    }
    assert {"engine", "router", "tandem_cli", "protos"} <= {m.split("/")[0] for m in modules}
    context = _docker_context(tmp_path / "context")
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    out = subprocess.run(
        [*pip, "-w", str(dist), str(context)], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        installed = set(z.namelist())
        entry_points = next(n for n in installed if n.endswith(".dist-info/entry_points.txt"))
        commands = z.read(entry_points).decode()
    assert modules - installed == set()
    kernel_files = {
        (build.SOURCE_DIR / name).relative_to(REPO).as_posix()
        for name in (*build.SOURCES, *build.HEADERS)
    }
    assert kernel_files - installed == set()
    assert "tandem = tandem_cli.main:main" in commands
