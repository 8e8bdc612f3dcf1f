"""Disaggregation's pure parts: the decode engine choice, the split decision, the NIXL
legs, per-model dialects, usage rewriting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import _parser
from router.config import ConfigError, DisaggregationConfig, PolicyConfig, load_config
from router.fleet.load import EngineLoad
from router.frontends.sidecar import AllowList, parse_target
from router.handoff import nixl, sglang
from router.index.base import Match
from router.policy import make_decode_policy, make_policy
from router.policy.base import Policy, RouteRequest
from router.policy.disagg import decide_split
from router.serve import config_from_args
from router.serving.errors import ApiError
from router.serving.usage import UsageTap
from router.types import EngineKey

CFG = DisaggregationConfig()


class TestSplitDecision:
    def test_a_long_uncached_prompt_is_split(self) -> None:
        d = decide_split(4000, 0, True, CFG)
        assert d.split and d.reason == "split" and d.uncached_tokens == 4000
        assert d.transfer_s < d.saved_s

    def test_no_prefill_engine_means_local(self) -> None:
        assert decide_split(4000, 0, False, CFG).reason == "no_prefill_engine"

    def test_a_decode_engine_holding_most_of_the_prompt_serves_it(self) -> None:
        d = decide_split(4000, 3500, True, CFG)
        assert not d.split and d.reason == "decode_holds_prefix"

    def test_few_missing_tokens_stay_local(self) -> None:
        assert decide_split(400, 0, True, CFG).reason == "short_uncached"
        assert decide_split(
            3000, 2600, True, CFG.model_copy(update={"decode_hit_ratio": 1.0})
        ).reason == ("short_uncached")

    def test_a_slow_link_makes_the_transfer_cost_more_than_it_saves(self) -> None:
        slow = CFG.model_copy(update={"transfer_bandwidth_gb_s": 1.0})
        d = decide_split(4000, 0, True, slow)
        assert not d.split and d.reason == "transfer_costs_more" and d.transfer_s > d.saved_s


A, B = EngineKey("127.0.0.1:9001"), EngineKey("127.0.0.1:9002")


def decode_policy(clock: float = 1.0, **weights: float) -> Policy:
    """The decode policy ``kvroute serve`` builds (and the simulator: same call)."""
    policy = PolicyConfig()
    return make_decode_policy(
        policy, CFG.model_copy(update=weights), make_policy(policy), lambda: clock
    )


def decode_request(rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, list(range(125)), 2000, 16)


def reported(waiting: float, running: float, kv_usage: float, **in_flight: int) -> EngineLoad:
    return EngineLoad(
        waiting=waiting, running=running, kv_usage=kv_usage, reported_at=0.0, **in_flight
    )


class TestDecodeChoice:
    def test_in_flight_decode_work_steers_away(self) -> None:
        loads = {A: EngineLoad(requests=8, decode_blocks=400), B: EngineLoad()}
        d = decode_policy().choose(decode_request(), [A, B], {A: Match(0), B: Match(0)}, loads)
        assert d.engine == B

    def test_a_held_prefix_on_an_idle_decode_engine_wins(self) -> None:
        loads = {A: EngineLoad(), B: EngineLoad()}
        d = decode_policy().choose(decode_request(), [A, B], {A: Match(0), B: Match(100)}, loads)
        assert d.engine == B

    def test_the_decode_weights_reach_the_decode_policy(self) -> None:
        policy = decode_policy(
            decode_kv_usage_weight=10.0, decode_waiting_weight=3.0, decode_running_weight=2.0
        )
        cfg = policy.config  # type: ignore[attr-defined]
        assert (cfg.kv_usage_weight, cfg.waiting_weight, cfg.running_weight) == (10.0, 3.0, 2.0)
        # the router's own policy keeps its own (zero) engine-reported weights
        assert PolicyConfig().kv_usage_weight == PolicyConfig().running_weight == 0.0
        # a baseline router policy chooses decode engines itself, weights or not
        baseline = make_decode_policy(
            PolicyConfig(name="round_robin"), CFG, make_policy(PolicyConfig(name="round_robin"))
        )
        assert baseline.name == "round_robin"

    def test_every_reported_signal_counts_by_default(self) -> None:
        loads = {
            A: reported(2, 0, 0),
            B: reported(0, 3, 0),
            EngineKey("127.0.0.1:9003"): reported(0, 0, 0.5),
        }
        scores = decode_policy().score(decode_request(), list(loads), {}, loads)
        assert [s.reported for s in scores] == [
            2 * CFG.decode_waiting_weight,
            3 * CFG.decode_running_weight,
            0.5 * CFG.decode_kv_usage_weight,
        ]
        assert all(s.reported > 0 for s in scores)

    def test_reported_load_decides_when_in_flight_work_is_equal(self) -> None:
        # The same in-flight work from this router on both engines; A is busier with
        # traffic this router does not see (other routers' requests).
        loads = {
            A: reported(2, 12, 0.9, requests=2, decode_blocks=200),
            B: reported(0, 3, 0.2, requests=2, decode_blocks=200),
        }
        policy = decode_policy()
        picks = {
            policy.choose(decode_request(f"r{i}"), [A, B], {}, loads).engine for i in range(20)
        }
        assert picks == {B}
        # without the reported terms it is a tie, broken by request id: both engines win
        blind = decode_policy(
            decode_kv_usage_weight=0.0, decode_waiting_weight=0.0, decode_running_weight=0.0
        )
        picks = {blind.choose(decode_request(f"r{i}"), [A, B], {}, loads).engine for i in range(20)}
        assert picks == {A, B}

    def test_reported_load_does_not_outweigh_a_request_in_flight(self) -> None:
        # A reports a full cache and a busy batch; B has one more 1,000-token request of
        # this router in flight (63 blocks), which B's report counts too.
        loads = {
            A: reported(0, 8, 1.0),
            B: reported(0, 1, 0.1, requests=1, decode_blocks=63),
        }
        d = decode_policy().choose(decode_request(), [A, B], {}, loads)
        assert d.engine == A

    def test_stale_reports_are_ignored(self) -> None:
        age = PolicyConfig().report_max_age_s
        loads = {A: reported(5, 20, 1.0), B: reported(0, 0, 0.0)}
        scores = decode_policy(clock=age + 1.0).score(decode_request(), [A, B], {}, loads)
        assert [s.reported for s in scores] == [0.0, 0.0]


class TestNixl:
    def test_the_prefill_leg_asks_for_one_token_and_a_remote_decode(self) -> None:
        client = {
            "prompt": "x",
            "stream": True,
            "max_tokens": 50,
            "max_completion_tokens": 50,
            "stream_options": {"include_usage": True},
            "min_tokens": 3,
            "temperature": 0,
        }
        body = nixl.prefill_body(client)
        assert body["stream"] is False and body["max_tokens"] == 1
        assert body["max_completion_tokens"] == 1
        assert "stream_options" not in body and "min_tokens" not in body
        assert body["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        assert client["max_tokens"] == 50  # the client's body is untouched

    def test_returned_params_go_to_the_decode_leg_verbatim(self) -> None:
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "e",
            "remote_block_ids": [[1, 2]],
            "remote_request_id": "r",
            "remote_host": "10.1.1.1",
            "remote_port": 5600,
            "tp_size": 1,
            "something_new": {"x": 1},
        }
        answer = {"choices": [], "kv_transfer_params": params}
        assert nixl.returned_params(answer) == params
        body = nixl.decode_body({"prompt": "x", "stream": True}, params)
        assert body == {"prompt": "x", "stream": True, "kv_transfer_params": params}

    @pytest.mark.parametrize(
        "answer",
        [{}, {"kv_transfer_params": None}, {"kv_transfer_params": {"do_remote_prefill": False}}],
    )
    def test_answers_without_usable_params(self, answer: dict) -> None:
        assert nixl.returned_params(answer) is None

    def test_a_loopback_remote_host_from_a_remote_engine_is_flagged_and_rewritten_on_request(
        self,
    ) -> None:
        params = {"remote_host": "127.0.0.1", "remote_port": 5600}
        same, flagged = nixl.check_remote_host(params, "10.0.0.7", rewrite=False)
        assert flagged and same is params
        fixed, flagged = nixl.check_remote_host(params, "10.0.0.7", rewrite=True)
        assert flagged and fixed == {"remote_host": "10.0.0.7", "remote_port": 5600}
        assert nixl.check_remote_host(params, "127.0.0.1", rewrite=True) == (params, False)

    def test_silent_recompute_shows_in_the_decode_legs_cached_tokens(self) -> None:
        assert not nixl.recomputed(1999, 2000, 16)
        assert not nixl.recomputed(None, 2000, 16)
        assert nixl.recomputed(320, 2000, 16)


def test_sglang_legs_carry_the_pairs_bootstrap_fields() -> None:
    import random

    room = sglang.new_room(random.Random(1))
    assert 0 <= room < 2**63
    assert sglang.with_bootstrap({"prompt": "x"}, "10.0.0.1", 8998, room) == {
        "prompt": "x",
        "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": room,
    }


class TestPerModelDialect:
    def test_a_model_entry_overrides_the_global_dialect(self) -> None:
        config = load_config(
            overrides={
                "models": [
                    {"name": "beta", "handoff": "sglang"},
                    {"name": "gamma", "block_size": 32},
                ]
            },
            environ={},
        )
        assert config.disaggregation.handoff == "nixl"
        assert config.handoff_for("beta") == "sglang"
        assert config.handoff_for("gamma") == "nixl"  # an entry without a dialect: the default
        assert config.handoff_for("alpha") == "nixl"  # no entry at all

    def test_the_handoff_flag_sets_the_default_and_model_entries_still_win(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "kvroute.yaml"
        path.write_text("models:\n  - name: beta\n    handoff: nixl\n")
        args = _parser("serve").parse_args(["serve", "--config", str(path), "--handoff", "sglang"])
        config = config_from_args(args)
        assert config.disaggregation.handoff == "sglang"
        assert config.handoff_for("alpha") == "sglang"
        assert config.handoff_for("beta") == "nixl"

    def test_an_unknown_dialect_is_refused(self) -> None:
        with pytest.raises(ConfigError, match=r"models\.0\.handoff"):
            load_config(overrides={"models": [{"name": "beta", "handoff": "mooncake"}]}, environ={})


class TestUsageTap:
    def test_a_json_answer_shows_the_prefill_legs_cached_tokens(self) -> None:
        seen: list[int] = []
        tap = UsageTap(lambda u: seen.append(u["prompt_tokens_details"]["cached_tokens"]), 1984)
        answer = {
            "choices": [{"text": "hi"}],
            "usage": {"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1999}},
        }
        out = json.loads(tap.answer(json.dumps(answer).encode()))
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 1984
        assert seen == [1999]  # the tap sees the engine's own value before rewriting it

    def test_a_stream_usage_event_is_rewritten_or_hidden(self) -> None:
        usage = {
            "id": "c",
            "choices": [],
            "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 9}},
        }
        chunk = (
            b'data: {"id":"c","choices":[{"text":"a"}]}\n\ndata: '
            + json.dumps(usage).encode()
            + b"\n\ndata: [DONE]\n\n"
        )
        rewritten = UsageTap(cached_tokens=0).chunk(chunk)
        assert b'"cached_tokens":0' in rewritten and rewritten.endswith(b"data: [DONE]\n\n")
        hidden = UsageTap(drop_usage_event=True).chunk(chunk)
        assert b"usage" not in hidden and b'"text":"a"' in hidden
        plain = b'data: {"choices":[{"text":"b"}]}\n\n'
        assert UsageTap(cached_tokens=0).chunk(plain) is plain


class TestSidecarAllowList:
    def test_pairs_and_networks(self) -> None:
        allow = AllowList(["127.0.0.1:8001", "10.1.0.0/16", "192.168.7.7"])
        assert allow.allows("127.0.0.1", 8001)
        assert not allow.allows("127.0.0.1", 8002)
        assert allow.allows("10.1.44.5", 9000)
        assert allow.allows("192.168.7.7", 1)
        assert not allow.allows("10.2.0.1", 9000)
        assert not allow.allows("evil.example", 80)
        assert not AllowList([]).allows("127.0.0.1", 8001)

    @pytest.mark.parametrize("value", ["nope", "1.2.3.4", "1.2.3.4:99999", "a\r\nb:80", ""])
    def test_bad_header_values_are_400(self, value: str) -> None:
        with pytest.raises(ApiError) as info:
            parse_target(value)
        assert info.value.status == 400

    def test_a_good_header_value(self) -> None:
        assert parse_target("10.0.0.9:8200") == ("10.0.0.9", 8200)
        assert parse_target("[::1]:8200") == ("::1", 8200)
