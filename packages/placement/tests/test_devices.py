import pytest
from tidal.placement import PlacementConfig, ResourceShortageError, detect_gpus, devices, plan_local_gpus


def test_cpu_mode_declares_what_the_job_needs_and_says_so():
    local = plan_local_gpus(PlacementConfig(actor_num_gpus_per_node=2, rollout_num_gpus=1), detected=0)
    assert local.logical and local.num_gpus == 3  # decoupled (slime's default): 2 + 1
    assert "logical" in local.describe() and "CPU mode" in local.describe()
    assert plan_local_gpus(PlacementConfig(num_gpus_local=4), detected=0).num_gpus == 4


def test_real_gpus_are_declared_as_they_are_whatever_the_job_asks():
    local = plan_local_gpus(PlacementConfig(), detected=8)
    assert not local.logical and local.num_gpus == 8
    assert plan_local_gpus(PlacementConfig(num_gpus_local=4), detected=8).num_gpus == 4  # part of the machine
    with pytest.raises(ValueError, match="--num-gpus-local 9 exceeds the 8 CUDA GPU"):
        plan_local_gpus(PlacementConfig(num_gpus_local=9), detected=8)


def test_shortage_on_a_gpu_machine_is_one_line_with_needed_available_and_fix():
    cfg = PlacementConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4)
    with pytest.raises(ResourceShortageError) as info:
        plan_local_gpus(cfg, detected=4)
    message = str(info.value)
    assert "\n" not in message
    assert "needs 8 GPUs (decoupled, --no-colocate" in message and "available: 4 CUDA GPU(s)" in message
    assert "--colocate (rollout shares the actor's 4)" in message
    plan_local_gpus(PlacementConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4, colocate=True), detected=4)


def test_cpu_mode_is_bounded_by_the_local_rays_cpus():
    with pytest.raises(ResourceShortageError, match=r"needs 72 GPUs.*available: none.*at most 20 GPU bundles"):
        plan_local_gpus(PlacementConfig(actor_num_gpus_per_node=64, rollout_num_gpus=8), detected=0)


def test_detection_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(devices, "_installed_gpus", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert detect_gpus() == 8
    for visible, count in (("0,1", 2), ("", 0), ("-1", 0), ("0,1,2,3,4,5,6,7,8,9", 8)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert detect_gpus() == count, visible


def test_detection_without_nvidia_smi_or_driver_is_zero(monkeypatch, tmp_path):
    monkeypatch.setattr(devices.shutil, "which", lambda name: None)
    monkeypatch.setattr(devices, "Path", lambda _: tmp_path / "no-driver")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert detect_gpus() == 0


SMI_MEMORY = """
==============NVSMI LOG==============

Attached GPUs                             : 2
GPU 00000000:19:00.0
    FB Memory Usage
        Total                             : 143771 MiB
        Reserved                          : 551 MiB
        Used                              : 0 MiB
        Free                              : 143219 MiB
    BAR1 Memory Usage
        Total                             : 262144 MiB
        Used                              : 1 MiB
GPU 00000000:2D:00.0
    FB Memory Usage
        Total                             : 81559 MiB
        Used                              : 0 MiB
    BAR1 Memory Usage
        Total                             : 131072 MiB
"""


def test_gpu_memory_is_the_smallest_framebuffer_total():
    assert devices.parse_gpu_memory(SMI_MEMORY) == 81559 * 2**20  # not BAR1's, and the smaller card decides
    assert devices.parse_gpu_memory("No devices were found") is None


def test_gpu_memory_without_nvidia_smi_is_unknown(monkeypatch):
    monkeypatch.setattr(devices.shutil, "which", lambda _: None)
    assert devices.gpu_memory_bytes() is None
