import subprocess
import sys

import tidal.batching


def test_config_imports_without_torch_or_numpy():
    code = (
        "import sys\n"
        "from tidal.batching import BatchingConfig\n"
        "BatchingConfig(rollout_batch_size=4).resolve(dp_size=2)\n"
        "heavy = sorted(m for m in ('torch', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_public_name_resolves():
    for name in tidal.batching.__all__:
        assert getattr(tidal.batching, name) is not None
    assert sorted(dir(tidal.batching)) == sorted(tidal.batching.__all__)


def test_no_ray_sglang_or_megatron():
    code = (
        "import sys, tidal.batching as b\n"
        "[getattr(b, n) for n in b.__all__]\n"
        "bad = sorted(m for m in ('ray', 'sglang', 'megatron') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
