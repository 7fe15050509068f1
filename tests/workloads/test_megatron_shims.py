"""The megatron-core CPU shim that answers its CUDA tensor-type checks (workloads/adapters/megatron_shims.py)
is scoped: inside it a CPU tensor names its CUDA twin, conversions still convert, and `Tensor.type` is
itself again afterwards, also when the body raises."""

import pytest
import torch

from workloads.adapters.megatron_shims import cuda_tensor_types


def test_cuda_tensor_types_is_scoped_and_leaves_conversions_alone():
    real = torch.Tensor.type
    with cuda_tensor_types():
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(2).type(torch.float64).dtype == torch.float64   # a conversion, not a name
    assert torch.Tensor.type is real and torch.zeros(2).type() == "torch.FloatTensor"
    with pytest.raises(RuntimeError, match="inside"), cuda_tensor_types():
        raise RuntimeError("inside")
    assert torch.Tensor.type is real
