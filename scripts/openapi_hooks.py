"""Schemathesis hooks for scripts/check_openapi.py: sign the central API's
agent calls, so generated requests get past the signature check to the
ledger's own rules.

Loaded through ``SCHEMATHESIS_HOOKS=openapi_hooks`` with the key file of an
enrolled identity in ``OPENAPI_SIGNING_KEY`` (a ``reservoirKey.v1`` file).
Every operation whose security lists the ``signature`` scheme is signed
as central-client/src/http_signature.rs signs (RFC 9421 profile: ``sig1``
over ``"@method" "@path" "content-digest"``, ed25519), over the exact bytes
the request will carry. A reserve's body gets the reservation ID the
identity derives from its key and pair (``ReservationId::derive``), and
half of the reserves go to ``OPENAPI_PAIR`` (``subject/route``, a pair with
a published policy), so they reach admission instead of stopping at
``reservation_id_foreign`` or ``no_policy``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import time
from typing import Any

import requests
import schemathesis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

_KEY = json.loads(open(os.environ["OPENAPI_SIGNING_KEY"]).read())
_IDENTITY: str = _KEY["keyId"]
_SECRET = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(_KEY["secretKey"]))
_PAIR = os.environ.get("OPENAPI_PAIR", "tenant-1/chat.generate").split("/", 1)


def reservation_id(identity: str, subject: str, route: str, key: str) -> str:
    """``ReservationId::derive``: ``rl-`` and 32 hex digits of SHA-256 over
    the length-prefixed (u64, big-endian) identity, subject, route and key."""
    data = b""
    for part in (identity, subject, route, key):
        encoded = part.encode()
        data += len(encoded).to_bytes(8, "big") + encoded
    return "rl-" + hashlib.sha256(data).hexdigest()[:32]


def _signed(case: Any) -> bool:
    security = case.operation.definition.raw.get("security") or []
    return any("signature" in requirement for requirement in security)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if not _signed(case):
        return
    body = case.body
    if (
        case.method.upper() == "POST"
        and case.path == "/v1/reservations"
        and isinstance(body, dict)
        and all(isinstance(body.get(name), str) for name in ("subject", "route", "idempotencyKey"))
    ):
        if int(hashlib.sha256(body["idempotencyKey"].encode()).hexdigest(), 16) % 2 == 0:
            body["subject"], body["route"] = _PAIR
        body["reservation"] = reservation_id(
            _IDENTITY, body["subject"], body["route"], body["idempotencyKey"]
        )
    # The bytes and path requests will send, as Schemathesis would send them.
    transport = case.as_transport_kwargs(base_url=case.operation.base_url)
    prepared = requests.Request(
        method=transport["method"],
        url=transport["url"],
        headers=transport.get("headers"),
        params=transport.get("params"),
        data=transport.get("data"),
        json=transport.get("json"),
    ).prepare()
    payload = prepared.body or b""
    if isinstance(payload, str):
        payload = payload.encode()
    path = prepared.path_url.split("?", 1)[0]
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(payload).digest()).decode() + ":"
    params = (
        '("@method" "@path" "content-digest")'
        f';created={int(time.time())};nonce="{secrets.token_hex(16)}"'
        f';keyid="{_IDENTITY}";alg="ed25519"'
    )
    base = (
        f'"@method": {case.method.upper()}\n"@path": {path}\n'
        f'"content-digest": {digest}\n"@signature-params": {params}'
    )
    signature = base64.b64encode(_SECRET.sign(base.encode())).decode()
    headers = case.headers if case.headers is not None else {}
    headers["Content-Digest"] = digest
    headers["Signature-Input"] = f"sig1={params}"
    headers["Signature"] = f"sig1=:{signature}:"
    case.headers = headers
