"""The deployment files, checked without Docker or Kubernetes: every command a container runs
parses with the CLI it calls (so each flag exists and takes its value), every environment
variable it sets is one kvswitch reads, every GPU worker has a GPU of its own, every
healthcheck runs a command the image installs, and the fleet is secured by default: every
router and worker gets the fleet token from a secret (so none needs --insecure, and blocks are
named with the keyed hash), Redis takes a password that reaches every router and worker from the
secrets in KVSWITCH_INDEX_PASSWORD (never on a command line, which ps shows), and Kubernetes
NetworkPolicies let only routers and workers reach workers and Redis. The worker image has the C
compiler Triton needs, and `make images` builds every image the files run.

Where no Docker engine can be reached these tests only parse the files: the one that builds the
images and runs a compiler and Triton in the worker image is skipped, and says so."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvswitch.app.cli import build_parser
from kvswitch.app.cli_args import config_from_args
from kvswitch.cache_index.hashing import BLAKE2B_KEYED
from kvswitch.logs import LOG_FORMAT_ENV, LOG_LEVEL_ENV
from kvswitch.router.server import RouterConfig
from kvswitch.security import FLEET_TOKEN_ENV, INDEX_PASSWORD_ENV, TOKEN_ENV
from kvswitch.worker.server import WorkerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE_FILES = sorted(DEPLOY.glob("docker-compose*.yml"))
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
# What the code reads from the environment (kvswitch/logs.py), and what the image sets for it.
KNOWN_ENV = {
    LOG_FORMAT_ENV,
    LOG_LEVEL_ENV,
    "HF_HOME",
    FLEET_TOKEN_ENV,
    TOKEN_ENV,
    INDEX_PASSWORD_ENV,
}
# The index URLs: the Redis password comes in KVSWITCH_INDEX_PASSWORD, never on a command line.
COMPOSE_REDIS_URL = "redis://redis:6379"
K8S_REDIS_URL = "redis://kvswitch-redis:6379"
KVSWITCH_IMAGES = ("kvswitch-router", "kvswitch-worker")


def substitute(value: str) -> str:
    """A compose ``${NAME:-default}`` / ``${NAME:?message}`` or a Kubernetes ``$(NAME)`` as a
    container would see it with the variable unset (compose; a required one as ``<NAME>``) or
    set to an example (pods)."""
    value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    value = re.sub(r"\$\{([A-Z_]+):\?[^}]*\}", r"<\1>", value)
    return re.sub(r"\$\(([A-Z_]+)\)", lambda m: EXAMPLES[m.group(1)], value)


EXAMPLES = {"POD_IP": "10.1.2.3", "POD_NAME": "kvswitch-worker-0", "REDIS_PASSWORD": "0123abcd"}


def parse_command(argv: list[Any]) -> Any:
    """The CLI's parse of a container's command (its entrypoint is ``kvswitch``); fails the test
    with argparse's message when a flag does not exist or a value does not fit."""
    argv = [substitute(str(arg)) for arg in argv]
    parser = build_parser(argv[0])
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"kvswitch {' '.join(argv)} does not parse (see stderr)")


def compose(path: Path, *overrides: Path) -> dict[str, Any]:
    """The file's services, with ``overrides`` laid over it as compose does for a service's
    command (the only key they override)."""
    services = yaml.safe_load(path.read_text())["services"]
    for override in overrides:
        for name, service in yaml.safe_load(override.read_text())["services"].items():
            services[name] = {**services[name], **service}
    return services


def dockerfile_targets() -> dict[str, str]:
    """Each build target of deploy/Dockerfile and its instructions."""
    targets: dict[str, str] = {}
    name = ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        match = re.match(r"FROM \S+ AS (\w+)", line)
        if match:
            name = match.group(1)
        if name:
            targets[name] = targets.get(name, "") + line + "\n"
    return targets


def images_install_kvswitch(image: str) -> bool:
    target = image.removeprefix("kvswitch-").removesuffix("-cpu")
    return 'pip install ".[' in dockerfile_targets().get(target, "")


