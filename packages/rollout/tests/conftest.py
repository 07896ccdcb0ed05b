"""Session fixtures: a tiny random Qwen2 checkpoint and one real SGLang server on it."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from tidal.rollout import SGLangEngine

# Words the tokenizer knows; prompts in the tests are built from them.
CORPUS = [
    "the answer is 0 1 2 3 4 5 6 7 8 9",
    "what is two plus two ? four",
    "a b c d e f g h i j k l m n o p",
]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stops_sglang_server: stops the session's SGLang server; run after the rest")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests that stop the shared server run last, so that nothing after them pays for a restart.
    items.sort(key=lambda item: item.get_closest_marker("stops_sglang_server") is not None)


def build_tiny_qwen2(out_dir: Path, *, seed: int) -> Path:
    """A word-level tokenizer trained on CORPUS and a random 2-layer Qwen2, saved in the HF layout."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(out_dir)
    config = Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    # A wider init than the default 0.02 so that the next-token distribution is far from uniform
    # and different weights give clearly different greedy outputs.
    config.initializer_range = 0.5
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out_dir)
    generation_config = {"eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config))
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """A function returning a currently unused TCP port on 127.0.0.1."""
    return free_port


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_a"), seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as tiny_model_dir, different weights."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_b"), seed=1)


@pytest.fixture(scope="session")
def _sglang_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    logging.getLogger("tidal").setLevel(logging.INFO)
    engine = SGLangEngine(
        tiny_model_dir,
        port=free_port(),
        log_dir=tmp_path_factory.mktemp("sglang_logs"),
        # SGLang serves a float32 checkpoint in float16 unless told; float32 lets the tests compare
        # its log-probs with transformers' to 1e-3.
        extra_server_args=["--dtype", "float32"],
        startup_timeout_s=600,
        # SGLang's own default is 5 s, tidal's 60 s; 2 s lets test_transport wait past it, and every other
        # test then runs against a server that closes idle connections quickly.
        keep_alive_s=2,
    )
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture
def sglang_server(_sglang_engine: SGLangEngine) -> SGLangEngine:
    """The session's real SGLang server on tiny_model_dir; restarted if a test stopped it."""
    if not _sglang_engine.is_running():
        _sglang_engine.start()
    return _sglang_engine


@contextlib.contextmanager
def _slowed_generation(server: SGLangEngine, generate: Callable[[], object]):
    """``generate()`` in a thread on ``server`` slowed to 0.05 s a forward (200 tokens: 10 s), still running after
    3 s; yields ``(thread, box)`` (``box["result"]`` or ``box["error"]``); the server is fast again after."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = generate()
        except BaseException as e:
            box["error"] = e

    server.call("/slow_down", {"forward_sleep_time": 0.05})
    try:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=3.0)
        assert thread.is_alive(), "generation finished within 3 s; the slow-down did not take"
        yield thread, box
    finally:
        server.call("/slow_down", {"forward_sleep_time": None})


@pytest.fixture
def slowed_generation() -> Callable:
    """``slowed_generation(server, generate)``: a context running ``generate()`` in a thread on a slowed ``server``."""
    return _slowed_generation


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Name of the module of test extension points (tests/tidal_rollout_plugins.py), importable by path."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    yield "tidal_rollout_plugins"
    sys.modules.pop("tidal_rollout_plugins", None)


class FlakyProxy:
    """Listens on a free port; connection ``i`` gets ``faults[i]`` ("reset", "503", "stall"), later ones a relay."""

    def __init__(self, upstream_port: int, faults: Sequence[str], *, stall_s: float = 3.0) -> None:
        self.upstream_port, self.faults, self.stall_s = upstream_port, list(faults), stall_s
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            fault = self.faults[self.connections] if self.connections < len(self.faults) else None
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, fault), daemon=True).start()

    def _serve(self, conn: socket.socket, fault: str | None) -> None:
        if fault is None:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=_pump, args=(upstream, conn), daemon=True).start()
            _pump(conn, upstream)
            return
        conn.recv(65536)  # the request has left the client
        if fault == "503":
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy")
        elif fault == "stall":
            self._stop.wait(self.stall_s)
        elif fault == "reset":  # SO_LINGER 0: close() sends RST, as a peer that drops the connection does
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxy(sglang_server: SGLangEngine) -> Iterator[Callable[..., FlakyProxy]]:
    """Makes FlakyProxy instances in front of the session's server (``proxy(["reset", "503"])``); closes them."""
    made: list[FlakyProxy] = []

    def make(faults: Sequence[str], **kwargs) -> FlakyProxy:
        made.append(FlakyProxy(sglang_server.port, faults, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


# A Qwen3-style chat template, short enough for the tiny model's 512-token context: `<|im_start|>ROLE\n...<|im_end|>\n`
# turns, tools listed in the system turn, tool calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
# With strip_think, earlier assistant turns lose their `<think>` part and the generation prompt opens `<think>\n`, as
# reasoning models' templates do.
_CHAT_TEMPLATE = """
{%- if tools or messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}
{%- for tool in tools or [] -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- set content = message.content or '' -%}
{%- if STRIP and '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- for call in message.tool_calls or [] -%}
{{- '<tool_call>{"name": "' + call.function.name + '", "arguments": ' -}}
{{- (call.function.arguments | tojson) + '}</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif not (message.role == 'system' and loop.first) -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' + ('<think>\\n' if STRIP else '') -}}{%- endif -%}
"""
CHAT_SPECIALS = [
    *("<unk>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"),
    *("<think>", "</think>", "<tool_call>", "</tool_call>"),
]
CHAT_CHARS = list('\n {}":,') + list("stemuraionlydbg") + list("123")
# Merged tokens: a sampled run of single "a"/"n" tokens re-tokenizes into these, so re-tokenizing differs.
CHAT_MERGES = [("a", "n"), ("n", "a"), ("a", "a"), ("n", "n")]


def build_chat_tokenizer(vocab_size: int, *, strip_think: bool = False):
    """A BPE tokenizer with a Qwen3-style chat template whose ids fit the tiny model (exactly ``vocab_size`` ids).

    Characters are single tokens plus a few merges; decoding is exact (Fuse), so decoded sampled tokens render
    back to the same text, while re-tokenizing that text may give other tokens (the token-drift trap).
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = [*CHAT_SPECIALS, *CHAT_CHARS, *("".join(m) for m in CHAT_MERGES)]
    assert len(pieces) == vocab_size, f"the chat tokenizer has {len(pieces)} tokens, the model {vocab_size}"
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=CHAT_MERGES, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=CHAT_SPECIALS[3:],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = _CHAT_TEMPLATE.replace("STRIP", "true" if strip_think else "false")
    return fast


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_model_dir: Path):
    """The Qwen3-style chat tokenizer over the session server's model's ids."""
    from transformers import AutoConfig

    return build_chat_tokenizer(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)


@pytest.fixture(scope="session")
def stripping_chat_tokenizer(tiny_model_dir: Path):
    """A reasoning model's chat tokenizer: earlier turns lose their ``<think>``, the generation prompt opens one."""
    from transformers import AutoConfig

    return build_chat_tokenizer(AutoConfig.from_pretrained(tiny_model_dir).vocab_size, strip_think=True)


# Chat templates shaped like three model families' (how each renders tools, tool calls and tool results), over a
# byte-level tokenizer that encodes any text: for the gateway's tests of each family's tool-call format.
# Qwen3 / Hermes: calls as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, results in a user turn.
QWEN3_TEMPLATE = """
{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}{{- '\\n</tools><|im_end|>\\n' -}}{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' + (message.content or '') -}}
{%- for call in message.tool_calls or [] -%}
{%- if loop.first and message.content -%}{{- '\\n' -}}{%- elif not loop.first -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) -}}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}
{%- else -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# Llama 3.1: calls as a bare `{"name": ..., "parameters": {...}}` JSON answer (`<|python_tag|>` for built-in tools),
# results in an `ipython` turn.
LLAMA31_TEMPLATE = """
{%- for message in messages -%}
{%- set role = 'ipython' if message.role == 'tool' else message.role -%}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}
{%- if message.role == 'user' and tools and loop.first -%}
{%- for tool in tools -%}{{- (tool | tojson) + '\\n\\n' -}}{%- endfor -%}{%- endif -%}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{{- '{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}' -}}
{%- endfor -%}
{%- elif message.role == 'assistant' and message.content and message.content.startswith('<|python_tag|>') -%}
{{- message.content -}}
{%- else -%}{{- message.content -}}{%- endif -%}
{{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}
"""

# Qwen3-Coder: XML calls, `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</tool_call>`.
QWEN3_CODER_TEMPLATE = """
{%- if tools -%}{{- '<|im_start|>system\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n<function>' + tool.function.name + '</function>' -}}{%- endfor -%}
{{- '\\n</tools><|im_end|>\\n' -}}{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' + (message.content or '') -}}
{%- for call in message.tool_calls or [] -%}
{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' -}}
{%- for key, value in call.function.arguments.items() -%}
{{- '<parameter=' + key + '>\\n' + (value | string) + '\\n</parameter>\\n' -}}
{%- endfor -%}
{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}
{%- else -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

FAMILY_SPECIALS = [
    *("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")
]


def family_tokenizer(chat_template: str, *, eos: str = "<|im_end|>"):
    """A byte-level tokenizer (one token per byte, the family's special tokens whole) with ``chat_template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, additional_special_tokens=FAMILY_SPECIALS)
    fast.chat_template = chat_template
    return fast


FAMILY_TEMPLATES = {
    "qwen3": (QWEN3_TEMPLATE, "<|im_end|>"),
    "llama31": (LLAMA31_TEMPLATE, "<|eot_id|>"),
    "qwen3_coder": (QWEN3_CODER_TEMPLATE, "<|im_end|>"),
}


@pytest.fixture(scope="session")
def family_templates() -> dict[str, tuple[str, str]]:
    """``(chat template, EOS token)`` of the Qwen3-, Llama 3.1- and Qwen3-Coder-shaped families, by family."""
    return FAMILY_TEMPLATES


@pytest.fixture(scope="session")
def family_tokenizers() -> dict:
    """Byte-level tokenizers with the Qwen3-, Llama 3.1- and Qwen3-Coder-shaped chat templates, by family."""
    return {family: family_tokenizer(template, eos=eos) for family, (template, eos) in FAMILY_TEMPLATES.items()}
