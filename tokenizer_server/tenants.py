"""Tenant cache salts: which requests may share prefix-cache blocks.

The engine never shares blocks across salts, so the salt is the isolation boundary. With API
keys configured, every salt the engine sees is an HMAC under a server-side secret:

- a request without `cache_salt` gets its key's default salt, HMAC(secret, "default" | key);
- an explicit `cache_salt` is scoped to the key that sent it, HMAC(secret, "scoped" | key |
  salt), so two tenants who pick the same string still get different caches. With
  `scope="global"` (`--cache-salt-scope global`) explicit salts are shared by every key that
  names them, for tenants that mean to share a cache.

Knowing how salts are made reveals nothing: without the secret, no one can compute another
tenant's salt (and block keys exported to routers name salts only through their hash). The
secret is random per start unless the operator gives a stable one (`--salt-secret` or the
RADIXKV_SALT_SECRET environment variable), which replicas behind one router must share.
Without API keys there is one tenant: `cache_salt` goes to the engine as given.
"""

import hashlib
import hmac
import secrets

SALT_SCOPES = ("key", "global")


class TenantSalts:
    def __init__(self, secret: bytes | None = None, *, scope: str = "key"):
        if scope not in SALT_SCOPES:
            raise ValueError(f"scope must be one of {SALT_SCOPES}, got {scope!r}")
        self._secret = secret if secret else secrets.token_bytes(32)
        self.scope = scope

    def _mac(self, *parts: bytes) -> str:
        # length-prefixed parts: ("ab", "c") and ("a", "bc") never collide
        msg = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
        return "t-" + hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:32]

    def salt(self, api_key: bytes | None, cache_salt: str | None) -> str | None:
        """The engine's salt for a request sent with `api_key` (None: no keys configured)."""
        if api_key is None:
            return cache_salt
        if cache_salt is None:
            return self._mac(b"default", api_key)
        if self.scope == "global":
            return self._mac(b"global", cache_salt.encode("utf-8", "surrogatepass"))
        return self._mac(b"scoped", api_key, cache_salt.encode("utf-8", "surrogatepass"))
