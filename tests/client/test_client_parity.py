"""Every public method of the SDK's clients exists on ember's in-process counterpart.

Found by inspecting the installed `tinker` package (so a new SDK method fails here),
with the same parameters, except the small allow-list in `ember.service.unsupported`:
those raise the `tinker.NotFoundError` the SDK raises over HTTP, never AttributeError.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import tinker

import ember
from ember.client import RestClient, SamplingClient, TrainingClient
from ember.service.unsupported import UNSUPPORTED, unsupported_error

PAIRS = [(tinker.ServiceClient, ember.ServiceClient), (tinker.TrainingClient, TrainingClient),
         (tinker.SamplingClient, SamplingClient), (tinker.RestClient, RestClient)]
# The SDK's ServiceClient connects in its constructor; ember's takes a model registry instead.
CONSTRUCTORS_DIFFER = {"__init__"}


def _public(cls) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_"))


def _is_unsupported(name: str) -> bool:
    return name.removesuffix("_async") in UNSUPPORTED


CASES = [(sdk, ours, name) for sdk, ours in PAIRS for name in _public(sdk)]
IDS = [f"{sdk.__name__}.{name}" for sdk, _, name in CASES]


def _params(fn) -> list[tuple[str, object, object]]:
    sig = inspect.signature(inspect.unwrap(fn))
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("sdk,ours,name", CASES, ids=IDS)
def test_every_sdk_method_exists_in_process(sdk, ours, name):
    assert name in ours.__dict__ or any(name in k.__dict__ for k in ours.__mro__[:-1]), \
        f"{ours.__name__} lacks the SDK's {name}"


@pytest.mark.parametrize("sdk,ours,name", [c for c in CASES if not _is_unsupported(c[2])],
                         ids=[i for c, i in zip(CASES, IDS) if not _is_unsupported(c[2])])
def test_same_parameters_as_the_sdk(sdk, ours, name):
    sdk_attr, our_attr = inspect.getattr_static(sdk, name), inspect.getattr_static(ours, name)
    if isinstance(sdk_attr, property):
        assert isinstance(our_attr, property)
        return
    sdk_fn, our_fn = getattr(sdk, name), getattr(ours, name)
    assert _params(our_fn) == _params(sdk_fn)
    assert inspect.iscoroutinefunction(inspect.unwrap(our_fn)) == inspect.iscoroutinefunction(inspect.unwrap(sdk_fn))


def test_the_allow_list_is_small_and_only_names_sdk_methods():
    sdk_names = {n.removesuffix("_async") for sdk, _ in PAIRS for n in _public(sdk)}
    assert set(UNSUPPORTED) <= sdk_names
    assert all(reason for reason in UNSUPPORTED.values())
    assert len(UNSUPPORTED) <= 20


UNSUPPORTED_CASES = [(ours, name) for sdk, ours in PAIRS for name in _public(sdk) if _is_unsupported(name)]


@pytest.mark.parametrize("ours,name", UNSUPPORTED_CASES, ids=[f"{o.__name__}.{n}" for o, n in UNSUPPORTED_CASES])
def test_an_unsupported_method_raises_the_sdk_http_error(ours, name):
    attr = inspect.getattr_static(ours, name)
    fn = attr.fget if isinstance(attr, property) else getattr(ours, name)
    args = () if isinstance(attr, staticmethod) else (object(),)  # any "self": it is never used
    with pytest.raises(tinker.NotFoundError) as info:
        result = fn(*args, "tinker://run/weights/x")
        if inspect.iscoroutine(result):
            asyncio.run(result)
    expected = unsupported_error(name.removesuffix("_async"))
    assert str(info.value) == str(expected)
    assert info.value.status_code == 404
    assert info.value.body == {"error": f"{name.removesuffix('_async')} is not supported by ember: "
                                        f"{UNSUPPORTED[name.removesuffix('_async')]}", "category": "user"}


def test_the_error_is_what_the_sdk_makes_of_such_an_answer():
    """`unsupported_error` builds the exception exactly as the SDK's HTTP client does."""
    import httpx

    err = unsupported_error("whoami")
    from tinker._client import AsyncTinker

    client = AsyncTinker(base_url="http://ember.invalid", api_key="tml-x")
    response = httpx.Response(404, json=err.body, request=httpx.Request("GET", "http://ember.invalid/x"))
    made = client._make_status_error_from_response(response)
    assert type(made) is type(err) and str(made) == str(err) and made.body == err.body


def test_telemetry_and_queue_state_hooks_answer_in_process(make_client):
    """The SDK's reporting hooks exist and are inert in process (no telemetry, no queue)."""
    from tinker.lib.api_future_impl import QueueState

    sc = make_client()
    tc = sc.create_lora_training_client("ember-test/tiny-qwen3", rank=2).result()
    sampler = sc.create_sampling_client(base_model="ember-test/tiny-qwen3").result()
    for client in (sc, tc, sampler, sc.create_rest_client()):
        assert client.get_telemetry() is None
    assert sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "busy") is None
