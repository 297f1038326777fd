"""``homagg-ctl serve`` as its own process, over TLS: agents that trust its CA (HOMAGG_CA) join
and sum exactly; an agent without the CA, or with another, cannot join.

The certificates are made here (a CA, and a server certificate for 127.0.0.1 signed by it).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("p4runtime_sh")
x509 = pytest.importorskip("cryptography.x509")

from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from homagg.host_agent import Agent, AgentConfig, AgentError  # noqa: E402
from homagg.launcher.local import LocalAggregator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _cert(subject: str, key, issuer_name, issuer_key, ca: bool):
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(where: Path, name: str) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) as PEM files."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = _cert(f"{name} CA", ca_key, ca_name, ca_key, True)
    cert = _cert("127.0.0.1", key, ca_name, ca_key, False)
    paths = (where / f"{name}-ca.pem", where / f"{name}-cert.pem", where / f"{name}-key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@pytest.fixture
def tls_service(tmp_path):
    agg = LocalAggregator(workdir=tmp_path).start()
    ca, cert, key = make_pki(tmp_path, "homagg")
    token = tmp_path / "token"
    token.write_text("tls-token\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMAGG_")}
    proc = subprocess.Popen([sys.executable, "-m", "homagg.controller.cli", "-c", str(agg.path),
                             "serve", "--listen", "127.0.0.1:0", "--token-file", str(token),
                             "--tls-cert", str(cert), "--tls-key", str(key)],
                            env=dict(env, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("serving joins at 127.0.0.1:") and first.strip().endswith(
            "(TLS)"), first + proc.stderr.read()
        yield first.split()[3], ca, tmp_path
    finally:
        proc.terminate()
        proc.wait(30)
        agg.stop()


def env_for(address: str, rank: int, world: int, ca: Path | None) -> dict:
    e = {"HOMAGG_CONTROLLER": address, "HOMAGG_TOKEN": "tls-token", "RANK": str(rank),
         "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
         "TORCHELASTIC_RUN_ID": "tls", "HOMAGG_JOIN_TIMEOUT": "20", "HOMAGG_JOIN_RETRY": "0",
         "HOMAGG_JOIN_SECRET": "join-secret-of/tls"}
    return e | ({"HOMAGG_CA": str(ca)} if ca else {})


def test_agents_that_trust_the_services_ca_join_over_tls_and_sum_exactly(tls_service):
    address, ca, _ = tls_service
    world, errors = 2, []

    def worker(rank):
        try:
            with Agent(AgentConfig.from_env(env_for(address, rank, world, ca),
                                            deadline=20.0)) as agent:
                xs = [np.arange(5000, dtype=np.int32) * (w + 1) for w in range(world)]
                got = agent.allreduce_int(xs[rank])
                assert np.array_equal(got, np.sum(xs, axis=0, dtype=np.int64))
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts) and not errors, errors


UNREACHABLE = r"cannot reach the controller at 127\.0\.0\.1:\d+ to join \(UNAVAILABLE\)"


def test_an_agent_without_the_ca_or_with_another_cannot_join(tls_service):
    address, _, tmp = tls_service
    with pytest.raises(AgentError, match=UNREACHABLE):
        AgentConfig.from_env(env_for(address, 0, 1, None))  # plaintext to a TLS server
    other_ca, _, _ = make_pki(tmp, "other")
    with pytest.raises(AgentError, match=UNREACHABLE):
        AgentConfig.from_env(env_for(address, 0, 1, other_ca))
