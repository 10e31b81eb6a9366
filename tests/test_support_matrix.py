"""The support-matrix script measures a supported family and explains a refused one."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import support_matrix  # noqa: E402


def test_a_supported_family_reports_error_and_speedup():
    result = support_matrix.measure("deit_tiny_patch16_224", {"img_size": 64}, batch=1, rounds=1)
    assert result["supported"] and result["source"] == "cls"
    assert result["error"] == 0.0  # nothing pruned: the same numbers as the unpatched model
    assert result["ideal"] > 1.2 and result["speedup"] > 0


def test_a_refused_family_reports_the_reason():
    result = support_matrix.measure("xcit_nano_12_p16_224", {}, batch=1, rounds=1)
    assert result == {"supported": False, "reason": "its cross-covariance attention mixes channels, not "
                      "tokens: there is no per-patch attention to score, and its local patch interaction "
                      "needs the full grid"}
