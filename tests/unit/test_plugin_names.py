"""Resource names the kubelet accepts (kubelet §3, plus NVIDIA's 63-character limit) and socket file names
(device plugin §2.3)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.plugin.names import resource_name_problem, socket_name

# Every name NVIDIA's strategies can produce (device plugin §2.1, §2.2).
NVIDIA_NAMES = [
    "nvidia.com/gpu",
    "nvidia.com/gpu.shared",
    "nvidia.com/mig-1g.5gb",
    "nvidia.com/mig-3g.40gb",
    "nvidia.com/mig-1g.24gb.me",
    "nvidia.com/mig-1g.24gb.me.all",
    "nvidia.com/mig-1g.24gb.gfx",
    "nvidia.com/mig-1g.24gb-me",
    "nvidia.com/mig-1c.3g.40gb",
    "nvidia.com/mig-1g.5gb.shared",
]


@pytest.mark.parametrize(
    "name",
    [
        *NVIDIA_NAMES,
        "example.com/foo",
        "k8s.io/x",  # k8s.io is not kubernetes.io
        "nvidia.com/GPU",  # upper case is allowed after the '/'
        "nvidia.com/a_b",
        "a.b-c.d/x",
        "nvidia.com/" + "x" * 52,  # 63 characters in all
    ],
)
def test_names_the_kubelet_accepts(name: str):
    assert resource_name_problem(name) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("gpu", "no domain prefix"),
        ("", "no domain prefix"),
        ("kubernetes.io/gpu", "reserved kubernetes.io"),
        ("foo.kubernetes.io/gpu", "reserved kubernetes.io"),
        ("mykubernetes.io/gpu", "reserved kubernetes.io"),
        ("requests.nvidia.com/gpu", "must not start with 'requests.'"),
        ("nvidia.com/" + "x" * 53, "longer than 63"),
        ("nvidia.com/mig/1g", "more than one '/'"),
        ("Nvidia.com/gpu", "lower-case DNS subdomain"),
        ("nvidia_corp.com/gpu", "lower-case DNS subdomain"),
        ("-nvidia.com/gpu", "lower-case DNS subdomain"),
        ("nvidia..com/gpu", "lower-case DNS subdomain"),
        ("/gpu", "lower-case DNS subdomain"),
        ("nvidia.com/", "1-63 letters"),
        ("nvidia.com/-gpu", "1-63 letters"),
        ("nvidia.com/gpu.", "1-63 letters"),
        ("nvidia.com/gpu shared", "1-63 letters"),
        ("nvidia.com/gpu\n", "1-63 letters"),  # Python's '$' would let a trailing newline through
        ("nvidia.com\n/gpu", "lower-case DNS subdomain"),
    ],
)
def test_names_the_kubelet_rejects_with_the_reason(name: str, why: str):
    problem = resource_name_problem(name)
    assert problem is not None
    assert why in problem
    assert repr(name) in problem  # the message quotes the name


def test_63_characters_is_the_limit():
    assert resource_name_problem("nvidia.com/" + "m" * 52) is None
    assert resource_name_problem("nvidia.com/" + "m" * 53) is not None


@pytest.mark.parametrize(
    ("resource", "socket"),
    [
        ("nvidia.com/gpu", "nvidia-gpu.sock"),
        ("nvidia.com/gpu.shared", "nvidia-gpu.shared.sock"),
        ("nvidia.com/mig-1g.10gb", "nvidia-mig-1g.10gb.sock"),
        ("nvidia.com/mig-1g.24gb.me.all", "nvidia-mig-1g.24gb.me.all.sock"),
        ("nvidia.com/mig-1c.3g.40gb", "nvidia-mig-1c.3g.40gb.sock"),
        ("example.com/foo", "example.com-foo.sock"),
        ("nvidia.com/GPU_x", "nvidia-GPU_x.sock"),
    ],
)
def test_socket_names_follow_nvidia(resource: str, socket: str):
    assert socket_name(resource) == socket


def test_different_resources_never_share_a_socket():
    names = ["nvidia.com/gpu", "nvidia.com/GPU", "nvidia.com/a_b", "nvidia.com/a-b", "example.com/x", "example.org/x"]
    assert len({socket_name(n) for n in names}) == len(names)


def test_every_nvidia_name_gets_its_own_socket():
    sockets = [socket_name(name) for name in NVIDIA_NAMES]
    assert len(set(sockets)) == len(sockets)


@pytest.mark.parametrize(
    "resource",
    [
        "",
        "nvidia.com/..",
        "nvidia.com/../../etc/passwd",
        "nvidia.com/a/../b",
        "nvidia.com/a..b",
        "nvidia.com/gpu\n",
        "nvidia.com/gpu\x00",
        "nvidia.com/gpu shared",
        "nvidia.com/gpu+me",
        "../x/gpu",
        "/gpu",
    ],
)
def test_unsafe_socket_names_are_refused(resource: str):
    with pytest.raises(ValueError, match="safe socket file name"):
        socket_name(resource)


def assert_bare_safe_file_name(name: str) -> None:
    assert name.endswith(".sock")
    assert "/" not in name and "\\" not in name
    assert ".." not in name
    assert not name.startswith((".", "-"))
    assert name.isascii() and name.isprintable()
    assert not any(c.isspace() for c in name)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("abcAB01._-/\n\x00 +:\u00e9"), max_size=30) | st.text(max_size=30))
def test_property_socket_name_is_a_bare_safe_file_name_or_an_error(resource: str):
    try:
        name = socket_name(resource)
    except ValueError:
        return
    assert_bare_safe_file_name(name)


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[a-z0-9]{1,8}(\.[a-z0-9]{1,8}){0,2}/[a-z0-9]([-a-z0-9.]{0,20}[a-z0-9])?", fullmatch=True))
def test_property_valid_lower_case_names_get_a_safe_socket_unless_they_hold_dot_dot(resource: str):
    assert resource_name_problem(resource) is None
    if ".." in resource:
        with pytest.raises(ValueError):
            socket_name(resource)
        return
    assert_bare_safe_file_name(socket_name(resource))
