"""RolloutConfig: the rollout section of tidal's configuration (standard library only)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tidal.rollout.tool_call_parsers import check_parser_name

logger = logging.getLogger(__name__)

# sglang-router load-balancing policies tidal accepts (see tidal.rollout.router).
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")

# Built-in dynamic-sampling group filters (see tidal.rollout.dynamic_sampling), by name.
BUILTIN_GROUP_FILTER_NAMES = ("reward_variance",)

WILDCARD_HOSTS = ("0.0.0.0", "::")
"""--sglang-host values that bind every interface: such a server is reached at its node's own address."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """How rollouts are generated and scored (slime's flag names, dashed, in the messages)."""

    n_samples_per_prompt: int = 1
    """Responses sampled per prompt (one GRPO group)."""
    rollout_max_response_len: int = 1024
    """Most new tokens per response (SGLang max_new_tokens)."""
    rollout_temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    rollout_top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    rollout_top_k: int = -1
    """Sample from the k most likely tokens; -1 for all."""
    rollout_stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response besides the model's EOS."""
    rollout_stop: tuple[str, ...] = ()
    """Strings that end a response (SGLang ``stop``); the tokens that spelled one stay in the response."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (checked at start-up by check_chat_template())."""
    rm_type: str = "math"
    """Built-in reward: exact_match, numeric_match, math (math-verify: symbolic and numeric equivalence of the final
    answer) or code (the last code block of the response run against the label's tests in a sandbox; see
    tidal.rollout.code_tests); ignored when custom_rm_path is set."""
    rm_math_timeout_s: float = 5.0
    """Most seconds --rm-type math may spend grading one answer; a slower one scores 0 and is counted in
    rollout/reward_errors/MathTimeout."""
    custom_rm_path: str | None = None
    """Reward function by import path 'pkg.module:fn' (takes a Sample, returns a float)."""
    code_sandbox_max_concurrency: int = 4
    """Most sandboxed programs running at once (--rm-type code)."""
    code_sandbox_timeout_s: float = 10.0
    """Wall-clock (and CPU) seconds one test case's program may run before it is killed and scores 0 (--rm-type
    code)."""
    code_sandbox_memory_mb: int = 1024
    """Address space of each process of a sandboxed program, MiB: an allocation beyond it fails (--rm-type code)."""
    over_sampling_batch_size: int | None = None
    """Prompts per generation round under dynamic sampling; None: the rollout batch size."""
    dynamic_sampling_filter_path: str | None = None
    """Group filter for dynamic sampling (DAPO): a built-in name (reward_variance) or 'pkg.module:fn'; None: off."""
    dynamic_sampling_max_rounds: int = 16
    """Most generation rounds one rollout may take to fill its batch under dynamic sampling."""
    custom_generate_function_path: str | None = None
    """Per-sample generate function 'pkg.module:fn' (multi-turn, tool use); None: one batched /generate."""
    generate_max_concurrency: int = 64
    """Most custom-generate-function calls in flight at once (each may make several requests)."""
    agent_function_path: str | None = None
    """Agent 'pkg.module:fn', an async fn(base_url, api_key, row) -> reward run per episode against an OpenAI-
    compatible gateway session (--n-samples-per-prompt episodes of a row form a group); None: no agents."""
    agent_max_concurrency: int = 64
    """Most agent episodes running at once (--agent-function-path)."""
    agent_timeout_s: float = 600.0
    """An agent episode running longer is cut and counted as failed; its group is replaced (--agent-function-path)."""
    tool_call_parser: str | None = None
    """SGLang's parser of the model's tool calls in agent answers (hermes, qwen25, llama3, qwen3_coder, glm45, ...);
    None: the one the chat template's tool-call markers call for (--agent-function-path)."""
    save_debug_rollout_data: str | None = None
    """Directory to write each rollout's samples to as it completes (one JSONL file per rollout)."""
    load_debug_rollout_data: str | None = None
    """Directory of saved rollouts to replay instead of generating (debug training without any server)."""
    sglang_host: str | None = None
    """Address the SGLang servers listen on; None: 127.0.0.1 when the job runs on one node, else each server's
    node address (so the actor and router on other nodes reach it). A wildcard (0.0.0.0, ::) binds every
    interface and the server is reached at its node's address."""
    sglang_api_key: str | None = None
    """Key every SGLang server (SGLang's --api-key), the router and every client use; None: none on loopback,
    and a key generated per run when servers listen on a node address (`train` writes it to the run folder,
    file sglang_api_key, mode 0600)."""
    sglang_server_args: tuple[str, ...] = field(default=(), metadata={"flag": None})
    """Extra sglang.launch_server arguments, mapped from --sglang-* (see tidal.rollout.pass_through)."""
    return_routed_experts: bool = field(default=False, metadata={"flag": None})
    """Ask the engines for the experts they routed every token to, kept per sample (``--use-rollout-routing-replay``
    sets it); launched engines get ``--enable-return-routed-experts``."""
    partial_rollout: bool = False
    """Once the batch is full, abort the requests still running and resume them next rollout (slime's flag); agent
    groups still running run on instead, and the next rollout takes them first (--agent-function-path)."""
    mask_offpolicy_in_partial_rollout: bool = False
    """Loss mask 0 on resumed tokens that older weights sampled (needs --partial-rollout)."""
    use_router: bool | None = None
    """Send requests through sglang-router; None: only when there are several engines."""
    sglang_router_policy: str = "cache_aware"
    """sglang-router policy: cache_aware, round_robin, random or power_of_two."""
    sglang_router_args: tuple[str, ...] = field(default=(), metadata={"flag": None})
    """Extra sglang_router.launch_router arguments, mapped from --sglang-router-* (see tidal.rollout.pass_through)."""
    rollout_external: bool = False
    """slime's switch for external engines; needs ``rollout_external_engine_addrs`` (which alone implies it)."""
    rollout_external_engine_addrs: tuple[str, ...] = field(default=(), metadata={"metavar": "HOST:PORT"})
    """``HOST:PORT`` of SGLang servers started elsewhere: tidal launches no engine, waits until these answer
    ``/health``, generates on them and loads weights into them, and never restarts or stops them."""
    sglang_startup_timeout_s: float = 600.0
    """Longest wait for an SGLang server to become healthy."""
    rollout_request_timeout_s: float = 600.0
    """Longest wait for one HTTP answer from an engine or router (a whole /generate); a timeout is retried."""
    rollout_request_retries: int = 5
    """Times one request is sent again after a transient failure (reset, refused, timeout, 5xx), with backoff."""
    rollout_health_check_interval: float = 10.0
    """Seconds between heartbeats (/health) to each launched engine under --use-fault-tolerance; 0: none."""
    rollout_health_check_timeout: float = 5.0
    """A heartbeat unanswered this long kills the engine; the next request restarts it (--use-fault-tolerance)."""

    def __post_init__(self) -> None:
        checks = (
            ("--n-samples-per-prompt", self.n_samples_per_prompt, self.n_samples_per_prompt >= 1, ">= 1"),
            ("--rollout-max-response-len", self.rollout_max_response_len, self.rollout_max_response_len >= 1, ">= 1"),
            ("--rollout-temperature", self.rollout_temperature, self.rollout_temperature >= 0, ">= 0"),
            ("--rollout-top-p", self.rollout_top_p, 0 < self.rollout_top_p <= 1, "in (0, 1]"),
            ("--rollout-top-k", self.rollout_top_k, self.rollout_top_k == -1 or self.rollout_top_k >= 1, "-1 or >= 1"),
            (
                "--dynamic-sampling-max-rounds",
                self.dynamic_sampling_max_rounds,
                self.dynamic_sampling_max_rounds >= 1,
                ">= 1",
            ),
            ("--generate-max-concurrency", self.generate_max_concurrency, self.generate_max_concurrency >= 1, ">= 1"),
            (
                "--code-sandbox-max-concurrency",
                self.code_sandbox_max_concurrency,
                self.code_sandbox_max_concurrency >= 1,
                ">= 1",
            ),
            ("--code-sandbox-timeout-s", self.code_sandbox_timeout_s, self.code_sandbox_timeout_s > 0, "> 0"),
            ("--code-sandbox-memory-mb", self.code_sandbox_memory_mb, self.code_sandbox_memory_mb >= 64, ">= 64"),
            ("--agent-max-concurrency", self.agent_max_concurrency, self.agent_max_concurrency >= 1, ">= 1"),
            ("--agent-timeout-s", self.agent_timeout_s, self.agent_timeout_s > 0, "> 0"),
            ("--sglang-startup-timeout-s", self.sglang_startup_timeout_s, self.sglang_startup_timeout_s > 0, "> 0"),
            ("--rollout-request-timeout-s", self.rollout_request_timeout_s, self.rollout_request_timeout_s > 0, "> 0"),
            ("--rollout-request-retries", self.rollout_request_retries, self.rollout_request_retries >= 0, ">= 0"),
            (
                "--rollout-health-check-interval",
                self.rollout_health_check_interval,
                self.rollout_health_check_interval >= 0,
                ">= 0 (0: no heartbeat)",
            ),
            (
                "--rollout-health-check-timeout",
                self.rollout_health_check_timeout,
                self.rollout_health_check_timeout > 0,
                "> 0",
            ),
        )
        for flag, value, ok, requirement in checks:
            if not ok:
                raise ValueError(f"{flag} must be {requirement}, got {value!r}")
        if self.sglang_api_key is not None and self.sglang_api_key.startswith("-"):
            raise ValueError("--sglang-api-key must not start with '-': SGLang's command line would read it as a flag")
        if not self.rm_math_timeout_s > 0:
            raise ValueError(f"--rm-math-timeout-s must be > 0, got {self.rm_math_timeout_s}")
        if self.custom_rm_path is None and self.rm_type not in ("exact_match", "numeric_match", "math", "code"):
            raise ValueError(
                f"--rm-type must be exact_match, numeric_match, math or code, got {self.rm_type!r}; "
                "or give --custom-rm-path pkg.module:fn"
            )
        self._check_code_sandbox()
        for flag, path in (
            ("--custom-rm-path", self.custom_rm_path),
            ("--custom-generate-function-path", self.custom_generate_function_path),
            ("--agent-function-path", self.agent_function_path),
        ):
            if path is not None and ":" not in path:
                raise ValueError(f"{flag} must look like 'pkg.module:fn', got {path!r}")
        self._check_sampling_strategy()
        self._check_agents()
        self.external_engine_urls()  # raises on a malformed address
        if self.rollout_external and not self.rollout_external_engine_addrs:
            raise ValueError(
                "--rollout-external needs --rollout-external-engine-addrs HOST:PORT [HOST:PORT ...]: the SGLang "
                "servers to use (drop --rollout-external to let tidal launch its own)"
            )

    def external_engine_urls(self) -> list[str]:
        """``http://HOST:PORT`` of each ``--rollout-external-engine-addrs`` entry.

        Raises:
            ValueError: An entry is not ``HOST:PORT`` with a port in 1..65535, or one appears twice.
        """
        urls = []
        for addr in self.rollout_external_engine_addrs:
            host, _, port = str(addr).removeprefix("http://").rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(
                    f"--rollout-external-engine-addrs entries must look like HOST:PORT (e.g. 10.0.0.5:30000), "
                    f"got {addr!r}"
                )
            urls.append(f"http://{host}:{int(port)}")
        if len(set(urls)) != len(urls):
            raise ValueError(
                f"--rollout-external-engine-addrs lists a server twice: {list(self.rollout_external_engine_addrs)}"
            )
        return urls

    def _check_code_sandbox(self) -> None:
        if self.rm_type == "code" and self.custom_rm_path is None:
            return
        for flag, value, default in (
            ("--code-sandbox-max-concurrency", self.code_sandbox_max_concurrency, 4),
            ("--code-sandbox-timeout-s", self.code_sandbox_timeout_s, 10.0),
            ("--code-sandbox-memory-mb", self.code_sandbox_memory_mb, 1024),
        ):
            if value != default:
                logger.warning("%s has no effect without --rm-type code", flag)

    def _check_agents(self) -> None:
        if self.tool_call_parser is not None:
            check_parser_name(self.tool_call_parser)
        if self.agent_function_path is None:
            for flag, value, default in (
                ("--agent-max-concurrency", self.agent_max_concurrency, 64),
                ("--agent-timeout-s", self.agent_timeout_s, 600.0),
                ("--tool-call-parser", self.tool_call_parser, None),
            ):
                if value != default:
                    logger.warning("%s has no effect without --agent-function-path", flag)
            return
        if self.custom_generate_function_path is not None:
            raise ValueError(
                "--agent-function-path and --custom-generate-function-path exclude each other (not supported yet); "
                "drop one"
            )
        if self.custom_rm_path is not None:
            raise ValueError(
                "--agent-function-path scores each episode with the reward its agent returns, so --custom-rm-path "
                "would be ignored: drop --custom-rm-path (call that reward function inside the agent)"
            )
        if self.return_routed_experts:
            raise ValueError(
                "--use-rollout-routing-replay with --agent-function-path is not supported: the agent gateway does "
                "not record the routed experts of each call; drop one of them"
            )
        router_options = (
            ("--use-router", self.use_router),
            ("--sglang-router-*", self.sglang_router_args),
            ("--sglang-router-policy", self.sglang_router_policy != "cache_aware"),
        )
        router = [flag for flag, given in router_options if given]
        if router:
            raise ValueError(
                f"{router[0]} with --agent-function-path is not supported: the agent gateway pins each episode to one "
                "engine itself and sends no request through sglang-router; drop the router option(s) "
                f"({' / '.join(router)})"
            )

    def _check_sampling_strategy(self) -> None:
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < 1:
            raise ValueError(f"--over-sampling-batch-size must be >= 1, got {self.over_sampling_batch_size!r}")
        spec = self.dynamic_sampling_filter_path
        if self.over_sampling_batch_size is not None and not self._over_samples():
            logger.warning(
                "--over-sampling-batch-size has no effect without --dynamic-sampling-filter-path or --partial-rollout"
            )
        if self.dynamic_sampling_max_rounds != 16 and spec is None and self.agent_function_path is None:
            logger.warning("--dynamic-sampling-max-rounds has no effect without --dynamic-sampling-filter-path")
        if spec is not None and ":" not in spec and spec not in BUILTIN_GROUP_FILTER_NAMES:
            raise ValueError(
                f"--dynamic-sampling-filter-path must be one of {list(BUILTIN_GROUP_FILTER_NAMES)} or look like "
                f"'pkg.module:fn', got {spec!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.rollout_stop):
            raise ValueError(f"--rollout-stop strings must be non-empty, got {self.rollout_stop!r}")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            logger.warning("--mask-offpolicy-in-partial-rollout has no effect without --partial-rollout")
        if self.sglang_router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"--sglang-router-policy must be one of {list(ROUTER_POLICIES)}, got {self.sglang_router_policy!r}"
            )
        if self.save_debug_rollout_data is not None and self.load_debug_rollout_data is not None:
            raise ValueError(
                "--save-debug-rollout-data and --load-debug-rollout-data are both set; replayed rollouts are "
                "already on disk: give only --load-debug-rollout-data"
            )

    def _over_samples(self) -> bool:
        """Whether a rollout can use more prompts than it keeps groups: filtered, carried over, or replaced."""
        filtered = self.dynamic_sampling_filter_path is not None
        return filtered or self.partial_rollout or self.agent_function_path is not None

    def prompts_per_round(self, rollout_batch_size: int) -> int:
        """Prompts a rollout (or a round of dynamic sampling) starts.

        ``--over-sampling-batch-size`` where it has an effect (a filter drops groups, partial rollout carries the
        unfinished ones over, agents replace failed groups), else the rollout batch size.
        """
        return (self.over_sampling_batch_size if self._over_samples() else None) or rollout_batch_size

    def router_wanted(self, num_engines: int) -> bool:
        """Whether requests go through sglang-router: ``use_router`` if set, else when there are several engines.

        Never with agents: their gateway pins each episode (session) to one engine itself.
        """
        if self.agent_function_path is not None:
            return False
        return num_engines > 1 if self.use_router is None else self.use_router

    def sampling_params(self) -> dict[str, Any]:
        """SGLang sampling parameters for :meth:`SGLangEngine.generate` (``n`` included)."""
        params: dict[str, Any] = {
            "n": self.n_samples_per_prompt,
            "max_new_tokens": self.rollout_max_response_len,
            "temperature": self.rollout_temperature,
            "top_p": self.rollout_top_p,
            "top_k": self.rollout_top_k,
        }
        if self.rollout_stop_token_ids:
            params["stop_token_ids"] = list(self.rollout_stop_token_ids)
        if self.rollout_stop:
            params["stop"] = list(self.rollout_stop)
        if self.return_routed_experts:
            params["return_routed_experts"] = True  # the client asks /generate for them (not a sampling parameter)
        return params
