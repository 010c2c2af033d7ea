"""kernels/backend.py: one table of kernel functions per backend name, the only place a name
is resolved; the model is built from a table and never compares names."""

import dataclasses

import pytest
import torch

from kernels.backend import NAMES, KernelOps, ops_for

FUSED = ("add_rms_norm", "silu_mul", "rope_qk_")  # None: the model's own torch ops
OPTIONAL = FUSED + ("plan_step",)


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_name_gives_a_complete_table(name):
    ops = ops_for(name, "cpu")
    assert isinstance(ops, KernelOps) and ops.name == name
    for f in dataclasses.fields(KernelOps):
        value = getattr(ops, f.name)
        if f.name == "name":
            continue
        if f.name == "prefix_groups":
            assert isinstance(value, bool)
        elif f.name in OPTIONAL:
            assert value is None or callable(value), f.name
        else:
            assert callable(value), f.name
    assert ops_for(name, "cpu") is ops  # built once per name
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
