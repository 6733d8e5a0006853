"""``te_npu.events``: subscriptions (nesting, type filters, closing), delivery, and that an
unobserved run builds no event at all."""
from __future__ import annotations

import dataclasses
import pickle
import threading

import pytest
import torch

import te_npu
from te_npu import MXFP8BlockRecipe, events
from tests.seeded import seeded_init, seeded_randn


def test_subscribe_delivers_in_subscription_order_until_closed():
    seen = []
    with events.subscribe(lambda e: seen.append(("outer", e))):
        inner = events.subscribe(lambda e: seen.append(("inner", e)))
        events.emit(events.StepBeginEvent(0))
        inner.close()
        inner.close()  # idempotent
        events.emit(events.StepBeginEvent(1))
    events.emit(events.StepBeginEvent(2))
    assert seen == [("outer", events.StepBeginEvent(0)), ("inner", events.StepBeginEvent(0)),
                    ("outer", events.StepBeginEvent(1))]
    assert not events.has_subscribers()


def test_type_filters_select_events_and_has_subscribers_answers_per_type():
    refreshes, steps = [], []
    with events.subscribe(refreshes.append, events.WeightRefreshEvent), \
            events.subscribe(steps.append, events.OptimizerStepEvent, events.StepBeginEvent):
        assert events.has_subscribers() and events.has_subscribers(events.WeightRefreshEvent)
        assert not events.has_subscribers(events.QuantEvent)
        for event in (events.WeightRefreshEvent("w"), events.StepBeginEvent(3), events.OptimizerStepEvent(False, float("nan"))):
            events.emit(event)
    assert refreshes == [events.WeightRefreshEvent("w")]
    assert [type(e) for e in steps] == [events.StepBeginEvent, events.OptimizerStepEvent] and steps[1].skipped


def test_subscribe_refuses_what_is_not_a_callback_or_a_type():
    with pytest.raises(TypeError, match="callback must be callable"):
        events.subscribe(None)
    with pytest.raises(TypeError, match="event types must be classes"):
        events.subscribe(print, "QuantEvent")


def test_a_failing_subscriber_is_loud():
    def broken(event):
        raise RuntimeError("subscriber bug")

    with events.subscribe(broken), pytest.raises(RuntimeError, match="subscriber bug"):
        events.emit(events.StepBeginEvent(0))


def test_events_are_frozen_and_picklable():
    event = events.FSDPGatherEvent(events.FSDPGatherContext("forward", True, "w"), "mxfp8_e4m3",
                                   ("row_data", "row_scale"), 100, 200, 192)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.local_bytes = 0
    assert pickle.loads(pickle.dumps(event)) == event and event.bytes_per_element == 200 / 192


def test_unobserved_work_builds_no_event(monkeypatch):
    """With nobody listening -- or only a listener for other events -- no producer builds an event."""
    def refuse(*args, **kwargs):
        raise AssertionError("an event was built with nobody subscribed to it")

    for name in ("QuantEvent", "OperandEvent", "GemmEvent"):
        monkeypatch.setattr(events, name, type(name, (), {"__init__": refuse}))
    layer = te_npu.TELinear(64, 96, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16)
    x = seeded_randn(1)(32, 64, requires_grad=True)

    def step():
        with te_npu.autocast(recipe=MXFP8BlockRecipe()):
            layer(x).float().sum().backward()

    step()
    with events.subscribe(lambda e: None, events.WeightRefreshEvent):
        step()


def test_subscriptions_from_many_threads_all_land_and_all_leave():
    seen = []
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        with events.subscribe(lambda e, i=i: seen.append(i), events.StepBeginEvent):
            barrier.wait()  # every thread subscribed
            if i == 0:
                events.emit(events.StepBeginEvent(0))
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(8)) and not events.has_subscribers()


def test_operand_event_amax_is_derived_on_the_device_from_the_scale():
    scale = torch.tensor([0.5, 2.0])
    hif8 = events.OperandEvent("m", te_npu.QuantizationRole.WEIGHT_FWD, "both", (2, 4, 4), "hif8", scale, 15.0)
    mx = events.OperandEvent("m", te_npu.QuantizationRole.INPUT_FWD, "row", (32, 64), "mxfp8_e4m3",
                             torch.zeros(32, 2, dtype=torch.uint8))
    assert torch.equal(hif8.amax, torch.tensor([7.5, 30.0])) and mx.amax is None
