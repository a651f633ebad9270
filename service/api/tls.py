"""Server TLS and mutual TLS, with certificates re-read when their files change.

``server_credentials(settings)`` is None for plaintext (no ``--tls-cert``). Otherwise grpc asks the fetcher for a
configuration at each new handshake; it compares the files' (mtime, size, inode) with what it last loaded and
re-reads them only on a change, so a rotated Secret is picked up by the next connection without a restart.
A rotation caught half-written (unreadable or empty files) keeps the previous certificates and logs a warning.
Connections already open keep the certificates they were made with.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import grpc

from service.config import ConfigError, Settings

log = logging.getLogger("loraplex.tls")

Signature = tuple[tuple[int, int, int], ...]


class CertificateFiles:
    """The server's key, certificate chain and (mutual TLS) client CA, as files watched for changes."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._lock = threading.Lock()  # the fetcher runs on grpc's threads
        self._signature = self.signature()
        self.reloads = 0
        self.initial = self.configuration()  # a missing or unreadable file fails start-up here, by name

    @property
    def paths(self) -> tuple[Path, ...]:
        return (self.cert, self.key) if self.client_ca is None else (self.cert, self.key, self.client_ca)

    def signature(self) -> Signature:
        stats = [os.stat(p) for p in self.paths]
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        pems = []
        for path in self.paths:
            data = path.read_bytes()
            if not data.strip():
                raise ConfigError(f"{path} is empty")
            pems.append(data)
        return grpc.ssl_server_certificate_configuration(
            [(pems[1], pems[0])], root_certificates=pems[2] if self.client_ca is not None else None
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher: a new configuration when the files changed since the last load, else None (keep)."""
        with self._lock:
            try:
                current = self.signature()
                if current == self._signature:
                    return None
                config = self.configuration()
            except (OSError, ValueError) as exc:
                log.warning("event=tls_reload_failed error=%s (keeping the previous certificates)", exc)
                return None
            self._signature = current
            self.reloads += 1
            log.info("event=tls_reloaded files=%s", ",".join(str(p) for p in self.paths))
            return config


def server_credentials(settings: Settings) -> tuple[grpc.ServerCredentials, CertificateFiles] | None:
    """TLS credentials from ``--tls-cert``/``--tls-key`` (and ``--tls-client-ca``: mutual TLS); None = plaintext."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    try:
        files = CertificateFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"TLS certificate files: {exc}") from None
    credentials = grpc.dynamic_ssl_server_credentials(
        files.initial,
        files.fetch,  # type: ignore[arg-type]  # grpc documents None as "keep the current configuration"
        require_client_authentication=settings.tls_client_ca is not None,
    )
    return credentials, files
