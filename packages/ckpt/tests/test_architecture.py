"""A checkpoint of another architecture: the error names the layer counts first, not an ``_extra_state`` key.

Uses megatron-core's real GPTModel (local layer spec, CPU initialization) and a torch AdamW sharded the way
megatron shards a torch optimizer, so the keys are exactly those a tidal actor saves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tidal.ckpt import CheckpointMismatchError, load_checkpoint, save_checkpoint

README = Path(__file__).parents[1] / "README.md"


def _gpt_state(num_layers: int) -> dict:
    # sglang's flash_mla wheel raises OSError (not ImportError) on import without libcuda, which megatron's
    # attention module does not catch; absent here when tidal-ckpt is installed alone.
    sys.modules.setdefault("flash_mla", None)
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=16
    )
    optimizer = torch.optim.AdamW(model.parameters())
    for param in model.parameters():  # optimizer state to save/load, without a forward pass
        param.grad = torch.zeros_like(param)
    optimizer.step()
    model_sd = model.sharded_state_dict()
    optim_sd = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, iter(model.parameters()))
    optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
    return {"model": model_sd, "optimizer": optim_sd}


def test_layer_count_mismatch_names_the_layers_first(ranks, tmp_path):
    def body(rank, world, load_dir):
        save_checkpoint(load_dir, 1, _gpt_state(4))
        loaded, _ = load_checkpoint(load_dir, _gpt_state(4))  # the same architecture loads
        try:
            load_checkpoint(load_dir, _gpt_state(2))
        except CheckpointMismatchError as e:
            return sorted(loaded), str(e)
        return sorted(loaded), None

    sections, message = ranks(1, body, tmp_path / "ckpt")[0]
    assert sections == ["model", "optimizer"]
    assert message is not None, "a 4-layer checkpoint loaded into a 2-layer model"
    lines = message.splitlines()
    assert lines[1] == (
        f"  - the checkpoint has 4 layers (decoder.layers.0-3), the model has 2 (decoder.layers.0-1): --load "
        f"{tmp_path / 'ckpt'} was saved from a different model; point --hf-checkpoint at the model it was saved from "
        f"(num_hidden_layers 4 in its config.json), or point --load at "
        f"a checkpoint of this model (40 checkpoint entries differ only in the layer count)"
    ), message
    assert len(lines) == 3 and lines[2].startswith("Nothing was loaded."), message  # nothing else to say
    assert "_extra_state" not in message and "--no-load-rng" not in message
    assert message.replace(str(tmp_path / "ckpt"), "DIR") in README.read_text(), "README lists a stale message"