COMPOSES = [
    ("docker-compose.yml", ()),
    ("docker-compose.yml", ("docker-compose.pd.yml",)),
    ("docker-compose.cpu.yml", ()),
]


def test_every_compose_file_is_checked() -> None:
    checked = {name for name, _ in COMPOSES} | {o for _, os in COMPOSES for o in os}
    assert checked == {path.name for path in COMPOSE_FILES}


@pytest.mark.parametrize(("name", "overrides"), COMPOSES, ids=lambda v: str(v))
def test_compose_services_run_commands_the_cli_takes(name: str, overrides: tuple) -> None:
    services = compose(DEPLOY / name, *(DEPLOY / o for o in overrides))
    ours = {n: s for n, s in services.items() if s.get("image", "").startswith(KVSWITCH_IMAGES)}
    assert {"router"} <= set(ours) and len(ours) >= 3
    for service_name, service in ours.items():
        args = parse_command(service["command"])
        assert args.command in ("router", "worker"), service_name
        if args.command == "worker":
            assert args.index == COMPOSE_REDIS_URL
            # Registered as HOSTNAME:PORT, which the router must resolve: its own hostname.
            assert args.host == "0.0.0.0" and service["hostname"] == service_name
        assert set(service.get("environment", {})) <= KNOWN_ENV, service_name
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "kvswitch", "health"], service_name
        health = parse_command(test[2:])
        assert health.service == f"kvswitch.v1.{args.command.title()}"
        assert health.target.endswith(f":{args.port}")
        assert images_install_kvswitch(service["image"])
        assert service["build"]["target"] in dockerfile_targets()
        assert service["restart"] == "unless-stopped"
    # The router serves the OpenAI-compatible HTTP API too, on a published port.
    router = parse_command(ours["router"]["command"])
    assert router.http_port > 0
    assert any(p.endswith(f":{router.http_port}") for p in ours["router"]["ports"])
    # The index is up before anything registers with it.
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert all(s["depends_on"]["redis"]["condition"] == "service_healthy" for s in ours.values())


def test_each_gpu_worker_has_a_gpu_of_its_own() -> None:
    services = compose(DEPLOY / "docker-compose.yml")
    workers = {n: s for n, s in services.items() if n.startswith("worker")}
    gpus = []
    for name, service in workers.items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        assert len(device["device_ids"]) == 1, name
        gpus += device["device_ids"]
        args = parse_command(service["command"])
        assert (args.device, args.model) == ("cuda", "/models/model")
        assert any(v.endswith(":/models/model:ro") for v in service["volumes"]), name
        assert "kv-shm:/dev/shm" in service["volumes"]  # one /dev/shm for the box's workers
        assert service["healthcheck"]["start_period"] == "600s"  # time to load the model
    assert len(set(gpus)) == len(gpus) >= 2


def test_the_pd_variant_has_a_prefill_and_a_decode_worker() -> None:
    services = compose(DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.pd.yml")
    roles = sorted(parse_command(services[n]["command"]).role for n in ("worker-0", "worker-1"))
    assert roles == ["decode", "prefill"]


def test_the_cpu_variant_needs_no_gpu_and_no_checkpoint() -> None:
    services = compose(DEPLOY / "docker-compose.cpu.yml")
    for name in ("worker-0", "worker-1"):
        assert "deploy" not in services[name]
        args = parse_command(services[name]["command"])
        assert (args.device, args.model, args.kv_cache_shm) == ("cpu", "", True)
        assert services[name]["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")


def test_the_images_run_as_a_user_and_check_their_health() -> None:
    targets = dockerfile_targets()
    assert {"router", "worker"} <= set(targets)
    for target in ("router", "worker"):
        lines = targets[target]
        assert "USER kvswitch" in lines and 'ENTRYPOINT ["kvswitch"]' in lines
        healthcheck = re.search(r"CMD (\[.*\])", lines.split("HEALTHCHECK", 1)[1]).group(1)
        parse_command(yaml.safe_load(healthcheck)[1:])
    assert "useradd --create-home --uid 1000" in targets["base"]


def built_images() -> dict[str, dict[str, Any]]:
    """Every image a compose file builds: its tag -> its ``build`` section."""
    images: dict[str, dict[str, Any]] = {}
    for path in COMPOSE_FILES:
        for service in yaml.safe_load(path.read_text())["services"].values():
            if "build" in service:
                images[service["image"]] = service["build"]
    return images


def make_images_builds() -> dict[str, tuple[str, dict[str, str]]]:
    """What ``make images`` builds: tag -> (Dockerfile target, build args), its variables
    substituted."""
    makefile = (DEPLOY.parent / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) :?= (.*)$", makefile, flags=re.MULTILINE))
    recipe = makefile.split("\nimages:\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    builds = {}
    for line in recipe.splitlines():
        line = re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], line)
        assert line.split()[:2] == ["docker", "build"], line
        tag = re.search(r"-t (\S+)", line).group(1)
        target = re.search(r"--target (\S+)", line).group(1)
        args = dict(re.findall(r"--build-arg (\w+)=(\S+)", line))
        builds[tag] = (target, args)
    return builds


