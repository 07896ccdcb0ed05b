import torch
from tidal.actor.transfer import to_device, to_host_async


def test_to_device_converts_on_the_host_and_keeps_values():
    """On CPU the helper is ``.to``; the dtype conversion happens before the copy (the device gets final bytes)."""
    x = torch.tensor([0, 5, 300, 2**31 - 1], dtype=torch.int64)
    y = to_device(x, torch.device("cpu"), torch.int32)
    assert y.dtype == torch.int32 and y.tolist() == x.tolist()
    z = torch.randn(7)
    assert to_device(z, torch.device("cpu")) is z  # nothing to do: no copy
    assert torch.equal(to_host_async(z), z)
