"""The agent gateway over two real engines: every call of a session goes to the same engine (its prefix cache).

The session's two SGLang servers on the embedded model (tests/conftest.py); which engine served each call is read
from the engines' own logs, not from the gateway.
"""

import openai
import pytest
from tidal.rollout import Gateway, SGLangClient
from tidal.rollout.gateway import pick_engine

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}{{ 'assistant: ' }}"


def test_each_session_stays_on_one_engine_and_both_engines_serve(
    external_engine, second_external_engine, external_engine_logs
):
    from tidal.train.embedded_model import ensure_embedded_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    tokenizer.chat_template = TEMPLATE
    addrs = [external_engine, second_external_engine]
    engines = [SGLangClient(f"http://{a}") for a in addrs]
    before = [external_engine_logs[a].read_text().count("POST /generate") for a in addrs]
    expected = dict.fromkeys(addrs, 0)
    # 8 session ids, 4 of them hashed to each engine (the ports, hence the hashes, differ from run to run)
    names: dict[str, list[str]] = {e.url: [] for e in engines}
    for j in range(1000):
        owner = names[pick_engine(f"episode-{j}", engines).url]
        if len(owner) < 4:
            owner.append(f"episode-{j}")
    ids = [n for owned in names.values() for n in owned]
    assert len(ids) == 8
    with Gateway(engines, tokenizer, api_key="k") as gw:
        for i, name in enumerate(ids):
            sid = gw.open_session(name)
            client = openai.OpenAI(base_url=gw.session_url(sid), api_key="k", max_retries=0)
            messages = [{"role": "user", "content": f"{i}{i}+11="}]
            for _ in range(3):
                answer = client.chat.completions.create(model="m", messages=messages, max_tokens=3, temperature=0)
                messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""}]
                messages += [{"role": "user", "content": "again"}]
            session = gw.close_session(sid)
            assert len(set(session.engine_urls)) == 1 and len(session.engine_urls) == 3
            assert session.engine_urls[0] == pick_engine(sid, engines).url
            expected[session.engine_urls[0].removeprefix("http://")] += 3
    served = [
        external_engine_logs[a].read_text().count("POST /generate") - n for a, n in zip(addrs, before, strict=True)
    ]
    assert served == [expected[a] for a in addrs] and all(served), (served, expected)
    # Rendezvous hashing: without the second engine, only its sessions move.
    moved = [n for n in ids if pick_engine(n, engines).url != engines[0].url]
    assert all(pick_engine(n, engines[:1]) is engines[0] for n in ids) and len(moved) == 4