def test_the_worker_image_has_the_c_compiler_triton_needs() -> None:
    """Triton compiles a launcher with the system's C compiler when a kernel first runs: every
    image a compose file runs a worker from is the worker target, which installs one (as root,
    before it becomes the user kvswitch)."""
    worker = dockerfile_targets()["worker"]
    install = re.search(r"apt-get install [^\n]*\bgcc\b[^\n]*\blibc6-dev\b", worker)
    assert install, "the worker target installs no C compiler"
    assert worker.index(install.group(0)) < worker.index("USER kvswitch")
    worker_images = {tag: b for tag, b in built_images().items() if "worker" in tag}
    assert worker_images
    assert all(build["target"] == "worker" for build in worker_images.values()), worker_images


def test_make_images_builds_every_image_the_deploy_files_run() -> None:
    builds = make_images_builds()
    for tag, build in built_images().items():
        assert builds.get(tag) == (build["target"], build.get("args", {})), tag
    k8s_images = {
        container(obj)["image"].split(":")[0]
        for obj in k8s_objects().values()
        if obj["kind"] in ("Deployment", "StatefulSet")
    }
    kvswitch_images = {image for image in k8s_images if image.startswith("kvswitch-")}
    assert kvswitch_images and kvswitch_images <= set(builds), kvswitch_images


def docker_engine_reachable() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(
    not docker_engine_reachable(),
    reason="no Docker engine here: the images were not built, the other deploy tests only parse "
    "the files",
)
def test_make_images_builds_a_worker_image_that_can_compile_its_kernels() -> None:
    root = DEPLOY.parent
    subprocess.run(["make", "images"], cwd=root, check=True, timeout=3600)
    check = "gcc --version && python -c 'import triton, torch; print(torch.__version__)'"
    for tag in make_images_builds():
        if "worker" in tag:
            command = ["docker", "run", "--rm", "--entrypoint", "sh", tag, "-c", check]
            subprocess.run(command, check=True, timeout=300)


# -- Kubernetes -----------------------------------------------------------------------------------


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in K8S_FILES:
        for doc in yaml.safe_load_all(path.read_text()):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (only,) = obj["spec"]["template"]["spec"]["containers"]
    return only


