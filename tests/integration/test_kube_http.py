"""The agent's own Kubernetes client (agent.kube_http) against the fake API server of tests/fake_kube.py and the
API server stand-in (agent/sim/apiserver): the credentials a node meets (a ServiceAccount token that rotates, a CA,
client certificates, insecure-skip-tls-verify), TLS failures said as such, names checked before they reach a URL,
and the kubeconfigs only the official client speaks (exec plugins) handed to it.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import ssl
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent import kube_http
from agent.config.node_label import CONFIG_LABEL, NodeLabelError, load_kube_api, read_node_labels
from agent.events import EventRecorder
from agent.kube_http import (
    Credentials,
    KubeApiError,
    KubeConfigError,
    KubeHttp,
    KubeUnreachable,
    Unsupported,
    in_cluster_credentials,
    kubeconfig_credentials,
)
from tests.fake_events_api import FakeEventsApi
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


# ----- answers cut, too large, or on a connection the server closed ------------------------------------------


Script = Callable[[int, str, str, bytes], tuple[bytes, str]]
DEADLINE = 15.0  # seconds a test waits at most for what it expects (and a hung answer is held)


class _Scripted:
    """A raw HTTP/1.1 server on 127.0.0.1 whose every answer is scripted, so a test can do what ``http.server``
    will not: cut an answer in the middle, close a kept-alive connection while it is idle, reset one after the
    request was read, or never answer.

    ``script(connection, method, path, body)`` gives the bytes to send and what then becomes of the connection:
    ``"keep"`` (read its next request), ``"close"`` (FIN), ``"reset"`` (RST) or ``"hang"`` (say nothing until the
    test ends). Connections are numbered from 1 in the order they were accepted."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[int, str, str]] = []  # (connection, method, path), as they arrived
        self.cond = threading.Condition()
        self._open: list[socket.socket] = []
        self._ended = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def connections(self) -> list[int]:
        """The connection of each request, in order."""
        with self.cond:
            return [number for number, _, _ in self.requests]

    def close_idle(self) -> None:
        """Close every open connection, as an API server does with one idle past its keep-alive timeout."""
        with self.cond:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def end(self) -> None:
        self._ended.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        self._listener.close()
        self.close_idle()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        number = 0
        while not self._ended.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            number += 1
            with self.cond:
                self._open.append(sock)
            threading.Thread(target=self._serve, args=(sock, number), daemon=True).start()

    def _serve(self, sock: socket.socket, number: int) -> None:
        reader = sock.makefile("rb")
        try:
            while True:
                line = reader.readline()
                if not line.strip():
                    return  # the client (or close_idle) ended the connection
                method, path, _ = line.decode().split(" ", 2)
                length = 0
                while (header := reader.readline()).strip():
                    name, _, value = header.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = reader.read(length) if length else b""
                with self.cond:
                    self.requests.append((number, method, path))
                    self.cond.notify_all()
                data, then = self.script(number, method, path, body)
                sock.sendall(data)
                if then == "reset":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if then == "hang":
                    self._ended.wait(DEADLINE)
                    return
                if then == "close":
                    sock.shutdown(socket.SHUT_RDWR)
                    return
        except OSError:
            return
        finally:
            with self.cond, contextlib.suppress(ValueError):
                self._open.remove(sock)
            reader.close()
            sock.close()


def _answer(status: int, body: object, *, length: int | None = None, cut: int | None = None) -> bytes:
    """An HTTP/1.1 answer with a JSON body; ``length``: the Content-Length said (else the body's); ``cut``: only
    this many bytes of the body are sent."""
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {http.client.responses[status]}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data) if length is None else length}\r\n\r\n"
    )
    return head.encode() + data[:cut]


def _node(**annotations: str) -> dict:
    return FakeKube(NODE, LABELS, annotations).node()


@contextlib.contextmanager
def _scripted(script: Script) -> Iterator[_Scripted]:
    server = _Scripted(script)
    try:
        yield server
    finally:
        server.end()


def _lean(port: int) -> KubeHttp:
    return KubeHttp(Credentials(f"http://127.0.0.1:{port}"))


