"""Block keys: chained, canonical bytes, the same in every process.

key(block i) = H(key(block i-1) || token ids of block i || extra keys of block i)

- Token ids are fixed-width unsigned 32-bit little-endian integers (never pickle, never
  repr), so a key depends on the token values only.
- The chain starts from a root key derived from the algorithm name and `seed`: the same
  tokens, salt and seed give the same key in every process and on every machine, so keys
  can be exported to routers and offload tiers; a different seed gives disjoint keys.
- Extra keys are tagged, length-prefixed fields. The first block of a sequence carries the
  tenant salt and the adapter (LoRA) id; any block can carry media hashes (each with the
  offset of its first placeholder token inside the block). Tags and lengths make the
  encoding injective: two different field sets never produce the same bytes.
- sha256 is the default. xxh3-128 is ~5x cheaper but not collision resistant against an
  adversary who picks prompts; the radix tree never trusts a key for a match (it compares
  tokens), so a collision can only confuse consumers of exported keys.
"""

import hashlib
import struct
import sys
from array import array

HASH_ALGOS = ("sha256", "xxh3_128")
TOKEN_TYPECODE = next(c for c in "IL" if array(c).itemsize == 4)
TOKEN_BYTES = 4
_BIG_ENDIAN = sys.byteorder == "big"
_U32 = struct.Struct("<I")


def tokens_to_array(token_ids, name: str = "token_ids") -> array:
    """Validated copy of `token_ids` as uint32 array; ValueError naming `name` otherwise."""
    if type(token_ids) is list:  # fromlist reads the list directly: ~30% cheaper than array(code, list)
        tokens = array(TOKEN_TYPECODE)
        try:
            tokens.fromlist(token_ids)
            return tokens
        except (TypeError, OverflowError, ValueError):
            pass
    elif isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    else:
        try:
            return array(TOKEN_TYPECODE, token_ids)
        except (TypeError, OverflowError, ValueError):
            pass
    # Slow path, only to say which element is wrong.
    try:
        items = list(token_ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}") from None
    for i, t in enumerate(items):
        if not hasattr(t, "__index__") or isinstance(t, float):
            raise ValueError(f"{name}[{i}] = {t!r} is not an int")
        if not 0 <= t.__index__() < 2**32:
            raise ValueError(f"{name}[{i}] = {t!r} is not in [0, 2**32)")
    raise ValueError(f"{name} could not be read as token ids")


def le_bytes(tokens: array) -> bytes:
    """Canonical bytes of a uint32 array: little-endian whatever the host."""
    if _BIG_ENDIAN:
        tokens = array(TOKEN_TYPECODE, tokens)
        tokens.byteswap()
    return tokens.tobytes()


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _U32.pack(len(payload)) + payload


def _text(value, name: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise ValueError(f"{name} must be str or bytes, got {type(value).__name__}")


def normalize_salt(salt) -> bytes | None:
    """None stays None (no tenant); str is encoded as UTF-8, so "a" and b"a" are one tenant."""
    return None if salt is None else _text(salt, "salt")


def adapter_bytes(adapter_id) -> bytes | None:
    if adapter_id is None:
        return None
    if isinstance(adapter_id, bool) or not isinstance(adapter_id, (int, str)):
        raise ValueError(f"adapter_id must be None, an int or a str, got {type(adapter_id).__name__}")
    if isinstance(adapter_id, str):
        return b"t" + adapter_id.encode("utf-8")
    if not -(2**63) <= adapter_id < 2**63:
        raise ValueError(f"adapter_id {adapter_id} does not fit in 64 bits")
    return b"i" + adapter_id.to_bytes(8, "little", signed=True)


def extra_keys(*, salt=None, adapter_id=None, media=()) -> bytes:
    """Canonical extra-key bytes of one block. `media`: (hash, offset in block) pairs."""
    out = b""
    salt_b = normalize_salt(salt)
    if salt_b is not None:
        out += _field(b"S", salt_b)
    adapter = adapter_bytes(adapter_id)
    if adapter is not None:
        out += _field(b"A", adapter)
    for i, entry in enumerate(media):
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"media[{i}] must be a (hash, offset) pair")
        mm_hash, offset = entry
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**32:
            raise ValueError(f"media[{i}] offset {offset!r} is not a non-negative int")
        out += _field(b"M", _U32.pack(offset) + _text(mm_hash, f"media[{i}] hash"))
    return out


def _sha256(data: bytes, _new=hashlib.sha256) -> bytes:
    return _new(data).digest()


class BlockHasher:
    """Computes chained block keys for one (algorithm, seed)."""

    def __init__(self, algo: str = "sha256", seed: int = 0):
        if algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {algo!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"hash_seed must be an int in [0, 2**64), got {seed!r}")
        if algo == "sha256":
            self.digest = _sha256
        else:
            import xxhash  # a base dependency; imported here so sha256 users never load it

            self.digest = xxhash.xxh3_128_digest
        self.algo, self.seed = algo, seed
        self.key_size = len(self.digest(b""))
        self.root_key = self.digest(b"radixkv block key v1\x00" + algo.encode() + seed.to_bytes(8, "little"))

    def key(self, parent_key: bytes, token_bytes: bytes, extra: bytes = b"") -> bytes:
        return self.digest(parent_key + token_bytes + extra)

    def chain(self, parent_key: bytes, data: bytes, block_bytes: int, first_extra: bytes = b"") -> list[bytes]:
        """Keys of the consecutive blocks in `data`, chained from `parent_key`; the first
        block also takes `first_extra`. The commit hot path: one tight loop per algorithm."""
        keys = []
        append = keys.append
        n = len(data) // block_bytes
        if n == 0:
            return keys
        key = self.digest(parent_key + data[:block_bytes] + first_extra)
        append(key)
        if self.algo == "sha256":
            new = hashlib.sha256
            for off in range(block_bytes, n * block_bytes, block_bytes):
                key = new(key + data[off : off + block_bytes]).digest()
                append(key)
        else:
            digest = self.digest
            for off in range(block_bytes, n * block_bytes, block_bytes):
                key = digest(key + data[off : off + block_bytes])
                append(key)
        return keys


def prompt_block_keys(token_ids, block_size: int = 16, *, salt=None, adapter_id=None,
                      hash_algo: str = "sha256", hash_seed: int = 0) -> list[bytes]:
    """Keys of every full block of `token_ids`, exactly as a manager with the same settings
    computes them at commit; for routers that map prompts to cached blocks."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    hasher = BlockHasher(hash_algo, hash_seed)
    data = le_bytes(tokens_to_array(token_ids))
    extra = extra_keys(salt=salt, adapter_id=adapter_id)
    size = block_size * TOKEN_BYTES
    keys, parent = [], hasher.root_key
    for i in range(len(data) // size):  # the plain definition, on purpose not chain()
        parent = hasher.key(parent, data[i * size : (i + 1) * size], extra if i == 0 else b"")
        keys.append(parent)
    return keys
