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
