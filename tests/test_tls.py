"""TLS on the public endpoint and mutual TLS between decode and prefill nodes."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pdserve.client import generate
from shared.serving.tls import ClientTls, ServerTls
from tests.engine_helpers import hf_greedy
from tests.support.cluster import pd_cluster


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d: Path) -> dict[str, str]:
    """A CA, a server cert for localhost/127.0.0.1 and a client cert, all signed by the CA."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=pdserve-ca",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
    )
    for name, ext in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN=pdserve-{name}",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(d / f"{name}.ext"),
            "-out",
            str(d / f"{name}.pem"),
        )
    return {
        k: str(d / f"{k}")
        for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


def test_tls_public_endpoint_and_mutual_tls_to_prefill(
    tmp_path: Path, checkpoint: Callable[..., Path]
) -> None:
    pki = make_pki(tmp_path)
    path = checkpoint("llama")
    server = ServerTls(pki["server.pem"], pki["server.key"])
    mutual = ServerTls(pki["server.pem"], pki["server.key"], client_ca=pki["ca.pem"])
    to_prefill = ClientTls(pki["ca.pem"], pki["client.pem"], pki["client.key"])

    async def body() -> None:
        async with pd_cluster(
            path,
            prefill_overrides={"tls": mutual},
            decode_overrides={"tls": server, "prefill_tls": to_prefill},
        ) as c:
            target = c.targets[0]
            creds = ClientTls(pki["ca.pem"]).credentials()
            channel = grpc.aio.secure_channel(target, creds)
            try:
                r = await generate(target, [5, 6, 7, 8], max_tokens=4, channel=channel)
            finally:
                await channel.close()
            assert r.token_ids == hf_greedy(path, [5, 6, 7, 8], 4)
            # plaintext is refused on a TLS port
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(target, [5, 6], max_tokens=1, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # the prefill node refuses a caller without a client certificate
            no_cert = grpc.aio.secure_channel(
                f"127.0.0.1:{c.prefills[0].port}", ClientTls(pki["ca.pem"]).credentials()
            )
            try:
                from proto.pdserve.v1 import generation_pb2, prefill_pb2_grpc

                with pytest.raises(grpc.aio.AioRpcError):
                    await prefill_pb2_grpc.PrefillStub(no_cert).GetModelInfo(
                        generation_pb2.GetModelInfoRequest(), timeout=5
                    )
            finally:
                await no_cert.close()
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_tls_config_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"missing\.pem"):
        ServerTls(str(tmp_path / "missing.pem"), str(tmp_path / "k")).validate()
    (tmp_path / "ca.pem").write_text("x")
    with pytest.raises(ValueError, match="both cert and key"):
        ClientTls(str(tmp_path / "ca.pem"), cert=str(tmp_path / "ca.pem")).validate()
