"""One test per patch: the function the patch replaced still fails (or misbehaves) here, and the patch works.

When an upgrade fixes the upstream code, the "original fails" half of a test fails and says the patch can go.
"""

import os
import subprocess
import sys
from importlib.machinery import PathFinder

import pytest
import torch
from tidal.actor import compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches apply only without CUDA")
CUDA_ERRORS = (RuntimeError, AssertionError, AttributeError)


def _skip_unless_installed(name: str) -> None:
    """Skip where ``name`` is not installed (sglang brings it; tidal-actor alone lacks it): nothing to guard there.

    Looked up on sys.path, not in sys.modules, where tidal.actor's __init__ has put None in its place.
    """
    if PathFinder.find_spec(name) is None:
        pytest.skip(f"{name} is not installed (it comes with sglang): the patch has nothing to guard here")


@pytest.fixture(scope="module", autouse=True)
def patched():
    assert compat.apply_cpu_compat() is True


def test_apply_is_idempotent():
    before = (torch.cuda.current_device, dict(compat.ORIGINALS))
    assert compat.apply_cpu_compat() is True
    assert (torch.cuda.current_device, compat.ORIGINALS) == before
    assert len(compat.ORIGINALS) == 12  # patch 8 wraps two P2PCommunicator methods


def test_patch1_flash_mla_import_raises_oserror_unguarded():
    _skip_unless_installed("flash_mla")
    # Fresh interpreter, no guard: the installed flash_mla raises OSError, which `except ImportError` misses.
    code = "try:\n import flash_mla\nexcept ImportError:\n print('IMPORTERROR')\nexcept OSError:\n print('OSERROR')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "OSERROR"
    assert sys.modules["flash_mla"] is None  # installed by tidal.actor's __init__
    with pytest.raises(ImportError):
        import flash_mla  # noqa: F401


def test_patch2_rng_state_functions():
    rng = "megatron.core.tensor_parallel.random"
    with pytest.raises(CUDA_ERRORS):
        compat.ORIGINALS[f"{rng}._get_cuda_rng_state"]()
    with pytest.raises(CUDA_ERRORS):
        compat.ORIGINALS["torch.cuda.get_rng_state"]()
    # The original manual_seed is queued lazily and never runs: seeding 1 then 2 leaves the generator alone.
    torch.manual_seed(7)
    state = torch.get_rng_state()
    compat.ORIGINALS["torch.cuda.manual_seed"](1)
    assert torch.equal(torch.get_rng_state(), state)
    torch.cuda.manual_seed(1)
    assert not torch.equal(torch.get_rng_state(), state)


def test_patch2_tracker_states_differ_and_fork_restores():
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.CudaRNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    states = tracker.get_states()
    assert not torch.equal(states["a"], states["b"])
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("a"):
        in_fork = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)  # default stream untouched by the fork
    torch.manual_seed(1)
    assert torch.equal(in_fork, torch.rand(3))  # the fork drew from the stream seeded with 1


def test_patch3_current_device():
    with pytest.raises(CUDA_ERRORS):
        compat.ORIGINALS["torch.cuda.current_device"]()
    assert torch.cuda.current_device() == "cpu"


@pytest.mark.parametrize("module", ["megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax"])
def test_patch4_default_causal_mask(module):
    with pytest.raises(CUDA_ERRORS):
        compat.ORIGINALS[f"{module}.get_default_causal_mask"](4)
    mask = sys.modules[module].get_default_causal_mask(4)
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))


def test_patch5_packed_rope_matches_the_per_sequence_loop(dist_env):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    original = compat.ORIGINALS["megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd"]
    assert rope_utils._apply_rotary_pos_emb_thd is compat._packed_rope_thd
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 5, 17, 18, 40], dtype=torch.int32)  # an empty and a one-token sequence
    t = torch.randn(40, 3, 8)
    freqs = torch.randn(23, 1, 1, 8)  # max_seqlen 22 < 23 rows
    cp = parallel_state.get_context_parallel_group()
    kwargs = {"rotary_interleaved": False, "mla_rotary_interleaved": False, "mscale": 1.0, "cp_group": cp}
    torch.testing.assert_close(compat._packed_rope_thd(t, cu, freqs, **kwargs), original(t, cu, freqs, **kwargs))


def test_patch6_megatron_imports_flashinfer_unless_tidal_hides_it():
    _skip_unless_installed("flashinfer")
    # Fresh interpreter, no guard: megatron-core imports flashinfer (seconds) although tidal-actor uses none of it.
    code = "import sys, megatron.core.tensor_parallel\nprint(sys.modules.get('flashinfer') is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout
    assert out.strip().splitlines()[-1] == "True"
    if not os.path.exists("/proc/driver/nvidia") and not os.path.exists("/dev/nvidia0"):
        assert sys.modules["flashinfer"] is None  # installed by tidal.actor's __init__
        from megatron.core.inference.quantization import mxfp8_tensor

        assert mxfp8_tensor.HAVE_FLASHINFER is False  # megatron's own guard took the ImportError


def _tiny_config(**kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True, **kwargs)


