"""TLS for the direct route between a group's head and a member (issue 19), pinned, not PKI.

A member's gate has no name a certificate authority could vouch for, and needs none: when the
member starts its gate it makes a throwaway self-signed certificate (EC P-256, valid two days),
and the queen hands the head that certificate's SHA-256 fingerprint together with the gate's
address. The head connects with certificate and hostname checks off, then compares the
certificate it got with the fingerprint (``check_pin``) before it sends or reads a single byte
of the handshake. A mismatch is ``TlsPinMismatch``: someone other than the member answered.

The key never touches the disk beyond one moment: ``ssl.SSLContext.load_cert_chain`` reads only
files, so they are written into a private temporary directory and removed right after loading.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from desktop_worker.errors import GroupCredentialsError, TlsPinMismatch

VALIDITY = datetime.timedelta(days=2)
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def fingerprint_of(der: bytes) -> str:
    """The SHA-256 of a DER certificate, as 64 lowercase hex digits."""
    return hashlib.sha256(der).hexdigest()


def normalize_fingerprint(text: str) -> str:
    """``AB:CD:…`` or ``abcd…`` as 64 lowercase hex digits, or ``GroupCredentialsError``."""
    value = text.replace(":", "").strip().lower() if isinstance(text, str) else ""
    if not _FINGERPRINT.fullmatch(value):
        raise GroupCredentialsError("a TLS fingerprint is a SHA-256: 64 hex digits")
    return value


@dataclass(frozen=True)
class SelfSignedIdentity:
    """A gate's throwaway certificate and key (PEM), and the fingerprint the queen passes on."""

    cert_pem: bytes
    key_pem: bytes
    fingerprint: str

    @classmethod
    def generate(cls, common_name: str = "apiary-member-gate") -> SelfSignedIdentity:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .sign(key, hashes.SHA256())
        )
        der = cert.public_bytes(serialization.Encoding.DER)
        return cls(
            cert_pem=cert.public_bytes(serialization.Encoding.PEM),
            key_pem=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            fingerprint=fingerprint_of(der),
        )

    def server_context(self) -> ssl.SSLContext:
        """A TLS 1.3 server context holding this certificate; no file is left behind."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        with tempfile.TemporaryDirectory(prefix="apiary-gate-tls-") as folder:
            cert_path = Path(folder) / "cert.pem"
            key_path = Path(folder) / "key.pem"
            cert_path.write_bytes(self.cert_pem)
            key_path.touch(mode=0o600)
            key_path.write_bytes(self.key_pem)
            context.load_cert_chain(cert_path, key_path)
        return context


def client_context() -> ssl.SSLContext:
    """The head's TLS 1.3 context: no CA and no hostname check, because ``check_pin`` decides."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def check_pin(ssl_object: ssl.SSLObject | ssl.SSLSocket | None, fingerprint: str) -> None:
    """Returns when the peer's certificate has ``fingerprint``; ``TlsPinMismatch`` otherwise
    (no TLS, no certificate, or another certificate)."""
    expected = normalize_fingerprint(fingerprint)
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise TlsPinMismatch("the member's gate presented no TLS certificate")
    got = fingerprint_of(der)
    if got != expected:
        raise TlsPinMismatch(
            f"the member's gate presented certificate {got[:16]}…, not the {expected[:16]}… "
            "the queen named: refusing to connect"
        )
