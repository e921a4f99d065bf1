"""The agent's own Kubernetes client (agent.kube_http) against the fake API server of tests/fake_kube.py and the
API server stand-in (agent/sim/apiserver): the credentials a node meets (a ServiceAccount token that rotates, a CA,
client certificates, insecure-skip-tls-verify), TLS failures said as such, names checked before they reach a URL,
and the kubeconfigs only the official client speaks (exec plugins) handed to it.
"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config.node_label import CONFIG_LABEL, NodeLabelError, load_kube_api, read_node_labels
from agent.kube_http import (
    Credentials,
    KubeApiError,
    KubeConfigError,
    KubeHttp,
    Unsupported,
    in_cluster_credentials,
    kubeconfig_credentials,
)
from tests.fake_kube import FakeKube, serving

pytestmark = pytest.mark.timeout(60)

NODE = "gpu-node-1"
LABELS = {CONFIG_LABEL: "mps-4", "kubernetes.io/hostname": NODE}


def _kubeconfig(path: Path, cluster: dict, user: dict) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with serving(FakeKube(NODE, LABELS)) as kube:
        yield kube


# ----- tokens ---------------------------------------------------------------------------------------------


def test_a_kubeconfig_token_is_sent_as_a_bearer_token(fake: FakeKube, tmp_path: Path) -> None:
    kubeconfig = _kubeconfig(tmp_path / "kc", {"server": f"http://127.0.0.1:{fake.port}"}, {"token": "s3cret"})
    api = load_kube_api(kubeconfig)
    assert isinstance(api, KubeHttp)
    assert read_node_labels(api, NODE) == LABELS
    assert fake.authorizations == ["Bearer s3cret"]


def test_a_rotated_token_file_is_read_again(fake: FakeKube, tmp_path: Path) -> None:
    """Bound ServiceAccount tokens rotate: the next request after the refresh period carries the new one."""
    token = tmp_path / "token"
    token.write_text("first\n")
    credentials = Credentials(f"http://127.0.0.1:{fake.port}", token_file=str(token))
    api = KubeHttp(credentials, token_refresh_seconds=0.0)
    read_node_labels(api, NODE)
    token.write_text("second\n")
    read_node_labels(api, NODE)
    assert fake.authorizations == ["Bearer first", "Bearer second"]


def test_a_token_file_that_goes_missing_keeps_the_last_token(fake: FakeKube, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first")
    api = KubeHttp(Credentials(f"http://127.0.0.1:{fake.port}", token_file=str(token)), token_refresh_seconds=0.0)
    read_node_labels(api, NODE)
    token.unlink()  # a rotation in progress (the kubelet swaps a symlink)
    read_node_labels(api, NODE)
    assert fake.authorizations == ["Bearer first", "Bearer first"]


# ----- in a pod -------------------------------------------------------------------------------------------


def _service_account(root: Path, token: str = "t0ken") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "token").write_text(token)
    (root / "ca.crt").write_text("")
    return root


@pytest.mark.parametrize(
    ("host", "server"),
    [("10.96.0.1", "https://10.96.0.1:443"), ("fd00:10:96::1", "https://[fd00:10:96::1]:443")],
)
def test_in_cluster_credentials_bracket_an_ipv6_host(tmp_path: Path, host: str, server: str) -> None:
    root = _service_account(tmp_path / "sa")
    environ = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": "443"}
    credentials = in_cluster_credentials(environ, root)
    assert credentials.server == server
    assert credentials.token_file == str(root / "token") and credentials.ca_file == str(root / "ca.crt")


@pytest.mark.parametrize(
    ("environ", "missing", "words"),
    [
        ({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, None, "KUBERNETES_SERVICE_PORT"),
        ({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "https"}, None, "not a port"),
        ({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, "token", "token"),
        ({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, "ca.crt", "CA bundle"),
    ],
)
def test_in_cluster_credentials_that_cannot_work_say_what_is_missing(
    tmp_path: Path, environ: dict[str, str], missing: str | None, words: str
) -> None:
    root = _service_account(tmp_path / "sa")
    if missing:
        (root / missing).unlink()
    with pytest.raises(KubeConfigError, match=words):
        in_cluster_credentials(environ, root)


# ----- TLS ------------------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    where = tmp_path_factory.mktemp("pki")
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=test-ca",
             cwd=where)  # fmt: skip
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        (where / f"{name}.ext").write_text(extension + "\n")
        _openssl("req", *curve, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=where)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=where)  # fmt: skip
    _openssl("req", "-x509", *curve, "-keyout", "other.key", "-out", "other.crt", "-days", "2", "-subj", "/CN=other",
             cwd=where)  # fmt: skip
    return where


def _server_tls(pki: Path, *, client_certs: bool = False) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "server.crt", pki / "server.key")
    if client_certs:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(pki / "ca.crt")
    return context


def _data(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_https_with_the_ca_as_data_reads_the_node(pki: Path, tmp_path: Path) -> None:
    with serving(FakeKube(NODE, LABELS), tls=_server_tls(pki)) as fake:
        cluster = {"server": f"https://127.0.0.1:{fake.port}", "certificate-authority-data": _data(pki / "ca.crt")}
        api = load_kube_api(_kubeconfig(tmp_path / "kc", cluster, {}))
        assert read_node_labels(api, NODE) == LABELS


def test_a_server_the_ca_did_not_sign_is_a_tls_error_naming_the_fix(pki: Path, tmp_path: Path) -> None:
    with serving(FakeKube(NODE, LABELS), tls=_server_tls(pki)) as fake:
        cluster = {"server": f"https://127.0.0.1:{fake.port}", "certificate-authority": str(pki / "other.crt")}
        api = load_kube_api(_kubeconfig(tmp_path / "kc", cluster, {}))
        with pytest.raises(NodeLabelError) as error:
            read_node_labels(api, NODE)
        message = str(error.value)
        assert "HTTP 0" in message and "CERTIFICATE_VERIFY_FAILED" in message
        assert "TLS settings" in message


def test_insecure_skip_tls_verify_reads_the_node(pki: Path, tmp_path: Path) -> None:
    with serving(FakeKube(NODE, LABELS), tls=_server_tls(pki)) as fake:
        cluster = {"server": f"https://127.0.0.1:{fake.port}", "insecure-skip-tls-verify": True}
        api = load_kube_api(_kubeconfig(tmp_path / "kc", cluster, {}))
        assert read_node_labels(api, NODE) == LABELS


@pytest.mark.parametrize("form", ["files", "data"])
def test_a_client_certificate_is_presented(pki: Path, tmp_path: Path, form: str) -> None:
    with serving(FakeKube(NODE, LABELS), tls=_server_tls(pki, client_certs=True)) as fake:
        cluster = {"server": f"https://127.0.0.1:{fake.port}", "certificate-authority": str(pki / "ca.crt")}
        if form == "files":
            user = {"client-certificate": str(pki / "client.crt"), "client-key": str(pki / "client.key")}
        else:
            user = {"client-certificate-data": _data(pki / "client.crt"), "client-key-data": _data(pki / "client.key")}
        api = load_kube_api(_kubeconfig(tmp_path / "kc", cluster, user))
        assert read_node_labels(api, NODE) == LABELS
        without = load_kube_api(_kubeconfig(tmp_path / "kc-none", cluster, {}))
        with pytest.raises(NodeLabelError):  # the server asks for a certificate: without one, no answer
            read_node_labels(without, NODE)


def test_a_certificate_without_its_key_is_a_kubeconfig_error(pki: Path, tmp_path: Path) -> None:
    cluster = {"server": "https://127.0.0.1:1", "certificate-authority": str(pki / "ca.crt")}
    kubeconfig = _kubeconfig(tmp_path / "kc", cluster, {"client-certificate": str(pki / "client.crt")})
    with pytest.raises(NodeLabelError, match="needs its key"):
        load_kube_api(kubeconfig)


# ----- what reaches a URL ---------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", ["Default", "a/b", "..", "a" * 64, ""])
def test_a_namespace_that_is_no_name_never_reaches_the_api(fake: FakeKube, namespace: str) -> None:
    api = KubeHttp(Credentials(f"http://127.0.0.1:{fake.port}"))
    with pytest.raises(ValueError, match="namespace"):
        api.create_event(namespace, {})
    with pytest.raises(ValueError, match="namespace"):
        api.patch_event("gpu-node-1.1", namespace, {})
    assert fake.requests == []


@pytest.mark.parametrize("name", ["../nodes", "a/b", "A", "x?watch=true", "a" * 254])
def test_a_node_or_event_name_that_is_no_name_never_reaches_the_api(fake: FakeKube, name: str) -> None:
    api = KubeHttp(Credentials(f"http://127.0.0.1:{fake.port}"))
    with pytest.raises(ValueError, match="name"):
        api.read_node(name)
    with pytest.raises(ValueError, match="name"):
        api.patch_event(name, "default", {})
    assert fake.requests == []


def test_an_error_answer_is_one_exception_with_the_servers_message(fake: FakeKube) -> None:
    fake.get_status = 403
    api = KubeHttp(Credentials(f"http://127.0.0.1:{fake.port}"))
    with pytest.raises(KubeApiError) as error:
        api.read_node(NODE)
    assert error.value.status == 403 and "cannot get resource" in error.value.message


# ----- the kubeconfigs only the official client speaks ------------------------------------------------------


@pytest.mark.parametrize(
    "user",
    [
        {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "x"}},
        {"auth-provider": {"name": "oidc"}},
        {"username": "admin", "password": "x"},
    ],
)
def test_plugins_and_passwords_are_left_to_the_official_client(tmp_path: Path, user: dict) -> None:
    with pytest.raises(Unsupported, match="official"):
        kubeconfig_credentials(_kubeconfig(tmp_path / "kc", {"server": "https://10.0.0.1"}, user))


def test_an_exec_kubeconfig_reads_the_node_through_the_official_client(fake: FakeKube, tmp_path: Path) -> None:
    """The exec plugin runs (it prints a token), and the official client's errors read as the lean one's."""
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": "from-exec"},
    }
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": ["-c", f"print({json.dumps(json.dumps(credential))})"],
            "interactiveMode": "Never",
        }
    }
    api = load_kube_api(_kubeconfig(tmp_path / "kc", {"server": f"http://127.0.0.1:{fake.port}"}, user))
    assert not isinstance(api, KubeHttp)
    assert read_node_labels(api, NODE) == LABELS
    assert fake.authorizations == ["Bearer from-exec"]
    with pytest.raises(NodeLabelError) as error:  # an ApiException of the official client, said the same way
        read_node_labels(api, "no-such-node")
    assert "HTTP 404" in str(error.value) and "NODE_NAME" in str(error.value)


def test_the_lean_client_loads_neither_the_official_client_nor_urllib3_nor_idna(fake: FakeKube, tmp_path: Path) -> None:
    kubeconfig = _kubeconfig(tmp_path / "kc", {"server": f"http://127.0.0.1:{fake.port}"}, {"token": "t"})
    code = (
        "import sys\nfrom agent.config.node_label import load_kube_api, read_node_labels\n"
        "from agent.core.events import event_name\nfrom agent.events import EventRecorder\n"
        f"print(read_node_labels(load_kube_api({str(kubeconfig)!r}), {NODE!r}))\nevent_name({NODE!r})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kubernetes', 'urllib3', 'pydantic', 'hmac')\n"
        "             or m in ('encodings.idna', 'unicodedata')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.splitlines() == [repr(LABELS), "[]"]
