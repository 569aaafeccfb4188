"""``--tls-ca FILE`` of the client commands (generate, scale, bench): talk TLS
to a router that serves it (``security.tls_cert``/``tls_key``), trusting that CA."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
TLS_CA_ENV = "TANDEM_TLS_CA"


class UsageError(Exception):
    """A bad command-line value: ``tandem`` prints it and exits with status 2."""


def add_tls_ca(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="PEM certificate of the CA that signed the router's certificate: connect "
        "with TLS (default: plaintext, or $TANDEM_TLS_CA)",
    )


def read_tls_ca(path: str | None) -> bytes | None:
    """The CA's PEM bytes, or None for plaintext. UsageError, naming the file,
    when it cannot be read or holds no certificate."""
    path = path or os.environ.get(TLS_CA_ENV) or None
    if path is None:
        return None
    try:
        pem = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"--tls-ca {path}: {exc.strerror or exc}") from None
    if PEM_CERTIFICATE not in pem:
        raise UsageError(f"--tls-ca {path}: no PEM certificate in the file")
    return pem
