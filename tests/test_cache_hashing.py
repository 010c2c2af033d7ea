"""Block keys: the documented definition, determinism across processes, namespaces, errors."""

import hashlib
from array import array
import struct
import subprocess
import sys

import pytest
import xxhash

from radixkv.cache import BlockHasher, KVCacheManager, extra_keys, prompt_block_keys
from radixkv.cache.hashing import TOKEN_TYPECODE, le_bytes, tokens_to_array

ALGOS = {"sha256": lambda d: hashlib.sha256(d).digest(), "xxh3_128": xxhash.xxh3_128_digest}


@pytest.fixture(params=sorted(ALGOS))
def algo(request):
    return request.param


def test_keys_follow_the_documented_definition(algo):
    """key_i = H(key_{i-1} || uint32 LE tokens || extras), extras (salt) in block 0 only."""
    H, seed = ALGOS[algo], 7
    toks = [1, 2**32 - 1, 300, 0, 5, 6, 7, 8, 9]
    root = H(b"radixkv block key v1\x00" + algo.encode() + seed.to_bytes(8, "little"))
    salt_field = b"S" + struct.pack("<I", 6) + b"tenant"
    k0 = H(root + struct.pack("<4I", *toks[:4]) + salt_field)
    k1 = H(k0 + struct.pack("<4I", *toks[4:8]))
    got = prompt_block_keys(toks, 4, salt="tenant", hash_algo=algo, hash_seed=seed)
    assert got == [k0, k1]  # the partial third block has no key
    assert len(k0) == (32 if algo == "sha256" else 16)


def test_chain_fast_path_equals_definition(algo):
    h = BlockHasher(algo, 3)
    data = le_bytes(tokens_to_array(range(40)))
    keys, parent = [], h.root_key
    for i in range(5):
        parent = h.key(parent, data[i * 32 : (i + 1) * 32], b"X" if i == 0 else b"")
        keys.append(parent)
    assert h.chain(h.root_key, data, 32, b"X") == keys


def test_manager_keys_equal_exported_keys(algo):
    """A router computing prompt_block_keys sees the keys the manager stores."""
    m = KVCacheManager(16, 4, hash_algo=algo, hash_seed=11, enable_events=True)
    prompt = list(range(100, 114))
    m.add_sequence("a", prompt, salt=b"t1", adapter_id=3)
    assert m.try_reserve("a", 14)
    m.mark_tokens_computed("a", prompt)
    (ev,) = m.take_events()
    assert list(ev.block_keys) == prompt_block_keys(prompt, 4, salt="t1", adapter_id=3, hash_algo=algo, hash_seed=11)
    assert ev.parent_key is None and ev.token_ids == tuple(prompt[:12]) and ev.salt == b"t1" and ev.adapter_id == 3
    assert ev.block_ids == tuple(m.block_table("a")[:3])


def test_same_keys_in_another_process(algo):
    code = ("from radixkv.cache import prompt_block_keys as k; "
            f"print(b''.join(k(list(range(64)), 16, salt='s', hash_algo='{algo}', hash_seed=5)).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(i), "PATH": ""}).stdout.strip() for i in (1, 2)}
    assert outs == {b"".join(prompt_block_keys(list(range(64)), 16, salt="s", hash_algo=algo, hash_seed=5)).hex()}


TOKS = list(range(32))
# what differs from the plain 32-token prompt (block size 8): keyword arguments, first token
KEY_VARIANTS = {
    "salt-a": (dict(salt="a"), None),
    "salt-b": (dict(salt="b"), None),
    "empty-salt": (dict(salt=""), None),  # an empty salt is still a salt
    "adapter-int": (dict(adapter_id=1), None),
    "adapter-str": (dict(adapter_id="1"), None),
    "seed": (dict(hash_seed=1), None),
    "first-token": ({}, 1),
}


def variant_keys(name, algo):
    kw, first = KEY_VARIANTS[name]
    toks = TOKS if first is None else [first] + TOKS[1:]
    return prompt_block_keys(toks, 8, hash_algo=algo, **kw)


@pytest.mark.parametrize("variant", list(KEY_VARIANTS))
def test_salt_adapter_seed_and_tokens_change_every_key(algo, variant):
    """The first block differs, and the chain carries it to every block."""
    base = prompt_block_keys(TOKS, 8, hash_algo=algo)
    assert all(a != b for a, b in zip(base, variant_keys(variant, algo)))


def test_every_variant_gives_its_own_keys(algo):
    assert len({tuple(variant_keys(v, algo)) for v in KEY_VARIANTS}) == len(KEY_VARIANTS)


def test_a_str_salt_keys_like_its_utf8_bytes(algo):
    assert prompt_block_keys(TOKS, 8, salt="a", hash_algo=algo) == prompt_block_keys(TOKS, 8, salt=b"a", hash_algo=algo)


def test_extra_keys_are_injective():
    fields = [
        extra_keys(salt="ab"),
        extra_keys(salt="a", adapter_id="b"),
        extra_keys(adapter_id="ab"),
        extra_keys(adapter_id=1),
        extra_keys(media=[("ab", 0)]),
        extra_keys(media=[("ab", 1)]),
        extra_keys(media=[("a", 0), ("b", 0)]),
        extra_keys(salt="ab", media=[("x", 0)]),
        extra_keys(),
    ]
    assert len(set(fields)) == len(fields)


def test_token_bytes_are_fixed_width_little_endian():
    assert le_bytes(tokens_to_array([0x01020304, 1])) == b"\x04\x03\x02\x01\x01\x00\x00\x00"
    # fixed width: (1, 256) and (256, 1) and (65537,) never share bytes
    assert len({le_bytes(tokens_to_array(t)) for t in ([1, 256], [256, 1], [65537])}) == 3


@pytest.mark.parametrize("bad, where", [
    ([1, -1], "token_ids[1]"), ([2**32], "token_ids[0]"), ([0, 1.5], "token_ids[1]"),
    ([None], "token_ids[0]"), ("abc", "token_ids"), (b"\x00\x00\x00\x00", "token_ids"), (5, "token_ids"),
])
def test_bad_token_ids_are_named(bad, where):
    with pytest.raises(ValueError, match=where.replace("[", r"\[").replace("]", r"\]")):
        tokens_to_array(bad)


def test_an_unknown_hash_algo_is_named():
    with pytest.raises(ValueError, match="hash_algo"):
        BlockHasher("md5")


@pytest.mark.parametrize("seed", [-1, 2**64, 1.0, True], ids=["negative", "over-64-bit", "float", "bool"])
def test_a_bad_hash_seed_is_named(seed):
    with pytest.raises(ValueError, match="hash_seed"):
        BlockHasher("sha256", seed)


@pytest.mark.parametrize("kw, name", [
    (dict(salt=3), "salt"), (dict(adapter_id=1.5), "adapter_id"), (dict(media=[("h", -1)]), "media"),
], ids=["int-salt", "float-adapter", "negative-media-offset"])
def test_a_bad_extra_key_is_named(kw, name):
    with pytest.raises(ValueError, match=name):
        extra_keys(**kw)


def test_uint32_array_tokens_are_copied_not_shared():
    src = array(TOKEN_TYPECODE, [7, 8, 9])
    got = tokens_to_array(src)
    assert got == src and got is not src
    src[0] = 1  # the caller may reuse its buffer
    assert list(got) == [7, 8, 9]
    assert list(tokens_to_array(array("q", [1, 2]))) == [1, 2]  # another typecode is converted
    with pytest.raises(ValueError, match=r"token_ids\[0\]"):
        tokens_to_array(array("q", [-1]))
