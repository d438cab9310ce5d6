"""Containers of the project's image run with podman as container-build runs it: the image build,
the compose services of docker/compose.yaml turned into `podman run` arguments, the containers,
volumes and network one run creates (`Stack`), and their leftovers removed. tests/test_container.py
and bench/kill_restart.py (`--containers`) run the image through them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from netns import pid_alive, tbf

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


# ---- podman and the image build ------------------------------------------------------------------


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


@contextlib.contextmanager
def new_stack() -> Iterator[Stack]:
    """A stack of names of its own (leftovers of runs that died removed first), taken down at the
    end, pass or fail."""
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


def run_service(
    stack: Stack,
    service: str,
    spec: dict[str, Any],
    *,
    named: set[str],
    image: str,
    ulimits: bool,
    extra_env: dict[str, str],
) -> None:
    """Start `service` as compose does (`run_args`), its container recorded in `stack` (once: a
    container removed and started again under its name is the same entry)."""
    args = run_args(
        service, spec, stack=stack, named=named, image=image, ulimits=ulimits, extra_env=extra_env
    )
    if stack.name(service) not in stack.containers:
        stack.containers.append(stack.name(service))
    podman(*args)


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


def stop(stack: Stack, service: str, grace_s: float) -> tuple[float, int]:
    """SIGTERM as compose sends it; (seconds until the container was gone, its exit code)."""
    t0 = time.monotonic()
    podman("stop", "-t", str(int(grace_s)), stack.name(service), timeout=grace_s + 30)
    took = time.monotonic() - t0
    return took, container_state(stack, service)[1]


def shape_link(stack: Stack, service: str, rate_mbit: float) -> None:
    """The container's link at `rate_mbit` Mbit/s both ways, as a volunteer's own line: `tbf` on its
    eth0's egress (its uplink) and on the host end of its veth (its downlink). A container started
    again gets a new veth: shape it again."""
    pid = podman("inspect", "--format", "{{.State.Pid}}", stack.name(service)).stdout.strip()
    inside = ["nsenter", "-t", pid, "-n"]

    def run(*argv: str) -> str:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    peer = run(*inside, "cat", "/sys/class/net/eth0/iflink").strip()
    # `ip -o link` lines read "28: veth0@if2: <...>": the host end is the link whose index is eth0's iflink.
    links = (line.split(":") for line in run("ip", "-o", "link").splitlines())
    host_end = {fields[0].strip(): fields[1].strip().split("@")[0] for fields in links}.get(peer)
    if host_end is None:
        raise RuntimeError(f"{service}: no host link with index {peer} (its eth0's peer)")
    run(*inside, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf(rate_mbit))
    run("tc", "qdisc", "replace", "dev", host_end, "root", *tbf(rate_mbit))
