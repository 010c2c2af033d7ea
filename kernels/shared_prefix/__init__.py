"""Shared-prefix (cascade) decode attention: rows of a decode batch that share cached prefix
blocks read them once per step for all of them (API and design: decode.py).

  decode.py   host side: SharedPrefixConfig, shared_prefix_decode (Triton), its torch reference
  groups.py   PrefixGroups, the sharing tree as flat tensors, its padding and checks
  derive.py   derive_groups: the groups of a batch from its block tables
  triton.py   the shared, private and combine programs
  softmax.py  their online-softmax steps and log-sum-exp merge
"""

from kernels.shared_prefix.decode import SharedPrefixConfig, shared_prefix_decode, shared_prefix_decode_ref
from kernels.shared_prefix.derive import derive_groups
from kernels.shared_prefix.groups import PrefixGroups

__all__ = ["PrefixGroups", "SharedPrefixConfig", "derive_groups", "shared_prefix_decode",
           "shared_prefix_decode_ref"]
