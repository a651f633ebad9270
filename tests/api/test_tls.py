"""TLS and mutual TLS over real loopback gRPC, with certificates made in the test: who gets in, who does not, and
a certificate rotation picked up without a restart."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import loraplex
import pytest
from support.certs import CA, Pair
from support.servers import tiny_settings

from service import cli
from service.api.server import BackgroundServer
from service.api.tls import server_credentials
from service.config import ConfigError, Settings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | Pair]:
    folder = tmp_path_factory.mktemp("pki")
    server_ca, client_ca, stranger = CA("server ca"), CA("client ca"), CA("stranger ca")
    return {
        "server_ca": server_ca.write(folder / "server-ca.crt"),
        "client_ca": client_ca.write(folder / "client-ca.crt"),
        "stranger_ca": stranger.write(folder / "stranger-ca.crt"),
        "server": server_ca.issue(folder, "server", server=True),
        "client": client_ca.issue(folder, "client", server=False),
        "stranger_client": stranger.issue(folder, "stranger-client", server=False),
    }


def _pair(pki: dict[str, Path | Pair], name: str) -> Pair:
    pair = pki[name]
    assert isinstance(pair, Pair)
    return pair


def _path(pki: dict[str, Path | Pair], name: str) -> Path:
    path = pki[name]
    assert isinstance(path, Path)
    return path


def tls_server(model: Path, pair: Pair, client_ca: Path | None = None) -> BackgroundServer:
    return BackgroundServer(tiny_settings(model, tls_cert=pair.cert, tls_key=pair.key, tls_client_ca=client_ca))


def model_name(target: str, **kwargs: object) -> str:
    with loraplex.Client(target, timeout=20, **kwargs) as client:  # type: ignore[arg-type]
        return client.model_info().model_name


def test_tls_serves_clients_that_trust_its_ca_and_refuses_the_rest(
    pki: dict[str, Path | Pair], served_tiny_dir: Path
) -> None:
    with tls_server(served_tiny_dir, _pair(pki, "server")) as srv:
        assert model_name(srv.target, tls_ca=_path(pki, "server_ca")) == served_tiny_dir.name
        with loraplex.Client(srv.target, timeout=20, tls_ca=_path(pki, "server_ca")) as client:
            assert client.health() is loraplex.HealthStatus.SERVING
            assert client.generate("hi", max_new_tokens=2).usage.generated_tokens >= 1
        with pytest.raises(loraplex.Unavailable):  # plaintext to a TLS port
            model_name(srv.target)
        with pytest.raises(loraplex.Unavailable):  # a server certificate this client does not trust
            model_name(srv.target, tls_ca=_path(pki, "stranger_ca"))


def test_mutual_tls_needs_a_client_certificate_signed_by_the_client_ca(
    pki: dict[str, Path | Pair], served_tiny_dir: Path
) -> None:
    ca = _path(pki, "server_ca")
    client, stranger = _pair(pki, "client"), _pair(pki, "stranger_client")
    with tls_server(served_tiny_dir, _pair(pki, "server"), client_ca=_path(pki, "client_ca")) as srv:
        assert model_name(srv.target, tls_ca=ca, tls_cert=client.cert, tls_key=client.key) == served_tiny_dir.name
        with pytest.raises(loraplex.Unavailable):  # no client certificate
            model_name(srv.target, tls_ca=ca)
        with pytest.raises(loraplex.Unavailable):  # a client certificate from another CA
            model_name(srv.target, tls_ca=ca, tls_cert=stranger.cert, tls_key=stranger.key)
        with pytest.raises(loraplex.Unavailable):
            model_name(srv.target)


def test_health_command_works_as_an_exec_probe_over_mutual_tls(tmp_path: Path, served_tiny_dir: Path) -> None:
    """In a pod the probe dials 127.0.0.1 while the certificate names the Service: --tls-server-name bridges it."""
    server_ca, client_ca = CA("server ca"), CA("client ca")
    ca_file, client_ca_file = server_ca.write(tmp_path / "ca.crt"), client_ca.write(tmp_path / "client-ca.crt")
    served = server_ca.issue(tmp_path, "tls", server=True, dns_name="loraplex.prod.svc")
    client = client_ca.issue(tmp_path, "probe", server=False)
    with tls_server(served_tiny_dir, served, client_ca=client_ca_file) as srv:
        probe = ["health", "--target", srv.target, "--tls-ca", str(ca_file)]
        probe += ["--tls-cert", str(client.cert), "--tls-key", str(client.key)]
        assert cli.main([*probe, "--tls-server-name", "loraplex.prod.svc"]) == 0
        assert cli.main([*probe, "--tls-server-name", "loraplex.prod.svc", "--service", "loraplex.v1.Generation"]) == 0
        assert cli.main(probe) == 1  # 127.0.0.1 is not a name in the certificate
        assert cli.main([*probe[:5], "--tls-server-name", "loraplex.prod.svc"]) == 1  # no client certificate


def test_the_async_client_speaks_mutual_tls(pki: dict[str, Path | Pair], served_tiny_dir: Path) -> None:
    client = _pair(pki, "client")

    async def ask(target: str) -> str:
        async with loraplex.AsyncClient(
            target, timeout=20, tls_ca=_path(pki, "server_ca"), tls_cert=client.cert, tls_key=client.key
        ) as c:
            return (await c.model_info()).model_name

    with tls_server(served_tiny_dir, _pair(pki, "server"), client_ca=_path(pki, "client_ca")) as srv:
        assert asyncio.run(ask(srv.target)) == served_tiny_dir.name


def test_rotated_certificates_are_used_by_the_next_connection(tmp_path: Path, served_tiny_dir: Path) -> None:
    old_ca, new_ca = CA("old ca"), CA("new ca")
    old_ca_file, new_ca_file = old_ca.write(tmp_path / "old-ca.crt"), new_ca.write(tmp_path / "new-ca.crt")
    live = old_ca.issue(tmp_path / "live", "tls", server=True)
    with tls_server(served_tiny_dir, live) as srv:
        assert srv.server is not None and srv.server.tls is not None
        assert model_name(srv.target, tls_ca=old_ca_file) == served_tiny_dir.name
        assert srv.server.tls.reloads == 0
        # Rotate the way a Secret update does: new files swapped in over the old names.
        fresh = new_ca.issue(tmp_path / "fresh", "tls", server=True)
        os.replace(fresh.key, live.key)
        os.replace(fresh.cert, live.cert)
        assert model_name(srv.target, tls_ca=new_ca_file) == served_tiny_dir.name
        assert srv.server.tls.reloads == 1
        with pytest.raises(loraplex.Unavailable):  # the old certificate is no longer served
            model_name(srv.target, tls_ca=old_ca_file)


def test_a_half_written_rotation_keeps_the_previous_certificates(tmp_path: Path, served_tiny_dir: Path) -> None:
    ca = CA("ca")
    ca_file = ca.write(tmp_path / "ca.crt")
    live = ca.issue(tmp_path, "tls", server=True)
    with tls_server(served_tiny_dir, live) as srv:
        assert srv.server is not None and srv.server.tls is not None
        live.cert.write_bytes(b"")  # caught mid-write
        assert model_name(srv.target, tls_ca=ca_file) == served_tiny_dir.name
        assert srv.server.tls.reloads == 0


def test_tls_settings_are_checked(tmp_path: Path) -> None:
    env = {"LORAPLEX_TLS_CERT": "/s/tls.crt", "LORAPLEX_TLS_KEY": "/s/tls.key", "LORAPLEX_TLS_CLIENT_CA": "/s/ca.crt"}
    settings = Settings.from_env(env)
    assert (settings.tls_cert, settings.tls_key, settings.tls_client_ca) == (
        Path("/s/tls.crt"),
        Path("/s/tls.key"),
        Path("/s/ca.crt"),
    )
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        Settings.from_env({"LORAPLEX_TLS_CERT": "/s/tls.crt"})
    with pytest.raises(ConfigError, match="needs tls_cert"):
        Settings.from_env({"LORAPLEX_TLS_CLIENT_CA": "/s/ca.crt"})
    with pytest.raises(ConfigError, match=r"missing\.crt"):  # start-up fails by name, before binding
        server_credentials(Settings(tls_cert=tmp_path / "missing.crt", tls_key=tmp_path / "missing.key"))


def test_serve_flags_and_variables_reach_the_settings() -> None:
    flags = ["serve", "--tls-cert", "/s/tls.crt", "--tls-key", "/s/tls.key", "--max-message-bytes", "1024"]
    flags += ["--max-connection-age-seconds", "0", "--api-key-file", "/k/keys"]
    env = {"LORAPLEX_TLS_CLIENT_CA": "/s/ca.crt", "LORAPLEX_MAX_MESSAGE_BYTES": "99", "LORAPLEX_API_KEYS": "a,b"}
    settings = cli.serve_settings(cli.build_parser().parse_args(flags), env)
    assert (settings.tls_cert, settings.tls_key, settings.tls_client_ca) == (
        Path("/s/tls.crt"),
        Path("/s/tls.key"),
        Path("/s/ca.crt"),
    )
    assert settings.max_message_bytes == 1024 and settings.max_connection_age_seconds == 0  # flags win
    assert settings.api_key_file == Path("/k/keys") and settings.api_keys == ("a", "b")
    assert settings.max_connection_age_grace_seconds == float("inf")
    with pytest.raises(ConfigError, match="max_message_bytes"):
        cli.serve_settings(cli.build_parser().parse_args(["serve", "--max-message-bytes", "0"]), {})


def test_client_tls_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        loraplex.Client("127.0.0.1:1", tls_cert=tmp_path / "c.crt")
    with pytest.raises(ValueError, match="cannot read"):
        loraplex.Client("127.0.0.1:1", tls_ca=tmp_path / "absent.crt")
