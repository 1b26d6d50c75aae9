"""Worker wire types: JSON identical to the official SDK's (baseten-loops 0.32.0)."""

from __future__ import annotations

import sys
import types
import zipfile

import pytest

from baseten_loops_cli.workers.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageChunk,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResult,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    LoadWeightsResponse,
    TensorData,
)
from tests.external import FETCH_HINT, sdk_wheel


def make_datum() -> Datum:
    return Datum(
        model_input=ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": TensorData(data=[2, 3, 4], dtype="int64", shape=[3]),
            "weights": TensorData(data=[0.0, 1.0, None], dtype="float32", shape=[3]),
        },
    )


def test_datum_json_shape():
    assert make_datum().model_dump(mode="json") == {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
            "weights": {"data": [0.0, 1.0, None], "dtype": "float32", "shape": [3]},
        },
        "routed_experts_ref": None,
    }
    assert Datum.model_validate(make_datum().model_dump(mode="json")) == make_datum()


def test_model_input_helpers():
    mi = ModelInput.from_ints([1, 2]).append_int(3).append(EncodedTextChunk(tokens=[4]))
    assert mi.to_ints() == [1, 2, 3, 4] and mi.length == 4
    img = ImageChunk(data=b"\x89PNG", format="png", expected_tokens=3)
    with_img = mi.append(img)
    assert with_img.length == 7
    dumped = with_img.model_dump(mode="json")
    assert dumped["chunks"][-1] == {"type": "image", "data": "iVBORw==", "format": "png", "expected_tokens": 3}
    assert ModelInput.model_validate(dumped) == with_img
    with pytest.raises(TypeError):
        with_img.to_ints()


def test_defaults():
    assert AdamParams().model_dump(mode="json") == {
        "learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0,
    }  # fmt: skip
    assert SamplingParams().model_dump() == {
        "max_tokens": None, "seed": None, "stop": None, "temperature": 1.0, "top_k": -1, "top_p": 1.0,
        "structured_outputs": None,
    }  # fmt: skip
    assert ForwardBackwardOutput().model_dump() == {"loss": 0.0, "loss_fn_output_type": "", "loss_fn_outputs": [], "metrics": {}}
    assert SaveWeightsForSamplerResponse().model_dump() == {"version": 0, "path": ""}
    assert SaveWeightsResponse().model_dump() == {"mode": "", "path": ""}
    assert LoadWeightsResponse().step == 0 and OptimStepResponse().metrics is None


def test_results_ignore_unknown_keys():
    out = ForwardBackwardOutput.model_validate({"loss": 1.0, "new_field": 1})
    assert out.loss == 1.0
    res = SampleResult.model_validate({"sequences": [{"tokens": [1], "stop_reason": "stop"}], "policy_version": 2, "x": 1})
    assert res.sequences[0] == SampledSequence(tokens=[1], stop_reason="stop")


def test_tensor_from_list_flattens():
    t = TensorData.from_list([[1, 2], [3, 4]], dtype="int64")
    assert t.data == [1, 2, 3, 4] and t.shape == [2, 2]


def load_sdk_models() -> types.ModuleType:
    """``baseten.loops.models`` of the official SDK, straight from its wheel (only pydantic
    needed, so it runs here; the rest of the SDK needs Python >= 3.12)."""
    wheel = sdk_wheel()
    if wheel is None:
        pytest.skip(f"the official SDK's wheel is not in the test cache ({FETCH_HINT})")
    member = "baseten/loops/models.py"
    source = zipfile.ZipFile(wheel).read(member)
    sdk = types.ModuleType("_sdk_models")
    sdk.__file__ = f"{wheel}/{member}"
    sys.modules["_sdk_models"] = sdk  # pydantic resolves forward refs through sys.modules
    exec(compile(source, sdk.__file__, "exec"), sdk.__dict__)
    return sdk


@pytest.mark.required_in_ci
def test_identical_json_to_official_sdk():
    sdk = load_sdk_models()
    ours = make_datum().model_dump(mode="json")
    theirs = sdk.Datum.model_validate(ours).model_dump(mode="json")
    assert ours == theirs
    for name in ("AdamParams", "SamplingParams", "ForwardBackwardOutput", "SaveWeightsForSamplerResponse",
                 "SaveWeightsResponse", "LoadWeightsResponse", "OptimStepResponse", "SampleResponse"):  # fmt: skip
        ours_cls = {"SampleResponse": SampleResult}.get(name) or globals()[name]
        assert ours_cls().model_dump(mode="json") == getattr(sdk, name)().model_dump(mode="json"), name
    sampled = {"sequences": [{"tokens": [1, 2], "logprobs": [-1.0, -2.0], "stop_reason": "stop", "text": "x"}],
               "policy_version": 3, "prompt_logprobs": [None, -0.5]}  # fmt: skip
    assert SampleResult.model_validate(sampled).model_dump(mode="json") == sdk.SampleResponse.model_validate(sampled).model_dump(mode="json")
