"""The forward benchmarks' own pieces: upstream's log-prob stand-in and the switch to its torch path, and the GPU
benchmarks run on a CPU at toy sizes (the scripts must work wherever they are started; their figures come from a
GPU)."""

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_actor_gpu  # noqa: E402
import bench_forward_gpu  # noqa: E402
from reporting.gpu import gpu_actor_section, gpu_forward_section  # noqa: E402
from upstream_logprobs import TRITON_MODULE, install_triton_profile, torch_fallback, upstream_path  # noqa: E402


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_triton_profile_gives_upstreams_log_probs_and_gradient(temperature):
    from openrlhf.models.utils import log_probs_from_logits

    logits = torch.randn(7, 31, generator=torch.Generator().manual_seed(0), requires_grad=True)
    labels = torch.randint(0, 31, (7,), generator=torch.Generator().manual_seed(1))
    with torch_fallback():
        expected = log_probs_from_logits(logits.clone(), labels, temperature)
    with install_triton_profile():
        profiled = log_probs_from_logits(logits.clone(), labels, temperature)
    torch.testing.assert_close(profiled, expected)
    (grad,) = torch.autograd.grad(profiled.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad)
    assert TRITON_MODULE not in sys.modules or sys.modules[TRITON_MODULE].__name__ == TRITON_MODULE


def test_upstream_takes_its_torch_path_on_a_cpu_and_in_the_fallback_block(monkeypatch):
    from openrlhf.models.utils import log_probs_from_logits

    assert upstream_path("cpu").startswith("torch fallback")
    calls = []
    kernel = type(sys)("kernel")
    kernel.cross_entropy_loss = lambda logits, labels: calls.append(1) or (torch.zeros(len(labels)), None)
    monkeypatch.setitem(sys.modules, TRITON_MODULE, kernel)  # as if flash-attn's kernel imported
    logits, labels = torch.randn(3, 5), torch.tensor([0, 4, 2])
    log_probs_from_logits(logits.clone(), labels)
    assert calls == [1]
    with torch_fallback():
        got = log_probs_from_logits(logits.clone(), labels)
    assert calls == [1] and sys.modules[TRITON_MODULE] is kernel
    torch.testing.assert_close(got, torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1))


def test_the_gpu_benchmark_runs_on_a_cpu_at_toy_sizes(tmp_path):
    sizes = ["--tokens", "48", "--hidden", "16", "--heads", "2", "--layers", "1", "--vocab", "2048"]
    result = bench_forward_gpu.main(
        ["--device", "cpu", "--dtype", "fp32", *sizes, "--repeats", "1", "--json", str(tmp_path / "forward_gpu.json")]
    )
    (row,) = result["rows"]
    assert result["upstream_path"].startswith("torch fallback") and result["versions"]["openrlhf"] == "0.11.2"
    assert set(row["experience"]) == {"upstream", "ours"}
    for kl in ("kl off", "kl on"):
        cells = row["training"][kl]
        assert set(cells) == {"upstream", "ours 0.05", "ours 0.2", "ours 1"}  # no Triton kernel on a CPU
        for fraction in ("0.05", "0.2", "1"):
            # never above upstream's, at every K (peaks from allocator events: exact on a CPU)
            assert cells[f"ours {fraction}"]["peak_mib"] <= cells["upstream"]["peak_mib"], (kl, fraction)
    assert (tmp_path / "forward_gpu.json").exists()
    # RESULTS.md's table of it, and the line that says where it has not run
    table = "\n".join(gpu_forward_section(result))
    assert "| 48 | kl on | ours 0.2 |" in table and "Not run" not in table and "torch fallback" in table
    assert "Not run yet" in "\n".join(gpu_forward_section(None))


def test_the_actor_benchmark_runs_on_a_cpu_at_toy_sizes(tmp_path):
    result = bench_actor_gpu.main(
        ["--device", "cpu", "--shapes", "toy", "--repeats", "1", "--json", str(tmp_path / "a.json")]
    )
    row = result["shapes"]["toy"]
    for variant in ("upstream", "ours all tokens", "ours K=0.2"):
        assert row[f"max |log p - upstream|: {variant}"] < 1e-5
        assert row[f"train step: {variant}"]["seconds"] > 0
    assert row["train step: ours K=0.2"]["peak_mib"] <= row["train step: upstream"]["peak_mib"]
    assert row["experience fwd (entropy): ours"]["peak_mib"] < row["experience fwd (entropy): upstream"]["peak_mib"]
    table = "\n".join(gpu_actor_section({"this run": result}, 10))
    assert "| toy (Qwen2 H=64 L=1 V=1000" in table and "torch fallback" in table


def test_the_pass_count_table_runs_and_ours_makes_fewer_passes_than_upstreams_torch_path(capsys):
    """``bench_passes.py`` (the table of docs/semantics.md): ours against upstream's real ``Actor.forward``."""
    import bench_passes

    bench_passes.main()
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    counts = {tuple(c.strip() for c in row[:3]): [int(c.split()[0]) for c in row[3:]] for row in rows}
    assert len(counts) == 12
    for (dtype, variant, outputs), ours in counts.items():
        if variant == "ours":
            torch_path = counts[(dtype, "upstream torch", outputs)]
            assert ours[0] < torch_path[0] and ours[1] < torch_path[1], (dtype, outputs)
    assert counts[("fp32", "ours", "log-probs")] == [5, 6]
    assert counts[("fp32", "upstream triton", "log-probs")] == [3, 4]


def test_the_forward_section_says_when_other_jobs_shared_the_cpu():
    from reporting.sections import _load_note

    assert "only indicative" in _load_note({"load_average": [3.2, 5.1], "cpu_count": 2})
    assert "only indicative" not in _load_note({"load_average": [0.4, 1.1], "cpu_count": 2})
    assert _load_note({}) == ""  # results from before the load was recorded
