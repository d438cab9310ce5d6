"""The container images and the compose stack, built and run for real with podman.

`test_compose_swarm_trains_and_stops` builds docker/Dockerfile.cpu with container-build (podman +
runc on a local Debian base tagged under the FROM names; $ADLOCO_CONTAINER_BUILD, by default
../shared/tools/container-build beside the repository; the build starts with the session, at the
lowest priority, tests/background.py), then starts the bootstrap and node
services of docker/compose.yaml as containers on one podman network. Entrypoint, command,
environment, volumes, init and shm size come from the compose file, so the containers run what
compose runs; `restart` is left out (a crash must fail the test) and so are `ulimits` where the
runtime may not set rlimits (this sandbox). It checks that the three nodes reach round 2 with the
same θ hash every round (from --status-file in their volumes), that the health checks pass and the
Prometheus targets of docker/prometheus.yml answer, then stops them as compose does (SIGTERM,
`podman stop -t <stop_grace_period>`) and checks that each exits 0 within 30 s after a final
checkpoint. `test_cuda_dockerfile_builds` only builds docker/Dockerfile and checks the image.

Everything a run creates is named adloco-ctest-<pid>-... and removed at the end, pass or fail;
leftovers of runs that died are removed at the start. The images are kept (tags adloco-node:cpu
and adloco-node:cuda) so the next build reuses their layers. `pytest -s` prints the timings.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from background import collect_outcome, container_image
from netns import pid_alive
from procs import wait_for

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
CPU_IMAGE = "localhost/adloco-node:cpu"
CUDA_IMAGE = "localhost/adloco-node:cuda"
PREFIX = "adloco-ctest-"
NODES = ("node1", "node2", "node3")
SWARM_SERVICES = ("bootstrap", *NODES)
# Keys of a compose service this test knows how to turn into `podman run` arguments.
KNOWN_KEYS = {
    *("image", "build", "init", "shm_size", "ulimits", "stop_grace_period", "restart"),
    *("depends_on", "entrypoint", "command", "environment", "volumes", "healthcheck"),
}
HEALTHCHECK = ["CMD", "adloco-node", "ctl", "--timeout", "5", "status"]
STOP_LIMIT_S = 30.0  # DESIGN.md §4: exit 0 within 30 s of SIGTERM

pytestmark = pytest.mark.container


def build_tool() -> Path | None:
    if os.environ.get("ADLOCO_CONTAINER_BUILD"):
        path = Path(os.environ["ADLOCO_CONTAINER_BUILD"])
        return path if path.is_file() else None
    # Beside the repository (the workspace layout), or the workspace's shared folder for a clone
    # made elsewhere (CI clones into a fresh folder).
    candidates = [
        ROOT.parent / "shared" / "tools" / "container-build",
        Path("/work/shared/tools/container-build"),
    ]
    return next((path for path in candidates if path.is_file()), None)


def podman_env() -> dict[str, str]:
    """container-build's podman settings: its containers.conf (no default rlimits, cgroupfs)."""
    env = dict(os.environ)
    conf = Path(os.environ.get("ADLOCO_CONTAINER_CACHE", "/var/cache/adloco-container")) / "containers.conf"
    if conf.is_file():
        env["CONTAINERS_CONF"] = str(conf)
    return env


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """podman as container-build runs it (runc as the runtime)."""
    runc = shutil.which("runc") or "runc"
    done = subprocess.run(
        ["podman", "--runtime", runc, *args],
        capture_output=True,
        text=True,
        env=podman_env(),
        timeout=timeout,
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {shlex.join(args)} (exit {done.returncode}): {quiet(done.stderr)}")
    return done


def quiet(text: str) -> str:
    """podman output without its syslog noise (there is no syslog in this sandbox)."""
    return "\n".join(line for line in text.splitlines() if "failed to connect to syslog" not in line)


def from_images(dockerfile: Path) -> list[str]:
    """The external images a Dockerfile's FROM lines name (not its own stages)."""
    stages: set[str] = set()
    images = []
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if m is None:
            continue
        if m[1] not in stages and m[1] not in images:
            images.append(m[1])
        if m[2]:
            stages.add(m[2])
    return images


def container_build(tool: Path, dockerfile: Path, tag: str, log: Path) -> float:
    """Build `dockerfile` (context: the repository) as `tag`; returns the seconds it took."""
    argv = [str(tool), "--tag", tag]
    for image in from_images(dockerfile):
        argv += ["--base-as", image]
    # Docker image format: the OCI format has no HEALTHCHECK, and buildah drops it.
    env = {**os.environ, "BUILDAH_FORMAT": "docker"}
    t0 = time.monotonic()
    with log.open("w") as f:
        done = subprocess.run(
            [*argv, str(dockerfile), str(ROOT)], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    seconds = time.monotonic() - t0
    tail = "\n".join(quiet(log.read_text()).splitlines()[-40:])
    assert done.returncode == 0, f"building {dockerfile.name} failed (exit {done.returncode}):\n{tail}"
    return seconds


def unusable(tool: Path | None, folder: Path) -> str | None:
    """Why the container tests cannot run here (their skip reason), or None: they need root and
    container-build, and container-build must build a probe image."""
    if os.geteuid() != 0:
        return "container tests need root (podman with runc, as tools/container-build runs it)"
    if tool is None:
        return "container-build not found: set ADLOCO_CONTAINER_BUILD to its path"
    (folder / "Dockerfile").write_text("FROM python:3.11-slim-bookworm\nRUN python3 -c 'import venv'\n")
    argv = [str(tool), "--tag", f"localhost/{PREFIX}probe", "--base-as", "python:3.11-slim-bookworm"]
    done = subprocess.run([*argv, str(folder / "Dockerfile"), str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(quiet(done.stdout + done.stderr).splitlines()[-15:])
        return f"container-build cannot build here (exit {done.returncode}):\n{tail}"
    podman("rmi", f"localhost/{PREFIX}probe", check=False)
    return None


@pytest.fixture(scope="module")
def tool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """container-build, once it has shown it can build something here (else the tests skip)."""
    found = build_tool()
    reason = unusable(found, tmp_path_factory.mktemp("probe"))
    if reason is not None:
        pytest.skip(reason)
    assert found is not None
    return found


def probe_and_build(folder: Path) -> None:
    """`cpu_image`'s work, run as a script (`python tests/test_container.py FOLDER`) that
    tests/background.py starts with the session at the lowest priority, since the build is most of a
    minute of CPU and pip downloads: the probe, then docker/Dockerfile.cpu built. folder/outcome.json
    says which: {"skip": reason}, {"build_s": seconds} or {"build_error": message}."""
    found = build_tool()
    reason = unusable(found, folder)
    outcome: dict[str, Any] = {"skip": reason}
    if reason is None:
        assert found is not None
        try:
            outcome = {
                "build_s": container_build(found, DOCKER / "Dockerfile.cpu", CPU_IMAGE, folder / "cpu.log")
            }
        except AssertionError as e:
            outcome = {"build_error": str(e)}
    (folder / "outcome.json").write_text(json.dumps(outcome))


@pytest.fixture(scope="module")
def cpu_image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    """docker/Dockerfile.cpu built (by the run the session started, or now), and how long it took."""
    _, built = collect_outcome(
        request, "cpu_image", lambda: tmp_path_factory.mktemp("build"), container_image, timeout=1500
    )
    assert "build_error" not in built, built["build_error"]
    print(f"\n[container] built docker/Dockerfile.cpu in {built['build_s']:.0f}s (with the session, niced)")
    return CPU_IMAGE, built["build_s"]


def image_healthcheck(image: str) -> dict[str, Any]:
    """The image's HEALTHCHECK (podman shows it beside Config, Docker inside it)."""
    data = json.loads(podman("image", "inspect", image).stdout)[0]
    return data.get("Healthcheck") or data["Config"].get("Healthcheck") or {}


def check_image_config(image: str) -> None:
    """The runtime contract of both images: entrypoint, non-root user, ports, health check."""
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["adloco-node"]
    assert config["User"] == "adloco"
    assert set(config["ExposedPorts"]) == {"31337/tcp", "9400/tcp"}
    health = image_healthcheck(image)
    assert health.get("Test") == HEALTHCHECK, health
    assert (health.get("Interval"), health.get("Timeout"), health.get("StartPeriod")) == (
        30 * 10**9,
        10 * 10**9,
        180 * 10**9,
    ), health
    uid = podman("run", "--rm", "--entrypoint", "id", image, "-u").stdout.strip()
    assert uid == "10001"
    assert "adloco-node" in podman("run", "--rm", image, "--help").stdout


# ---- leftovers and cleanup ------------------------------------------------------------------------


def remove_leftovers() -> None:
    """Remove containers, volumes and networks of earlier runs whose process is gone."""
    kinds = {
        "container": (["ps", "-a", "--format", "{{.Names}}"], ["rm", "-f", "-t", "0"]),
        "volume": (["volume", "ls", "--format", "{{.Name}}"], ["volume", "rm", "-f"]),
        "network": (["network", "ls", "--format", "{{.Name}}"], ["network", "rm", "-f"]),
    }
    for listing, remove in kinds.values():
        for name in podman(*listing, check=False).stdout.split():
            m = re.match(re.escape(PREFIX) + r"(\d+)-", name)
            if m and not pid_alive(int(m[1])):
                podman(*remove, name, check=False)


@dataclass
class Stack:
    """The containers, volumes and network one test run created (removed by `down`)."""

    prefix: str
    containers: list[str]
    volumes: list[str]

    @property
    def network(self) -> str:
        return f"{self.prefix}net"

    def name(self, service: str) -> str:
        return f"{self.prefix}{service}"

    def down(self) -> None:
        for name in self.containers:
            podman("rm", "-f", "-t", "0", name, check=False)
        for name in self.volumes:
            podman("volume", "rm", "-f", name, check=False)
        podman("network", "rm", "-f", self.network, check=False)

    def logs(self, service: str, lines: int = 40) -> str:
        done = podman("logs", "--tail", str(lines), self.name(service), check=False)
        return f"--- {service} ---\n" + quiet(done.stdout + done.stderr)

    def all_logs(self) -> str:
        return "\n".join(self.logs(s) for s in SWARM_SERVICES if self.name(s) in self.containers)


@pytest.fixture
def stack() -> Iterator[Stack]:
    remove_leftovers()
    s = Stack(prefix=f"{PREFIX}{os.getpid()}-{os.urandom(2).hex()}-", containers=[], volumes=[])
    try:
        yield s
    finally:
        s.down()


# ---- compose services as podman run arguments ----------------------------------------------------


def load_compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # safe_load resolves the <<: merge keys
    return compose


def seconds(value: str | int | float) -> float:
    """A compose duration ("40s", "1m30s", 40) in seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"unsupported duration {value!r}"
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def environment(spec: dict[str, Any]) -> dict[str, str]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def volume_args(spec: dict[str, Any], stack: Stack, named: set[str]) -> list[str]:
    args = []
    for entry in spec.get("volumes") or []:
        source, target, *mode = entry.split(":")
        if source in named:
            source = stack.prefix + source
            if source not in stack.volumes:
                podman("volume", "create", source)
                stack.volumes.append(source)
        else:
            source = str((DOCKER / source).resolve())
        args += ["-v", ":".join([source, target, *mode])]
    return args


def run_args(
    service: str,
    spec: dict[str, Any],
    *,
    stack: Stack,
    named: set[str],
    image: str,
    ulimits: bool,
    extra_env: dict[str, str],
) -> list[str]:
    unknown = set(spec) - KNOWN_KEYS
    assert not unknown, f"compose.yaml: {service} uses {sorted(unknown)}, which {__name__} does not map"
    assert image.endswith("/" + spec["image"]), f"{service}: image {spec['image']} is not {image}"
    args = ["run", "-d", "--name", stack.name(service), "--network", stack.network]
    args += ["--network-alias", service]  # compose's service-name DNS
    if spec.get("init"):
        args.append("--init")
    if "shm_size" in spec:
        args += ["--shm-size", str(spec["shm_size"])]
    if ulimits:
        for name, limit in (spec.get("ulimits") or {}).items():
            value = f"{limit['soft']}:{limit['hard']}" if isinstance(limit, dict) else str(limit)
            args += ["--ulimit", f"{name}={value}"]
    for key, value in {**environment(spec), **extra_env}.items():
        args += ["-e", f"{key}={value}"]
    args += volume_args(spec, stack, named)
    entrypoint = spec.get("entrypoint")
    if entrypoint is not None:
        args += ["--entrypoint", json.dumps(entrypoint) if isinstance(entrypoint, list) else entrypoint]
    command = spec.get("command") or []
    args.append(image)
    args += shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    return args


def rlimits_settable(image: str) -> bool:
    """False where the runtime may not set rlimits (runc fails 'operation not permitted' here)."""
    done = podman("run", "--rm", "--ulimit", "nofile=1024:1024", "--entrypoint", "true", image, check=False)
    return done.returncode == 0


def data_dir(stack: Stack, spec: dict[str, Any]) -> Path:
    """The host path of the named volume a service mounts at /data."""
    for entry in spec.get("volumes") or []:
        source, target, *_ = entry.split(":")
        if target == "/data":
            mount = podman("volume", "inspect", "--format", "{{.Mountpoint}}", stack.prefix + source)
            return Path(mount.stdout.strip())
    raise AssertionError("no volume at /data")


def status_events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def container_state(stack: Stack, service: str) -> tuple[str, int]:
    done = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", stack.name(service))
    status, code = done.stdout.split()
    return status, int(code)


def check_health(stack: Stack, service: str, spec: dict[str, Any], image_check: list[str]) -> None:
    """Run the service's health check command (the compose one, else the image's) in the container."""
    test = (spec.get("healthcheck") or {}).get("test") or image_check
    assert test[0] == "CMD", f"{service}: health check {test} is not exec form"
    done = podman("exec", stack.name(service), *test[1:], check=False, timeout=30)
    assert done.returncode == 0, f"{service}: health check {test[1:]} failed: {done.stdout}{done.stderr}"


def prometheus_targets() -> list[str]:
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    return [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]


def check_targets(stack: Stack, via: str) -> None:
    """docker/prometheus.yml is valid and each of its targets answers with adloco_ metrics."""
    fetch = (
        "import sys, urllib.request\n"
        "for t in sys.argv[1:]:\n"
        "    body = urllib.request.urlopen(f'http://{t}/metrics', timeout=10).read().decode()\n"
        "    assert 'adloco_' in body, t\n"
    )
    if shutil.which("promtool"):  # Debian's prometheus package; tests/test_metrics.py uses it too
        checked = subprocess.run(
            ["promtool", "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    targets = prometheus_targets()
    done = podman("exec", stack.name(via), "python", "-c", fetch, *targets, check=False, timeout=60)
    assert done.returncode == 0, f"scraping {targets} from {via} failed: {done.stderr}"


def stop(stack: Stack, service: str, grace_s: float) -> tuple[float, int]:
    """SIGTERM as compose sends it; (seconds until the container was gone, its exit code)."""
    t0 = time.monotonic()
    podman("stop", "-t", str(int(grace_s)), stack.name(service), timeout=grace_s + 30)
    took = time.monotonic() - t0
    return took, container_state(stack, service)[1]


# ---- the tests -----------------------------------------------------------------------------------


@pytest.mark.long  # the image build alone is ~7 minutes on a cold machine
@pytest.mark.timeout(1500)
def test_compose_swarm_trains_and_stops(cpu_image: tuple[str, float], stack: Stack) -> None:
    image, build_s = cpu_image
    check_image_config(image)
    compose = load_compose()
    services = compose["services"]
    named = set(compose.get("volumes") or {})
    image_check = image_healthcheck(image)["Test"]
    ulimits = rlimits_settable(image)
    if not ulimits:
        print("\n[container] this runtime may not set rlimits: running without compose's ulimits")

    podman("network", "create", stack.network)
    t_start = time.monotonic()
    for service in SWARM_SERVICES:
        spec = services[service]
        assert set(spec.get("depends_on") or []) <= {s for s in SWARM_SERVICES if s != service}
        extra = {"ADLOCO_STATUS_FILE": "/data/status.jsonl"} if service in NODES else {}
        args = run_args(
            service, spec, stack=stack, named=named, image=image, ulimits=ulimits, extra_env=extra
        )
        stack.containers.append(stack.name(service))
        podman(*args)

    status = {n: data_dir(stack, services[n]) / "status.jsonl" for n in NODES}

    def rounds(node: str) -> dict[int, str]:
        return {e["round"]: e["theta_hash"] for e in status_events(status[node]) if e["event"] == "round"}

    def all_reached_round_2() -> bool:
        for service in SWARM_SERVICES:
            state, code = container_state(stack, service)
            assert state == "running", f"{service} is {state} (exit {code}):\n{stack.all_logs()}"
        return all(max(rounds(n), default=0) >= 2 for n in NODES)

    try:
        wait_for(all_reached_round_2, timeout=600, interval=1.0, what="every node at round 2")
    except TimeoutError as e:
        pytest.fail(f"{e}: rounds { {n: sorted(rounds(n)) for n in NODES} }\n{stack.all_logs()}")
    to_round_2_s = time.monotonic() - t_start

    seen = {n: rounds(n) for n in NODES}
    common = sorted(set.intersection(*(set(r) for r in seen.values())))
    assert common, f"no round reported by every node: { {n: sorted(r) for n, r in seen.items()} }"
    differing = {
        r: {n: seen[n][r][:12] for n in NODES} for r in common if len({seen[n][r] for n in NODES}) > 1
    }
    assert not differing, f"θ differs between nodes after rounds {differing}\n{stack.all_logs()}"

    for service in SWARM_SERVICES:
        check_health(stack, service, services[service], image_check)
    check_targets(stack, via=NODES[0])

    with ThreadPoolExecutor(len(NODES)) as pool:  # compose stops the nodes together
        grace = {n: seconds(services[n].get("stop_grace_period", 10)) for n in NODES}
        stopped = dict(zip(NODES, pool.map(lambda n: stop(stack, n, grace[n]), NODES), strict=True))
    bootstrap_grace = seconds(services["bootstrap"].get("stop_grace_period", 10))
    bootstrap_s, bootstrap_code = stop(stack, "bootstrap", bootstrap_grace)
    print(
        f"\n[container] build {build_s:.0f}s, start to round 2 {to_round_2_s:.0f}s (rounds in common:"
        f" {common}), stop "
        + ", ".join(f"{n} {s:.1f}s exit {c}" for n, (s, c) in stopped.items())
        + f", bootstrap {bootstrap_s:.1f}s exit {bootstrap_code}"
    )
    logs = stack.all_logs()
    for node, (took, code) in stopped.items():
        assert code == 0, f"{node} exited {code} on SIGTERM\n{logs}"
        assert took < STOP_LIMIT_S, f"{node} took {took:.1f}s to stop (limit {STOP_LIMIT_S}s)\n{logs}"
        events = status_events(status[node])
        final = [e for e in events if e["event"] == "checkpoint" and e.get("final")]
        assert final, f"{node}: no final checkpoint in its status file"
        assert events[-1]["event"] == "done", f"{node}: last event {events[-1]}"
    assert bootstrap_code == 0, f"the bootstrap exited {bootstrap_code} on SIGTERM\n{logs}"


@pytest.mark.slow  # 160 s more on a cold machine; run with -m "container and slow"
@pytest.mark.timeout(1500)
def test_cuda_dockerfile_builds(tool: Path, tmp_path: Path) -> None:
    build_s = container_build(tool, DOCKER / "Dockerfile", CUDA_IMAGE, tmp_path / "cuda.log")
    print(f"\n[container] built docker/Dockerfile (CUDA layout, local base) in {build_s:.0f}s")
    check_image_config(CUDA_IMAGE)


if __name__ == "__main__":  # python tests/test_container.py FOLDER (tests/background.py)
    probe_and_build(Path(sys.argv[1]))
