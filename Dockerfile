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

# ---- builder: the wheel of this source tree, plus binary wheels of its dependencies -----------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# Only what the wheel is built from (see .dockerignore): the package metadata and the package.
COPY pyproject.toml README.md ./
COPY agent ./agent
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m pip wheel --only-binary=:all: --wheel-dir /wheels /wheels/tessera_agent-*.whl

# ---- final: the wheels installed into a clean slim image; no compilers, no build tools, no pip -------
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
# The wheels are bind-mounted from the builder, so they never become a layer of this image. pip itself
# (and setuptools/wheel) is removed afterwards: nothing installs anything at run time.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir --no-index --find-links=/wheels tessera-agent \
 && python -m pip uninstall --yes pip setuptools wheel \
 && tessera --help > /dev/null
# Root, deliberately: a device plugin creates its sockets in the kubelet's root-owned
# /var/lib/kubelet/device-plugins and connects to kubelet.sock there. Everything else is taken away by
# the DaemonSet: no capabilities (drop ALL), no privilege escalation, a read-only root filesystem.
USER 0:0
EXPOSE 9479
ENTRYPOINT ["tessera"]
CMD ["run"]