def test_an_answer_larger_than_the_bound_is_refused_and_its_connection_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Node answer larger than MAX_ANSWER_BYTES is an error saying so (not a truncated parse, not an unbounded
    read), and what is left of it unread never reaches the next request: that one goes on a new connection."""
    monkeypatch.setattr(kube_http, "MAX_ANSWER_BYTES", 4096)
    big = _node(**{"example.com/images": "x" * 20_000})

    def script(connection: int, method: str, path: str, body: bytes) -> tuple[bytes, str]:
        return _answer(200, big if connection == 1 else _node()), "keep"

    with _scripted(script) as server:
        api = _lean(server.port)
        with pytest.raises(KubeApiError, match="answer too large") as error:
            api.read_node(NODE)
        assert error.value.status == 200
        assert api.read_node(NODE)["metadata"]["labels"] == LABELS
        assert server.connections == [1, 2]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_answer_cut_in_the_middle_is_unreachable_and_the_next_request_works(framing: str) -> None:
    """Headers (with a Content-Length, or chunked), then the connection ends mid-body: the API server was not
    heard, said as such (KubeUnreachable, which the node watch and the Events retry; not "the answer is not
    JSON"), and the next request works, on a new connection."""
    node = _node()

    def script(connection: int, method: str, path: str, body: bytes) -> tuple[bytes, str]:
        if connection > 1:
            return _answer(200, node), "keep"
        if framing == "content-length":
            return _answer(200, node, cut=40), "close"
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        return head + b"400\r\n" + json.dumps(node).encode()[:40], "close"

    with _scripted(script) as server:
        api = _lean(server.port)
        with pytest.raises(KubeUnreachable, match="the answer was cut"):
            api.read_node(NODE)
        assert api.read_node(NODE)["metadata"]["labels"] == LABELS
        assert server.connections == [1, 2]


def test_a_kept_connection_the_server_closed_meanwhile_is_replaced_at_once() -> None:
    """The API server closes a keep-alive connection it found idle; the next request, sent on it, fails, and is
    sent again at once on a new connection: the caller sees its answer, not an error."""
    with _scripted(lambda *_: (_answer(200, _node()), "keep")) as server:
        api = _lean(server.port)
        api.read_node(NODE)
        server.close_idle()
        assert api.read_node(NODE)["metadata"]["labels"] == LABELS
        assert server.connections == [1, 2]  # the second request reached the server once, on connection 2


def test_a_new_connection_that_fails_is_not_tried_again() -> None:
    """Only a kept connection is replaced: a request that fails on a connection just made is one attempt, said as
    KubeUnreachable naming the server, not sent again (that would double a slow failure)."""
    with _scripted(lambda *_: (b"", "close")) as server:
        api = _lean(server.port)
        with pytest.raises(KubeUnreachable, match=f"127.0.0.1:{server.port}"):
            api.read_node(NODE)
        assert server.connections == [1]


def test_a_kept_connection_that_times_out_is_not_tried_again() -> None:
    """A kept connection on which the API server takes the request and says nothing is a timeout, not a closed
    connection: the caller's timeout is not doubled by a second attempt."""

    answered = 0

    def script(connection: int, method: str, path: str, body: bytes) -> tuple[bytes, str]:
        nonlocal answered
        answered += 1
        return (_answer(200, _node()), "keep") if answered == 1 else (b"", "hang")

    with _scripted(script) as server:
        api = _lean(server.port)
        api.read_node(NODE)
        with pytest.raises(KubeUnreachable, match="TimeoutError"):
            api.read_node(NODE, _request_timeout=0.3)
        assert server.connections == [1, 1]


@pytest.mark.parametrize("lost", ["reset", "cut"])
def test_an_event_create_the_server_took_but_did_not_answer_is_sent_once(lost: str) -> None:
    """The API server stores an Event, then resets the kept connection before answering, or cuts its answer.
    The POST is sent again on a new connection (after a reset the lean client does it at once, as for any request
    on a kept connection; after a cut answer the recorder retries, the failure being the network's); the API
    server answers 409 AlreadyExists, which the recorder takes as sent: the node shows each Event once, nothing
    is logged as lost or rejected."""
    events = FakeEventsApi()
    posts = 0

    def script(connection: int, method: str, path: str, body: bytes) -> tuple[bytes, str]:
        nonlocal posts
        status, answer = events.answer(method, path, "application/json", body)
        posts += method == "POST"
        if posts == 2 and connection == 1:  # stored, and its answer lost
            return (b"", "reset") if lost == "reset" else (_answer(status, answer, cut=20), "close")
        return _answer(status, answer), "keep"

    with _scripted(script) as server:
        recorder = EventRecorder(_lean(server.port), NODE, retry_delay=0.01, send_delay=0.0)
        recorder.start()
        try:
            recorder.emit("Normal", "Started", "Start", "the agent started")
            assert recorder.flush(DEADLINE)
            recorder.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 0: XID 79")
            assert recorder.flush(DEADLINE)
        finally:
            recorder.stop()
        assert sorted(e["reason"] for e in events.stored()) == ["GPUUnhealthy", "Started"]
        assert [r.status for r in events.seen("POST")] == [201, 201, 409]  # the repeat, refused by name
        assert server.connections == [1, 1, 2]
        assert (recorder.sent, recorder.failures, recorder.dropped) == (2, 0, 0)
