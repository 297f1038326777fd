"""The switches' P4Runtime over TLS: the software aggregator serves it (``homagg-softswitch
--grpc-tls-cert/--grpc-tls-key``, ``--grpc-tls-client-ca`` for mutual TLS) and the controller
reaches it with the config's ``grpc_ca`` (``grpc_cert``/``grpc_key``). P4Runtime takes no token:
TLS, with client certificates, is what keeps a reachable P4Runtime port from being anyone's.

The certificates are made here (tests/test_service_tls.py's ``make_pki``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("p4runtime_sh")
pytest.importorskip("cryptography.x509")

from homagg.controller import jobs as J  # noqa: E402
from homagg.controller.cli import main as ctl  # noqa: E402
from homagg.controller.p4client import P4RuntimeSwitch, SwitchError  # noqa: E402
from homagg.errors import ConfigError  # noqa: E402
from homagg.netconfig import GrpcTls, parse, render  # noqa: E402
from homagg.targets.p4runtime_server import P4RuntimeServer  # noqa: E402
from homagg.targets.soft import SoftSwitch  # noqa: E402
from tests.staging import wait_for  # noqa: E402
from tests.test_service_tls import make_pki  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def served(tmp_path, client_ca: Path | None = None):
    ca, cert, key = make_pki(tmp_path, "switch")
    srv = P4RuntimeServer(SoftSwitch(), "127.0.0.1:0", tls=(cert, key, client_ca)).start()
    return srv, ca


def session(srv, tls: GrpcTls | None) -> P4RuntimeSwitch:
    return P4RuntimeSwitch(srv.address, 1, (0, 1), None, "s1", tls).open(timeout=5)


def test_the_controller_reaches_a_tls_switch_with_its_ca_and_nothing_else(tmp_path):
    srv, ca = served(tmp_path)
    try:
        with session(srv, GrpcTls(str(ca))) as sw:
            assert J.list_jobs(sw) == []
        with pytest.raises(SwitchError) as e:
            session(srv, None)
        assert str(e.value) == (f"switch s1 at {srv.address}: no P4Runtime session (device id "
                                "1? a switch that serves TLS needs grpc_ca)")
        other, _, _ = make_pki(tmp_path, "other")
        with pytest.raises(SwitchError) as e:
            session(srv, GrpcTls(str(other)))
        assert "no P4Runtime session over TLS" in str(e.value)
        with pytest.raises(SwitchError, match=r"grpc_ca .*missing\.pem: no such file"):
            session(srv, GrpcTls(str(tmp_path / "missing.pem")))
    finally:
        srv.stop()


def test_mutual_tls_takes_only_controllers_with_a_certificate_the_client_ca_signed(tmp_path):
    client_ca, client_cert, client_key = make_pki(tmp_path, "controller")
    srv, ca = served(tmp_path, client_ca)
    try:
        with session(srv, GrpcTls(str(ca), str(client_cert), str(client_key))) as sw:
            assert J.list_jobs(sw) == []
        with pytest.raises(SwitchError, match="no P4Runtime session over TLS"):
            session(srv, GrpcTls(str(ca)))  # no client certificate
        _, stranger_cert, stranger_key = make_pki(tmp_path, "stranger")
        with pytest.raises(SwitchError, match="no P4Runtime session over TLS"):
            session(srv, GrpcTls(str(ca), str(stranger_cert), str(stranger_key)))
    finally:
        srv.stop()


def test_the_config_keys_round_trip_and_half_a_setting_is_refused():
    sw = {"target": "soft", "grpc_ca": "/etc/homagg/ca.pem", "grpc_cert": "c.pem",
          "grpc_key": "k.pem"}
    cfg = parse({"switch": sw, "fallback": {"grpc_ca": "fb-ca.pem"}})
    assert cfg.switch.tls == GrpcTls("/etc/homagg/ca.pem", "c.pem", "k.pem")
    assert cfg.fallback is not None and cfg.fallback.tls == GrpcTls("fb-ca.pem")
    import tomllib

    assert parse(tomllib.loads(render(cfg))) == cfg
    with pytest.raises(ConfigError, match=r"^\[switch\]: grpc_cert and grpc_key go together"):
        parse({"switch": {"grpc_ca": "a", "grpc_cert": "c"}})
    with pytest.raises(ConfigError, match=r"^\[fallback\]: grpc_cert and grpc_key need grpc_ca"):
        parse({"switch": {}, "fallback": {"grpc_cert": "c", "grpc_key": "k"}})


def test_homagg_softswitch_serves_tls_and_homagg_ctl_drives_it(tmp_path, capsys):
    client_ca, client_cert, client_key = make_pki(tmp_path, "controller")
    ca, cert, key = make_pki(tmp_path, "switch")
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "homagg.targets.soft", "--grpc",
                             "127.0.0.1:0", "--bind", "127.0.0.253", "--port", "0",
                             "--grpc-tls-cert", str(cert), "--grpc-tls-key", str(key),
                             "--grpc-tls-client-ca", str(client_ca), "--ready-file", str(ready),
                             "--log-level", "warning"],
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 20, "homagg-softswitch")
        assert proc.poll() is None
        addr = json.loads(ready.read_text())["grpc"]
        cfg = tmp_path / "net.toml"
        cfg.write_text(f'[switch]\ntarget = "soft"\ngrpc = "{addr}"\nip = "127.0.0.253"\n'
                       f'grpc_ca = "{ca}"\ngrpc_cert = "{client_cert}"\n'
                       f'grpc_key = "{client_key}"\n')
        assert ctl(["-c", str(cfg), "job", "list"]) == 0
        assert capsys.readouterr().out.strip() == "no jobs installed"
        plain = tmp_path / "plain.toml"
        plain.write_text(f'[switch]\ntarget = "soft"\ngrpc = "{addr}"\nip = "127.0.0.253"\n')
        assert ctl(["-c", str(plain), "job", "list"]) == 1
        assert "a switch that serves TLS needs grpc_ca" in capsys.readouterr().err
    finally:
        proc.terminate()
        proc.wait(10)
