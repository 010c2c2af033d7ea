"""kernels/backend.py: one table of kernel functions per backend name, the only place a name
is resolved; the model is built from a table and never compares names."""

import dataclasses

import pytest
import torch

from kernels.backend import NAMES, KernelOps, ops_for

FUSED = ("add_rms_norm", "silu_mul", "rope_qk_")  # None: the model's own torch ops
OPTIONAL = FUSED + ("plan_step",)
# every other entry but the name and the prefix_groups flag: a function each backend must bring
REQUIRED = tuple(f.name for f in dataclasses.fields(KernelOps) if f.name not in OPTIONAL + ("name", "prefix_groups"))
# the optional entries each backend brings (test_what_each_backend_brings: the rest are None)
BRINGS = {"triton": FUSED, "torch": ("plan_step",), "reference": ()}


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_name_gives_a_table_of_its_name(name):
    ops = ops_for(name, "cpu")
    assert isinstance(ops, KernelOps) and ops.name == name


@pytest.mark.parametrize("field", REQUIRED)
@pytest.mark.parametrize("name", NAMES)
def test_every_required_entry_is_a_function(name, field):
    assert callable(getattr(ops_for(name, "cpu"), field))


@pytest.mark.parametrize("name, field", [(n, f) for n in NAMES for f in BRINGS[n]],
                         ids=[f"{n}-{f}" for n in NAMES for f in BRINGS[n]])
def test_an_optional_entry_a_backend_brings_is_a_function(name, field):
    assert callable(getattr(ops_for(name, "cpu"), field))


def test_the_optional_entries_are_the_known_ones():
    """BRINGS names only optional entries, and every backend is in it."""
    assert set(BRINGS) == set(NAMES) and all(set(fields) <= set(OPTIONAL) for fields in BRINGS.values())


@pytest.mark.parametrize("name", NAMES)
def test_prefix_groups_is_a_bool(name):
    assert isinstance(ops_for(name, "cpu").prefix_groups, bool)


@pytest.mark.parametrize("name", NAMES)
def test_a_table_is_built_once_per_name(name):
    assert ops_for(name, "cpu") is ops_for(name, "cpu")


@pytest.mark.parametrize("name", NAMES)
def test_a_table_is_frozen(name):
    ops = ops_for(name, "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ops.store_kv = None


def test_what_each_backend_brings():
    triton, cpu, ref = (ops_for(n) for n in ("triton", "torch", "reference"))
    assert all(getattr(triton, f) is not None for f in FUSED) and triton.prefix_groups
    assert all(getattr(t, f) is None for t in (cpu, ref) for f in FUSED)
    assert cpu.plan_step is not None and triton.plan_step is None and ref.plan_step is None
    assert not cpu.prefix_groups and not ref.prefix_groups


def test_auto_follows_the_device():
    assert ops_for("auto", "cpu").name == "torch"
    assert ops_for("auto", torch.device("cuda", 0)).name == "triton"


@pytest.mark.parametrize("bad", ["cuda", "Triton", "", None, 3])
def test_an_unknown_name_is_a_value_error_naming_the_argument(bad):
    with pytest.raises(ValueError, match="attention_backend"):
        ops_for(bad, "cpu")


@pytest.mark.parametrize("name", NAMES)
def test_the_model_holds_the_table_it_was_built_with(tiny_llama_dir, name):
    from radixkv.models.config import load_model_config
    from radixkv.models.loader import load_model

    cfg = load_model_config(str(tiny_llama_dir))
    ops = ops_for(name, "cpu")
    model = load_model(str(tiny_llama_dir), cfg, device="cpu", dtype=torch.float32, backend=ops)
    assert model.ops is ops
    layer = model.model.layers[0]
    assert layer.self_attn.attn.ops is ops
    assert layer.mlp._silu_mul is ops.silu_mul and layer.input_layernorm._add_norm is ops.add_rms_norm
    assert layer.self_attn.fused_rope == (ops.rope_qk_ is not None)
    by_name = load_model(str(tiny_llama_dir), cfg, device="cpu", dtype=torch.float32, backend=name)
    assert by_name.ops is ops  # a name is looked up in the same tables
