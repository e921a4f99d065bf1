#!/bin/sh
# Install Debian's prometheus package (the server and promtool) for tests/integration/test_prometheus.py.
# Never fails CI: already installed -> nothing to do; no apt-get, not root, or apt failing -> a message, and
# the Prometheus tests skip themselves with their reason.
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "install-prometheus: already installed ($(command -v prometheus), $(command -v promtool))"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-prometheus: apt-get is not available; skipping (the Prometheus tests will be skipped)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-prometheus: not root; skipping (the Prometheus tests will be skipped)"
    exit 0
fi
if apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
    echo "install-prometheus: installed $(prometheus --version 2>&1 | head -n 1)"
    # the package enables a system Prometheus on :9090 where systemd runs; the tests start their own
    if command -v systemctl >/dev/null 2>&1; then
        systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
else
    echo "install-prometheus: apt-get could not install prometheus; skipping (the Prometheus tests will be skipped)"
fi
exit 0
