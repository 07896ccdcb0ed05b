"""CPUOffloadAdamW: torch.optim.AdamW's update with the moments on the host, streamed in slices."""

import pytest
import torch
from tidal.actor.offload import CPUOffloadAdamW

HYPER = {"lr": 1e-2, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.1}


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(opt_cls, params, steps=3, **kw):
    opt = opt_cls(params, **HYPER, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if step == 1:
            params[3].grad = None  # a parameter without a gradient this step is left alone
        for group in opt.param_groups:
            group["lr"] = HYPER["lr"] * (step + 1)  # a schedule changes lr between steps
        opt.step()
    return opt


@pytest.mark.parametrize("staging_bytes", [4 * 6, 4 * 1000])  # slices that split parameters, or one slice
def test_equals_torch_adamw(staging_bytes):
    ref, off = _params(0), _params(0)
    ref_opt = _run(torch.optim.AdamW, ref, foreach=False)
    off_opt = _run(CPUOffloadAdamW, off, staging_bytes=staging_bytes)
    for a, b in zip(ref, off, strict=True):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
        sa, sb = ref_opt.state[a], off_opt.state[b]
        assert float(sb["step"]) == float(sa["step"])
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_state_dict_round_trip_continues_identically():
    a, b = _params(0), _params(0)
    opt_a = _run(CPUOffloadAdamW, a, steps=2)
    opt_b = CPUOffloadAdamW(b, **HYPER)
    with torch.no_grad():
        for pa, pb in zip(a, b, strict=True):
            pb.copy_(pa)
    opt_b.load_state_dict(opt_a.state_dict())
    assert all(st["exp_avg"].device.type == "cpu" for st in opt_b.state.values())
    for opt, params in ((opt_a, a), (opt_b, b)):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pb.detach(), pa.detach(), rtol=0, atol=0)


def test_refuses_a_state_dict_of_another_model():
    opt = CPUOffloadAdamW(_params(0), **HYPER)
    other = CPUOffloadAdamW(_params(0)[:2], **HYPER)
    with pytest.raises(ValueError, match="different number"):
        opt.load_state_dict(other.state_dict())


SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3, 4], [120, 0, 33, 33, 8, 90]]


def _actor_cfg(qwen2_dir, **kw):
    from tidal.actor import ActorConfig

    mixed = {"params_dtype": "bfloat16", "fp32_main_params": True}
    return ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, weight_decay=0.1, **mixed, **kw)


def _assert_same_mains(a, b):
    for x, y in zip(a.main_params.main, b.main_params.main, strict=True):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-7)


def test_actor_with_offloaded_optimizer_trains_like_on_device_adam(dist_env, qwen2_dir, tmp_path, rl_batch):
    """--optimizer-cpu-offload keeps Adam's state on the CPU and trains as on-device Adam does."""
    from tidal.actor import Actor
    from tidal.ckpt import load_checkpoint, save_checkpoint

    off, ref = Actor(_actor_cfg(qwen2_dir, optimizer_cpu_offload=True)), Actor(_actor_cfg(qwen2_dir))
    assert isinstance(off.optimizer, CPUOffloadAdamW)
    for _ in range(2):
        m_off, m_ref = off.train_step([rl_batch(off, SEQS)]), ref.train_step([rl_batch(ref, SEQS)])
        assert m_off["train/grad_norm"] == pytest.approx(m_ref["train/grad_norm"], rel=1e-5)
    _assert_same_mains(off, ref)
    assert all(st["exp_avg"].device.type == "cpu" for st in off.optimizer.state.values())

    save_checkpoint(tmp_path / "ckpt", 2, off.sharded_state_dict())
    # its checkpoint resumes an on-device optimizer (same sharded layout) and an offloaded one alike
    resumed = [Actor(_actor_cfg(qwen2_dir)), Actor(_actor_cfg(qwen2_dir, optimizer_cpu_offload=True))]
    for actor in resumed:
        state, _ = load_checkpoint(tmp_path / "ckpt", actor.sharded_state_dict())
        actor.load_state_dict(state)
        assert actor.num_steps == 2
    for actor in (off, *resumed):
        actor.train_step([rl_batch(actor, SEQS)])
    for actor in resumed:
        _assert_same_mains(off, actor)


def test_a_pinned_reservation_counts_its_bytes_and_never_raises():
    from tidal.actor.offload import PinnedReservation

    shapes = [(torch.Size([2, 3]), torch.float32), (torch.Size([4]), torch.bfloat16)]
    reservation = PinnedReservation(shapes)
    reservation.wait()  # on CPU pinning fails inside the thread: logged, and the offload pins (or not) itself
    assert reservation.bytes == 2 * 3 * 4 + 4 * 2
    assert reservation.seconds is not None and reservation.error is None
