"""The step profiler: a real (tiny) training run under torch.profiler, on CPU."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from gem_platform.errors import GemError
from gem_platform.recipe import recipe_from_dict
from gem_profile.profile import is_annotation, kernel_kind, main, profile_recipe
from tests.conftest import run_gemctl
from tests.tiny_training import TINY


@pytest.mark.parametrize("name, kind", [
    ("_quantize_kernel", "fp8 quantize"),
    ("_quantize_dual_kernel", "fp8 quantize"),
    ("_gemm_body", "fp8 gemm (triton)"),
    ("bwd_kernel", "attention (ours)"),
    ("_gdpa_fwd_tma_kernel", "attention (ours)"),
    ("triton_poi_fused_add_mul_silu_0", "element-wise"),
    ("triton_red_fused_native_layer_norm_1", "reduction"),
    ("triton_per_fused_sum_2", "reduction"),
    ("triton_tem_fused_mm_3", "matmul"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor"
     "<float, 4, (at::native::ADAM_MODE)1, false>>", "optimizer"),
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x128_8x4_nt_align1>", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>",
     "copy / fill"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>",
     "reduction"),
    ("void (anonymous namespace)::indexing_backward_kernel<float, 4>", "gather / scatter"),
    ("aten::bmm", "matmul"),
    # FBGEMM's TBE kernels are table lookups and updates, although "fbgemm" holds "gemm"
    ("void fbgemm_gpu::split_embedding_nobag_codegen_forward_unweighted_small_kernel<float, "
     "float, float, int64_t, 4, 8>", "gather / scatter"),
    ("void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1",
     "gather / scatter"),
    ("something_new", "other"),
])
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind


def test_profile_of_a_tiny_cpu_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = yaml.safe_load(TINY.format(data=tmp_path / "data"))
    tree["parallel"]["workers"] = 1
    result = profile_recipe(recipe_from_dict(tree), warmup=2, active=3, top=10,
                            echo=lambda _: None)
    assert result.device == "cpu" and result.active_steps == 3 and result.precision == "fp32"
    assert result.step_ms > 0 and 0 < result.busy_ms
    assert result.busy_ms == pytest.approx(sum(result.by_kind.values()))
    assert "matmul" in result.by_kind  # the model's linear layers
    times = [r.ms_per_step for r in result.top]
    assert len(times) == 10 and times == sorted(times, reverse=True)
    assert sum(r.share for r in result.top) <= 1 + 1e-9
    assert result.calls_per_step >= sum(r.calls_per_step for r in result.top) > 0
    names = [r.name for r in result.top]
    assert not any(n.startswith(("ProfilerStep", "Optimizer.")) for n in names), names
    assert result.by_kind_of_step == pytest.approx(
        {k: ms / result.step_ms for k, ms in result.by_kind.items()})


def test_annotations_are_not_counted_as_kernels():
    """The profiler's user annotations (Optimizer.step#AdamW.step, ProfilerStep#N, ones made
    with record_function) span kernels that are counted on their own."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = torch.nn.Linear(64, 64, device=device)
    opt = torch.optim.AdamW(layer.parameters())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            with record_function("my_region"):
                layer(torch.randn(32, 64, device=device)).sum().backward()
            opt.step()
            prof.step()
    annotated = {e.key for e in prof.key_averages() if is_annotation(e)}
    assert {"my_region", "Optimizer.step#AdamW.step"} <= annotated
    assert not any(is_annotation(e) for e in prof.key_averages()
                   if e.key.startswith("aten::"))


def test_profile_cli_writes_json(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY.format(data=tmp_path / "data"))
    (tmp_path / "prof").mkdir()  # gemctl writes into existing folders only
    proc = run_gemctl("profile", "tiny.yaml", "--set", "parallel.workers=1", "--warmup", "2",
                      "--active", "2", "--top", "5", "--out", "prof/tiny.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ms / step" in proc.stdout
    data = json.loads((tmp_path / "prof/tiny.json").read_text())
    assert data["active_steps"] == 2 and len(data["top"]) == 5
    assert data["environment"]["libraries"]["torch"]
    assert data["resolved_recipe"]["parallel"]["workers"] == 1
    assert data["resolved_recipe"]["train"]["steps"] == 4  # warmup + active


def test_bad_step_counts_are_named(tmp_path, capsys):
    (tmp_path / "tiny.yaml").write_text(TINY.format(data=tmp_path / "data"))
    assert main([str(tmp_path / "tiny.yaml"), "--active", "0"]) == 2
    assert "active=0" in capsys.readouterr().err
    with pytest.raises(GemError):
        profile_recipe(recipe_from_dict(yaml.safe_load(TINY.format(data=tmp_path))), warmup=1)
