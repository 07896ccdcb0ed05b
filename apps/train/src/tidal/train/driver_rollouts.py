"""Rollouts the driver generates itself over HTTP: partial rollout, DAPO over-sampling, or a router in front.

The plain path (one batched request per engine, inside each engine's Ray actor) is the rollout manager's own;
these strategies need to see every group as it finishes, so the driver talks to the router or the engine
directly through tidal.rollout. Engines are reached through the rollout manager (``driver_target``,
``restart_dead_engines``), never through Ray here.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class DriverRollouts:
    """Per-rollout generation through ``tidal.rollout.generate_partial_rollout`` (carry-over kept between calls).

    Dynamic sampling runs up to ``--dynamic-sampling-max-rounds`` rounds of ``--over-sampling-batch-size`` prompts
    (the first the rollout's own batch, the next from ``PromptDataset.more_batch``) and stops the run with one line
    when the batch is still short; a custom generate function makes every sample here, through the router or the
    one engine.
    """

    def __init__(
        self, rollout, engines, train_data, reward_fn, *, rollout_batch_size: int, fault_tolerant: bool, tokenizer
    ) -> None:
        """Load the group filter, if any; nothing starts here.

        ``rollout`` is the RolloutConfig; ``engines`` is the rollout manager: its ``engines`` and ``router`` decide
        the path, its ``driver_target()`` and ``restart_dead_engines()`` reach them. ``fault_tolerant``: a dead
        engine is restarted and its requests resent (--use-fault-tolerance) rather than stopping the run.
        """
        self.cfg, self.engines, self.data, self.reward_fn = rollout, engines, train_data, reward_fn
        self.rollout_batch_size, self.fault_tolerant, self.tokenizer = rollout_batch_size, fault_tolerant, tokenizer
        self.carry: list = []
        self.group_filter = None
        if rollout.dynamic_sampling_filter_path is not None:
            from tidal.rollout import resolve_group_filter

            self.group_filter = resolve_group_filter(rollout.dynamic_sampling_filter_path)
        self.generate_fn = None
        if rollout.custom_generate_function_path:  # runs here, in the driver, on the router or the one engine
            from tidal.rollout import load_generate_fn

            self.generate_fn = load_generate_fn(rollout.custom_generate_function_path)
        self.agent_fn = None
        self.agents = None  # the gateway and its episode runner, started on the first agent rollout
        self.agent_pool = None  # --partial-rollout: the groups that run on between rollouts (AgentGroupPool)
        self.agent_hold = None  # and the hold of their engine calls while the engines give their memory away
        self.agent_restored: list | None = None  # a checkpoint's groups, handed to the pool when it starts
        self.eval_agents = None  # evaluation's own, sampling at --eval-temperature, started on the first evaluation
        if rollout.agent_function_path:  # agents talk to a gateway in this process, over every engine
            from tidal.rollout import load_agent_fn

            self.agent_fn = load_agent_fn(rollout.agent_function_path)

    @property
    def driver_side(self) -> bool:
        """Whether rollouts take this path: engines run, and partial rollout, dynamic sampling or a router is on."""
        rollout = self.cfg
        wanted = rollout.partial_rollout or rollout.dynamic_sampling_filter_path is not None
        wanted = wanted or self.agent_fn is not None
        return bool(self.engines.engines) and (wanted or self.engines.router is not None)

    def carry_state(self) -> list | None:
        """Partial rollout's carried groups as plain data for the checkpoint (None when nothing is carried).

        Plain generation: each unfinished group's samples. Agents: each group's record (``AgentGroup.record``):
        a finished group with its episodes, a running one with its row only (it runs again after ``--load``).
        """
        if self.agent_fn is not None:
            if self.agent_pool is not None:
                return self.agent_pool.state() or None
            return self.agent_restored or None  # restored and no rollout since
        if not self.carry:
            return None
        from tidal.rollout import sample_records

        return [sample_records(group) for group in self.carry]

    def restore_carry(self, state: list | None) -> None:
        """Resume with the groups ``carry_state`` saved: the next rollout takes them first, as without a stop."""
        if not state:
            return
        agent_groups = isinstance(state[0], dict)
        if not self.cfg.partial_rollout or agent_groups != (self.agent_fn is not None):
            what = "agent" if agent_groups else "unfinished partial-rollout"
            why = "--partial-rollout is off" if not self.cfg.partial_rollout else "this run's generation differs"
            logger.warning("the checkpoint carries %d %s group(s) but %s: dropped", len(state), what, why)
            return
        if agent_groups:
            self.agent_restored = list(state)
            running = sum("episodes" not in g for g in state)
            logger.info("resumed %d carried agent group(s) from the checkpoint: %d finished, %d to run again from "
                        "their rows", len(state), len(state) - running, running)  # fmt: skip
            return
        from tidal.rollout import samples_from_records

        self.carry = [samples_from_records(group) for group in state]
        logger.info("resumed %d unfinished partial-rollout group(s) from the checkpoint", len(self.carry))

    def generate(self, rollout_id: int) -> tuple[list, dict[str, Any]]:
        """Scored samples of ``rollout_batch_size`` finished groups, and the strategy's metrics."""
        from tidal.rollout import RolloutError, generate_partial_rollout

        if self.agent_fn is not None:
            return self._agent_rollout(rollout_id)
        rollout = self.cfg
        wanted = self.rollout_batch_size
        size = rollout.prompts_per_round(wanted)
        prompts = self.data.batch(rollout_id, size)
        max_rounds = rollout.dynamic_sampling_max_rounds

        def more_prompts(round_no: int) -> list[tuple[tuple[int, ...], object]]:  # dynamic sampling's rounds 2, 3, ...
            return [
                (p.ids, p.label, p.metadata)
                for p in self.data.more_batch(rollout_id, round_no, size, max_rounds=max_rounds)
            ]

        def attempt():
            return generate_partial_rollout(
                self.engines.driver_target(),
                [list(p.ids) for p in prompts],
                rollout.sampling_params(),
                num_groups=wanted,
                carry_over=self.carry if rollout.partial_rollout else (),
                labels=[p.label for p in prompts],
                metadata=[p.metadata for p in prompts],
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                reward_fn=self.reward_fn,
                group_filter=self.group_filter,
                mask_offpolicy=rollout.mask_offpolicy_in_partial_rollout,
                # --max-staleness: a weight update aborts the engines' requests; the cut samples go out again
                resume_interrupted=self.engines.async_plan.resume_interrupted,
                generate_fn=self.generate_fn,
                max_concurrency=rollout.generate_max_concurrency if self.generate_fn else 64,
                max_rounds=max_rounds,
                more_prompts=more_prompts,
            )

        try:
            result = attempt()
        except RolloutError as e:
            if not self.fault_tolerant:
                raise
            # The engines live in their Ray actors: restart the dead ones there, then the router (its circuit
            # breaker keeps a restarted engine marked unhealthy), and run the rollout once more from its start.
            logger.warning("rollout %d failed (%s); restarting dead engines and retrying it", rollout_id, e)
            self.engines.restart_dead_engines()
            result = attempt()
        self.carry = list(result.carry_over) if rollout.partial_rollout else []
        # Dynamic sampling raised already when its rounds came up short; every prompt batch holds enough groups.
        assert len(result.samples) == wanted * rollout.n_samples_per_prompt, (len(result.samples), wanted)
        return list(result.samples), {k: float(v) for k, v in result.metrics.items()}

    def _agent_rollout(self, rollout_id: int) -> tuple[list, dict[str, Any]]:
        """``rollout_batch_size`` groups of agent episodes, through the gateway (started on first use).

        Under --use-fault-tolerance the engines whose server died are restarted (and given the current weights)
        before each round after the first: the episodes a dead engine failed dropped their groups, which the next
        round replaces, as it replaces a group dynamic sampling drops (``rollout/agent/engines_restarted``).
        """
        from tidal.rollout import agent_rollout

        runner = self._agent_runner()
        size = self.cfg.prompts_per_round(self.rollout_batch_size)
        max_rounds = self.cfg.dynamic_sampling_max_rounds
        restarted = 0

        def rows_of_round(round_no: int) -> list[tuple[dict, object]]:
            nonlocal restarted
            if round_no == 1:
                prompts = self.data.batch(rollout_id, size)
            else:  # a failed or filtered group is replaced from dynamic sampling's second prompt order
                if self.fault_tolerant:  # an engine that died failed its episodes: bring it back first
                    restarted += self.engines.restart_dead_engines()
                prompts = self.data.more_batch(rollout_id, round_no, size, max_rounds=max_rounds)
            return [(p.row if p.row is not None else {"prompt": p.text}, p.label) for p in prompts]

        if self.cfg.partial_rollout:  # groups not taken run on, and the next rollout takes them first
            from tidal.rollout import partial_agent_rollout

            result = partial_agent_rollout(
                self._agent_pool(),
                rows_of_round,
                rollout_id=rollout_id,
                num_groups=self.rollout_batch_size,
                max_rounds=max_rounds,
                group_filter=self.group_filter,
                current_version=lambda: runner.gateway.engines[0].get_model_info().get("weight_version"),
                mask_offpolicy=self.cfg.mask_offpolicy_in_partial_rollout,
            )
        else:
            result = agent_rollout(
                runner, rows_of_round, num_groups=self.rollout_batch_size, max_rounds=max_rounds,
                group_filter=self.group_filter,
            )  # fmt: skip
        from tidal.rollout import num_episodes

        episodes = num_episodes(result.samples)  # an episode that forked gave one sample per trajectory
        assert episodes == self.rollout_batch_size * self.cfg.n_samples_per_prompt, (episodes, len(result.samples))
        if self.fault_tolerant:
            return result.samples, {**result.metrics, "rollout/agent/engines_restarted": float(restarted)}
        return result.samples, result.metrics

    def evaluate_agents(self, prompts: list, n: int, sampling_params: dict[str, Any]) -> tuple[list[list[float]], int]:
        """Rewards of ``n`` agent episodes of each held-out prompt (``[prompt][episode]``), and how many failed.

        Every call of these episodes samples at ``sampling_params``' temperature, top-p and top-k, whatever the agent
        asks (evaluation's ``--eval-temperature``, 0: greedy), and stops at its stops; a failed episode scores 0 (its
        traceback goes to ``agent_eval_failures.log``, beside the rollouts' ``agent_failures.log``).
        """
        if self.eval_agents is None:
            self.eval_agents = self._start_runner(n, sampling_params, log_name="agent_eval_failures.log")
        rows = [p.row if p.row is not None else {"prompt": p.text} for p in prompts]
        groups = self.eval_agents.run_groups(rows, [p.label for p in prompts])
        rewards = [[r.reward if r.failure is None else 0.0 for r in group] for group in groups]
        return rewards, sum(r.failure is not None for group in groups for r in group)

    def _agent_runner(self):
        if self.agents is None:
            cfg = self.cfg
            if cfg.partial_rollout:  # groups run on while the actor trains: their calls wait while engines offload
                from tidal.rollout import CallHold

                self.agent_hold = CallHold(timeout_s=cfg.rollout_request_timeout_s)
            self.agents = self._start_runner(cfg.n_samples_per_prompt, cfg.sampling_params(), hold=self.agent_hold)
        return self.agents

    def _agent_pool(self):
        """The pool of groups that outlive a rollout (started on first use, with a checkpoint's groups first)."""
        if self.agent_pool is None:
            from tidal.rollout import AgentGroupPool

            self.agent_pool = AgentGroupPool(self._agent_runner())
            self.agent_pool.restore(self.agent_restored or [])
            self.agent_restored = None
        return self.agent_pool

    def hold_agent_calls(self) -> None:
        """The engines release their memory next: carried agent groups' calls wait, those in flight finish first."""
        if self.agent_hold is not None:
            self.agent_hold.hold()

    def release_agent_calls(self) -> None:
        """The engines serve again: the agent calls held by :meth:`hold_agent_calls` go out."""
        if self.agent_hold is not None:
            self.agent_hold.release()

    def _start_runner(self, n: int, sampling: dict[str, Any], *, log_name: str = "agent_failures.log", hold=None):
        """A started gateway over every engine and an episode runner of ``n`` episodes a row on it.

        ``sampling`` (SGLang sampling parameters: the rollout's, or evaluation's) rules every call: its temperature,
        top-p and top-k whatever the agent asks (a call asking another is logged once), its stop strings and stop
        tokens beside the call's own, its ``max_new_tokens`` when the call gives no ``max_tokens``. ``hold`` (a
        ``CallHold``), when given, stops the gateway's engine calls while it is held.
        """
        from tidal.rollout import AgentRunner, Gateway

        cfg = self.cfg
        # One client per engine: the gateway pins each session to one engine (its prefix cache stays warm). The
        # manager makes them, with its key and the LoRA adapter it serves (renamed at each adapter sync).
        clients = [self.engines.engine_client(url) for url in self.engines.engine_urls]
        if hold is not None:
            clients = [hold.wrap(client) for client in clients]
        gateway = Gateway(
            clients,
            self.tokenizer,
            max_concurrent_calls=cfg.agent_max_concurrency,
            default_max_tokens=sampling["max_new_tokens"],
            sampling_override={k: sampling[k] for k in ("temperature", "top_p", "top_k")},
            extra_stop_token_ids=sampling.get("stop_token_ids", ()),
            stop=sampling.get("stop", ()),
            update_gate=self.engines.update_gate,  # --max-staleness: a cut call resumes after the update
            tool_call_parser=cfg.tool_call_parser,
        ).start()
        return AgentRunner(
            gateway,
            self.agent_fn,
            n_samples_per_prompt=n,
            max_concurrency=cfg.agent_max_concurrency,
            timeout_s=cfg.agent_timeout_s,
            failure_log=self.engines.log_dir / log_name,
        )

    def shutdown(self) -> None:
        """Stop the carried agent groups (their episodes are cancelled), then the agent gateways, if any started."""
        if self.agent_pool is not None:
            self.agent_pool.close()
            self.agent_pool = None
        if self.agent_hold is not None:
            self.agent_hold.release()
        for runner in (self.agents, self.eval_agents):
            if runner is not None:
                runner.close()
                runner.gateway.stop()
        self.agents = self.eval_agents = None
