import pytest
from data_helpers import ROOT
from workflow_scripts.checks.config import load_config
from workflow_scripts.core.errors import ConfigError

def test_a_variant_that_quantises_against_an_unquantised_reference_is_named_with_both_values():
    """The variant's block against the reference's null: both values named (was "sets '<absent>' ... uses None")."""
    with pytest.raises(ConfigError) as caught:
        load_config(ROOT / "config" / "config.yaml", {"variants": {"mtup": {"training": {"quantization": {"bits": 4}}}}})
    print(caught.value)
    assert "variants.mtup.training.quantization" in str(caught.value)
    assert "<absent>" not in str(caught.value) and "uses None" in str(caught.value) and "'bits': 4" in str(caught.value)


def test_a_key_without_default_set_on_one_side_is_named_not_a_keyerror():
    """Issue 44: a variant setting a training key that has no schema default and that the reference leaves
    unset (micro_batch_tokens) ended in KeyError from the fairness guard; now both directions are named, and
    listing it under intended_differences lets it through."""
    config = ROOT / "config" / "config.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(config, {"variants": {"mtup": {"training": {"micro_batch_tokens": 512}}}})
    assert caught.value.key == "variants.mtup.training.micro_batch_tokens"
    assert "sets 512 where the reference variant 'baseline' leaves it unset" in caught.value.problem
    with pytest.raises(ConfigError) as caught:
        load_config(config, {"variants": {"baseline": {"training": {"micro_batch_tokens": 512}}}})
    assert caught.value.key.endswith(".training.micro_batch_tokens")
    assert "leaves it unset where the reference variant 'baseline' uses 512" in caught.value.problem
    load_config(config, {"variants": {"mtup": {"training": {"micro_batch_tokens": 512}}},
                         "comparison": {"intended_differences": ["training.micro_batch_tokens"]}})
