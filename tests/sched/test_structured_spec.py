"""StructuredOutput and SamplingParams(structured_output=...): bad specs are refused at
admission with one line naming the field."""

from __future__ import annotations

import pytest

from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.structured import StructuredOutput


@pytest.mark.parametrize(("spec", "message"), [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": [1]}, "json_schema must be a JSON object"),
    ({"json_schema": {"x": {1, 2}}}, "not plain JSON"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": 3}, "grammar must be a non-empty string"),
    ({"choice": "yes"}, "choice must be a list of strings"),
    ({"choice": []}, "choice must not be empty"),
    ({"choice": ["a", 2]}, "choice must hold non-empty strings"),
    ({"json_object": "yes"}, "json_object must be True or False"),
    ({"jsonschema": {}}, "unknown structured_output field(s) jsonschema"),
])
def test_bad_specs_are_refused_in_one_line(spec, message):
    with pytest.raises(ValueError, match=None) as info:
        SamplingParams(structured_output=spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_equal_specs_share_a_key_and_a_schema_is_copied():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    one = StructuredOutput(json_schema=schema)
    two = StructuredOutput(json_schema='{"properties": {"a": {"type": "integer"}}, '
                                       '"type": "object"}')
    assert one.key == two.key != StructuredOutput(json_object=True).key
    schema["type"] = "array"  # the caller's dict changing later changes nothing
    assert one.json_schema["type"] == "object"
    params = SamplingParams.from_dict({"structured_output": {"choice": ["x", "y"]}, "n": 2})
    assert params.structured_output == StructuredOutput(choice=("x", "y"))
    assert params.for_sample(1).structured_output == params.structured_output