def test_patch7_pipeline_schedule_allocates_on_cuda(dist_env):
    from megatron.core.pipeline_parallel import schedules

    original = compat.ORIGINALS[
        "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
    ]
    assert schedules.forward_backward_pipelining_without_interleaving is not original

    class OneStage(torch.nn.Linear):
        config = _tiny_config()

        def set_input_tensor(self, _tensor):  # a single stage receives nothing
            pass

    model = OneStage(2, 2)

    def forward_step(data_iterator, module):
        x = next(data_iterator)
        return module(x), lambda out: (out.sum(), torch.tensor(1, dtype=torch.int), out.detach())

    kwargs = dict(forward_step_func=forward_step, model=model, num_microbatches=1, seq_length=1, micro_batch_size=1)
    with pytest.raises(CUDA_ERRORS):  # `torch.zeros(..., device="cuda")` before the first micro-batch
        original(data_iterator=iter([torch.ones(1, 2)]), forward_only=True, **kwargs)
    out = schedules.forward_backward_pipelining_without_interleaving(
        data_iterator=iter([torch.ones(1, 2)]), forward_only=False, **kwargs
    )
    torch.testing.assert_close(out[0], model(torch.ones(1, 2)).detach())
    assert model.weight.grad is not None  # one stage: forward and backward ran


def test_patch8_p2p_communicator_synchronizes_cuda(dist_env, monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    comm = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=_tiny_config())
    assert comm._communicate_shapes(None, None, False, False) == ([0, 0, 0], [0, 0, 0])
    nothing = dict(tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=False, tensor_shape=None)
    assert comm._communicate(**nothing)[:2] == (None, None)
    assert torch.cuda.synchronize is not compat._cpu_synchronize  # the patch is scoped to the two methods
    with pytest.raises(CUDA_ERRORS):  # after the shape exchange, even with nothing to exchange
        compat.ORIGINALS["P2PCommunicator._communicate_shapes"](comm, None, None, False, False)
    with pytest.raises(CUDA_ERRORS):  # after batched send/receive (batch_p2p_sync, the default)
        compat.ORIGINALS["P2PCommunicator._communicate"](comm, **nothing)
    assert torch.cuda.synchronize is not compat._cpu_synchronize  # restored after the calls too


def test_patch9_megatron_refuses_wgrad_fusion_without_apex_and_the_shim_accumulates(dist_env):
    from megatron.core.tensor_parallel import ColumnParallelLinear, layers

    compat.apply_wgrad_accumulation_fusion()
    assert compat.ORIGINALS["megatron.core.tensor_parallel.layers._grad_accum_fusion_available"]() is False
    config = _tiny_config()
    config.gradient_accumulation_fusion = True
    layers._grad_accum_fusion_available = False  # what megatron finds without APEX
    try:
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            ColumnParallelLinear(4, 6, config=config, init_method=torch.nn.init.normal_, bias=False)
    finally:
        layers._grad_accum_fusion_available = True
    linear = ColumnParallelLinear(4, 6, config=config, init_method=torch.nn.init.normal_, bias=False)
    main_grad = torch.full((6, 4), 0.5)
    linear.weight.main_grad = main_grad
    x = torch.randn(3, 2, 4, requires_grad=True)
    g = torch.randn(3, 2, 6)
    out, _ = linear(x)
    out.backward(g)
    assert linear.weight.grad is None  # no separate weight gradient: it went into main_grad
    expected = 0.5 + g.reshape(-1, 6).t() @ x.detach().reshape(-1, 4)
    torch.testing.assert_close(main_grad, expected)
    assert x.grad is not None


def test_patch9_shim_adds_half_precision_gradients_into_fp32():
    x, g = torch.randn(5, 3, dtype=torch.bfloat16), torch.randn(5, 2, dtype=torch.bfloat16)
    main_grad = torch.ones(2, 3)
    compat.WgradAccum.wgrad_gemm_accum_fp32(x, g, main_grad)
    torch.testing.assert_close(main_grad, 1 + g.float().t() @ x.float())


def test_patch9_main_params_take_fused_weight_gradients(dist_env):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from tidal.actor.main_params import MainParams

    compat.apply_wgrad_accumulation_fusion()
    config = _tiny_config(params_dtype=torch.bfloat16, gradient_accumulation_fusion=True)
    linear = ColumnParallelLinear(4, 6, config=config, init_method=torch.nn.init.normal_, bias=True)
    linear = linear.to(torch.bfloat16)
    main = MainParams(list(linear.parameters()))
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    for _ in range(2):  # two micro-batches accumulate
        out, _ = linear(x)
        out.float().sum().backward()
    weight_grad, bias_grad = main.main[0].grad, main.main[1].grad
    torch.testing.assert_close(weight_grad, 2 * torch.ones(5, 6).t() @ x.float())
    torch.testing.assert_close(bias_grad, torch.full((6,), 10.0))  # the bias takes the hook's path
    assert all(p.grad is None for p in linear.parameters())


def test_patch10_moe_alltoall_dispatcher_needs_cuda_streams():
    from types import SimpleNamespace

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    with pytest.raises(CUDA_ERRORS):  # the constructor's side stream
        torch.cuda.Stream()
    state = dict(drop_and_pad=False, cuda_dtoh_point="before_permutation_1", cuda_sync_point="before_finish")
    state |= dict(input_splits=torch.tensor([3, 1]), output_splits=torch.tensor([2, 2]), output_splits_tp=None)
    state |= dict(num_out_tokens=torch.tensor(4), num_local_experts=1, cuda_dtoh_stream="host")
    with pytest.raises(CUDA_ERRORS):
        compat.ORIGINALS["MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"](
            SimpleNamespace(**state), "before_permutation_1", torch.tensor([4])
        )
    host = SimpleNamespace(**state)
    tokens = MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize(host, "before_permutation_1", torch.tensor([4]))
    assert tokens.tolist() == [4] and host.input_splits.tolist() == [3, 1] and host.output_splits_tp is None
    assert not torch.is_tensor(host.input_splits)  # numpy, as the CUDA path leaves the split sizes
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream == "host"
