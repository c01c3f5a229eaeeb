"""TLS for the router<->worker gRPC API: credentials made from PEM files, checked at start-up.

A worker serves with a certificate chain and its private key and, for mutual TLS, the CAs that
routers' certificates must chain to (a connection without such a certificate is then refused).
A router dials with the CAs that workers' certificates must chain to and, for mutual TLS, a
certificate and key of its own. Each side reads and checks its files once, when the process
starts: a file that is missing or unreadable, one holding no PEM certificate or key, an
encrypted key or a key that is not the certificate's stops start-up with a message naming the
file, rather than failing every handshake later with gRPC's bare "handshake failed".

Routers dial workers by IP address (discovery resolves names to addresses), and no pod's
certificate names its address: ClientTls.server_name is the name the workers' certificates are
checked against instead, usually the workers' Service name.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PRIVATE_KEY = b"PRIVATE KEY-----"      # the end of "BEGIN [RSA |EC |ENCRYPTED ]PRIVATE KEY"


class TlsError(ValueError):
    """A TLS file that cannot be used; the message names the file and says why."""


@dataclass(frozen=True)
class ServerTls:
    """What a server presents, and what it requires of clients (see load_server_tls)."""

    certificate_chain: bytes        # PEM, the server's certificate first
    private_key: bytes              # PEM, unencrypted
    client_ca: bytes | None = None  # PEM CAs client certificates must chain to; None: none needed

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientTls:
    """How a client checks servers, and what it presents to them (see load_client_tls)."""

    ca: bytes                               # PEM CAs the servers' certificates must chain to
    certificate_chain: bytes | None = None  # mutual TLS: the client's own certificate ...
    private_key: bytes | None = None        # ... and its key
    server_name: str | None = None          # the name servers' certificates must carry; None: the host dialled

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key,
                                            certificate_chain=self.certificate_chain)

    def channel_options(self) -> list[tuple[str, object]]:
        """Channel options that make gRPC check the certificate against server_name."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def load_server_tls(cert_file: str, key_file: str, client_ca_file: str | None = None) -> ServerTls:
    """A server's TLS from PEM files; raises TlsError naming the file that cannot be used.
    With client_ca_file, clients must present a certificate chaining to one of its CAs."""
    chain, key = _key_pair(cert_file, key_file)
    return ServerTls(chain, key, _ca(client_ca_file) if client_ca_file else None)


def load_client_tls(ca_file: str, cert_file: str | None = None, key_file: str | None = None,
                    server_name: str | None = None) -> ClientTls:
    """A client's TLS from PEM files; raises TlsError naming the file that cannot be used.
    cert_file and key_file, for mutual TLS, go together."""
    if (cert_file is None) != (key_file is None):
        raise TlsError("a TLS client certificate needs its key and a key its certificate: "
                       f"got certificate {cert_file} and key {key_file}")
    chain, key = _key_pair(cert_file, key_file) if cert_file and key_file else (None, None)
    return ClientTls(_ca(ca_file), chain, key, server_name or None)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise TlsError(f"cannot read the TLS {what} {path}: {error.strerror or error}") from None


def _key_pair(cert_file: str, key_file: str) -> tuple[bytes, bytes]:
    """The certificate chain and key, once OpenSSL accepts them as a pair."""
    chain, key = _read(cert_file, "certificate"), _read(key_file, "private key")
    if _CERTIFICATE not in chain:
        raise TlsError(f"the TLS certificate {cert_file} holds no PEM certificate")
    if _PRIVATE_KEY not in key:
        raise TlsError(f"the TLS private key {key_file} holds no PEM private key")

    def no_passphrase() -> bytes:
        # Called by OpenSSL for an encrypted key, which it would otherwise ask a terminal to
        # unlock; gRPC takes no passphrase at all.
        raise TlsError(f"the TLS private key {key_file} is encrypted: give it unencrypted "
                       "(in a Secret, not in the image)")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, no_passphrase)
    except ssl.SSLError as error:
        if "KEY_VALUES_MISMATCH" in str(error):
            raise TlsError(f"the TLS private key {key_file} is not the key of the certificate "
                           f"{cert_file}") from None
        raise TlsError(f"the TLS certificate {cert_file} or its key {key_file} is not valid PEM "
                       f"(OpenSSL: {error})") from None
    return chain, key


def _ca(ca_file: str) -> bytes:
    """The CA bundle, once OpenSSL parses every certificate in it."""
    bundle = _read(ca_file, "CA certificates")
    if _CERTIFICATE not in bundle:
        raise TlsError(f"the TLS CA certificates {ca_file} hold no PEM certificate")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=bundle.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError) as error:
        raise TlsError(f"the TLS CA certificates {ca_file} are not valid PEM ({error})") from None
    return bundle
