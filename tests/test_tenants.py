"""Tenant cache salts: HMACs under a server secret, explicit salts scoped to their API key
unless the server shares them (`--cache-salt-scope global`)."""

import httpx
import pytest
from test_server_harness import running_server

from tokenizer_server.tenants import TenantSalts

KEY_A, KEY_B = b"key-alpha", b"key-beta"


def test_without_keys_the_salt_is_the_clients():
    s = TenantSalts(b"secret")
    assert s.salt(None, None) is None
    assert s.salt(None, "room") == "room"


def test_default_salts_differ_per_key_and_per_secret():
    a, b = TenantSalts(b"secret"), TenantSalts(b"other secret")
    assert a.salt(KEY_A, None) != a.salt(KEY_B, None)
    assert a.salt(KEY_A, None) == TenantSalts(b"secret").salt(KEY_A, None)  # stable for a stable secret
    assert a.salt(KEY_A, None) != b.salt(KEY_A, None)
    assert TenantSalts().salt(KEY_A, None) != TenantSalts().salt(KEY_A, None)  # random secret per start


def test_explicit_salts_are_scoped_to_the_key_unless_global():
    key, shared = TenantSalts(b"s"), TenantSalts(b"s", scope="global")
    assert key.salt(KEY_A, "room") != key.salt(KEY_B, "room")
    assert shared.salt(KEY_A, "room") == shared.salt(KEY_B, "room")
    # no explicit salt can name a key's default salt, nor a scoped salt another key's
    assert key.salt(KEY_A, "room") != key.salt(KEY_A, None)
    assert shared.salt(KEY_A, "room") != key.salt(KEY_A, "room")
    # the parts are length-prefixed: moving bytes between key and salt changes the salt
    assert key.salt(b"ab", "c") != key.salt(b"a", "bc")
    assert key.salt(KEY_A, "room").startswith("t-") and "room" not in key.salt(KEY_A, "room")


def test_scope_is_checked():
    with pytest.raises(ValueError, match="scope"):
        TenantSalts(scope="tenant")


def test_global_scope_shares_an_explicit_salt_across_keys(tiny_llama_dir, tmp_path):
    prompt = " ".join(f"line {i} of a shared instruction block;" for i in range(20))
    with running_server(tiny_llama_dir, tmp_path, "--api-key", KEY_A.decode(), "--api-key", KEY_B.decode(),
                        "--cache-salt-scope", "global", "--served-model-name", "tiny") as srv:
        def cached(key: bytes, **kw) -> int:
            r = httpx.post(srv.api + "/completions", headers={"Authorization": f"Bearer {key.decode()}"},
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 1, **kw}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(KEY_A, cache_salt="room") == 0
        assert cached(KEY_B, cache_salt="room") > 0  # shared on purpose
        assert cached(KEY_B) == 0  # the key's default salt stays its own
