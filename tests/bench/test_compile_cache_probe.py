"""gem_bench.compile_cache_probe on CPU: three real processes compile and run the graph; on CPU
the graph loaded from the shared cache sums as the one compiled for its size (the difference
shows on CUDA: docs/bench/compile_cache_probe_h100.json)."""

from __future__ import annotations

import json
import shutil

import pytest

from gem_bench.compile_cache_probe import main


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="Inductor on CPU needs a C++ compiler")
def test_the_probe_compares_a_shared_cache_with_an_own_one_on_cpu(tmp_path, capsys):
    assert main(["--device", "cpu", "--small", "100", "--large", "5000",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "compile_cache_probe.json").read_text())
    assert result["device"] == "cpu" and result["large_rows"] == 5000
    assert result["bitwise_equal"] is True and result["max_abs_difference"] == 0.0
    assert result["max_abs_value"] > 0
    assert "cpu: shared cache equal" in capsys.readouterr().out
