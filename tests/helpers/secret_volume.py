"""Files laid out as the kubelet mounts a Secret or a ConfigMap, and renewed as it renews
them: `DIR/KEY -> ..data/KEY`, `..data -> ..<timestamp>`; an update writes a new timestamped
directory, renames a new `..data` symlink over the old one (one atomic step: a reader sees the
old files or the new ones, never a mix of the two in one directory) and removes the old
directory. Also certificates for the rotation tests (trustme)."""

from __future__ import annotations

import itertools
import os
import shutil
import ssl
from pathlib import Path

import trustme

_STAMPS = itertools.count()


class SecretVolume:
    """A Secret volume at `root` holding `files` (key -> bytes); `update` renews it."""

    def __init__(self, root: Path, files: dict[str, bytes]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.update(files)

    def path(self, key: str) -> str:
        return str(self.root / key)

    def update(self, files: dict[str, bytes]) -> None:
        """The kubelet's atomic update: a new timestamped directory, `..data` swapped to it,
        the keys' symlinks made where missing, the old directory removed."""
        data = self.root / "..data"
        old = os.readlink(data) if data.is_symlink() else None
        stamp = f"..2026_12_07_00_00_00.{os.getpid()}{next(_STAMPS):06d}"
        (self.root / stamp).mkdir()
        for key, content in files.items():
            (self.root / stamp / key).write_bytes(content)
        staging = self.root / "..data_tmp"
        os.symlink(stamp, staging)
        os.rename(staging, data)
        for key in files:
            link = self.root / key
            if not link.is_symlink():
                os.symlink(f"..data/{key}", link)
        if old is not None:
            shutil.rmtree(self.root / old)


class Issued:
    """A CA and a certificate for 127.0.0.1 and localhost it signed, as PEM bytes."""

    def __init__(self) -> None:
        self.ca = trustme.CA()
        leaf = self.ca.issue_cert("127.0.0.1", "localhost")
        self.ca_pem = self.ca.cert_pem.bytes()
        self.cert = leaf.cert_chain_pems[0].bytes()
        self.key = leaf.private_key_pem.bytes()

    @property
    def der(self) -> bytes:
        """The certificate as a peer presents it (`getpeercert(binary_form=True)`)."""
        return ssl.PEM_cert_to_DER_cert(self.cert.decode())


def tls_files(issued: Issued, *bundle: Issued) -> dict[str, bytes]:
    """A TLS Secret's keys (cert-manager's): `issued`'s certificate and key, and a ca.crt
    bundle of the CAs of `bundle` (default: `issued`'s)."""
    cas = bundle or (issued,)
    return {
        "tls.crt": issued.cert,
        "tls.key": issued.key,
        "ca.crt": b"".join(item.ca_pem for item in cas),
    }
