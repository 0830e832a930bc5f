"""Sampling parameters the platform sends, including the edges it expects to be refused."""

from __future__ import annotations

import pytest

from tests.admission.conftest import assert_openai_error, chat, ok

pytestmark = pytest.mark.server


@pytest.mark.parametrize("temperature", [0, 1, 1.1, 2])
def test_temperature(server, temperature) -> None:
    assert (
        ok(chat(server, max_tokens=4, temperature=temperature))["usage"]["completion_tokens"] == 4
    )


@pytest.mark.parametrize("top_p", [0.01, 0.95, 1])
def test_top_p_in_range(server, top_p) -> None:
    assert ok(chat(server, max_tokens=4, top_p=top_p))["usage"]["completion_tokens"] == 4


def test_top_p_zero_is_served_or_clearly_refused(server) -> None:
    resp = chat(server, max_tokens=4, top_p=0)
    if resp.status_code != 200:
        assert_openai_error(resp, 400)


def test_top_p_above_one_is_a_400(server) -> None:
    err = assert_openai_error(chat(server, max_tokens=4, top_p=1.1), 400)
    assert "top_p" in err["message"]


@pytest.mark.parametrize("penalty", [-2, 0, 2])
@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_penalties(server, name, penalty) -> None:
    assert ok(chat(server, max_tokens=4, **{name: penalty}))["usage"]["completion_tokens"] == 4


def test_same_seed_gives_the_same_output(server) -> None:
    def once(seed: int) -> str:
        body = ok(chat(server, max_tokens=12, temperature=1.0, seed=seed))
        return body["choices"][0]["message"]["reasoning_content"]

    assert once(1234) == once(1234)
    assert once(1234) != once(99)  # 12 random tokens from a 248K vocabulary


def test_n_2_returns_two_choices(server) -> None:
    body = ok(chat(server, max_tokens=4, n=2, temperature=1.0))
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    assert body["usage"]["completion_tokens"] == 8


def test_n_2_on_a_scheduler_that_holds_one_sequence(small_server) -> None:
    """--max-num-seqs 1: the two choices are served one after the other, never a hang."""
    body = ok(chat(small_server, max_tokens=4, n=2, temperature=1.0))
    assert len(body["choices"]) == 2
    assert all(c["finish_reason"] == "length" for c in body["choices"])
