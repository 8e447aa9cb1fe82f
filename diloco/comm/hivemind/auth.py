"""Run keys and run names: HMAC over length-prefixed parts, the DHT authorizer of a keyed run, run names."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over length-prefixed parts (so that part boundaries cannot shift)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.digest()


def check_run_name(name: str) -> str:
    if not RUN_NAME.match(name or ""):
        raise ValueError(f"run name {name!r}: use 1-64 letters, digits, '-' or '_' (it becomes a DHT key prefix)")
    return name


def make_authorizer(secret: bytes):
    from hivemind.utils.auth import AuthorizerBase
    from hivemind.utils.timed_storage import TimedStorage, get_dht_time

    class HMACAuthorizer(AuthorizerBase):
        """Shared-key authorization of DHT requests and responses: HMAC, time skew <= 60 s, no nonce replays."""

        MAX_SKEW = 60.0

        def __init__(self) -> None:
            self.nonces = TimedStorage()

        def _digest(self, msg) -> bytes:
            sig = msg.auth.signature
            msg.auth.signature = b""
            d = hmac.new(secret, msg.SerializeToString(), hashlib.sha256).digest()
            msg.auth.signature = sig
            return d

        async def sign_request(self, request, service_public_key) -> None:
            request.auth.time = get_dht_time()
            request.auth.nonce = secrets.token_bytes(8)
            request.auth.signature = b""
            request.auth.signature = self._digest(request)

        async def validate_request(self, request) -> bool:
            if not hmac.compare_digest(request.auth.signature, self._digest(request)):
                return False
            now = get_dht_time()
            if abs(request.auth.time - now) > self.MAX_SKEW:
                return False
            with self.nonces.freeze():
                if request.auth.nonce in self.nonces:
                    return False
            self.nonces.store(request.auth.nonce, None, now + 3 * self.MAX_SKEW)
            return True

        async def sign_response(self, response, request) -> None:
            response.auth.nonce = request.auth.nonce
            response.auth.signature = b""
            response.auth.signature = self._digest(response)

        async def validate_response(self, response, request) -> bool:
            return response.auth.nonce == request.auth.nonce and \
                hmac.compare_digest(response.auth.signature, self._digest(response))

    return HMACAuthorizer()
