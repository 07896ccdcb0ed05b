import numpy as np
import pytest


@pytest.fixture
def rl_lengths() -> np.ndarray:
    """An RL-shaped global batch: log-normal responses 10-8k tokens plus prompts of 50-500 tokens."""
    rng = np.random.default_rng(1234)
    responses = np.clip(rng.lognormal(np.log(600), 1.0, 2048), 10, 8192).astype(np.int64)
    return responses + rng.integers(50, 501, 2048)
