"""The per-run SGLang API key: generated only for servers on node addresses, readable by its owner alone."""

import stat

import pytest
from tidal.rollout import RolloutConfig, SGLangClient
from tidal.train.rollout_manager import _new_api_key


def test_generated_key_is_in_the_run_folder_with_mode_0600(tmp_path):
    (tmp_path / "sglang_api_key").write_text("old\n")
    (tmp_path / "sglang_api_key").chmod(0o644)
    key = _new_api_key(tmp_path)
    path = tmp_path / "sglang_api_key"
    assert path.read_text() == key + "\n" and len(key) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _new_api_key(tmp_path) != key  # one per run
    # token_urlsafe gave a key starting with "-" 1 time in 64, which sglang.launch_server's parser took for a flag
    assert not any(_new_api_key(tmp_path).startswith("-") for _ in range(256))


def test_a_key_that_reads_as_a_flag_is_refused_by_name():
    with pytest.raises(ValueError, match="--sglang-api-key must not start with '-'"):
        RolloutConfig(sglang_api_key="-abc")


def test_clients_built_from_the_config_send_the_key():
    client = SGLangClient.from_config(RolloutConfig(sglang_api_key="k3y"), "http://127.0.0.1:1")
    assert client._session.headers["Authorization"] == "Bearer k3y"
    assert "Authorization" not in SGLangClient.from_config(RolloutConfig(), "http://127.0.0.1:1")._session.headers
