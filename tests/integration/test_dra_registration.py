"""The DRA driver's registration socket, called as the kubelet's plugin watcher calls it (real gRPC, unix socket)."""

from __future__ import annotations

import logging
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from agent.api.pluginregistration.v1 import api_pb2
from agent.dra.names import dra_socket, registration_socket
from agent.dra.registration import DRA_SERVICES, HEALTH_SERVICE, DraRegistrar

DRIVER = "gpu.nvidia.com"
POD_UID = "0b6b3d4e-1234-4cde-8f00-123456789abc"


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))  # unix socket paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Kubelet:
    """The plugin watcher's side: GetInfo with its 1 s timeout, then NotifyRegistrationStatus."""

    def __init__(self, socket_path: Path) -> None:
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")

    def info(self) -> api_pb2.PluginInfo:
        call = self._channel.unary_unary(
            "/pluginregistration.Registration/GetInfo", response_deserializer=api_pb2.PluginInfo.FromString
        )
        return call(b"", timeout=1)

    def notify(self, registered: bool, error: str = "") -> None:
        call = self._channel.unary_unary(
            "/pluginregistration.Registration/NotifyRegistrationStatus",
            request_serializer=api_pb2.RegistrationStatus.SerializeToString,
        )
        call(api_pb2.RegistrationStatus(plugin_registered=registered, error=error), timeout=5)

    def close(self) -> None:
        self._channel.close()


@pytest.fixture
def registrar(base: Path) -> Iterator[tuple[DraRegistrar, list[tuple[bool, str]]]]:
    heard: list[tuple[bool, str]] = []
    registrar = DraRegistrar(
        registration_socket(base / "plugins_registry", DRIVER),
        DRIVER,
        dra_socket(base / "plugins", DRIVER),
        (*DRA_SERVICES, HEALTH_SERVICE),
        on_status=lambda registered, error: heard.append((registered, error)),
    )
    registrar.start()
    yield registrar, heard
    registrar.stop()


def test_get_info_names_the_driver_its_endpoint_and_v1_before_v1beta1(registrar, base: Path) -> None:
    server, _ = registrar
    kubelet = Kubelet(server.socket_path)
    info = kubelet.info()
    kubelet.close()
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(base / "plugins" / DRIVER / "dra.sock")
    # the kubelet takes the first service it knows: v1 for 1.34+, v1beta1 for older kubelets
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]


def test_the_socket_is_where_the_watcher_looks_and_only_root_may_use_it(registrar, base: Path) -> None:
    server, _ = registrar
    assert server.socket_path == base / "plugins_registry" / "gpu.nvidia.com-reg.sock"
    mode = server.socket_path.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_the_kubelets_verdict_is_heard(registrar, caplog) -> None:
    server, heard = registrar
    kubelet = Kubelet(server.socket_path)
    kubelet.notify(True)
    assert server.registered is True and heard == [(True, "")]
    with caplog.at_level(logging.ERROR), pytest.raises(grpc.RpcError) as refused:
        kubelet.notify(False, "RegisterPlugin error -- plugin name gpu.nvidia.com endpoint already registered")
    kubelet.close()
    assert server.registered is False
    assert heard[-1] == (False, "RegisterPlugin error -- plugin name gpu.nvidia.com endpoint already registered")
    assert "already registered" in refused.value.details()  # answered with an error, as the Go helper does
    assert any(
        "refused the DRA driver" in r.getMessage() and "already registered" in r.getMessage() for r in caplog.records
    )


def test_restart_is_a_new_socket_and_stop_removes_it(registrar) -> None:
    server, _ = registrar
    info = server.socket_path.stat()
    server.restart()
    after = server.socket_path.stat()
    assert (after.st_ino, after.st_ctime_ns) != (info.st_ino, info.st_ctime_ns)  # created anew: the watcher sees it
    kubelet = Kubelet(server.socket_path)
    assert kubelet.info().name == DRIVER
    kubelet.close()
    server.stop()
    assert not server.socket_path.exists()


def test_a_stale_socket_of_a_previous_run_is_replaced(base: Path) -> None:
    path = registration_socket(base / "plugins_registry", DRIVER)
    path.parent.mkdir(parents=True)
    path.write_text("stale")
    registrar = DraRegistrar(path, DRIVER, dra_socket(base / "plugins", DRIVER))
    registrar.start()
    try:
        assert stat.S_ISSOCK(path.stat().st_mode)
    finally:
        registrar.stop()


def test_rolling_update_names_carry_the_pod_uid_and_stay_under_the_socket_limit(base: Path) -> None:
    registry = Path("/var/lib/kubelet/plugins_registry")
    assert registration_socket(registry, DRIVER, POD_UID).name == f"{DRIVER}-{POD_UID}-reg.sock"
    assert dra_socket(Path("/var/lib/kubelet/plugins"), DRIVER, POD_UID).name == f"dra-{POD_UID}.sock"
    deep = Path("/" + "d" * 50)  # <driver>-<pod UID>-reg.sock would pass the 108-byte limit here
    shorter = registration_socket(deep, DRIVER, POD_UID)
    assert len(str(shorter).encode()) <= 107 and shorter.name.startswith(f"{DRIVER}-") and POD_UID not in shorter.name
    long_driver = "gpu." + "x" * 40 + ".example.com"
    shortest = registration_socket(Path("/" + "d" * 40), long_driver, POD_UID)
    assert len(str(shortest).encode()) <= 107
    assert shortest.name.startswith("dra-") and shortest.name.endswith("-reg.sock")
    with pytest.raises(ValueError, match="no registration socket name fits"):
        registration_socket(Path("/" + "d" * 80), DRIVER, POD_UID)


@pytest.mark.parametrize("driver", ["GPU.nvidia.com", "gpu_nvidia", "", "a" * 64, "gpu.nvidia.com/x", "../x"])
def test_a_driver_name_that_is_no_dns_subdomain_is_refused(base: Path, driver: str) -> None:
    with pytest.raises(ValueError, match="DNS subdomain"):
        registration_socket(base, driver)


@pytest.mark.parametrize("uid", ["../../etc", "not-a-uid", POD_UID + "/x", ""])
def test_a_pod_uid_that_is_no_uid_is_refused(base: Path, uid: str) -> None:
    with pytest.raises(ValueError, match="not a UID"):
        dra_socket(base, DRIVER, uid)
