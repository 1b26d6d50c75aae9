from __future__ import annotations

import pytest

from baseten_loops_cli.api.uri import CheckpointUri
from baseten_loops_cli.errors import UsageError


@pytest.mark.parametrize(
    "text,run,target,name",
    [
        ("bt://loops:k4q95w5/weights/step-100", "k4q95w5", "trainer", "step-100"),
        ("bt://loops:k4q95w5/sampler_weights/final", "k4q95w5", "sampler", "final"),
        ("abt://loops:run_abc123/sampler_weights/s-0123456789abcdef0123456789abcdef", "run_abc123", "sampler",
         "s-0123456789abcdef0123456789abcdef"),
        ("bt://loops:r/sampler_weights/a.b_c/", "r", "sampler", "a.b_c"),  # S3 weight sync trailing slash
        ("  bt://loops:r/weights/x  ", "r", "trainer", "x"),
    ],
)  # fmt: skip
def test_parse(text, run, target, name):
    uri = CheckpointUri.parse(text)
    assert (uri.run_id, uri.target, uri.name) == (run, target, name)
    assert str(uri) == f"bt://loops:{run}/{'weights' if target == 'trainer' else 'sampler_weights'}/{name}"
    assert CheckpointUri.parse(str(uri)) == uri


@pytest.mark.parametrize(
    "bad",
    ["", "step-100", "bt://loops:r/weights/", "bt://loops:r/other/x", "bt://r/weights/x", "s3://b/k",
     "bt://loops:r/sequences/1", "bt://loops:/weights/x", "bt://loops:r/weights/a/b", "hf://org/repo"],
)  # fmt: skip
def test_malformed(bad):
    with pytest.raises(UsageError) as info:
        CheckpointUri.parse(bad)
    assert "bt://loops:<run_id>/weights/<name>" in str(info.value)
    assert "\n" not in str(info.value)
    assert not CheckpointUri.is_uri(bad)


def test_format():
    assert str(CheckpointUri.sampler("r", "n")) == "bt://loops:r/sampler_weights/n"
    assert str(CheckpointUri("r", "trainer", "n")) == "bt://loops:r/weights/n"
    assert str(CheckpointUri.trainer("r", "n")) == "bt://loops:r/weights/n"
    assert CheckpointUri.sampler("r", "n").directory == "sampler_weights"
    with pytest.raises(UsageError):
        CheckpointUri.parse("bt://loops:r/bogus/n")
