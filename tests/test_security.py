"""Security defaults: loopback binding, TLS and a bearer token on the gateway, limits."""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import pytest

pytest.importorskip("cryptography", reason="a dev dependency (pip install -e .[dev]): the tests' certificates")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig

TOKEN = "s3cret-token-for-tests"


def self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@pytest.fixture(scope="module")
def secure_stack(tiny_target: Path, tiny_head: Path, tmp_path_factory: pytest.TempPathFactory) -> ServiceStack:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(folder)
    (folder / "token").write_text(TOKEN + "\n")
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, log_dir=folder,
                         tls_cert=str(cert), tls_key=str(key), max_prompt_tokens=64, max_new_tokens_cap=100,
                         extra_gateway_args=["--auth-token-file", str(folder / "token")])
    with ServiceStack(cfg) as stack:
        stack.ca = cert.read_bytes()  # type: ignore[attr-defined]
        yield stack


def client(stack: ServiceStack, token: str | None) -> GatewayClient:
    return GatewayClient(stack.addr("gateway"), token=token, tls_ca=stack.ca, tls_server_name="localhost")  # type: ignore[attr-defined]


def test_tls_and_token_serve(secure_stack: ServiceStack) -> None:
    c = client(secure_stack, TOKEN)
    out = c.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=5))
    assert len(out.token_ids) == 5
    c.close()


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated(secure_stack: ServiceStack, token: str | None) -> None:
    c = client(secure_stack, token)
    with pytest.raises(grpc.RpcError) as err:
        c.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=5))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        c.model_info()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    c.close()


def test_plaintext_client_cannot_talk_to_the_tls_port(secure_stack: ServiceStack) -> None:
    c = GatewayClient(secure_stack.addr("gateway"), token=TOKEN)
    with pytest.raises(grpc.RpcError) as err:
        c.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=5), timeout=5)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    c.close()


def test_health_is_open_without_a_token(secure_stack: ServiceStack) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=secure_stack.ca)  # type: ignore[attr-defined]
    with grpc.secure_channel(secure_stack.addr("gateway"), creds,
                             options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_configured_limits(secure_stack: ServiceStack) -> None:
    c = client(secure_stack, TOKEN)
    for req, text in [(make_request(token_ids=list(range(1, 80)), max_new_tokens=5), "exceeds the limit of 64"),
                      (make_request(token_ids=[1, 2], max_new_tokens=101), "exceeds the cap of 100")]:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()
    c.close()


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a LISTEN socket on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(addr)
    return found


def test_internal_services_listen_on_loopback_only(secure_stack: ServiceStack) -> None:
    # 127.0.0.1, ::1 and ::ffff:127.0.0.1
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    for name in ("target", "draft", "gateway"):
        addrs = listening_addresses(secure_stack.ports[name])
        assert addrs and addrs <= loopback, (name, addrs)
