# syntax=docker/dockerfile:1
#
# The Tessera node agent image:
#   docker build -t <registry>/tessera-agent:0.1.0 .
#   docker build --build-arg SOURCE_URL=<repository URL> --build-arg REVISION=$(git rev-parse HEAD) ...
#
# No GPU, driver or CUDA is needed to build it, and none is in it. At run time the NVIDIA container
# runtime (the DaemonSet's runtimeClassName: nvidia) mounts the host driver's pieces into the container,
# selected by two variables (set below and again in the DaemonSet):
#   NVIDIA_VISIBLE_DEVICES=all                 every GPU's device nodes (the agent serves them all; the
#                                              agent's pod requests no nvidia.com/gpu itself)
#   NVIDIA_DRIVER_CAPABILITIES=compute,utility "utility": libnvidia-ml.so (NVML: discovery, health, MIG)
#                                              and nvidia-smi; "compute": libcuda.so and
#                                              nvidia-cuda-mps-control / nvidia-cuda-mps-server, which
#                                              must match the host driver exactly, so they are never
#                                              copied into an image.
#
# The base image is pinned to a patch version. For reproducible builds pin its digest too, e.g.
#   FROM python:3.11.11-slim-bookworm@sha256:<digest>
# (`docker buildx imagetools inspect python:3.11.11-slim-bookworm` prints it; Renovate/Dependabot can keep
# it current). The digest is not written here because it cannot be looked up offline, and a wrong one
# fails every build.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- builder: the wheels, installed into a virtual environment that the final stage copies ---------
# The runtime dependencies come as binary wheels (no compiler anywhere). What is installed is then made
# small, and only what the agent uses at run time is kept:
#   - the virtual environment has no pip, setuptools or wheel (--without-pip);
#   - kubernetes/aio (the client's asyncio twin, 65 MiB) and aiohttp with the packages only it needs are
#     removed: the agent and its simulators use the synchronous client alone (the check below fails the
#     build if anything left imports them); attrs stays, as msgspec imports it for attrs classes;
#   - byte code is compiled once here (the root filesystem is read-only, so nothing is cached at run
#     time), except for the client's generated API and model modules the agent never loads: of those only
#     the API classes the agent and its simulators use are compiled (the models they load are small and
#     compile in milliseconds). Every module of the agent is then imported, as a check.
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the wheel is built from (see .dockerignore): the package metadata and the package.
COPY pyproject.toml README.md LICENSE ./
COPY agent ./agent
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m pip wheel --only-binary=:all: --wheel-dir /wheels /wheels/tessera_agent-*.whl \
 && python -m venv --without-pip /opt/tessera \
 && python -m pip --python /opt/tessera/bin/python install --no-compile --no-index --find-links=/wheels tessera-agent \
 && python -m pip --python /opt/tessera/bin/python uninstall --yes \
        aiohttp aiohttp-retry aiohappyeyeballs aiosignal frozenlist multidict propcache yarl \
 && site="$(/opt/tessera/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
 && rm -r "$site/kubernetes/aio" \
 && ! grep -rlE --include='*.py' '^\s*(import|from) (aiohttp|aiohttp_retry|aiohappyeyeballs|aiosignal|frozenlist|multidict|propcache|yarl)\b' "$site" \
 && /opt/tessera/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash \
        -x '/kubernetes/client/(models/|api/(?!(core_v1|custom_objects|resource_v1|version)_api[.]py))' "$site" \
 && /opt/tessera/bin/python -c 'import importlib, pkgutil, agent, kubernetes.client as k; \
        [importlib.import_module(m.name) for m in pkgutil.walk_packages(agent.__path__, "agent.") if m.name != "agent.__main__"]; \
        k.ApiClient, k.CoreV1Api, k.CustomObjectsApi, k.ResourceV1Api, k.VersionApi' \
 && /opt/tessera/bin/tessera --help > /dev/null

# ---- final: the virtual environment on a clean slim image; no compilers, no build tools, no pip ------
FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG SOURCE_URL=""
ARG REVISION=""
LABEL org.opencontainers.image.title="tessera-agent" \
      org.opencontainers.image.description="Tessera: node-level GPU sharing agent for Kubernetes (device plugin, MIG and MPS manager, health and telemetry)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.revision="${REVISION}"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=builder /opt/tessera /opt/tessera
# The base image's pip (and setuptools/wheel) is removed: nothing installs anything at run time.
RUN python -m pip uninstall --yes pip setuptools wheel \
 && /opt/tessera/bin/tessera --help > /dev/null
ENV PATH=/opt/tessera/bin:$PATH
# Root, deliberately: a device plugin creates its sockets in the kubelet's root-owned
# /var/lib/kubelet/device-plugins and connects to kubelet.sock there. Everything else is taken away by
# the DaemonSet: no capabilities (drop ALL), no privilege escalation, a read-only root filesystem.
USER 0:0
EXPOSE 9479
ENTRYPOINT ["tessera"]
CMD ["run"]
