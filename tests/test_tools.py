"""tools/: what of the measuring tools can be checked without a GPU."""

import os

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


@pytest.fixture
def ab(monkeypatch):
    """tools/ab.py as a module (it is run as a script), its knobs and whether the Gluon
    kernels run put back as they were after the test (use() sets them globally)."""
    from memattn.kernels import hopper

    monkeypatch.syspath_prepend(TOOLS)
    import ab

    for key in ab.DEFAULTS:
        module, name = ab.knob_module(key), key.split(".")[1]
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(hopper, "enabled", hopper.enabled)
    return ab


def test_ab_variants_set_only_knobs_it_knows(ab):
    """Each of tools/ab.py's variants sets knobs of its DEFAULTS (each read from the
    module whose code reads it): a misspelt knob would be set as a new attribute that
    no kernel reads, and the A/B would time the shipped kernels against themselves."""
    unknown = {(name, key) for name, knobs in ab.VARIANTS.items() if knobs
               for key in knobs if key not in ab.DEFAULTS}  # fmt: skip
    assert not unknown
    for key in ab.DEFAULTS:
        assert hasattr(ab.knob_module(key), key.split(".")[1]), key


def test_ab_use_sets_a_variant_and_puts_the_shipped_knobs_back(ab):
    """use() sets a variant's knobs over the shipped ones and a later use() of another
    variant puts back the first one's: each A/B round starts from the shipped kernels."""
    ab.use(ab.VARIANTS["bwd_serial"])
    assert ab.knob_module("bwd.DEPENDENT_LAUNCHES").DEPENDENT_LAUNCHES is False
    ab.use(ab.VARIANTS["default"])
    for key, value in ab.DEFAULTS.items():
        assert getattr(ab.knob_module(key), key.split(".")[1]) == value, key