def test_routers_are_replicated_and_never_all_down_in_an_update() -> None:
    objects = k8s_objects()
    router = objects[("Deployment", "kvswitch-router")]
    assert router["spec"]["replicas"] >= 2
    assert router["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    args = parse_command(container(router)["args"])
    assert args.index == K8S_REDIS_URL
    probes = container(router)
    assert probes["readinessProbe"]["grpc"] == {"port": 50051, "service": "kvswitch.v1.Router"}
    assert probes["livenessProbe"]["grpc"]["port"] == args.port
    assert objects[("PodDisruptionBudget", "kvswitch-router")]["spec"]["minAvailable"] == 1
    http_ports = {p["containerPort"] for p in probes["ports"] if p["name"] == "http"}
    assert http_ports == {args.http_port}
    service_ports = objects[("Service", "kvswitch-router")]["spec"]["ports"]
    assert {"name": "http", "port": args.http_port, "targetPort": "http"} in service_ports
    assert ("Service", "kvswitch-redis") in objects and ("Service", "kvswitch-router") in objects


def test_workers_get_a_gpu_each_and_time_to_load_their_model() -> None:
    objects = k8s_objects()
    workers = objects[("StatefulSet", "kvswitch-worker")]
    spec = container(workers)
    args = parse_command(spec["args"])
    assert (args.host, args.worker_id) == (EXAMPLES["POD_IP"], EXAMPLES["POD_NAME"])
    assert args.device == "cuda"
    assert {e["name"] for e in spec["env"]} <= KNOWN_ENV | set(EXAMPLES)
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    startup = spec["startupProbe"]
    assert startup["grpc"] == {"port": args.port, "service": "kvswitch.v1.Worker"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert spec["readinessProbe"]["grpc"]["service"] == "kvswitch.v1.Worker"
    assert workers["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1}
    assert objects[("PodDisruptionBudget", "kvswitch-worker")]["spec"]["maxUnavailable"] == 1
    assert objects[("Service", "kvswitch-worker")]["spec"]["clusterIP"] == "None"
    shm = next(v for v in workers["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_every_pod_runs_as_a_user() -> None:
    for (kind, name), obj in k8s_objects().items():
        if kind in ("Deployment", "StatefulSet") and name != "kvswitch-redis":
            security = obj["spec"]["template"]["spec"]["securityContext"]
            assert security["runAsNonRoot"] and security["runAsUser"] == 1000, name


# -- secured by default ---------------------------------------------------------------------------

SECRET_VALUES = {FLEET_TOKEN_ENV: "fleet-token-example", TOKEN_ENV: "client-token-example"}


def built_config(argv: list[Any], env: dict[str, str]) -> RouterConfig | WorkerConfig:
    """The config the container's command builds with ``env``'s tokens, as ``kvswitch router``
    and ``kvswitch worker`` take them from the environment: it raises (as the process would
    refuse to start) if a port beyond loopback would take any caller."""
    args = parse_command(argv)
    for name, variable in (("token", TOKEN_ENV), ("fleet_token", FLEET_TOKEN_ENV)):
        if hasattr(args, name) and not getattr(args, name):
            setattr(args, name, env.get(variable, ""))
    return config_from_args(RouterConfig if args.command == "router" else WorkerConfig, args)


def required(variable: str) -> str:
    """How a compose file says: this variable, and refuse to start without it."""
    return "${" + variable + ":?"


@pytest.mark.parametrize(("name", "overrides"), COMPOSES, ids=lambda v: str(v))
def test_compose_fleets_are_secured_by_default(name: str, overrides: tuple) -> None:
    services = compose(DEPLOY / name, *(DEPLOY / o for o in overrides))
    ours = {n: s for n, s in services.items() if s.get("image", "").startswith(KVSWITCH_IMAGES)}
    for service_name, service in ours.items():
        env = service["environment"]
        # Each token from the operator's env file, never on a command line (ps shows those).
        assert env[FLEET_TOKEN_ENV].startswith(required(FLEET_TOKEN_ENV)), service_name
        assert env[INDEX_PASSWORD_ENV].startswith(required("KVSWITCH_REDIS_PASSWORD"))
        command = [str(arg) for arg in service["command"]]
        assert not {"--token", "--fleet-token", "--insecure"} & set(command), service_name
        assert not [arg for arg in command if "PASSWORD" in arg], service_name
        config = built_config(command, {v: SECRET_VALUES[v] for v in env if v in SECRET_VALUES})
        assert config.index == COMPOSE_REDIS_URL, service_name
        assert config.block_naming().mode == BLAKE2B_KEYED, service_name
        if config.host != "127.0.0.1":
            assert config.fleet_token, service_name
    assert ours["router"]["environment"][TOKEN_ENV].startswith(required(TOKEN_ENV))
    # Metrics have no authentication: published on this host's loopback only.
    assert [p for p in ours["router"]["ports"] if p.endswith(":9100")] == [
        "127.0.0.1:${KVSWITCH_METRICS_PORT:-9100}:9100"
    ]
    redis = services["redis"]
    assert "ports" not in redis  # the compose network only
    command = redis["command"]
    password = command[command.index("--requirepass") + 1]
    assert password.startswith(required("KVSWITCH_REDIS_PASSWORD"))
    assert redis["environment"]["REDISCLI_AUTH"] == password  # its healthcheck's redis-cli


def env_of(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in spec.get("env", [])}


def from_secret(entry: dict[str, Any]) -> tuple[str, str]:
    ref = entry["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional", False)  # no pod starts without the Secret
    return ref["name"], ref["key"]


def test_k8s_pods_take_their_secrets_from_the_secret() -> None:
    objects = k8s_objects()
    for kind, name in (("Deployment", "kvswitch-router"), ("StatefulSet", "kvswitch-worker")):
        spec = container(objects[(kind, name)])
        env = env_of(spec)
        assert from_secret(env[FLEET_TOKEN_ENV]) == ("kvswitch", "fleet-token"), name
        assert from_secret(env[INDEX_PASSWORD_ENV]) == ("kvswitch", "redis-password"), name
        assert not [arg for arg in spec["args"] if "PASSWORD" in str(arg)], name
        # Every $(VAR) in the command is one the container sets.
        for arg in spec["args"]:
            assert set(re.findall(r"\$\(([A-Z_]+)\)", str(arg))) <= set(env), (name, arg)
        assert K8S_REDIS_URL in spec["args"], name
        assert not {"--token", "--fleet-token", "--insecure"} & set(spec["args"]), name
        values = {v: SECRET_VALUES[v] for v in env if v in SECRET_VALUES}
        assert built_config(spec["args"], values).block_naming().mode == BLAKE2B_KEYED, name
    router = env_of(container(objects[("Deployment", "kvswitch-router")]))
    assert from_secret(router[TOKEN_ENV]) == ("kvswitch", "client-token")
    redis = container(objects[("Deployment", "kvswitch-redis")])
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    redis_env = env_of(redis)
    for variable in ("REDIS_PASSWORD", "REDISCLI_AUTH"):  # the server's, its probe's redis-cli
        assert from_secret(redis_env[variable]) == ("kvswitch", "redis-password")


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"]["labels"]


def test_k8s_network_policies_let_only_the_fleet_reach_workers_and_redis() -> None:
    objects = k8s_objects()
    pods = {
        name: obj for (kind, name), obj in objects.items() if kind in ("Deployment", "StatefulSet")
    }
    allowed = {"kvswitch-worker": {"kvswitch-router", "kvswitch-worker"},
               "kvswitch-redis": {"kvswitch-router", "kvswitch-worker"}}  # fmt: skip
    for target, callers in allowed.items():
        policy = objects[("NetworkPolicy", target)]["spec"]
        selected = {
            n
            for n, o in pods.items()
            if selects(policy["podSelector"]["matchLabels"], pod_labels(o))
        }
        assert selected == {target}
        assert policy["policyTypes"] == ["Ingress"]
        (rule,) = policy["ingress"]
        let_in = {
            n
            for n, o in pods.items()
            for source in rule["from"]
            if set(source) == {"podSelector"}  # no namespaces, no address blocks
            and selects(source["podSelector"]["matchLabels"], pod_labels(o))
        }
        assert let_in == callers, target
        serving = {p["containerPort"] for p in container(pods[target])["ports"]}
        ports = {p["port"] for p in rule["ports"]}
        assert ports <= serving and len(ports) == 1, target
    worker_args = parse_command(container(pods["kvswitch-worker"])["args"])
    (worker_rule,) = objects[("NetworkPolicy", "kvswitch-worker")]["spec"]["ingress"]
    assert [p["port"] for p in worker_rule["ports"]] == [worker_args.port]
