"""The support-matrix script measures a supported family with both methods and explains a refused one."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import support_matrix  # noqa: E402


def test_a_supported_family_reports_error_and_speedup_for_both_methods():
    result = support_matrix.measure("deit_tiny_patch16_224", {"img_size": 64}, batch=1, rounds=1)
    assert result["supported"] and result["source"] == "cls"
    assert set(result) == {"supported", "source", "defaults", "paper"}
    for method in ("defaults", "paper"):
        assert result[method]["error"] < 1e-5  # nothing pruned: the unpatched model's numbers
        assert result[method]["ideal"] > 1.2 and result[method]["speedup"] > 0
    assert result["paper"]["error"] == 0.0  # the same operations in the same order
    # the two are different patches: the defaults' fit (class token alone in the last block) saves more
    assert result["defaults"]["ideal"] > result["paper"]["ideal"]


def test_a_method_that_refuses_what_the_other_accepts_is_an_error(monkeypatch):
    # an unknown keyword: patch refuses it with a TypeError, as it refuses an unsupported family
    monkeypatch.setitem(support_matrix.METHODS, "defaults", {"nonsense": 1})
    with pytest.raises(RuntimeError, match="refuse"):
        support_matrix.measure("deit_tiny_patch16_224", {"img_size": 64}, batch=1, rounds=1)


def test_a_refused_family_reports_the_reason():
    result = support_matrix.measure("xcit_nano_12_p16_224", {}, batch=1, rounds=1)
    assert result == {"supported": False, "reason": "its cross-covariance attention mixes channels, not "
                      "tokens: there is no per-patch attention to score, and its local patch interaction "
                      "needs the full grid"}
