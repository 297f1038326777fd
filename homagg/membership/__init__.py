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

import math
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
#: The fewest distinct characters, and the fewest bits (its length times log2 of its distinct
#: characters: a generous estimate for a chosen one), of a join secret the service takes.
MIN_SECRET_CHARS = 8
MIN_SECRET_BITS = 48
GENERATOR = "grpcio-tools==1.49.1"
#: where the generator lives: in the venv's directory, outside its site-packages
PROTOGEN_DIR = "protogen"

__all__ = ["GENERATOR", "MIN_JOIN_SECRET", "MIN_SECRET_BITS", "MIN_SECRET_CHARS", "PROTO",
           "PROTOGEN_DIR", "REFUSAL_KEY", "pb2", "rpc", "secret_too_plain"]


def secret_too_plain(secret: str) -> str | None:
    """Why ``secret`` varies too little to be a join secret (one character repeated, a short
    pattern), or None. A token holder may guess at a pending attempt's secret for as long as
    its ranks wait: the rule is at least MIN_SECRET_CHARS distinct characters and
    MIN_SECRET_BITS bits (length x log2(distinct characters)); 32 hex digits have about 128."""
    distinct = len(set(secret))
    bits = len(secret) * math.log2(distinct) if distinct > 1 else 0.0
    if distinct >= MIN_SECRET_CHARS and bits >= MIN_SECRET_BITS:
        return None
    return (f"the join secret varies too little ({distinct} distinct characters, about "
            f"{bits:.0f} bits): at least {MIN_SECRET_CHARS} distinct characters and "
            f"{MIN_SECRET_BITS} bits (its length x log2 of its distinct characters) are "
            "required; draw one, e.g. python -c 'import secrets; print(secrets.token_hex(16))'")
