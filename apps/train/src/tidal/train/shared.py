"""Values that more than one package needs: each is one option of one package, copied to the others by one table.

A user sets ``--n-samples-per-prompt`` once, on the rollout section that owns it; :func:`propagate_shared` copies
it into the batching section's field before either config is built. A target field is no command-line option
(``metadata={"flag": None}``), so nobody can set it twice with two values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tidal.train.flags import section_defaults

Field = tuple[str, str]
"""``(section, field name)`` of a JobConfig field."""

SHARED: dict[Field, tuple[Field, ...]] = {
    ("train", "hf_checkpoint"): (("actor", "hf_checkpoint"), ("ckpt", "hf_checkpoint")),
    ("rollout", "n_samples_per_prompt"): (("batching", "n_samples_per_prompt"),),
    ("rollout", "rollout_temperature"): (("actor", "temperature"),),
    ("rollout", "rollout_max_response_len"): (("actor", "max_response_len"),),
    ("parallel", "context_parallel_size"): (("batching", "context_parallel_size"),),
    ("train", "seed"): (("actor", "seed"),),
    ("actor", "use_rollout_routing_replay"): (("rollout", "return_routed_experts"),),
}
"""Each shared option (the owner's field) -> the fields of the other sections that receive its value."""

CONVERT: dict[Field, Callable[[Any], Any]] = {
    # Greedy sampling (temperature 0): the actor's log-probs are of the untempered distribution.
    ("actor", "temperature"): lambda t: t or 1.0,
}
"""How a target turns the owner's value into its own, where it differs."""


def propagate_shared(sections: dict[str, dict[str, Any]], resolved: Mapping[Field, Any] | None = None) -> None:
    """Copy every shared option's value from its owner's section into each target's (in place).

    ``sections`` maps section -> the keyword arguments its config will be built from; an owner's value is the one
    given, else its field's default. ``resolved`` replaces an owner's value where the app resolves it first
    (``hf_checkpoint`` None -> the embedded model's folder). A required option left unset is not copied: its
    owner's config reports it.
    """
    resolved = resolved or {}
    for (section, name), targets in SHARED.items():
        if (section, name) in resolved:
            value = resolved[section, name]
        elif name in sections[section]:
            value = sections[section][name]
        elif name in (defaults := section_defaults(section)):
            value = defaults[name]
        else:
            continue
        for target in targets:
            sections[target[0]][target[1]] = CONVERT.get(target, lambda v: v)(value)
