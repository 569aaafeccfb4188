"""Throwaway certificates for TLS tests, made with the ``openssl`` command.

One CA and one leaf certificate valid for loopback (127.0.0.1, 127.0.0.2,
localhost) for both server and client use; plus a second, unrelated CA and
leaf, to check that a peer signed by another CA is refused.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SUBJECT_ALT_NAMES = "IP:127.0.0.1,IP:127.0.0.2,DNS:localhost"


@dataclass(frozen=True)
class CertSet:
    ca: Path
    cert: Path
    key: Path


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_certs(directory: Path, name: str = "tandem") -> CertSet:
    """A CA and a leaf it signs, in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = directory / f"{name}-ca.key", directory / f"{name}-ca.pem"
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
    ext = directory / f"{name}.ext"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", f"/CN={name} test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name} node",
    )  # fmt: skip
    ext.write_text(
        f"subjectAltName={SUBJECT_ALT_NAMES}\n"
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
    )  # fmt: skip
    return CertSet(ca, cert, key)


def tls_files(certs: CertSet):
    """``certs`` as the cluster TLS settings of kv_transfer."""
    from net.security import TLSFiles

    return TLSFiles(str(certs.cert), str(certs.key), str(certs.ca))
