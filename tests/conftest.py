"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import trustme


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """PEM files: a test CA (`ca`), a certificate for 127.0.0.1/localhost it signed (`cert`,
    `key`), and another CA that signed nothing of ours (`other`)."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {k: root / f"{k}.pem" for k in ("ca", "cert", "key", "other")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    cert.private_key_pem.write_to_path(str(files["key"]))
    trustme.CA().cert_pem.write_to_path(str(files["other"]))
    return {k: str(v) for k, v in files.items()}
