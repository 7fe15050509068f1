"""The megatron-core CPU shim that answers its CUDA tensor-type checks and moves to the GPU
(workloads/adapters/megatron_shims.py) is scoped: inside it a CPU tensor names its CUDA twin and stays
put when moved, conversions still convert, and `Tensor.type` and `Tensor.cuda` are themselves again
afterwards, also when the body raises."""

import pytest
import torch

from workloads.adapters.megatron_shims import cpu_tensors_as_cuda


def test_cpu_tensors_as_cuda_is_scoped_and_leaves_conversions_alone():
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda
    with cpu_tensors_as_cuda():
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(2).type(torch.float64).dtype == torch.float64   # a conversion, not a name
        t = torch.zeros(2)
        assert t.cuda() is t
    assert torch.Tensor.type is real_type and torch.zeros(2).type() == "torch.FloatTensor"
    assert torch.Tensor.cuda is real_cuda
    with pytest.raises(RuntimeError, match="inside"), cpu_tensors_as_cuda():
        raise RuntimeError("inside")
    assert torch.Tensor.type is real_type and torch.Tensor.cuda is real_cuda
