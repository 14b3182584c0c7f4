"""Certificates for TLS tests, made with the ``openssl`` command line: a CA, a server certificate
for 127.0.0.1 and a client certificate, both signed by the CA. The keys are P-256 (EC) keys,
generated in milliseconds where an RSA key takes a good part of a second."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "make_expired_server_cert", "make_pki"]


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    client_cn: str
    other_key: Path
    """A key that belongs to no certificate here."""
    encrypted_key: Path
    """The client key, encrypted with a passphrase."""

    def server_context(self, *, require_client_cert: bool) -> ssl.SSLContext:
        """A server's context on the server certificate; with ``require_client_cert``, a client
        must present a certificate the CA signed."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.server_cert, self.server_key)
        if require_client_cert:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=self.ca)
        return ctx


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")


def _issue(d: Path, name: str, subject: str, ca: Path, ca_key: Path, ext: str, days: int = 1) -> tuple[Path, Path]:
    key, csr, cert, extfile = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    extfile.write_text(ext + "\n")
    _openssl("req", *EC_KEY, "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", subject)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", str(days), "-extfile", str(extfile),
    )  # fmt: skip
    return cert, key


def make_pki(d: Path, client_cn: str = "wowd-client") -> Pki:
    """The certificates and keys, written into the directory ``d`` (created)."""
    d.mkdir(parents=True, exist_ok=True)
    ca, ca_key = d / "ca.pem", d / "ca.key"
    _openssl(
        "req", "-x509", *EC_KEY, "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", "1", "-subj", "/CN=wowd test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    server_cert, server_key = _issue(
        d, "server", "/CN=127.0.0.1", ca, ca_key, "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"
    )
    client_cert, client_key = _issue(d, "client", f"/CN={client_cn}", ca, ca_key, "extendedKeyUsage=clientAuth")
    other_key = d / "other.key"
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", str(other_key))
    encrypted_key = d / "client-encrypted.key"
    _openssl("pkey", "-in", str(client_key), "-aes256", "-passout", "pass:hunter22", "-out", str(encrypted_key))
    return Pki(ca, server_cert, server_key, client_cert, client_key, client_cn, other_key, encrypted_key)


def make_expired_server_cert(d: Path) -> tuple[Path, Path]:
    """A server certificate for 127.0.0.1 signed by the CA :func:`make_pki` wrote into ``d``, that
    expired a day ago (its certificate and key)."""
    return _issue(
        d,
        "expired",
        "/CN=127.0.0.1",
        d / "ca.pem",
        d / "ca.key",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth",
        days=-1,
    )
