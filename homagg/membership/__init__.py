"""The controller service's wire contract: ``membership.proto`` and its generated stubs.

A neutral module: the service (``homagg.controller.service``) and its clients (the host
agent's ``homagg.host_agent.membership``) both import it, and it imports neither. The stubs
are generated and committed; after editing the proto, regenerate them with the pinned
generator, which ``./run.sh setup`` installs apart from the venv's packages, in
``.venv/protogen`` (``PROTOGEN_DIR``): its protoc writes code that runs on the protobuf 3.20
p4runtime-shell pins, but it declares protobuf 4, which the venv's resolver would report as a
conflict:

    pip install --no-deps --target .venv/protogen grpcio-tools==1.49.1
    PYTHONPATH=.venv/protogen python -m grpc_tools.protoc -I. --python_out=. \\
        --grpc_python_out=. homagg/membership/membership.proto

``tests/test_membership_proto.py`` fails while they are stale.
"""

from __future__ import annotations

from typing import Any

from homagg.membership import membership_pb2 as _pb2
from homagg.membership import membership_pb2_grpc as _rpc

#: The messages and the service's stubs, typed ``Any``: the generated modules build their
#: classes at import time, so a type checker cannot see them.
pb2: Any = _pb2
rpc: Any = _rpc
PROTO = "homagg/membership/membership.proto"
#: Trailing metadata the service puts on its own refusals: a status without it (UNAVAILABLE,
#: mostly) came from gRPC, the call never reaching the service.
REFUSAL_KEY = "homagg-refusal"
#: The shortest join secret (JoinRequest.join_secret) the service takes.
MIN_JOIN_SECRET = 16
GENERATOR = "grpcio-tools==1.49.1"
#: where the generator lives: in the venv's directory, outside its site-packages
PROTOGEN_DIR = "protogen"

__all__ = ["GENERATOR", "MIN_JOIN_SECRET", "PROTO", "PROTOGEN_DIR", "REFUSAL_KEY", "pb2", "rpc"]
