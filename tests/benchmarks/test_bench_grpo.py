"""bench_grpo.py's update profile (kernel categories) and its --compile path, on the CPU."""

import argparse
import os

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_grpo")


@pytest.fixture(scope="module")
def kb(load_benchmark):
    return load_benchmark("kernel_breakdown")


# kernel names as torch.profiler reported them on the H200 (benchmarks/results/*profile*), by hand
NAMED = {
    "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NTN": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k128_sm80": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "row_stats_kernel": "head",
    "dlogits_kernel": "head",
    "merge_slab_kernel": "head",
    "triton_red_fused__to_copy_mean_pow_rsqrt_0": "fused",
    "triton_poi_fused__to_copy_add_arange_eq_exp_mul_": "fused",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::silu_kernel>>": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>":
        "elementwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
    "void at::native::lpnorm_cleanup<float, at::native::NormType::L2>": "optimizer",
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "copy",
    "void at::native::index_elementwise_kernel<128, 4>": "copy",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "other",
    "decode_partial_kernel": "attention",  # logitless's split-K decode attention
    "decode_merge_kernel": "attention",
    "decode_prefix_kernel": "attention",  # a shared prompt's columns (was 'other')
    "counter_draw_kernel": "fused",  # the compiled sampler's draw
    "counter_pick_kernel": "fused",
    "decode_rotary_cache_kernel": "fused",  # the step's rotary and cache write, as inductor's kernels it replaces
}


@pytest.mark.parametrize("name,expected", sorted(NAMED.items()))
def test_kernels_fall_in_their_category(kb, name, expected):
    assert kb.category(name) == expected


def test_breakdown_sums_categories_and_counts_overlap_once(kb):
    kernels = [("nvjet_gemm_a", 0.0, 40.0), ("flash_fwd_kernel", 30.0, 50.0),  # overlap 30..40 (two streams)
               ("row_stats_kernel", 60.0, 70.0), ("vectorized_elementwise_kernel", 70.0, 75.0),
               ("nvjet_gemm_a", 80.0, 90.0)]
    out = kb.breakdown(kernels, wall_us=100.0, top=2)
    assert out["gemm"] == 50.0 and out["attention"] == 20.0 and out["head"] == 10.0 and out["elementwise"] == 5.0
    assert out["busy"] == 50.0 + 10.0 + 5.0 + 10.0  # union: 0..50, 60..75, 80..90
    assert out["idle"] == 100.0 - out["busy"]
    assert out["top"] == [("nvjet_gemm_a", 50.0), ("flash_fwd_kernel", 20.0)]
    assert out["launches"] == {**{c: 0 for c in kb.CATEGORIES}, "gemm": 2, "attention": 1, "head": 1,
                               "elementwise": 1}


def test_profile_update_needs_cuda(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--models", "tiny", "--device", "cpu", "--profile-update", "--out", str(tmp_path / "g.csv")])
    assert "--profile-update" in capsys.readouterr().err


def _one_update(bench, compile_layers: bool):
    torch.manual_seed(0)
    args = argparse.Namespace(beta=0.0, compile=compile_layers, activation_checkpointing=True)
    model, optimizer, reference = bench.build_policy("tiny", args, torch.device("cpu"), torch.float32)
    loss_fn = bench.make_loss("chunked", 0.0)
    loss_fn.set_model_output(model)
    cfg = argparse.Namespace(G=4, prompt_len=8, completion_len=6, update_only=True, generator="eager",
                             micro_batch_size="2", num_iterations=1)
    out = bench.one_step(model, loss_fn, optimizer, cfg, torch.device("cpu"), seed=3)
    return model, out


def test_compiled_layers_take_the_same_update(bench, monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")  # torchtune's compile_model reads it
    torch._dynamo.reset()
    eager, out_eager = _one_update(bench, False)
    compiled, out_compiled = _one_update(bench, True)
    assert any(getattr(m, "_compiled_call_impl", None) is not None for m in compiled.modules())
    assert not any(getattr(m, "_compiled_call_impl", None) is not None for m in eager.modules())
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert out_compiled["update_flops"] == out_eager["update_flops"]
    torch._dynamo.reset()


@pytest.mark.parametrize("checkpointing", [True, False])
def test_activation_checkpointing_flag(bench, tmp_path, checkpointing):
    """--no-activation-checkpointing builds the policy without checkpoint wrappers and says so in its
    rows; the cascade prompt-once path runs from the CLI."""
    import csv

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    args = argparse.Namespace(beta=0.0, compile=False, activation_checkpointing=checkpointing)
    model, _, _ = bench.build_policy("tiny", args, torch.device("cpu"), torch.float32)
    assert any(isinstance(m, CheckpointWrapper) for m in model.modules()) is checkpointing
    out = tmp_path / "g.csv"
    bench.main(["--models", "tiny", "--device", "cpu", "--update-only", "--G", "4", "--prompt-len", "8",
                "--completion-len", "6", "--micro-batch-size", "G", "--impls", "chunked+prompt_once_cascade",
                "--steps", "1", "--out", str(out)] + ([] if checkpointing else ["--no-activation-checkpointing"]))
    (row,) = list(csv.DictReader(open(out)))
    assert (row["status"], row["prompt_sharing"], row["activation_checkpointing"]) == ("ok", "True", str(checkpointing))


def test_rows_carry_the_versions_and_date_of_their_run(bench, tmp_path):
    import csv
    import datetime

    out = tmp_path / "g.csv"
    bench.main(["--models", "tiny", "--device", "cpu", "--dtype", "fp32", "--update-only", "--impls", "chunked",
                "--G", "2", "--prompt-len", "8", "--completion-len", "4", "--micro-batch-size", "2", "--steps", "1",
                "--out", str(out)])
    (row,) = list(csv.DictReader(out.open()))
    assert row["status"] == "ok" and row["torch"] == torch.__version__
    from importlib.metadata import version

    assert row["triton"] == version("triton") and row["torchtune"] == version("torchtune")
    stamp = datetime.datetime.fromisoformat(row["date"])
    assert abs((datetime.datetime.now(datetime.timezone.utc) - stamp).total_seconds()) < 600


def test_models_are_named_by_the_qwen2_5_short_names_or_any_logitless_key(bench):
    from logitless.models import model_family

    assert model_family(bench.build_model("qwen3_tiny", torch.device("cpu"), torch.float32)) == "qwen3"
    assert model_family(bench.build_model("tiny", torch.device("cpu"), torch.float32)) == "qwen2"
    with torch.device("meta"):
        big = bench.build_model("qwen3_1_7b", torch.device("meta"), torch.bfloat16)
    assert model_family(big) == "qwen3" and big.layers[0].attn.head_dim == 128 and len(big.layers) == 28
    with pytest.raises(ValueError, match=r"--models: unknown model 'qwen9'"):
        bench.build_model("qwen9", torch.device("cpu"), torch.float32)
