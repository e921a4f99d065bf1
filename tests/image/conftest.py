"""The image, built once per run from the repository's Dockerfile on the stand-in base (see engine.py).

Needs root and Debian's buildah, podman, runc and mmdebstrap (``.ci/run`` installs them). Where they are
missing the image tests skip, naming what is missing — except in CI (``CI`` set), where a missing tool
means the install step broke, and the tests fail.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.image.engine import ROOT, Engine, base_image_name, base_tarball, debian_release, missing_tools, pip_settings

TAG = "localhost/tessera-agent:test"


@dataclass
class Image:
    engine: Engine
    name: str
    base: str


def _cache_dir() -> Path:
    """The base tarball's cache: in the repository's virtual environment when the tests run from it (a fresh
    clone builds it once; later runs reuse it), else under /tmp."""
    venv = ROOT / ".venv"
    if Path(sys.prefix).resolve() == venv.resolve():
        return venv / "image-cache"
    return Path("/tmp/tessera-image-cache")


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the image tests run buildah and podman as root"
    missing = missing_tools()
    if missing:
        return f"missing {', '.join(missing)}: apt-get install {' '.join(missing)} (as .ci/run does)"
    return None


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the image tests: {reason}", pytrace=False)
        pytest.skip(reason)
    storage = Path(tmp_path_factory.mktemp("image", numbered=True))
    engine = Engine(storage)
    try:
        base = base_image_name()
        engine.import_base(base_tarball(_cache_dir(), debian_release(base)), base)
        engine.build(ROOT, TAG, pip_settings())
        yield Image(engine, TAG, base)
    finally:
        engine.remove_all()
        shutil.rmtree(storage, ignore_errors=True)
