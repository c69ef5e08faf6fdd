"""The scheduler through the bindings: a hypothesis state machine (add,
schedule, update with random tokens, abort) checking the plan and the KV
invariants after every step, and bad input."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ferrox._native import BatchPlan, Scheduler
from ferrox.common import errors

VOCAB = 40
BLOCK_SIZE = 4


def make_scheduler(**overrides: object) -> Scheduler:
    options: dict = dict(
        block_size=BLOCK_SIZE,
        num_blocks=12,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=32,
        vocab_size=VOCAB,
    )
    options.update(overrides)
    return Scheduler(**options)


def check_plan(plan: BatchPlan, sched: Scheduler) -> None:
    b = plan.num_reqs
    assert b <= sched.max_num_seqs
    assert plan.num_tokens <= sched.max_num_batched_tokens
    qsl = plan.query_start_loc
    assert qsl.shape == (b + 1,) and qsl[0] == 0 and qsl[-1] == plan.num_tokens
    np.testing.assert_array_equal(np.diff(qsl), plan.num_scheduled_tokens)
    np.testing.assert_array_equal(
        plan.seq_lens, plan.num_computed_tokens + plan.num_scheduled_tokens
    )
    assert plan.block_table.shape[0] == b
    assert (plan.num_scheduled_tokens[: plan.num_decodes] == 1).all()
    rows = np.repeat(np.arange(b), plan.num_scheduled_tokens)
    pos = plan.positions
    expected = (
        plan.block_table[rows, pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    )
    np.testing.assert_array_equal(plan.slot_mapping, expected)
    assert len(set(plan.slot_mapping.tolist())) == plan.num_tokens, "two tokens share a KV slot"
    # Sampled positions are the last token of their row.
    np.testing.assert_array_equal(plan.logits_indices, qsl[1:][plan.sample_rows] - 1)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched = make_scheduler(policy="priority")
        self.next_id = 0
        self.live: set[int] = set()
        self.prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]

    @rule(
        prefix=st.integers(0, 2),
        suffix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
        max_tokens=st.integers(1, 12),
        priority=st.integers(-1, 1),
    )
    def add(self, prefix: int, suffix: list[int], max_tokens: int, priority: int) -> None:
        prompt = self.prefixes[prefix] + suffix
        self.sched.add_request(
            self.next_id, prompt, max_tokens=max_tokens, eos_token_ids=[0], priority=priority
        )
        self.live.add(self.next_id)
        self.next_id += 1

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        plan = self.sched.schedule()
        check_plan(plan, self.sched)
        assert set(plan.req_ids.tolist()) <= self.live
        self.sched.check_integrity()
        sampled = data.draw(
            st.lists(
                st.integers(0, VOCAB - 1), min_size=plan.num_sampled, max_size=plan.num_sampled
            )
        )
        stop_some = data.draw(st.lists(st.sampled_from(sorted(self.live) or [0]), max_size=1))
        events = self.sched.update(plan, np.array(sampled, dtype=np.int32), stop_some)
        for rid, reason in zip(
            events.req_ids.tolist(), events.finish_reasons.tolist(), strict=True
        ):
            if reason:
                self.live.discard(rid)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.integers(0, self.next_id))
        found = self.sched.abort(rid)
        assert found == (rid in self.live)
        self.live.discard(rid)

    @invariant()
    def consistent(self) -> None:
        self.sched.check_integrity()
        s = self.sched.stats()
        assert s.num_free_blocks + s.num_used_blocks + s.num_cached_blocks == 12
        assert s.num_running + s.num_waiting == len(self.live) == self.sched.num_requests

    def teardown(self) -> None:
        for rid in list(self.live):
            assert self.sched.abort(rid)
        plan = self.sched.schedule()
        self.sched.update(plan, [])
        s = self.sched.stats()
        assert s.num_used_blocks == 0
        assert s.num_free_blocks + s.num_cached_blocks == 12


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_plan_arrays_and_events() -> None:
    sched = make_scheduler()
    sched.add_request(7, np.arange(1, 7, dtype=np.int64), max_tokens=2)
    plan = sched.schedule()
    assert plan.req_ids.tolist() == [7]
    assert plan.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert plan.positions.tolist() == list(range(6))
    assert plan.block_table.shape == (1, 2)
    assert plan.logits_indices.tolist() == [5]
    events = sched.update(plan, [11])
    assert (events.req_ids.tolist(), events.token_ids.tolist()) == ([7], [11])
    assert events.finish_reasons.tolist() == [0]
    plan = sched.schedule()
    assert plan.num_decodes == 1 and plan.input_ids.tolist() == [11]
    events = sched.update(plan, [12])
    assert events.finish_reasons.tolist() == [2]  # length
    assert not sched.has_unfinished()
    assert sched.request_info(7) is None


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(prompt_token_ids=[]), errors.RequestRejectedError),
        (dict(prompt_token_ids=[VOCAB]), errors.RequestRejectedError),
        (dict(prompt_token_ids=[-3]), errors.InvalidArgumentError),
        (dict(prompt_token_ids=[1] * 32), errors.RequestRejectedError),
        (dict(prompt_token_ids=[1], max_tokens=0), errors.RequestRejectedError),
        (dict(prompt_token_ids="hello"), errors.InvalidArgumentError),
        (dict(prompt_token_ids=[1], request_id=-1), errors.InvalidArgumentError),
        (dict(prompt_token_ids=[1], request_id=1), errors.DuplicateRequestError),
    ],
)
def test_bad_requests_are_rejected(kwargs: dict, error: type) -> None:
    sched = make_scheduler(num_blocks=4)
    sched.add_request(1, [1, 2], max_tokens=2)
    kwargs.setdefault("request_id", 2)
    kwargs.setdefault("max_tokens", 2)
    with pytest.raises(error):
        sched.add_request(kwargs.pop("request_id"), **kwargs)
    assert sched.num_requests == 1
    sched.check_integrity()


def test_bad_config_and_out_of_order_calls() -> None:
    with pytest.raises(errors.InvalidArgumentError, match="max_num_seqs"):
        make_scheduler(max_num_batched_tokens=2)
    with pytest.raises(errors.InvalidArgumentError, match="policy"):
        make_scheduler(policy="lifo")
    sched = make_scheduler()
    sched.add_request(1, [1, 2, 3], max_tokens=3)
    plan = sched.schedule()
    with pytest.raises(errors.SchedulerStateError):
        sched.schedule()
    with pytest.raises(errors.InvalidArgumentError, match="expected 1 sampled"):
        sched.update(plan, [1, 2])
    with pytest.raises(errors.InvalidArgumentError):
        sched.update(plan, [VOCAB])
    sched.update(plan, [3])
    with pytest.raises(errors.SchedulerStateError):
        sched.update(plan, [3])
    sched.check_integrity()
